"""Several GPUs through Lightning's DDP: loss parity, scaling, and checkpoints across device counts.

Three measurements, each a real ``lit-mhar fit`` (LitMharCLI, LitLM, Lightning's DDP strategy):

``parity``: the first ``--steps`` steps on N devices with global batch B must match 1 device with
    batch B. Both runs read the same global batches in the same order: the first ``steps x B``
    blocks of the train split in a seeded permutation, as a map-style dataset whose
    ``DistributedSampler`` (no shuffle) gives rank r the rows r, r + N, r + 2N, ... of every
    global batch. DDP averages the ranks' gradients of their mean losses: the gradient of the
    global batch's mean loss, as on one device. Same seed, so the same initial weights. Per step
    the global loss (mean over ranks) is written to ``parity-<N>dev.csv``; the report gives the
    largest and the mean absolute difference. Under bf16 autocast the two runs differ by rounding
    (the gradient all-reduce sums in another order); in float32 on CPU they agree to below 1e-5 (tests/test_distributed.py).
``scaling``: tokens/s on N devices against 1 (the same per-device batch, so N times the tokens per
    step), median of the logged ``perf/tokens_per_s`` after warm-up, for each variant's config.
``resume``: a checkpoint written on N devices resumes on 1 and the reverse; the resumed run must
    reach the requested step (``global_step`` of its last checkpoint).

Results go to ``--out``: ``parity-*.csv``, ``scaling.csv``, ``resume.csv`` and ``ddp.md``.

    python benchmarks/bench_ddp.py parity  --config configs/350m/block_mhar.yaml --devices 2 --global_batch 32 --steps 50 --out OUT
    python benchmarks/bench_ddp.py control --config configs/350m/block_mhar.yaml --global_batch 32 --steps 50 --out OUT
    python benchmarks/bench_ddp.py scaling --config configs/350m/prenorm.yaml configs/350m/block_mhar.yaml --devices 2 --steps 60 --out OUT
    python benchmarks/bench_ddp.py resume  --config configs/350m/block_mhar.yaml --devices 2 --steps 20 --out OUT
    # a CPU dry run (gloo): add --accelerator cpu --precision 32-true and small --set overrides

``control``: the 1-device parity run twice, compared the same way: the run-to-run difference that
    nondeterministic GPU kernels alone make, against which the parity difference is read.

``train`` is the single run ``parity`` starts twice (it is what Lightning's DDP launcher re-runs
on every rank).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve()


def _fit_args(config: str, devices: int, accelerator: str, precision: Optional[str], steps: int, out: Path, extra: list[str]) -> list[str]:
    args = ["--config", config, "--trainer.devices", str(devices), "--trainer.max_steps", str(steps),
            "--trainer.accelerator", accelerator, "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(out / "runs"),
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{out / 'mlflow.db'}"]
    if devices > 1:
        args += ["--trainer.strategy", "ddp"]
    if precision:
        args += ["--trainer.precision", precision]
    return args + extra


# ----------------------------------------------------------------------------- parity


def fixed_blocks(data_dir: str, seq_len: int, count: int, seed: int, path: Path) -> Path:
    """Writes to ``path`` the first ``count`` blocks of ``seq_len + 1`` tokens of the train split, in a
    permutation seeded by ``seed``: int64 ``[count, seq_len + 1]``. Run in one process (not under DDP,
    where litdata's ``len`` is per rank), so every run reads the same global order.

    Raises:
        ValueError: the split has fewer than ``count`` blocks.
    """
    import numpy as np
    import torch
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    dataset = StreamingDataset(str(Path(data_dir) / "train"), item_loader=TokensLoader(block_size=seq_len + 1), shuffle=False)
    if len(dataset) < count:
        raise ValueError(f"{data_dir}/train has {len(dataset)} blocks of {seq_len + 1} tokens; parity needs {count}")
    order = np.random.default_rng(seed).permutation(len(dataset))[:count]
    torch.save(torch.from_numpy(np.stack([dataset[int(i)] for i in order]).astype(np.int64)), path)
    return path


def train(config: str, devices: int, global_batch: int, steps: int, out: str, batches: str, accelerator: str = "auto",
          precision: Optional[str] = None, extra: Optional[list[str]] = None) -> Path:
    """One parity run: ``steps`` steps on ``devices`` devices over the global batches in ``batches``
    (from :func:`fixed_blocks`); the global loss of every step goes to ``OUT/parity-<devices>dev.csv`` (returned).

    Raises:
        ValueError: ``global_batch`` not a multiple of ``devices``, or fewer blocks than ``steps x global_batch``.
    """
    import lightning as L
    import torch

    from lit_mhar.cli.lightning import LitMharCLI
    from lit_mhar.data import TokenDataModule
    from lit_mhar.module import LitLM

    if global_batch % devices:
        raise ValueError(f"global_batch={global_batch} must be a multiple of devices={devices}")
    out_dir = Path(out).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"parity-{devices}dev.csv"

    blocks = torch.load(batches)
    if len(blocks) < steps * global_batch:
        raise ValueError(f"{batches} holds {len(blocks)} blocks; parity needs steps x global_batch = {steps * global_batch}")

    class FixedOrder(TokenDataModule):
        """The blocks of ``batches`` in order, as a map-style dataset."""

        def train_dataloader(self):
            # rank r reads rows r, r + N, ... of each global batch (Lightning's own sampler would shuffle)
            rows = blocks[: steps * global_batch]
            sampler = torch.utils.data.DistributedSampler(
                rows, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    class GlobalLoss(L.Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")
            self.rows.append((trainer.global_step, float(loss)))

    args = _fit_args(config, devices, accelerator, precision, steps, out_dir / f"parity-{devices}dev", extra or [])
    args += ["--data.batch_size", str(global_batch // devices), "--trainer.val_check_interval", str(steps),
             "--trainer.limit_val_batches", "0", "--data.val_tokens", "null", "--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0",
             "--checkpoint.monitor", "null"]
    cli = LitMharCLI(LitLM, FixedOrder, run=False, args=args, save_config_callback=None)
    recorder = GlobalLoss()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cli.trainer.is_global_zero:
        with csv_path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss"])
            writer.writerows(recorder.rows)
    return csv_path


def compare(one: Path, many: Path) -> dict[str, Any]:
    """Largest / mean absolute loss difference per step between two parity CSVs (and the first step's)."""
    def read(p: Path) -> list[float]:
        with p.open() as f:
            return [float(r["loss"]) for r in csv.DictReader(f)]

    a, b = read(one), read(many)
    if len(a) != len(b) or not a:
        raise ValueError(f"{one} has {len(a)} steps, {many} has {len(b)}")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return dict(steps=len(a), first_loss_1=a[0], first_loss_n=b[0], last_loss_1=a[-1], last_loss_n=b[-1],
                max_abs_diff=max(diffs), mean_abs_diff=statistics.fmean(diffs), max_rel_diff=max(d / abs(x) for d, x in zip(diffs, a)))


def _resolved_data(config: str, extra: list[str]) -> dict[str, Any]:
    """The ``data`` section of the fit config with the overrides, as the fit CLI resolves it."""
    import contextlib
    import io

    import yaml

    from lit_mhar.cli.lightning import run_lightning

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        run_lightning(["fit", "--config", config, *extra, "--print_config"])
    resolved = yaml.safe_load(text.getvalue())
    return resolved["data"]


def _parity_runs(args: argparse.Namespace, runs: list[tuple[int, Path]]) -> list[Path]:
    """The fixed global batches (once, in ``--out``), then one ``train`` process per ``(devices, out_dir)``; the CSV paths."""
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    data = _resolved_data(args.config[0], args.set)
    from lit_mhar.data import TokenDataModule

    TokenDataModule(data["data_dir"], data["seq_len"], prepare_if_missing=data["prepare_if_missing"])  # the default corpus, once
    batches = fixed_blocks(data["data_dir"], data["seq_len"], args.steps * args.global_batch, data["seed"], out / "batches.pt")
    paths = []
    for devices, run_out in runs:
        command = [sys.executable, str(HERE), "train", "--config", args.config[0], "--devices", str(devices),
                   "--global_batch", str(args.global_batch), "--steps", str(args.steps), "--out", str(run_out), "--batches", str(batches),
                   "--accelerator", args.accelerator] + (["--precision", args.precision] if args.precision else [])
        command += [f"--set={s}" for s in args.set_raw]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        paths.append(run_out / f"parity-{devices}dev.csv")
    return paths


def parity(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).absolute()
    paths = _parity_runs(args, [(1, out), (args.devices, out)])
    result = dict(config=args.config[0], devices=args.devices, global_batch=args.global_batch, **compare(*paths))
    _write(out, "parity", [result])
    return result


def control(args: argparse.Namespace) -> dict[str, Any]:
    """The noise floor of ``parity``: the 1-device run twice (same seed, weights and batches), compared as parity compares.

    On a GPU the two differ only by nondeterministic kernels (atomics in cuBLAS / SDPA backward
    reductions); a parity difference of the same size is that noise, not a DDP error.
    """
    out = Path(args.out).absolute()
    paths = _parity_runs(args, [(1, out / "control-a"), (1, out / "control-b")])
    result = dict(config=args.config[0], devices=1, global_batch=args.global_batch, **compare(*paths))
    _write(out, "control", [result])
    return result


# ----------------------------------------------------------------------------- scaling and resume


def _fit(args: list[str], log: Path) -> None:
    command = [sys.executable, "-m", "lit_mhar.cli", "fit", *args]
    print("$", " ".join(command), flush=True)
    with log.open("w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"fit exited {code}; see {log}")


def _last_run_metric(db: Path, metric: str, skip: int) -> list[float]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["attributes.start_time DESC"], max_results=1)
    history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
    return [m.value for m in history[skip:]]


def scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out).absolute()
    rows = []
    for config in args.config:
        speeds = {}
        for devices in (1, args.devices):
            run_dir = out / f"scaling-{Path(config).parent.name}-{Path(config).stem}-{devices}dev"
            run_dir.mkdir(parents=True, exist_ok=True)
            _fit(_fit_args(config, devices, args.accelerator, args.precision, args.steps, run_dir,
                           ["--trainer.val_check_interval", str(args.steps), "--trainer.limit_val_batches", "0", "--data.val_tokens", "null",
                            "--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0", "--checkpoint.monitor", "null",
                            "--trainer.log_every_n_steps", str(args.log_every), *args.set]), run_dir / "fit.log")
            values = _last_run_metric(run_dir / "mlflow.db", "perf/tokens_per_s", skip=1)  # the first window compiles
            speeds[devices] = statistics.median(values) if values else float("nan")
        rows.append(dict(config=config, devices=args.devices, tokens_per_s_1=speeds[1], tokens_per_s_n=speeds[args.devices],
                         speedup=speeds[args.devices] / speeds[1], efficiency=speeds[args.devices] / speeds[1] / args.devices))
        print(rows[-1], flush=True)
    _write(out, "scaling", rows)
    return rows


def resume(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    out = Path(args.out).absolute()
    rows = []
    for first, second in ((args.devices, 1), (1, args.devices))[: 1 if args.one_way else 2]:
        run_dir = out / f"resume-{first}to{second}"
        run_dir.mkdir(parents=True, exist_ok=True)
        common = ["--trainer.val_check_interval", str(args.steps), "--data.val_tokens", "null", *args.set]
        _fit(_fit_args(args.config[0], first, args.accelerator, args.precision, args.steps, run_dir, common), run_dir / "first.log")
        (ckpt,) = run_dir.glob("runs/*/*/checkpoints/last.ckpt")
        _fit(_fit_args(args.config[0], second, args.accelerator, args.precision, 2 * args.steps, run_dir, common)
             + ["--ckpt_path", str(ckpt)], run_dir / "second.log")
        # the resumed fit continues the checkpoint's MLflow run, in runs/<exp>/<run>/resumed-<time>/checkpoints/
        newest = max(run_dir.glob("runs/**/last.ckpt"), key=lambda p: p.stat().st_mtime)
        step = torch.load(newest, map_location="cpu", weights_only=False)["global_step"]
        rows.append(dict(config=args.config[0], written_on=first, resumed_on=second, first_steps=args.steps,
                         final_step=step, ok=step == 2 * args.steps))
        print(rows[-1], flush=True)
    _write(out, "resume", rows)
    return rows


def _write(out: Path, name: str, rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with (out / "ddp.md").open("a") as f:
        f.write(f"\n## {name}\n\n| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]) + "\n")
        for r in rows:
            f.write("| " + " | ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in r.values()) + " |\n")
    print(json.dumps(rows, indent=1), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["parity", "control", "scaling", "resume", "train"])
    parser.add_argument("--config", nargs="+", required=True, help="fit config(s) (configs/<scale>/<variant>.yaml)")
    parser.add_argument("--devices", type=int, default=2, help="devices of the multi-device run (the other has 1)")
    parser.add_argument("--global_batch", type=int, default=32, help="parity: sequences per step, all devices together")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--log_every", type=int, default=10, help="scaling: steps per tokens/s window")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default=None, help="default: the CLI's (bf16-mixed on GPUs)")
    parser.add_argument("--set", action="append", default=[], help="one more fit argument as KEY=VALUE: --set=--data.seq_len=128 (repeatable)")
    parser.add_argument("--batches", help="train: the global batches (parity writes them: OUT/batches.pt)")
    parser.add_argument("--one_way", action="store_true", help="resume: only N devices -> 1 (default: also 1 -> N)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.set_raw, args.set = args.set, [part for s in args.set for part in s.split("=", 1)]
    if args.mode == "train":
        train(args.config[0], args.devices, args.global_batch, args.steps, args.out, args.batches, args.accelerator, args.precision, args.set)
    elif args.mode == "parity":
        parity(args)
    elif args.mode == "control":
        control(args)
    elif args.mode == "scaling":
        scaling(args)
    else:
        return 0 if all(r["ok"] for r in resume(args)) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
