"""Where one routing op's GPU time goes: per-kernel times of a fused forward + backward.

Routes ``N`` bf16 sources of a preset's width and tokens per step into one site (``depth_route``,
as ``bench_routing_op.py`` does) and profiles ``--iters`` forward + backward passes with
``torch.profiler``; prints, per (N, H) and kernel setting, each kernel's GPU time per pass.

    python benchmarks/profile_op.py --scale 1b --shapes 9x1,9x8 --knobs ,pad
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_routing_op import SCALES, op_inputs  # noqa: E402
from bench_training import KNOBS, knobs  # noqa: E402

from lit_mhar.kernels import triton_routing  # noqa: E402


def profile(scale: str, n: int, heads: int, iters: int) -> dict[str, float]:
    """GPU ms per forward + backward pass of each kernel name."""
    sources, q, g, dout = op_inputs(scale, n, heads, "cuda")
    inputs = [*sources, q, g]

    def step():
        out = triton_routing.depth_route(sources, q, g, heads)
        torch.autograd.grad(out, inputs, dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time / 1000 / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="1b", choices=[s for s in SCALES])
    ap.add_argument("--shapes", default="9x1,9x8", help="comma-separated NxH")
    ap.add_argument("--knobs", default="", help="comma-separated knob names of bench_training.KNOBS; empty: defaults")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    names = args.knobs.split(",")
    for k in names:
        if k and k not in KNOBS:
            raise SystemExit(f"unknown knob {k!r}; valid: {list(KNOBS)}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_op.py needs a CUDA GPU")
    for n, heads in shapes:
        for k in names:
            with knobs([k] if k else []):
                times = profile(args.scale, n, heads, args.iters)
            total = sum(times.values())
            print(f"{args.scale} N={n} H={heads} knob={k or 'defaults'}: {total:.3f} ms per pass")
            for name, ms in times.items():
                print(f"    {ms:8.3f}  {name}")


if __name__ == "__main__":
    main()
