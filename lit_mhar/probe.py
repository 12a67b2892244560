"""``lit-mhar probe``: how a trained model routes across depth, measured on held-out tokens.

For every routing site l (before sublayer l; the last before the LM head) and routing head h, the
routing weights ``alpha_{i->l,h}`` over the site's N_l sources (AttnRes eq. 2-4; MHAR: one softmax
per channel slice) are averaged over tokens:

- the depth-mixing matrix per head: site x source, mean weight (rows sum to 1);
- per site, the collapse diagnostics of Delta AttnRes (arXiv 2605.18855, Sec. 3): mean over
  tokens and heads of the largest weight, and of the entropy ``-sum_i alpha_i ln alpha_i`` (nats;
  at most ln N_l). Routing over cumulative states flattens to ~0.2 max weight in deep layers, over
  deltas it stays near 0.6;
- head disagreement (MHAR): the mean over head pairs of the Jensen-Shannon divergence between two
  heads' depth distributions, per token, then averaged (nats, in [0, ln 2]); the same between the
  token-averaged distributions; and the cosine similarity between heads' pseudo-query slices
  ``q_l[h*d/H:(h+1)*d/H]`` (raw, and times the key-norm gain, which is what scores the keys).

Output folder: ``probe.json`` (every number), ``mixing.png`` (heatmaps per head and their mean),
``depth.png`` (max weight and entropy against depth) and, for H > 1, ``heads.png`` (disagreement
against depth). The same numbers and files are logged to the checkpoint's MLflow run when it has
one (see :func:`find_mlflow_run`).
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_mhar.config import ModelConfig
from lit_mhar.outputs import check_output_dir, staged_directory
from lit_mhar.tracking import absolute_tracking_uri
from lit_mhar.tracking import tracking_uri as default_tracking_uri

PROBE_JSON = "probe.json"
OUTPUT_NAMES = (PROBE_JSON, "mixing.png", "depth.png", "heads.png")  # all probe writes
_CKPT_IN_RUN = re.compile(r"(?P<experiment_id>[^/]+)/(?P<run_id>[0-9a-f]{32})/checkpoints/[^/]+$")


# ----------------------------------------------------------------------------- MLflow run of a checkpoint


def _local_store_missing(uri: str) -> bool:
    """True for a sqlite / file store that does not exist (opening it would create an empty one)."""
    if uri.startswith("sqlite:///"):
        return not Path(uri[len("sqlite:///") :]).is_file()
    if uri.startswith("file:"):
        return not Path(uri[len("file:") :].removeprefix("//")).exists()
    return "://" not in uri and not Path(uri).exists()


def find_mlflow_run(
    checkpoint_path: Path, checkpoint: dict[str, Any], run_id: Optional[str] = None, tracking_uri: Optional[str] = None
) -> tuple[Optional[str], Optional[str], str]:
    """The MLflow run a checkpoint belongs to: ``(tracking_uri, run_id, how)``, or Nones.

    In order: the ``run_id`` / ``tracking_uri`` given; the ``checkpoint["mlflow"]`` record that
    :class:`LitLM` writes into every checkpoint of a run logged with ``MLFlowLogger``; for older
    checkpoints, the path Lightning gives them, ``<root>/<experiment_id>/<run_id>/checkpoints/x.ckpt``,
    with the tracking URI given, else ``MLFLOW_TRACKING_URI``, else the CLI's ``sqlite:///mlflow.db``
    (used only if that store holds the run in that experiment). ``how`` says which.
    """
    if run_id is not None:
        record = checkpoint.get("mlflow") or {}
        return absolute_tracking_uri(tracking_uri or record.get("tracking_uri") or default_tracking_uri()), run_id, "given"
    record = checkpoint.get("mlflow")
    if isinstance(record, dict) and record.get("run_id"):
        uri = tracking_uri or record.get("tracking_uri") or default_tracking_uri()
        if _local_store_missing(uri):
            return None, None, f"checkpoint (its store {uri} is not here)"
        return uri, record["run_id"], "checkpoint"
    match = _CKPT_IN_RUN.search(checkpoint_path.resolve().as_posix())
    if match is None:
        return None, None, "none"
    uri = absolute_tracking_uri(tracking_uri or default_tracking_uri())
    if _local_store_missing(uri):
        return None, None, "none"
    import mlflow

    try:
        run = mlflow.MlflowClient(tracking_uri=uri).get_run(match["run_id"])
    except Exception:  # mlflow raises MlflowException for an unknown run; any failure means "not this store"
        return None, None, "none"
    if run.info.experiment_id != match["experiment_id"]:
        return None, None, "none"
    return uri, match["run_id"], "path"


# ----------------------------------------------------------------------------- statistics


def pairwise_jsd(p: Tensor) -> Tensor:
    """Jensen-Shannon divergence (nats) between every pair of distributions.

    Args:
        p: ``[N, ..., H]`` H distributions over N outcomes (each sums to 1 over dim 0).

    Returns:
        ``[..., H, H]`` symmetric, zero diagonal, each entry in [0, ln 2];
        ``JSD(a, b) = KL(a || m) / 2 + KL(b || m) / 2`` with ``m = (a + b) / 2`` and 0 ln 0 = 0.
    """
    H = p.shape[-1]
    out = p.new_zeros((*p.shape[1:-1], H, H))
    for a in range(H):
        for b in range(a + 1, H):
            pa, pb = p[..., a], p[..., b]
            m = (pa + pb) / 2
            kl = lambda x: (torch.xlogy(x, x) - torch.xlogy(x, m)).sum(0)  # noqa: E731
            out[..., a, b] = out[..., b, a] = (kl(pa) + kl(pb)) / 2
    return out


def head_cosine(vector: Tensor, heads: int) -> Tensor:
    """``[H, H]`` cosine similarity between the H contiguous d/H slices of ``vector`` ``[d]``
    (NaN where a slice is zero, e.g. an untrained pseudo-query)."""
    s = vector.detach().double().view(heads, -1)
    norms = s.norm(dim=1)
    cos = (s @ s.T) / (norms[:, None] * norms[None, :])
    return torch.where((norms[:, None] > 0) & (norms[None, :] > 0), cos, torch.full_like(cos, math.nan))


class SiteAccumulator:
    """Running token sums of one site's routing statistics (float64), from ``[N, B, T, H]`` weights."""

    def __init__(self, n_sources: int, heads: int) -> None:
        self.tokens = 0
        self.weight = torch.zeros(n_sources, heads, dtype=torch.float64)
        self.max_weight = torch.zeros(heads, dtype=torch.float64)
        self.entropy = torch.zeros(heads, dtype=torch.float64)
        self.jsd = torch.zeros(heads, heads, dtype=torch.float64)

    def add(self, w: Tensor) -> None:
        w = w.double().flatten(1, -2)  # [N, tokens, H]
        self.tokens += w.shape[1]
        self.weight += w.sum(1).cpu()
        self.max_weight += w.amax(0).sum(0).cpu()
        self.entropy += (-torch.xlogy(w, w).sum(0)).sum(0).cpu()
        if w.shape[-1] > 1:
            self.jsd += pairwise_jsd(w).sum(0).cpu()

    def result(self) -> dict[str, Any]:
        n = self.tokens
        H = self.weight.shape[1]
        mixing = (self.weight / n).T  # [H, N]
        pairs = torch.triu_indices(H, H, 1)
        jsd = self.jsd / n
        mean_jsd = pairwise_jsd(mixing.T)
        return {
            "mixing": mixing,
            "max_weight_per_head": self.max_weight / n,
            "entropy_per_head": self.entropy / n,
            "head_jsd_matrix": jsd,
            "head_jsd": jsd[pairs[0], pairs[1]].mean() if H > 1 else None,
            "mean_distribution_jsd": mean_jsd[pairs[0], pairs[1]].mean() if H > 1 else None,
        }


def site_names(cfg: ModelConfig) -> list[str]:
    """``attn0, mlp0, attn1, ..., final``: the sublayer each routing site feeds."""
    return [f"{kind}{i}" for i in range(cfg.n_layer) for kind in ("attn", "mlp")] + ["final"]


def source_names(cfg: ModelConfig) -> list[str]:
    """Column j of the mixing matrix: ``emb``, then sublayer outputs (S = 1) or block j (S > 1).

    With S > 1, column j >= 1 is block j whether a site sees it completed or in progress (the
    partial sum is always the newest source), so every site's weights fall in one column layout.
    """
    if cfg.block_size == 1:
        return ["emb", *site_names(cfg)[:-1]]
    return ["emb", *(f"block{j}" for j in range(1, math.ceil(cfg.n_sublayers / cfg.block_size) + 1))]


# ----------------------------------------------------------------------------- plots


def _plot(result: dict[str, Any], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sites, sources = result["site_names"], result["source_names"]
    H = result["config"]["heads"]
    sites_data = result["sites"]
    depth = np.arange(len(sites))
    none = lambda x: np.nan if x is None else x  # noqa: E731
    written = []

    # mixing matrices: one heatmap per head plus the mean over heads
    panels = [(f"head {h}", h) for h in range(H)] + ([("mean over heads", None)] if H > 1 else [])
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 0.22 * len(sites) * rows + 1.6 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    image = None
    for ax, (title, h) in zip(axes.flat, panels):
        m = np.full((len(sites), len(sources)), np.nan)
        for l, s in enumerate(sites_data):
            row = np.array(s["mixing"])  # [H, N_l]
            m[l, : row.shape[1]] = row.mean(0) if h is None else row[h]
        image = ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        step_y, step_x = max(1, len(sites) // 24), max(1, len(sources) // 24)
        ax.set_yticks(depth[::step_y], [sites[i] for i in depth[::step_y]], fontsize=6)
        ax.set_xticks(np.arange(len(sources))[::step_x], sources[::step_x], fontsize=6, rotation=90)
        ax.set_xlabel("source", fontsize=7)
        ax.set_ylabel("routing site", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8, label="mean routing weight")
    fig.suptitle(f"depth mixing, {result['tokens']:,} {result['split']} tokens, step {result['global_step']}", fontsize=10)
    fig.savefig(folder / "mixing.png", dpi=100)
    plt.close(fig)
    written.append("mixing.png")

    # collapse diagnostics against depth
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for h in range(H if H > 1 else 0):
        ax1.plot(depth, [s["max_weight_per_head"][h] for s in sites_data], lw=0.8, alpha=0.5, label=f"head {h}")
        ax2.plot(depth, [s["entropy_per_head"][h] for s in sites_data], lw=0.8, alpha=0.5)
    ax1.plot(depth, [s["max_weight"] for s in sites_data], "k-o", ms=3, label="mean")
    ax1.plot(depth, [1 / s["n_sources"] for s in sites_data], "k:", lw=0.8, label="uniform 1/N")
    ax2.plot(depth, [s["entropy"] for s in sites_data], "k-o", ms=3, label="mean")
    ax2.plot(depth, [s["max_entropy"] for s in sites_data], "k:", lw=0.8, label="uniform ln N")
    ax1.set(ylabel="max routing weight", ylim=(0, 1.02))
    ax2.set(ylabel="routing entropy (nats)")
    for ax in (ax1, ax2):
        ax.set_xticks(depth[:: max(1, len(sites) // 16)], [sites[i] for i in depth[:: max(1, len(sites) // 16)]], rotation=90, fontsize=7)
        ax.set_xlabel("routing site (depth)")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "depth.png", dpi=100)
    plt.close(fig)
    written.append("depth.png")

    if H > 1:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
        ax1.plot(depth, [none(s["head_jsd"]) for s in sites_data], "-o", ms=3, label="per token")
        ax1.plot(depth, [none(s["mean_distribution_jsd"]) for s in sites_data], "--s", ms=3, label="token-averaged distributions")
        ax1.set(ylabel="mean pairwise JS divergence (nats, max ln 2)")
        ax2.plot(depth, [none(s["query_cosine"]) for s in sites_data], "-o", ms=3, label="pseudo-query slices")
        ax2.plot(depth, [none(s["effective_query_cosine"]) for s in sites_data], "--s", ms=3, label="query x key gain")
        ax2.set(ylabel="mean pairwise cosine similarity", ylim=(-1.02, 1.02))
        for ax in (ax1, ax2):
            ax.set_xticks(depth[:: max(1, len(sites) // 16)], [sites[i] for i in depth[:: max(1, len(sites) // 16)]], rotation=90, fontsize=7)
            ax.set_xlabel("routing site (depth)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"head disagreement, H={H}", fontsize=10)
        fig.tight_layout()
        fig.savefig(folder / "heads.png", dpi=100)
        plt.close(fig)
        written.append("heads.png")
    return written


# ----------------------------------------------------------------------------- probe


def _jsonable(x: Any) -> Any:
    """Tensors -> lists / floats, NaN -> None (JSON has no NaN)."""
    if isinstance(x, Tensor):
        x = x.tolist()
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _log_to_mlflow(uri: str, run_id: str, result: dict[str, Any], folder: Path, artifact_path: str) -> None:
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient(tracking_uri=uri)
    now, step = int(time.time() * 1000), int(result["global_step"] or 0)
    metrics = {"probe/loss": result["loss"], "probe/tokens": result["tokens"]}
    for s in result["sites"]:
        for key in ("max_weight", "entropy", "head_jsd", "query_cosine"):
            metrics[f"probe/site_{s['index']:02d}/{key}"] = s[key]
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
    for i in range(0, len(batch), 1000):  # MLflow's log_batch limit
        client.log_batch(run_id, metrics=batch[i : i + 1000])
    client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)


def _check_data_dir(data_dir: str, ckpt_path: Path, checkpoint: dict[str, Any]) -> None:
    """Raises FileNotFoundError, naming the path and how to get a dataset, unless ``data_dir`` is one.

    The hint, first that applies: the dataset above a ``train/`` or ``val/`` folder given; the
    dataset the checkpoint was trained on, if it is here (``lit-mhar fit`` checkpoints record it);
    a dataset inside the folder given; else ``lit-mhar prepare`` with the model's tokenizer (the
    ids must mean what the model learnt).
    """
    from lit_mhar.data import MANIFEST_NAME
    from lit_mhar.checkpoint import tokenizer_candidates

    path = Path(data_dir).expanduser()
    if (path / MANIFEST_NAME).is_file():
        return
    if not path.exists():
        problem = ": no such folder"
    elif not path.is_dir():
        problem = " is a file, not a dataset folder"
    else:
        problem = f" has no {MANIFEST_NAME} (not a dataset, or one whose preparation did not finish)"
    trained = (checkpoint.get("datamodule_hyper_parameters") or {}).get("data_dir")
    trained_path = Path(str(trained)).expanduser() if trained else None
    split_parent = [path.parent] if path.name in ("train", "val") and (path.parent / MANIFEST_NAME).is_file() else []
    children = sorted(p for p in path.iterdir() if (p / MANIFEST_NAME).is_file()) if path.is_dir() else []
    if split_parent:
        fix = f"did you mean --data_dir {split_parent[0]}?"
    elif trained_path is not None and (trained_path / MANIFEST_NAME).is_file():
        fix = f"the checkpoint was trained on {trained_path}: pass --data_dir {trained_path}"
    elif children:
        fix = f"did you mean --data_dir {children[0]}?"
    else:
        tokenizer = next((str(t) for t in tokenizer_candidates(ckpt_path, checkpoint) if t.is_file()), "MODEL_TOKENIZER.json")
        fix = f"make one: lit-mhar prepare --output_dir {path} --source files --files '[\"corpus/*.txt\"]' --tokenizer {tokenizer}"
    raise FileNotFoundError(
        f"data_dir={data_dir!r}{problem}. --data_dir takes a dataset written by lit-mhar prepare (a folder with "
        f"{MANIFEST_NAME}, train/, val/) with the model's tokenizer; {fix}"
    )


def probe(
    checkpoint: str,
    data_dir: str,
    output_dir: str,
    split: Literal["val", "train"] = "val",
    max_tokens: int = 65536,
    batch_size: int = 8,
    seq_len: Optional[int] = None,
    device: str = "auto",
    overwrite: bool = False,
    mlflow: bool = True,
    run_id: Optional[str] = None,
    tracking_uri: Optional[str] = None,
) -> dict[str, Any]:
    """Measure a checkpoint's depth routing on a dataset; write JSON + PNGs; log them to its MLflow run.

    Runs the model in float32 (eval mode, no gradients) on the first ``max_tokens`` tokens of the
    split, ``batch_size`` sequences of ``seq_len`` tokens at a time, and averages the routing
    weights of every site and head over those tokens (see the module docstring for each number).

    Args:
        checkpoint: A lit-mhar checkpoint (``.ckpt``) of a routed model (attnres or delta).
        data_dir: A dataset written by ``lit-mhar prepare`` (token ids must fit the model's vocabulary).
        output_dir: Folder for ``probe.json`` and the PNGs; must not exist or be empty unless ``overwrite``.
        split: ``val`` (held out, default; read in order) or ``train`` (in the DataModule's
            seeded shuffle).
        max_tokens: Token budget: the first ``max_tokens // seq_len`` whole sequences of the split
            (fewer if the split is smaller; ``probe.json`` says how many tokens were used).
        batch_size: Sequences per forward pass.
        seq_len: Tokens per sequence; default the model's ``seq_len``; at most that.
        device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        overwrite: Replace a non-empty ``output_dir``.
        mlflow: Log metrics ``probe/site_XX/{max_weight,entropy,head_jsd,query_cosine}`` and
            ``probe/loss`` (at the checkpoint's step) and the output files (under
            ``probe/<split>-step<N>``) to the checkpoint's MLflow run, if it has one.
        run_id: Log to this MLflow run instead of the checkpoint's own.
        tracking_uri: The MLflow store of ``run_id`` (or of a checkpoint path's run); default
            ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``.

    Returns:
        The dict written to ``probe.json``.

    Raises:
        ValueError: a prenorm checkpoint (no routing sites, nothing to probe), a bad argument, a
            dataset whose vocabulary exceeds the model's; all before any output is written.
        FileExistsError: ``output_dir`` is not empty and ``overwrite`` is false.
        FileNotFoundError: no checkpoint or dataset at the paths given (the message names the path
            and the dataset to pass or how to prepare one).
    """
    from lit_mhar.checkpoint import read_checkpoint
    from lit_mhar.data import TokenDataModule, read_manifest
    from lit_mhar.model import LM

    ckpt_path, out = Path(checkpoint).expanduser(), Path(output_dir).expanduser()
    for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if split not in ("val", "train"):
        raise ValueError(f"split={split!r} is unknown; valid: ['val', 'train']")
    check_output_dir(out, overwrite, OUTPUT_NAMES, "probe")
    from lit_mhar.generate import resolve_device

    dev = resolve_device(device)
    cfg, weights, ckpt = read_checkpoint(ckpt_path)
    if not cfg.routed:
        raise ValueError(
            f"checkpoint {str(ckpt_path)!r} is a residual={cfg.residual!r} model: it has no routing sites, so there is "
            "nothing to probe. Probe an attnres / delta model (lit-mhar convert turns a prenorm one into delta)"
        )
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= cfg.seq_len:
        raise ValueError(f"seq_len={seq_len!r} must be an integer in [1, {cfg.seq_len}] (the model's seq_len)")
    if max_tokens < seq_len:
        raise ValueError(f"max_tokens={max_tokens} is less than one sequence of seq_len={seq_len} tokens")
    _check_data_dir(data_dir, ckpt_path, ckpt)
    manifest = read_manifest(data_dir)
    if manifest["vocab_size"] > cfg.vocab_size:
        raise ValueError(
            f"data_dir={data_dir!r} has a vocabulary of {manifest['vocab_size']} ids, the model only {cfg.vocab_size}: "
            "probe it on data tokenised with the model's tokenizer"
        )
    uri, mlflow_run, how = find_mlflow_run(ckpt_path, ckpt, run_id, tracking_uri) if mlflow else (None, None, "disabled")

    model = LM(cfg)
    model.load_state_dict(weights)
    model.to(dev).eval()
    sites = model.routing_sites()
    accumulators = [SiteAccumulator(cfg.n_sources(l), cfg.heads) for l in range(len(sites))]
    data = TokenDataModule(data_dir=data_dir, seq_len=seq_len, batch_size=batch_size, prepare_if_missing=False)
    loader = data.val_dataloader() if split == "val" else data.train_dataloader()
    tokens, loss_sum = 0, 0.0
    started = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            rows = min(batch.shape[0], (max_tokens - tokens) // seq_len)
            if rows == 0:
                break
            batch = batch[:rows].to(dev)
            logits, routing = model(batch[:, :-1], return_routing=True)
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            for acc, w in zip(accumulators, routing):
                acc.add(w)
            tokens += batch[:, :-1].numel()
            if tokens >= max_tokens:
                break
    if tokens == 0:
        raise ValueError(f"data_dir={data_dir!r}: the {split} split yielded no sequence of {seq_len + 1} tokens")
    seconds = time.perf_counter() - started

    names, sources = site_names(cfg), source_names(cfg)
    per_site = []
    for l, (site, acc) in enumerate(zip(sites, accumulators)):
        r = acc.result()
        cos = head_cosine(site.query, cfg.heads)
        eff = head_cosine(site.query * site.key_gain, cfg.heads)
        pairs = torch.triu_indices(cfg.heads, cfg.heads, 1)
        n = cfg.n_sources(l)
        per_site.append(
            {
                "index": l,
                "name": names[l],
                "n_sources": n,
                "sources": sources[:n],
                "mixing": r["mixing"],
                "mixing_mean_over_heads": r["mixing"].mean(0),
                "max_weight": r["max_weight_per_head"].mean(),
                "max_weight_per_head": r["max_weight_per_head"],
                "entropy": r["entropy_per_head"].mean(),
                "entropy_per_head": r["entropy_per_head"],
                "max_entropy": math.log(n),
                "head_jsd": r["head_jsd"],
                "head_jsd_matrix": r["head_jsd_matrix"],
                "mean_distribution_jsd": r["mean_distribution_jsd"],
                "query_cosine": cos[pairs[0], pairs[1]].mean() if cfg.heads > 1 else None,
                "query_cosine_matrix": cos,
                "effective_query_cosine": eff[pairs[0], pairs[1]].mean() if cfg.heads > 1 else None,
                "gate_rms": site.gate.detach().double().pow(2).mean().sqrt() if site.gate is not None else None,
            }
        )
    result = _jsonable(
        {
            "checkpoint": str(ckpt_path.resolve()),
            "global_step": ckpt.get("global_step"),
            "config": cfg.to_dict(),
            "data_dir": str(Path(data_dir).resolve()),
            "split": split,
            "tokens": tokens,
            "max_tokens": max_tokens,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "device": str(dev),
            "seconds": round(seconds, 2),
            "loss": loss_sum / tokens,
            "units": {
                "entropy": "nats (natural log); a site with N sources has at most ln N",
                "head_jsd": "nats, mean over head pairs of the per-token Jensen-Shannon divergence; in [0, ln 2]",
                "mean_distribution_jsd": "nats, JS divergence between heads' token-averaged distributions",
                "loss": "cross-entropy, nats per token, on the probed tokens",
                "query_cosine": "mean over head pairs; null for H = 1 or a zero query slice",
            },
            "site_names": names,
            "source_names": sources,
            "summary": {
                "max_weight_by_site": [s["max_weight"] for s in per_site],
                "entropy_by_site": [s["entropy"] for s in per_site],
                "head_jsd_by_site": [s["head_jsd"] for s in per_site],
                "query_cosine_by_site": [s["query_cosine"] for s in per_site],
            },
            "sites": per_site,
        }
    )
    artifact_path = f"probe/{split}-step{int(result['global_step'] or 0)}" if mlflow_run else None
    result["mlflow"] = {"tracking_uri": uri, "run_id": mlflow_run, "found_by": how, "artifact_path": artifact_path}

    with staged_directory(out, before_replace=lambda: check_output_dir(out, overwrite, OUTPUT_NAMES, "probe")) as tmp:
        result["plots"] = _plot(result, tmp)
        (tmp / PROBE_JSON).write_text(json.dumps(result, indent=1) + "\n")
        if mlflow_run is not None:
            try:
                _log_to_mlflow(uri, mlflow_run, result, tmp, artifact_path)
            except Exception as e:
                if how == "given":
                    raise
                # the run recorded in the checkpoint may live in a store not reachable from here
                warnings.warn(f"probe: could not log to MLflow run {mlflow_run} at {uri} ({e}); results are in {out}")
                result["mlflow"].update(artifact_path=None, error=str(e))
                (tmp / PROBE_JSON).write_text(json.dumps(result, indent=1) + "\n")
    _print_summary(result, out)
    return result


def _print_summary(result: dict[str, Any], out: Path) -> None:
    fmt = lambda x: "   -  " if x is None else f"{x:6.3f}"  # noqa: E731
    print(f"[lit-mhar probe] {result['tokens']:,} {result['split']} tokens, loss {result['loss']:.4f}, {result['seconds']}s on {result['device']}")
    print(" site  name     N  max_w  entropy  head_jsd  q_cos")
    for s in result["sites"]:
        print(f" {s['index']:4d}  {s['name']:<6} {s['n_sources']:3d} {fmt(s['max_weight'])} {fmt(s['entropy'])}  {fmt(s['head_jsd'])}  {fmt(s['query_cosine'])}")
    m = result["mlflow"]
    where = f"; logged to MLflow run {m['run_id']} ({m['found_by']}) under {m['artifact_path']}" if m["run_id"] else "; no MLflow run"
    print(f"[lit-mhar probe] wrote {out / PROBE_JSON} and {', '.join(result['plots'])}{where}")
