"""Run each routing kernel of a 350m training step (and one decode site) a few times, for Nsight Compute.

Meant to run under ``ncu`` (GPU), which then reports per launch where the time goes (achieved
bandwidth, occupancy, warp stall reasons):

    ncu -k regex:"_route|_decode" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section WarpStateStats --section LaunchStats --csv --page details \\
        python3 benchmarks/ncu_kernels.py --scale 350m > OUT/ncu.csv

Workloads (bf16, the scale's tokens per step and width, H = 8): phase one of Block AttnRes
(8 completed blocks, S = 2L/8 sites) forward and backward (site-loop kernels); one merge site
(the partial block and a prior) forward and backward (two-pass kernel); one decode site of block
routing (9 slots and the pending output, batch 1 and 32). ``BENCH_DEVICE=cpu`` runs it on the
interpreter at a tiny size (a check of the script).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lit_mhar.kernels import triton_routing as tr
from tune_tiles import SCALES, make

DEVICE = os.environ.get("BENCH_DEVICE", "cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="350m")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    if DEVICE == "cpu":
        args.scale = "tiny"
    d, layers, M = SCALES[args.scale]
    S, heads = max(1, 2 * layers // 8), 8
    sources, q, gn, douts, dlse = make(M, d, 8, S, heads)
    for _ in range(args.repeats):
        outs, lse = tr.route_sites(sources, q, gn, heads)
        torch.autograd.grad([*outs, lse], sources + [q, gn], [*douts, dlse])
    # one merge site: the partial block and the prior of phase one
    partial = sources[0].detach().clone().requires_grad_()
    prior_out, prior_lse = outs[0].detach().requires_grad_(), lse[0].detach().requires_grad_()
    q1, g1 = q[0].detach().clone().requires_grad_(), gn[0].detach().clone().requires_grad_()
    for _ in range(args.repeats):
        r = tr.merge_route([partial], q1, g1, heads, prior_out, prior_lse)
        torch.autograd.grad(r, [partial, q1, g1, prior_out, prior_lse], douts[0])
    # decode: one block-routing site over 9 slots and the pending output
    with torch.no_grad():
        for batch in (1, 32):
            history = torch.randn(11, batch, d, device=DEVICE, dtype=torch.bfloat16)
            pending = torch.randn(batch, d, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(args.repeats):
                tr.route_norm_decode(history, 9, pending, True, q1.detach(), g1.detach(), heads, torch.ones(d, device=DEVICE), 1e-5)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("ran", args.scale, "M", M, "d", d, "S", S, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
