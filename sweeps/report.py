"""``lit-mhar sweep report``: tables and plots of a study, written to a folder and logged to its MLflow parent run.

Everything comes from the Optuna study (each trial's parameters, state and the user attributes the
runner stored: the resolved model shape, seed, tokens, validation loss, tokens/s, MFU, peak
memory, failure reason). Trials that were never run (``lit_mhar.surplus``) are left out.

Files (``OUTPUT/``):

* ``trials.csv``: one row per trial, failed and pruned ones with their reason;
* ``summary.csv`` / ``summary.md``: completed trials grouped by scale, residual, S, H and any other
  swept parameter except the seed, with mean and standard deviation over seeds, the change against
  the prenorm baseline of the same scale, and throughput relative to it; the best row of each scale
  in bold;
* ``val_loss_vs_heads.png`` (the U-curve, one panel per scale, one line per residual and S, the
  best point starred), ``val_loss_vs_block_size.png``, ``tokens_per_s_vs_heads.png``,
  ``peak_memory_vs_heads.png``;
* ``report.md``: the study's settings, the summary table, failures and the plots.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Optional

ATTR = "lit_mhar."
KEY_COLUMNS = ("scale", "residual", "block_size", "heads")


def _rows(study: Any) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if attrs.get(ATTR + "surplus") or ATTR + "point" not in attrs:
            continue
        model = attrs.get(ATTR + "model") or {}
        params = dict(t.params)
        row: dict[str, Any] = {
            "trial": t.number,
            "state": t.state.name,
            "scale": model.get("name", params.get("scale")),
            "residual": model.get("residual", params.get("residual")),
            "block_size": model.get("block_size", params.get("block_size")),
            "heads": model.get("heads", params.get("heads")),
            "seed": attrs.get(ATTR + "seed", params.get("seed")),
            **{f"param:{k}": v for k, v in params.items() if k not in ("scale", "residual", "block_size", "heads", "seed")},
            "val_loss": t.value if t.state.name == "COMPLETE" else attrs.get(ATTR + "val_loss"),
            "last_reported": t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None,
            "tokens_per_s": attrs.get(ATTR + "tokens_per_s"),
            "mfu": attrs.get(ATTR + "mfu"),
            "peak_memory_gb": attrs.get(ATTR + "peak_memory_gb"),
            "tokens": attrs.get(ATTR + "tokens"),
            "max_steps": attrs.get(ATTR + "max_steps"),
            "duration_s": attrs.get(ATTR + "duration_s"),
            "fail_reason": attrs.get(ATTR + "fail_reason", "" if t.state.name != "FAIL" else "interrupted"),
            "mlflow_run_id": attrs.get(ATTR + "mlflow_run_id"),
        }
        rows.append(row)
    return rows


def _mean_std(values: list[float]) -> tuple[float, Optional[float]]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _extra_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("param:")})


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed trials grouped by scale, residual, S, H and other swept parameters (seeds pooled).

    Each group has ``n`` (seeds), ``val_loss`` (mean), ``val_loss_std`` (sample standard deviation,
    None for one seed), ``delta_vs_prenorm`` (mean minus the same scale's prenorm mean),
    ``tokens_per_s`` (mean), ``throughput_vs_prenorm``, ``mfu``, ``peak_memory_gb``,
    ``memory_vs_prenorm`` and ``best`` (the lowest mean loss of its scale).
    """
    extras = _extra_keys(rows)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["state"] == "COMPLETE" and r["val_loss"] is not None:
            groups.setdefault(tuple(r[k] for k in KEY_COLUMNS) + tuple(r.get(k) for k in extras), []).append(r)
    out = []
    for key, members in groups.items():
        loss, std = _mean_std([m["val_loss"] for m in members])
        speeds = [m["tokens_per_s"] for m in members if m["tokens_per_s"] is not None]
        mfus = [m["mfu"] for m in members if m["mfu"] is not None]
        mems = [m["peak_memory_gb"] for m in members if m["peak_memory_gb"] is not None]
        out.append({
            **dict(zip(KEY_COLUMNS + tuple(extras), key)),
            "n": len(members),
            "val_loss": loss,
            "val_loss_std": std,
            "tokens_per_s": statistics.fmean(speeds) if speeds else None,
            "mfu": statistics.fmean(mfus) if mfus else None,
            "peak_memory_gb": statistics.fmean(mems) if mems else None,
            "tokens": members[0]["tokens"],
        })
    out.sort(key=lambda r: (str(r["scale"]), r["residual"] != "prenorm", str(r["residual"]), r["block_size"] or 0, r["heads"] or 0))
    for scale in {r["scale"] for r in out}:
        same = [r for r in out if r["scale"] == scale]
        base = [r for r in same if r["residual"] == "prenorm"]
        best = min(same, key=lambda r: r["val_loss"])
        for r in same:
            r["best"] = r is best
            r["delta_vs_prenorm"] = r["val_loss"] - base[0]["val_loss"] if base else None
            r["throughput_vs_prenorm"] = (
                r["tokens_per_s"] / base[0]["tokens_per_s"] if base and r["tokens_per_s"] and base[0]["tokens_per_s"] else None
            )
            r["memory_vs_prenorm"] = (
                r["peak_memory_gb"] / base[0]["peak_memory_gb"] if base and r["peak_memory_gb"] and base[0]["peak_memory_gb"] else None
            )
    return out


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """The summary as a GitHub markdown table; the best row of each scale in bold."""
    extras = [k for k in (summary[0] if summary else {}) if k.startswith("param:")]
    header = ["scale", "residual", "S", "H", *[e[6:] for e in extras], "seeds", "val loss", "± std", "Δ vs prenorm",
              "tokens/s", "× prenorm", "MFU", "peak GiB", "mem × prenorm"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in summary:
        cells = [
            str(r["scale"]), str(r["residual"]), _fmt(r["block_size"]), _fmt(r["heads"]), *[_fmt(r[e]) for e in extras], str(r["n"]),
            _fmt(r["val_loss"]), _fmt(r["val_loss_std"]),
            "" if r["residual"] == "prenorm" else (f"{r['delta_vs_prenorm']:+.4f}" if r["delta_vs_prenorm"] is not None else "n/a"),
            _fmt(r["tokens_per_s"] and round(r["tokens_per_s"])), _fmt(r["throughput_vs_prenorm"], 2),
            _fmt(r["mfu"] and 100 * r["mfu"], 1) + ("%" if r["mfu"] else ""), _fmt(r["peak_memory_gb"], 2),
            _fmt(r.get("memory_vs_prenorm"), 2),
        ]
        if r.get("best"):
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


def _line_label(r: dict[str, Any], by: str, extras: list[str]) -> str:
    label = f"{r['residual']} {by}={r['block_size'] if by == 'S' else r['heads']}"
    return label + "".join(f" {e[6:]}={r[e]}" for e in extras)


def plot_vs(summary: list[dict[str, Any]], x: str, y: str, ylabel: str, path: Path, title: str, mark_best: bool = False) -> None:
    """One panel per scale; one line per residual and the other routing size; prenorm as a dashed line.

    Args:
        x: ``heads`` (lines per S) or ``block_size`` (lines per H); plotted on a log2 axis.
        y: the summary column to plot; error bars are the standard deviation over seeds for val_loss.
        mark_best: star the scale's lowest-loss point.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extras = [k for k in (summary[0] if summary else {}) if k.startswith("param:")]
    scales = sorted({str(r["scale"]) for r in summary})
    fig, axes = plt.subplots(1, max(1, len(scales)), figsize=(5.5 * max(1, len(scales)), 4.2), squeeze=False)
    other = "S" if x == "heads" else "H"
    for ax, scale in zip(axes[0], scales or [""]):
        same = [r for r in summary if str(r["scale"]) == scale and r[y] is not None]
        routed = [r for r in same if r["residual"] != "prenorm"]
        lines: dict[str, list[dict[str, Any]]] = {}
        for r in routed:
            lines.setdefault(_line_label(r, other, extras), []).append(r)
        xs_all = sorted({r[x] for r in routed})
        for label, members in sorted(lines.items()):
            members.sort(key=lambda r: r[x])
            errs = [r["val_loss_std"] or 0.0 for r in members] if y == "val_loss" else None
            ax.errorbar([r[x] for r in members], [r[y] for r in members], yerr=errs, marker="o", capsize=3, label=label)
        for r in same:
            if r["residual"] == "prenorm":
                ax.axhline(r[y], color="gray", linestyle="--", label="prenorm" + "".join(f" {e[6:]}={r[e]}" for e in extras))
        if mark_best and same:
            best = min(same, key=lambda r: r["val_loss"])
            if best["residual"] != "prenorm":
                ax.plot([best[x]], [best[y]], marker="*", markersize=18, color="gold", markeredgecolor="black", zorder=5,
                        label=f"best: {best['residual']} H={best['heads']} S={best['block_size']} ({best['val_loss']:.4f})")
            else:
                ax.plot([], [], " ", label=f"best: prenorm ({best['val_loss']:.4f})")
        if not same:
            ax.text(0.5, 0.5, f"{ylabel}: not measured\n(peak memory is logged on GPUs only)" if y == "peak_memory_gb" else "no completed trials",
                    ha="center", va="center", transform=ax.transAxes)
        if xs_all:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all)
            ax.set_xticklabels([str(v) for v in xs_all])
        ax.set_xlabel("routing heads H" if x == "heads" else "block size S (sublayers per block)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} — {scale}" if scale else title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(
    study: str,
    storage: str = "sqlite:///sweeps.db",
    output_dir: Optional[str] = None,
    overwrite: bool = False,
    log_to_mlflow: bool = True,
) -> str:
    """Writes a study's tables and plots to a folder and logs them to its MLflow parent run.

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

    from lit_mhar.sweeps.runner import open_storage
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
    names_written = ["trials.csv", "summary.csv", "summary.md", "report.md", "val_loss_vs_heads.png", "val_loss_vs_block_size.png",
                     "tokens_per_s_vs_heads.png", "peak_memory_vs_heads.png"]
    if out.exists() and any(out.iterdir()):
        foreign = sorted(p.name for p in out.iterdir() if p.name not in names_written)
        if not overwrite or foreign:
            raise ValueError(
                f"{out} is not empty; pass --overwrite true to replace an earlier report there"
                if not foreign else f"{out} holds files the report did not write ({foreign[:5]}); choose another --output_dir"
            )
    out.mkdir(parents=True, exist_ok=True)

    rows = _rows(loaded)
    summary = summarise(rows)
    _write_csv(out / "trials.csv", rows)
    _write_csv(out / "summary.csv", summary)
    table = markdown_table(summary)
    (out / "summary.md").write_text(table)
    plot_vs(summary, "heads", "val_loss", "validation loss (nats/token)", out / "val_loss_vs_heads.png", "val loss vs H", mark_best=True)
    plot_vs(summary, "block_size", "val_loss", "validation loss (nats/token)", out / "val_loss_vs_block_size.png", "val loss vs S", mark_best=True)
    plot_vs(summary, "heads", "tokens_per_s", "training tokens/s", out / "tokens_per_s_vs_heads.png", "throughput vs H")
    plot_vs(summary, "heads", "peak_memory_gb", "peak GPU memory (GiB)", out / "peak_memory_vs_heads.png", "peak memory vs H")

    spec = attrs[ATTR + "spec"]
    objective = spec["objective"]
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    seeds = sorted({r["seed"] for r in rows if r["seed"] is not None})
    problems = [r for r in rows if r["state"] in ("FAIL", "PRUNED")]
    lines = [
        f"# Sweep `{study}`",
        "",
        f"- storage: `{redact(storage)}`; sampler `{spec['sampler']}`; trials: "
        + ", ".join(f"{v} {k}" for k, v in sorted(states.items())),
        f"- objective: `{objective['metric']}` after {objective['tokens']:,} training tokens per trial "
        f"(rounded up to whole steps; {objective['evals']} validations per trial)",
        f"- seeds: {seeds} (mean ± sample standard deviation over seeds where there are several)",
        "",
        "## Summary",
        "",
        table,
        "## Plots",
        "",
        "![val loss vs H](val_loss_vs_heads.png)",
        "![val loss vs S](val_loss_vs_block_size.png)",
        "![tokens/s vs H](tokens_per_s_vs_heads.png)",
        "![peak memory vs H](peak_memory_vs_heads.png)",
        "",
    ]
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

        MlflowClient(info["tracking_uri"]).log_artifacts(info["parent_run_id"], str(out), artifact_path="report")
    print(f"[sweep {study}] report written to {out}" + (f" and logged to MLflow run {info['parent_run_id']}" if log_to_mlflow and info else ""))
    return str(out)


__all__ = ["report", "summarise", "markdown_table", "plot_vs"]
