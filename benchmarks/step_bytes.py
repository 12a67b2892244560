"""Bytes each kernel of one training step moves to and from GPU memory, against the copy bandwidth.

Answers "what bounds a variant's step": for every kernel of one step (Nsight Compute's DRAM byte
counters and its duration), grouped as ``profile_step.py`` groups them, the bytes moved, the time,
the achieved bandwidth and the time the same bytes would take at the copy bandwidth measured in
the same run. Three modes:

    python benchmarks/step_bytes.py copy --out OUT          # copy bandwidth (GB/s) -> OUT/copy_bandwidth.json
    ncu --profile-from-start off --clock-control none --csv --page raw --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python benchmarks/step_bytes.py step --scale 350m --variant mhar-block8-H8 > OUT/ncu_bytes_350m_mhar-block8-H8.csv
    python benchmarks/step_bytes.py report --out OUT         # OUT/step_bytes.md and step_bytes.csv from every ncu_bytes_*.csv

``step`` builds the variant as ``bench_training.py`` does (its presets, compilation and fused
AdamW), runs ``--warmup`` eager steps, then one step between ``cudaProfilerStart`` and
``cudaProfilerStop``: only that step's kernels are profiled (each replayed alone, caches flushed,
clocks not locked). Bytes are DRAM traffic (``dram__bytes_read.sum + dram__bytes_write.sum``), the
figure the copy bandwidth bounds; ``BENCH_DEVICE=cpu`` runs ``step`` on the CPU at the debug scale
(a check of the script, no profiler).
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import DEVICE, SCALES, knobs, split_variant, training_step  # noqa: E402
from profile_step import categorise  # noqa: E402

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
UNITS = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6, "GB": 1e9}
FIELDS = ["scale", "variant", "category", "kernels", "GB", "ms", "GB_per_s", "frac_copy", "ms_at_copy"]


def copy_bandwidth(gib: float = 1.0) -> float:
    """GB/s of ``dst.copy_(src)`` on ``gib`` GiB (bytes read plus bytes written over the median time)."""
    from triton.testing import do_bench

    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n * 2 / ms / 1e6


def profile_one_step(scale: str, variant: str, warmup: int) -> None:
    """Build ``variant`` at ``scale``, run ``warmup`` steps, then one step inside the CUDA profiler's range."""
    batch, seq, _ = SCALES[scale]
    overrides, knob_names = split_variant(variant)
    if any(k in ("cuda-graph", "graphed-loss") for k in knob_names):
        raise ValueError(f"{variant!r}: step runs the eager step (each kernel profiled on its own); drop the graph knob")
    with knobs(knob_names):
        _, step = training_step(scale, overrides, batch, seq, compile_=DEVICE == "cuda")
        for _ in range(warmup):
            step()
        if DEVICE != "cuda":
            print(f"ran {variant} at {scale} on {DEVICE}", file=sys.stderr)
            return
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def read_ncu_csv(path: str) -> list[tuple[str, float, float]]:
    """``[(kernel name, ms, bytes)]`` of an ``ncu --csv --page raw`` file with :data:`METRICS`.
    ValueError if the file has no header with those metrics (ncu failed: its messages are the file)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own "==PROF==" lines are not CSV
    rows = list(csv.reader(lines))
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r and all(m in r for m in METRICS)), None)
    if header is None:
        raise ValueError(f"{path}: no ncu CSV header with Kernel Name and {METRICS}")
    cols = rows[header]
    units = rows[header + 1]
    name_i = cols.index("Kernel Name")
    idx = {m: cols.index(m) for m in METRICS}
    scale = {m: UNITS.get(units[idx[m]], None) for m in METRICS}
    bad = [f"{m} in {units[idx[m]]!r}" for m in METRICS if scale[m] is None]
    if bad:
        raise ValueError(f"{path}: unknown units {bad}; known: {sorted(UNITS)}")
    out = []
    for r in rows[header + 2:]:
        if len(r) != len(cols):
            continue

        def num(m):
            return float(r[idx[m]].replace(",", "")) * scale[m]

        out.append((r[name_i], num(METRICS[0]), num(METRICS[1]) + num(METRICS[2])))
    return out


def summarise(kernels: list[tuple[str, float, float]], copy_gbs: float) -> list[dict]:
    """Per category and in total: kernels, GB, ms, achieved GB/s, its fraction of ``copy_gbs`` and
    the ms the same bytes take at ``copy_gbs``."""
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, ms, nbytes in kernels:
        for cat in (categorise(name), "all profiled"):
            g = groups[cat]
            g[0] += 1
            g[1] += nbytes
            g[2] += ms
    rows = []
    for cat, (n, nbytes, ms) in sorted(groups.items(), key=lambda kv: -kv[1][2]):
        gbs = nbytes / ms / 1e6 if ms else float("nan")
        rows.append(dict(category=cat, kernels=n, GB=nbytes / 1e9, ms=ms, GB_per_s=gbs, frac_copy=gbs / copy_gbs,
                         ms_at_copy=nbytes / copy_gbs / 1e6))
    return rows


def report(out: str) -> int:
    with open(os.path.join(out, "copy_bandwidth.json")) as f:
        copy_gbs = json.load(f)["GB_per_s"]
    paths = sorted(glob.glob(os.path.join(out, "ncu_bytes_*.csv")))
    if not paths:
        print(f"no ncu_bytes_*.csv in {out}", file=sys.stderr)
        return 1
    lines = [f"Copy bandwidth: {copy_gbs:.0f} GB/s. One step, each kernel replayed alone by Nsight Compute.", ""]
    table = []
    for path in paths:
        m = re.match(r"ncu_bytes_([^_]+)_(.+)\.csv$", os.path.basename(path))
        scale, variant = m.group(1), m.group(2)
        try:
            kernels = read_ncu_csv(path)
        except ValueError as e:
            lines.append(f"- {scale} {variant}: {e}")
            continue
        rows = summarise(kernels, copy_gbs)
        for r in rows:
            table.append(dict(scale=scale, variant=variant, **r))
        lines += [f"### {scale} {variant}", "", "| category | kernels | GB | ms | GB/s | × copy | ms at copy |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['category']} | {r['kernels']} | {r['GB']:.2f} | {r['ms']:.2f} | {r['GB_per_s']:.0f} | {r['frac_copy']:.2f} | {r['ms_at_copy']:.2f} |" for r in rows]
        per_kernel = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for name, ms, nbytes in kernels:
            cat = categorise(name)
            if cat.startswith("routing") or cat in ("elementwise", "compiled (inductor)", "reduction"):
                k = per_kernel[name[:90]]
                k[0] += 1
                k[1] += nbytes
                k[2] += ms
        lines += ["", "| kernel | launches | GB | ms | × copy |", "|---|---|---|---|---|"]
        for name, (n, nbytes, ms) in sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[:14]:
            lines.append(f"| `{name}` | {n} | {nbytes / 1e9:.2f} | {ms:.2f} | {nbytes / ms / 1e6 / copy_gbs:.2f} |")
        lines.append("")
    with open(os.path.join(out, "step_bytes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "step_bytes.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in table:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["copy", "step", "report"])
    ap.add_argument("--scale", choices=list(SCALES), default="350m")
    ap.add_argument("--variant", default="mhar-block8-H8", help="a bench_training.py variant, with knobs (<variant>:<knob>)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if args.mode == "copy":
        gbs = copy_bandwidth()
        with open(os.path.join(args.out, "copy_bandwidth.json"), "w") as f:
            json.dump({"GB_per_s": gbs}, f)
        print(f"copy bandwidth {gbs:.0f} GB/s")
        return 0
    if args.mode == "step":
        if DEVICE == "cpu":
            args.scale = "debug"
        profile_one_step(args.scale, args.variant, args.warmup)
        return 0
    return report(args.out)


if __name__ == "__main__":
    sys.exit(main())
