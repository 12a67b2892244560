"""``lit-mhar sweep report``: the map of a study, written to a folder and logged to its MLflow parent run.

Everything comes from the Optuna study (each trial's parameters, state and the user attributes the
runner stored: the resolved model shape, seed, tokens, FLOPs per token, passes over the data,
validation loss, tokens/s, MFU, peak memory, start-up time, failure reason). Trials that were never
run (``lit_mhar.surplus``) are left out.

How a point is judged (Marin's feature sweeps; ``shared/PAPERS.md``):

* **Paired differences.** For every seed the point and the prenorm baseline of its scale both ran
  with (same seed: same initialisation and data order), ``d = L_point - L_prenorm``; the report gives
  their mean and a 95% Student-t interval (two seeds or more), and the points whose interval
  overlaps the best point's interval ("indistinguishable from the best").
* **Compute multiplier.** Prenorm trained at several budgets (the space's ``budget``) gives
  ``L(C) = E + A * C^-alpha`` per scale, ``C`` = tokens x FLOPs per token. A point's multiplier is the
  compute prenorm would need to reach the point's loss, ``(A / (L - E))^(1/alpha)``, over the compute
  the point spent; its throughput-adjusted speedup multiplies that by its tokens/s over prenorm's.
  Fewer than 3 distinct budgets leave the fit underdetermined: the report says so and gives none.
* **Throughput** is meaningful only for trials that each had a GPU to themselves: on a CPU, or with
  ``--trials_per_gpu`` above 1, the report leaves throughput ratios, speedups and their plots out
  and says why.

Files (``OUTPUT/``): ``trials.csv`` (every trial, failures with their reasons), ``summary.csv`` /
``summary.md`` (the map: one row per point), ``fit.json`` (the power-law fit per scale),
``report.md``, and the plots ``val_loss_vs_heads.png``, ``val_loss_vs_block_size.png`` (paired
differences with their intervals), ``prenorm_fit.png``, ``multiplier_vs_heads.png``, and where
throughput is meaningful ``pareto.png``, ``speedup_vs_heads.png``, ``tokens_per_s_vs_heads.png``, and
where memory was measured ``peak_memory_vs_heads.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

ATTR = "lit_mhar."
KEY_COLUMNS = ("scale", "residual", "block_size", "heads")
PLOTS = ("val_loss_vs_heads.png", "val_loss_vs_block_size.png", "prenorm_fit.png", "multiplier_vs_heads.png", "pareto.png",
         "speedup_vs_heads.png", "tokens_per_s_vs_heads.png", "peak_memory_vs_heads.png")
FILES = ("trials.csv", "summary.csv", "summary.md", "fit.json", "report.md", *PLOTS)


# ----------------------------------------------------------------------------- statistics


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, Optional[float], Optional[float]]:
    """Mean of ``values`` and its Student-t confidence interval ``(mean, low, high)``; no interval for fewer than 2."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    from scipy.stats import t

    half = float(t.ppf(0.5 + level / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class PowerLaw:
    """``L(C) = E + A * C^-alpha``: validation loss against training compute ``C`` (FLOPs)."""

    E: float
    A: float
    alpha: float
    points: int
    rms: float  # root-mean-square residual of the fit, nats

    def loss(self, compute: float) -> float:
        """The fitted loss at ``compute`` FLOPs."""
        return self.E + self.A * compute ** -self.alpha

    def compute_for(self, loss: float) -> float:
        """The compute at which the fit reaches ``loss`` (inf at or below its floor ``E``)."""
        return math.inf if loss <= self.E else (self.A / (loss - self.E)) ** (1 / self.alpha)


def fit_power_law(compute: list[float], loss: list[float]) -> PowerLaw:
    """Least-squares ``L = E + A * C^-alpha`` with ``A > 0``, ``0 < alpha <= 2`` and ``E >= 0``.

    For a fixed ``alpha`` the loss is linear in ``(E, A)``: solved exactly for each ``alpha`` of a
    log-spaced grid, then refined around the best one (bounded scalar minimisation).

    Raises:
        ValueError: fewer than 3 distinct compute values (three parameters: underdetermined), or a
            non-positive compute.
    """
    import numpy as np
    from scipy.optimize import minimize_scalar

    if len(compute) != len(loss):
        raise ValueError(f"fit_power_law: {len(compute)} compute values for {len(loss)} losses")
    if any(not c > 0 for c in compute):
        raise ValueError(f"fit_power_law: compute must be > 0 FLOPs, got {min(compute)}")
    distinct = len(set(compute))
    if distinct < 3:
        raise ValueError(
            f"fit_power_law: L = E + A*C^-alpha has 3 parameters and {distinct} distinct compute value(s) determine it "
            "(underdetermined): train the baseline at 3 budgets or more (space: budget: [0.25, 0.5, 1])"
        )
    c = np.asarray(compute, dtype=np.float64) / max(compute)  # scaled: A is then the gap above E at the largest compute
    y = np.asarray(loss, dtype=np.float64)

    def solve(alpha: float) -> tuple[float, float, float]:
        x = c ** -alpha
        design = np.stack([np.ones_like(x), x], axis=1)
        (e, a), *_ = np.linalg.lstsq(design, y, rcond=None)
        if a <= 0 or e < 0:  # hold the constraint: the best of E = 0 or A -> 0
            a0 = max(float(x @ y / (x @ x)), 1e-12)
            options = [(0.0, a0), (float(y.mean()), 1e-12)]
            e, a = min(options, key=lambda ea: float(((ea[0] + ea[1] * x - y) ** 2).sum()))
        return float(((e + a * x - y) ** 2).sum()), float(e), float(a)

    grid = np.geomspace(1e-3, 2.0, 200)
    best = min(grid, key=lambda a: solve(a)[0])
    i = int(np.argmin(np.abs(grid - best)))
    refined = minimize_scalar(lambda a: solve(a)[0], bounds=(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]), method="bounded")
    alpha = float(refined.x) if refined.fun <= solve(best)[0] else float(best)
    sse, e, a = solve(alpha)
    return PowerLaw(E=e, A=a * max(compute) ** alpha, alpha=alpha, points=len(compute), rms=math.sqrt(sse / len(compute)))


# ----------------------------------------------------------------------------- rows


def _rows(study: Any) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if attrs.get(ATTR + "surplus") or ATTR + "point" not in attrs:
            continue
        model = attrs.get(ATTR + "model") or {}
        params = dict(t.params)
        rows.append({
            "trial": t.number,
            "state": t.state.name,
            "scale": model.get("name", params.get("scale")),
            "residual": model.get("residual", params.get("residual")),
            "block_size": model.get("block_size", params.get("block_size")),
            "heads": model.get("heads", params.get("heads")),
            "seed": attrs.get(ATTR + "seed", params.get("seed")),
            "budget": float(params.get("budget", 1.0)),
            **{f"param:{k}": v for k, v in params.items() if k not in ("scale", "residual", "block_size", "heads", "seed", "budget")},
            "val_loss": t.value if t.state.name == "COMPLETE" else attrs.get(ATTR + "val_loss"),
            "last_reported": t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None,
            "tokens": attrs.get(ATTR + "tokens"),
            "flops_per_token": attrs.get(ATTR + "flops_per_token"),
            "passes": attrs.get(ATTR + "passes"),
            "tokens_per_s": attrs.get(ATTR + "tokens_per_s"),
            "mfu": attrs.get(ATTR + "mfu"),
            "peak_memory_gb": attrs.get(ATTR + "peak_memory_gb"),
            "trials_per_gpu": attrs.get(ATTR + "trials_per_gpu", 1),
            "max_steps": attrs.get(ATTR + "max_steps"),
            "startup_s": attrs.get(ATTR + "startup_s"),
            "duration_s": attrs.get(ATTR + "duration_s"),
            "fail_reason": attrs.get(ATTR + "fail_reason", "" if t.state.name != "FAIL" else "interrupted"),
            "mlflow_run_id": attrs.get(ATTR + "mlflow_run_id"),
        })
    return rows


def _extra_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("param:")})


def throughput_note(rows: list[dict[str, Any]]) -> Optional[str]:
    """Why the trials' tokens/s cannot be compared (CPU, or several trials sharing a GPU), or None when they can."""
    done = [r for r in rows if r["state"] == "COMPLETE"]
    if not done:
        return None
    if any(r["peak_memory_gb"] is None for r in done):
        return "trials ran on a CPU (or a GPU without memory statistics): tokens/s there say nothing about GPU cost"
    shared = max(int(r["trials_per_gpu"] or 1) for r in done)
    if shared > 1:
        return f"{shared} trials trained at once on each GPU (--trials_per_gpu {shared}): their tokens/s depend on their neighbours"
    return None


def fits(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The prenorm loss-vs-compute fit of each scale: a :class:`PowerLaw` or the reason there is none."""
    out: dict[str, Any] = {}
    for scale in sorted({str(r["scale"]) for r in rows}):
        base = [r for r in rows if str(r["scale"]) == scale and r["residual"] == "prenorm" and r["state"] == "COMPLETE"
                and r["val_loss"] is not None and r["flops_per_token"] and r["tokens"]]
        try:
            out[scale] = fit_power_law([r["tokens"] * r["flops_per_token"] for r in base], [r["val_loss"] for r in base])
        except ValueError as e:
            out[scale] = str(e).removeprefix("fit_power_law: ")
    return out


def summarise(rows: list[dict[str, Any]], throughput: bool = True) -> list[dict[str, Any]]:
    """The map: one row per point trained at the full budget (seeds pooled, paired against prenorm).

    Each row: the point's keys (scale, residual, S, H and other swept parameters), ``n`` (seeds),
    ``val_loss`` (mean) and ``val_loss_std``, ``pairs`` (seeds shared with the scale's prenorm),
    ``delta`` / ``delta_low`` / ``delta_high`` (mean paired difference to prenorm and its 95%
    t-interval), ``best`` and ``indistinguishable`` (interval overlaps the best point's),
    ``compute_flops`` (spent), ``multiplier`` (with ``multiplier_low`` / ``_high`` from the interval),
    ``tokens_per_s``, ``throughput_vs_prenorm`` and ``adjusted_speedup`` (None unless ``throughput``),
    ``mfu``, ``peak_memory_gb``, ``memory_vs_prenorm``, ``passes`` and ``startup_s``.
    """
    extras = _extra_keys(rows)
    done = [r for r in rows if r["state"] == "COMPLETE" and r["val_loss"] is not None and r["budget"] == 1.0]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in done:
        groups.setdefault(tuple(r[k] for k in KEY_COLUMNS) + tuple(r.get(k) for k in extras), []).append(r)
    laws = fits(rows)

    def mean_of(members: list[dict[str, Any]], key: str) -> Optional[float]:
        values = [m[key] for m in members if m[key] is not None]
        return statistics.fmean(values) if values else None

    out = []
    for key, members in groups.items():
        losses = [m["val_loss"] for m in members]
        row = {
            **dict(zip(KEY_COLUMNS + tuple(extras), key)),
            "n": len(members),
            "val_loss": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
            "tokens": members[0]["tokens"],
            "compute_flops": members[0]["tokens"] * members[0]["flops_per_token"] if members[0]["flops_per_token"] else None,
            "tokens_per_s": mean_of(members, "tokens_per_s"),
            "mfu": mean_of(members, "mfu"),
            "peak_memory_gb": mean_of(members, "peak_memory_gb"),
            "passes": max((m["passes"] for m in members if m["passes"] is not None), default=None),
            "startup_s": mean_of(members, "startup_s"),
            "_by_seed": {m["seed"]: m["val_loss"] for m in members},
        }
        out.append(row)
    out.sort(key=lambda r: (str(r["scale"]), r["residual"] != "prenorm", str(r["residual"]), r["block_size"] or 0, r["heads"] or 0))
    for scale in sorted({str(r["scale"]) for r in out}):
        same = [r for r in out if str(r["scale"]) == scale]
        base = next((r for r in same if r["residual"] == "prenorm"), None)
        law = laws.get(scale)
        for r in same:
            pairs = [r["_by_seed"][s] - base["_by_seed"][s] for s in r["_by_seed"] if base and s in base["_by_seed"]]
            delta, low, high = t_interval(pairs) if pairs else (None, None, None)
            r.update(pairs=len(pairs), delta=delta, delta_low=low, delta_high=high)
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if throughput and base and r["tokens_per_s"] and base["tokens_per_s"] else None
            r["throughput_vs_prenorm"] = ratio
            r["memory_vs_prenorm"] = (r["peak_memory_gb"] / base["peak_memory_gb"]
                                      if base and r["peak_memory_gb"] and base["peak_memory_gb"] else None)
            r["multiplier"] = r["multiplier_low"] = r["multiplier_high"] = r["adjusted_speedup"] = None
            if isinstance(law, PowerLaw) and r["compute_flops"]:
                r["multiplier"] = law.compute_for(r["val_loss"]) / r["compute_flops"]
                if low is not None and base:
                    r["multiplier_high"] = law.compute_for(base["val_loss"] + low) / r["compute_flops"]
                    r["multiplier_low"] = law.compute_for(base["val_loss"] + high) / r["compute_flops"]
                if ratio is not None:
                    r["adjusted_speedup"] = r["multiplier"] * ratio
        ranked = [r for r in same if r["delta"] is not None]
        best = min(ranked, key=lambda r: r["delta"]) if ranked else None
        for r in same:
            r["best"] = r is best
            if best is None or best["delta_low"] is None or r["delta_low"] is None:
                r["indistinguishable"] = None if r is not best else True
            else:
                r["indistinguishable"] = r["delta_low"] <= best["delta_high"] and best["delta_low"] <= r["delta_high"]
    for r in out:
        r.pop("_by_seed")
    return out


# ----------------------------------------------------------------------------- tables


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "beyond the fit"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _interval(low: Optional[float], high: Optional[float], digits: int = 4, signed: bool = True) -> str:
    if low is None or high is None:
        return "n/a"
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    return f"[{f.format(low)}, {f.format(high)}]" if math.isfinite(high) else f"[{f.format(low)}, beyond the fit]"


def markdown_table(summary: list[dict[str, Any]], throughput_note: Optional[str] = None) -> str:
    """The map as a GitHub markdown table; the best point of each scale in bold, indistinguishable ones marked ≈."""
    extras = [k for k in (summary[0] if summary else {}) if k.startswith("param:")]
    header = ["scale", "residual", "S", "H", *[e[6:] for e in extras], "seeds", "val loss", "Δ vs prenorm (paired)", "95% CI",
              "≈ best", "compute ×", "compute × CI", "passes"]
    if throughput_note is None:
        header += ["tokens/s × prenorm", "adjusted speedup", "MFU", "peak GiB × prenorm"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in summary:
        prenorm = r["residual"] == "prenorm"
        cells = [
            str(r["scale"]), str(r["residual"]), _fmt(r["block_size"]), _fmt(r["heads"]), *[_fmt(r[e]) for e in extras], str(r["n"]),
            _fmt(r["val_loss"]) + (f" ± {r['val_loss_std']:.4f}" if r["val_loss_std"] is not None else ""),
            "" if prenorm else (f"{r['delta']:+.4f}" if r["delta"] is not None else "n/a"),
            "" if prenorm else _interval(r["delta_low"], r["delta_high"]),
            "best" if r["best"] else {True: "≈", False: "", None: "n/a"}[r["indistinguishable"]],
            _fmt(r["multiplier"], 2), _interval(r["multiplier_low"], r["multiplier_high"], 2, signed=False),
            _fmt(r["passes"], 2),
        ]
        if throughput_note is None:
            cells += [_fmt(r["throughput_vs_prenorm"], 3), _fmt(r["adjusted_speedup"], 2),
                      _fmt(r["mfu"] and 100 * r["mfu"], 1) + ("%" if r["mfu"] else ""), _fmt(r["memory_vs_prenorm"], 3)]
        if r["best"]:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv

    columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


# ----------------------------------------------------------------------------- plots


def _axes(n: int, title: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, n), figsize=(5.8 * max(1, n), 4.3), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(r: dict[str, Any], by: str, extras: list[str]) -> str:
    return f"{r['residual']} {by}={r['block_size'] if by == 'S' else r['heads']}" + "".join(f" {e[6:]}={r[e]}" for e in extras)


def plot_vs(summary: list[dict[str, Any]], x: str, y: str, ylabel: str, path: Path, title: str, intervals: bool = False,
            reference: Optional[float] = None) -> None:
    """One panel per scale, one line per residual and the other routing size, on a log2 x axis.

    Args:
        x: ``heads`` (lines per S) or ``block_size`` (lines per H).
        y: the summary column to plot (rows where it is None are left out).
        intervals: draw ``{y}_low`` / ``{y}_high`` as error bars and star the scale's best point.
        reference: a horizontal line (0 for differences, 1 for multipliers), labelled prenorm.
    """
    extras = [k for k in (summary[0] if summary else {}) if k.startswith("param:")]
    scales = sorted({str(r["scale"]) for r in summary})
    fig, axes = _axes(len(scales), title)
    other = "S" if x == "heads" else "H"
    for ax, scale in zip(axes, scales or [""]):
        same = [r for r in summary if str(r["scale"]) == scale and r["residual"] != "prenorm" and r.get(y) is not None
                and math.isfinite(r[y])]
        lines: dict[str, list[dict[str, Any]]] = {}
        for r in same:
            lines.setdefault(_label(r, other, extras), []).append(r)
        for label, members in sorted(lines.items()):
            members.sort(key=lambda r: r[x])
            xs, ys = [r[x] for r in members], [r[y] for r in members]
            if intervals:
                err = [[max(0.0, r[y] - r[f"{y}_low"]) if r.get(f"{y}_low") is not None else 0.0 for r in members],
                       [max(0.0, r[f"{y}_high"] - r[y]) if r.get(f"{y}_high") is not None and math.isfinite(r[f"{y}_high"]) else 0.0
                        for r in members]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
            else:
                ax.plot(xs, ys, marker="o", label=label)
        if reference is not None:
            ax.axhline(reference, color="gray", linestyle="--", label="prenorm")
        best = [r for r in summary if str(r["scale"]) == scale and r["best"] and r["residual"] != "prenorm" and r.get(y) is not None]
        if intervals and best:
            r = best[0]
            ax.plot([r[x]], [r[y]], marker="*", markersize=18, color="gold", markeredgecolor="black", zorder=5,
                    label=f"best: {r['residual']} H={r['heads']} S={r['block_size']}")
        if not same:
            ax.text(0.5, 0.5, "nothing to plot", ha="center", va="center", transform=ax.transAxes)
        xs_all = sorted({r[x] for r in same})
        if xs_all:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all)
            ax.set_xticklabels([str(v) for v in xs_all])
        _style(ax, scale, "routing heads H" if x == "heads" else "block size S (sublayers per block)", ylabel)
    _save(fig, path)


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    """Labels, title, a light grid and (where anything is labelled) a small legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_fits(rows: list[dict[str, Any]], laws: dict[str, Any], path: Path) -> None:
    """Prenorm's validation loss against compute per scale, with the fitted power law where there is one."""
    import numpy as np

    scales = sorted(laws)
    fig, axes = _axes(len(scales), "prenorm: validation loss against training compute")
    for ax, scale in zip(axes, scales or [""]):
        base = [r for r in rows if str(r["scale"]) == scale and r["residual"] == "prenorm" and r["state"] == "COMPLETE"
                and r["flops_per_token"] and r["val_loss"] is not None]
        cs = [r["tokens"] * r["flops_per_token"] for r in base]
        ax.scatter(cs, [r["val_loss"] for r in base], label="prenorm trials")
        law = laws.get(scale)
        if isinstance(law, PowerLaw) and cs:
            grid = np.geomspace(min(cs) / 2, max(cs) * 4, 100)
            ax.plot(grid, [law.loss(c) for c in grid], color="black",
                    label=f"E={law.E:.3f} + A C^-{law.alpha:.3f} (rms {law.rms:.4f})")
        elif law is not None:
            ax.text(0.5, 0.9, "no fit: " + str(law)[:60] + "...", ha="center", transform=ax.transAxes, fontsize=7)
        ax.set_xscale("log")
        _style(ax, scale, "training compute C (FLOPs)", "validation loss (nats/token)")
    _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (tokens/s, loss) no other point beats on both: faster and lower loss."""
    return [i for i, (s, l) in enumerate(points)
            if not any((s2 >= s and l2 <= l) and (s2 > s or l2 < l) for j, (s2, l2) in enumerate(points) if j != i)]


def plot_pareto(summary: list[dict[str, Any]], path: Path) -> None:
    """Validation loss against tokens/s per scale, the Pareto front joined and its points labelled."""
    scales = sorted({str(r["scale"]) for r in summary})
    fig, axes = _axes(len(scales), "validation loss against training throughput (Pareto front joined)")
    for ax, scale in zip(axes, scales or [""]):
        same = [r for r in summary if str(r["scale"]) == scale and r["tokens_per_s"]]
        pts = [(r["tokens_per_s"], r["val_loss"]) for r in same]
        front = sorted(pareto_front(pts), key=lambda i: pts[i][0])
        for i, r in enumerate(same):
            ax.scatter([pts[i][0]], [pts[i][1]], color="tab:red" if i in front else "tab:gray", zorder=3)
            if i in front:
                ax.annotate(f"{r['residual']} H{r['heads']} S{r['block_size']}", pts[i], fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color="tab:red", label="Pareto front")
        _style(ax, scale, "training tokens/s", "validation loss (nats/token)")
    _save(fig, path)


# ----------------------------------------------------------------------------- the command


def report(
    study: str,
    storage: str = "sqlite:///sweeps.db",
    output_dir: Optional[str] = None,
    overwrite: bool = False,
    log_to_mlflow: bool = True,
) -> str:
    """Writes a study's map (tables and plots) to a folder and logs it to the study's MLflow parent run.

    Args:
        study: The study name (``lit-mhar sweep run --study``).
        storage: Its Optuna storage (RDB URL or journal:PATH).
        output_dir: Folder for the files; default ``OUTPUT_DIR/STUDY/report`` of the sweep
            (``runs/sweeps/STUDY/report``).
        overwrite: Replace the files of an earlier report in that folder (never other files).
        log_to_mlflow: Log the folder as artifacts ``report/`` of the study's MLflow parent run.

    Returns:
        The folder written.

    Raises:
        ValueError: the storage is unreachable, the study does not exist (the message lists those
            that do) or was not made by lit-mhar sweep, or the folder holds files and overwrite is false.
    """
    import optuna

    from lit_mhar.sweeps.storage import open_storage
    from lit_mhar.tracking import redact

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opened = open_storage(storage)
    names = optuna.get_all_study_names(storage=opened)
    if study not in names:
        raise ValueError(f"no study {study!r} in {redact(storage)}; studies there: {names}")
    loaded = optuna.load_study(study_name=study, storage=opened)
    attrs = loaded.user_attrs
    if ATTR + "spec" not in attrs:
        raise ValueError(f"study {study!r} was not made by lit-mhar sweep (no {ATTR}spec user attribute)")
    out = Path(output_dir) if output_dir else Path(attrs.get(ATTR + "output_dir", "runs/sweeps")) / study / "report"
    if out.exists() and any(out.iterdir()):
        foreign = sorted(p.name for p in out.iterdir() if p.name not in FILES)
        if not overwrite or foreign:
            raise ValueError(
                f"{out} is not empty; pass --overwrite true to replace an earlier report there"
                if not foreign else f"{out} holds files the report did not write ({foreign[:5]}); choose another --output_dir"
            )
        for name in FILES:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    rows = _rows(loaded)
    note = throughput_note(rows)
    summary = summarise(rows, throughput=note is None)
    laws = fits(rows)
    _write_csv(out / "trials.csv", rows)
    _write_csv(out / "summary.csv", summary)
    table = markdown_table(summary, note)
    (out / "summary.md").write_text(table)
    (out / "fit.json").write_text(json.dumps({s: asdict(v) if isinstance(v, PowerLaw) else {"none": v} for s, v in laws.items()}, indent=2) + "\n")
    plot_vs(summary, "heads", "delta", "Δ validation loss vs prenorm (nats/token)", out / "val_loss_vs_heads.png",
            "paired Δ val loss vs H, 95% t-intervals", intervals=True, reference=0.0)
    plot_vs(summary, "block_size", "delta", "Δ validation loss vs prenorm (nats/token)", out / "val_loss_vs_block_size.png",
            "paired Δ val loss vs S, 95% t-intervals", intervals=True, reference=0.0)
    plot_fits(rows, laws, out / "prenorm_fit.png")
    plots = ["val_loss_vs_heads.png", "val_loss_vs_block_size.png", "prenorm_fit.png"]
    if any(r["multiplier"] is not None for r in summary):
        plot_vs(summary, "heads", "multiplier", "compute multiplier vs prenorm", out / "multiplier_vs_heads.png",
                "compute multiplier vs H (prenorm's compute to reach the loss / compute spent)", intervals=True, reference=1.0)
        plots.append("multiplier_vs_heads.png")
    if note is None and any(r["tokens_per_s"] for r in summary):
        plot_pareto(summary, out / "pareto.png")
        plot_vs(summary, "heads", "tokens_per_s", "training tokens/s", out / "tokens_per_s_vs_heads.png", "throughput vs H")
        plots += ["pareto.png", "tokens_per_s_vs_heads.png"]
        if any(r["adjusted_speedup"] is not None for r in summary):
            plot_vs(summary, "heads", "adjusted_speedup", "throughput-adjusted speedup vs prenorm", out / "speedup_vs_heads.png",
                    "throughput-adjusted speedup vs H (compute multiplier x tokens/s ratio)", reference=1.0)
            plots.append("speedup_vs_heads.png")
    if any(r["peak_memory_gb"] for r in summary):
        plot_vs(summary, "heads", "peak_memory_gb", "peak GPU memory (GiB)", out / "peak_memory_vs_heads.png", "peak memory vs H")
        plots.append("peak_memory_vs_heads.png")

    spec = attrs[ATTR + "spec"]
    objective = spec["objective"]
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    seeds = sorted({r["seed"] for r in rows if r["seed"] is not None})
    passes = [r["passes"] for r in rows if r["passes"] is not None]
    startups = [r["startup_s"] for r in rows if r["startup_s"] is not None]
    problems = [r for r in rows if r["state"] in ("FAIL", "PRUNED")]
    lines = [
        f"# Sweep `{study}`",
        "",
        f"- storage: `{redact(storage)}`; sampler `{spec['sampler']}`; trials: " + ", ".join(f"{v} {k}" for k, v in sorted(states.items())),
        f"- objective: `{objective['metric']}` after {objective['tokens']:,} training tokens per trial "
        f"(rounded up to whole steps; {objective['evals']} validations per trial; a point's `budget` trains that fraction)",
        f"- seeds: {seeds}; a point's difference to prenorm is paired by seed (same initialisation and data order), "
        "its interval a 95% Student t over the pairs; ≈: the interval overlaps the best point's",
        f"- passes over the training split per trial: {min(passes):.3f} to {max(passes):.3f}" if passes else "- passes: not recorded",
        f"- trial start-up (process start to the end of the first step): median {statistics.median(startups):.1f} s, "
        f"max {max(startups):.1f} s" if startups else "- trial start-up: not recorded",
        "",
        "## Loss against compute (prenorm)",
        "",
    ]
    for scale, law in laws.items():
        lines.append(f"- {scale}: L(C) = {law.E:.4f} + {law.A:.4g} C^-{law.alpha:.4f} over {law.points} trials, rms residual {law.rms:.4f}"
                     if isinstance(law, PowerLaw) else f"- {scale}: no fit ({law})")
    lines += ["", "## The map", ""]
    if note is not None:
        lines += [f"Throughput ratios, adjusted speedups and their plots are left out: {note}.", ""]
    lines += [table, "## Plots", "", *[f"![{p[:-4]}]({p})" for p in plots], ""]
    if problems:
        lines += ["## Failed and pruned trials", "", "| trial | state | scale | residual | S | H | reason / last value |", "|---|---|---|---|---|---|---|"]
        for r in problems:
            why = r["fail_reason"] if r["state"] == "FAIL" else f"pruned; last reported {_fmt(r['last_reported'])}"
            why = str(why).replace("\n", " ").replace("|", "\\|")[:300]
            lines.append(f"| {r['trial']} | {r['state']} | {r['scale']} | {r['residual']} | {_fmt(r['block_size'])} | {_fmt(r['heads'])} | {why} |")
        lines.append("")
    (out / "report.md").write_text("\n".join(lines))

    info = attrs.get(ATTR + "mlflow") or {}
    if log_to_mlflow and info.get("parent_run_id"):
        from mlflow import MlflowClient

        from lit_mhar.sweeps.storage import absolute_sqlite

        from mlflow.exceptions import MlflowException

        uri = absolute_sqlite(info["tracking_uri"]) if info["tracking_uri"].startswith("sqlite") else info["tracking_uri"]
        try:
            MlflowClient(uri).log_artifacts(info["parent_run_id"], str(out), artifact_path="report")
        except MlflowException as e:  # a study carried from another machine without its tracking store
            print(f"[sweep {study}] note: not logged to MLflow: parent run {info['parent_run_id']} is not in {redact(uri)} ({e.error_code})")
            log_to_mlflow = False
    print(f"[sweep {study}] report written to {out}" + (f" and logged to MLflow run {info['parent_run_id']}" if log_to_mlflow and info else ""))
    return str(out)


__all__ = ["report", "summarise", "markdown_table", "plot_vs", "fit_power_law", "t_interval", "PowerLaw", "pareto_front"]
