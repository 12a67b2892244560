"""Training throughput through ``lit-mhar fit`` itself: each variant's YAML config run for a few
hundred steps by the real command (Lightning's loop, the litdata loader, the logged ``perf/*``).

``bench_training.py`` times a plain loop over the model; this script times what a user runs.
Each config runs in its own ``python -m lit_mhar.cli fit`` process, logging to a CSVLogger in
``--out`` (no MLflow run is made) with validation and routing statistics at the configs' settings
unless overridden; the throughput is the median of the logged ``perf/tokens_per_s`` windows
after the first ``--skip`` (compilation, warm-up). Ratios are against the first config of the run
that completed.

    python benchmarks/bench_fit.py --configs configs/350m/prenorm.yaml,configs/350m/block_mhar.yaml \\
        --steps 120 --out results/ -- --model.compile sublayers

Arguments after ``--`` go to every ``fit`` command; a config's own settings follow its path after
``+``, as ``key=value`` (``configs/350m/block_mhar.yaml+model.cuda_graph=true`` passes
``--model.cuda_graph true`` to that fit only), so one run can time one config two ways. Appends one row per config to
``fit_bench.csv`` in ``--out`` as each fit ends and prints it; refuses an ``--out`` holding an
earlier run's logs; the default corpus is built by the first fit in the current folder
(``data/stdlib``) if it is not there.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import time

FIELDS = ["config", "args", "steps", "windows", "tokens_per_s", "ratio", "mfu", "peak_memory_gb", "wall_s", "status", "note"]


def read_windows(metrics_csv: str, key: str) -> list[float]:
    """The logged values of ``key`` in a CSVLogger ``metrics.csv``, in step order."""
    with open(metrics_csv, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get(key)]
    return [float(r[key]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def split_config(item: str) -> tuple[str, list[str]]:
    """``(path, fit arguments)`` of a ``--configs`` item ``PATH[+key=value...]``; ValueError names a
    setting without ``=`` or an empty key."""
    path, *settings = item.split("+")
    args = []
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq or not key:
            raise ValueError(f"--configs item {item!r}: setting {setting!r} is not key=value")
        args += [f"--{key}", value]
    return path, args


def run_config(config: str, steps: int, log_every: int, skip: int, extra: list[str], out: str, index: int) -> dict:
    """Runs one fit of a ``--configs`` item; returns its row (see :data:`FIELDS`): medians of the
    windows after the first ``skip``."""
    item, (config, own) = config, split_config(config)
    extra = [*extra, *own]
    save_dir = os.path.join(out, f"fit_logs_{index}")
    if os.path.exists(save_dir):
        raise FileExistsError(f"bench_fit: {save_dir} exists; choose another --out (nothing is overwritten)")
    cmd = [
        sys.executable, "-m", "lit_mhar.cli", "fit", "--config", config,
        "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", str(log_every),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", save_dir,
        "--trainer.default_root_dir", save_dir, "--trainer.enable_progress_bar", "false", *extra,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = dict(config=item, args=" ".join(extra), steps=steps, wall_s=f"{time.time() - t0:.0f}")
    with open(os.path.join(out, f"fit_{index}.log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    metrics = [os.path.join(root, "metrics.csv") for root, _, files in os.walk(save_dir) if "metrics.csv" in files]
    for ckpt_dir in [os.path.join(root, d) for root, dirs, _ in os.walk(save_dir) for d in dirs if d == "checkpoints"]:
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # (a 350m checkpoint is gigabytes; the logs stay)
    if proc.returncode != 0 or not metrics:
        return {**row, "status": "error", "note": (proc.stderr.strip().splitlines() or ["no metrics.csv"])[-1][:300]}
    tokens = read_windows(metrics[0], "perf/tokens_per_s")[skip:]
    if not tokens:
        return {**row, "status": "error", "note": f"no throughput window logged after the first {skip}"}
    mfu = read_windows(metrics[0], "perf/mfu")[skip:]
    peak = read_windows(metrics[0], "perf/peak_memory_gb")
    row.update(
        status="ok", windows=len(tokens), tokens_per_s=f"{statistics.median(tokens):.0f}",
        mfu=f"{statistics.median(mfu):.3f}" if mfu else "", peak_memory_gb=f"{max(peak):.2f}" if peak else "",
    )
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", required=True, help="comma-separated YAML configs, each PATH[+key=value...]; the first is the baseline of the ratios")
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per fit")
    ap.add_argument("--log-every", type=int, default=10, help="steps per throughput window (trainer.log_every_n_steps)")
    ap.add_argument("--skip", type=int, default=2, help="first windows left out (compilation, warm-up)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    try:
        paths = [split_config(c)[0] for c in configs]
    except ValueError as e:
        ap.error(str(e))
    missing = [c for c in paths if not c or not os.path.isfile(c)]
    if missing:
        ap.error(f"--configs: no such file: {missing}")
    if args.steps < 1 or args.log_every < 1 or args.skip < 0:
        ap.error(f"--steps {args.steps} and --log-every {args.log_every} must be >= 1, --skip {args.skip} >= 0")
    if args.steps // args.log_every <= args.skip:
        ap.error(f"--steps {args.steps} / --log-every {args.log_every} gives no window after the {args.skip} skipped")
    taken = [d for i in range(len(configs)) if os.path.exists(d := os.path.join(args.out, f"fit_logs_{i}"))]
    if taken:
        ap.error(f"--out {args.out}: {taken} exist from an earlier run; choose another --out (nothing is overwritten)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fit_bench.csv")
    statuses, base = [], None
    for i, config in enumerate(configs):
        row = run_config(config, args.steps, args.log_every, args.skip, extra, args.out, i)
        if row["status"] == "ok":
            base = base or float(row["tokens_per_s"])
            row["ratio"] = f"{float(row['tokens_per_s']) / base:.3f}"
        statuses.append(row["status"])
        print(" ".join(f"{k}={row.get(k, '')}" for k in FIELDS), flush=True)
        new = not os.path.exists(path)
        with open(path, "a", newline="") as fh:  # row by row: a run stopped by a time limit keeps the rows before
            writer = csv.DictWriter(fh, FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(row)
    return 0 if all(s == "ok" for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
