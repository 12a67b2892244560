"""Where a training step's GPU time goes: a kernel-level profile of each variant, side by side.

Builds the model exactly as ``bench_training.py`` does (same presets, compilation and optimiser),
runs warm-up steps, then profiles ``--steps`` steps with ``torch.profiler`` (CUDA activity). Per
variant it writes the step's wall time, the GPU's busy time, and the GPU time per step of every
kernel name (top ``--top``), grouped into categories (routing forward / backward, matmul,
attention, compiled (inductor) kernels, elementwise, reductions and copies), as markdown and JSON.

    python benchmarks/profile_step.py --scale 350m --variants prenorm,mhar-block8-H8,mhar-block8-H8:cuda-graph --out results/

Variants take ``bench_training.py``'s kernel knobs (``<variant>:<knob>``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import DEVICE, SCALES, knobs, split_variant, training_step  # noqa: E402


CATEGORIES = (  # first match wins; matched against the lower-cased kernel name
    ("routing fwd", ("_route_fwd", "_decode_route")),
    ("routing bwd", ("_route_bwd",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("compiled (inductor)", ("triton_",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy / cast", ("copy", "cast", "memcpy", "to_copy")),
    ("reduction", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill")),
)


def categorise(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_variant(scale: str, name: str, steps: int, warmup: int, compile_: bool, top: int) -> dict:
    batch, seq, _ = SCALES[scale]
    overrides, knob_names = split_variant(name)
    with knobs(knob_names):
        return _profile(scale, name, overrides, batch, seq, steps, warmup, compile_, top)


def _profile(scale, name, overrides, batch, seq, steps, warmup, compile_, top):
    _, step = training_step(scale, overrides, batch, seq, compile_)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy_us = 0.0
    routing: list[tuple[float, str, float]] = []  # (start, name, us) of every routing kernel, in time order
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0 and not ev.cpu_children:
            k = kernels[ev.name]
            k[0] += ev.device_time_total
            k[1] += 1
            busy_us += ev.device_time_total
            if categorise(ev.name).startswith("routing"):
                routing.append((ev.time_range.start, ev.name, ev.device_time_total))
    routing.sort()
    per_step = len(routing) // steps
    rows = sorted(((n, t / steps / 1e3, c // steps) for n, (t, c) in kernels.items()), key=lambda r: -r[1])
    cats: dict[str, float] = collections.defaultdict(float)
    for n, ms, _ in rows:
        cats[categorise(n)] += ms
    result = dict(
        scale=scale, variant=name, wall_ms=wall_ms, gpu_busy_ms=busy_us / steps / 1e3,
        categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        kernels=[dict(name=n[:160], ms=round(ms, 4), calls=c, category=categorise(n)) for n, ms, c in rows[:top]],
        routing_kernels_first_step=[f"{n} {us:.1f}" for _, n, us in routing[:per_step]],
    )
    return result


def to_markdown(results: list[dict]) -> str:
    lines = ["| variant | wall ms/step | GPU busy ms | " + " | ".join(c for c, _ in CATEGORIES) + " | other |", "|---" * (len(CATEGORIES) + 4) + "|"]
    for r in results:
        cells = [f"{r['categories'].get(c, 0.0):.1f}" for c, _ in CATEGORIES] + [f"{r['categories'].get('other', 0.0):.1f}"]
        lines.append(f"| {r['scale']} {r['variant']} | {r['wall_ms']:.1f} | {r['gpu_busy_ms']:.1f} | " + " | ".join(cells) + " |")
    for r in results:
        lines += ["", f"### {r['scale']} {r['variant']}", "", "| kernel | category | ms/step | calls/step |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['category']} | {k['ms']:.3f} | {k['calls']} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), required=True)
    ap.add_argument("--variants", default="prenorm,mhar-block8-H8,mhar-full-H8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if DEVICE != "cuda":
        raise SystemExit("profile_step.py profiles CUDA kernels: run it on a GPU machine")
    for name in args.variants.split(","):
        split_variant(name)  # "<variant>[:<knob>...]" as in bench_training; ValueError names a bad part
    torch._dynamo.config.cache_size_limit = 64
    results = []
    for name in args.variants.split(","):
        r = profile_variant(args.scale, name, args.steps, args.warmup, not args.no_compile, args.top)
        results.append(r)
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{args.scale}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    md = to_markdown(results)
    with open(os.path.join(args.out, f"profile_{args.scale}.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
