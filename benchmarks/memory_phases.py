"""Where a training step's peak memory is reached: forward (with the loss) or backward (GPU).

For each variant (``bench_training.py``'s variants and knobs, same model, compilation and step),
after two warm-up steps one step runs in phases, each with its own ``max_memory_allocated``:
the forward and the loss, the backward, the optimiser. During the backward it records the memory
allocated when each routing op's backward starts (``_RouteFunction.backward``, host order), so
that the backward's profile by routing site can be read: its largest value and at which call.

    python benchmarks/memory_phases.py --scale 350m --variants prenorm,delta-full-H8,delta-full-H8:save-stream --out OUT
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys

import torch

from bench_training import DEVICE, SCALES, knobs, split_variant, training_parts
from lit_mhar.kernels import triton_routing as tr

FIELDS = ["scale", "variant", "fwd_peak_GiB", "after_fwd_GiB", "bwd_peak_GiB", "opt_peak_GiB", "bwd_calls", "bwd_entry_max_GiB", "bwd_entry_argmax", "status"]
GiB = 2**30


def phases(scale: str, name: str) -> dict:
    """The phase peaks (GiB) of one step of variant ``name`` after two warm-up steps."""
    overrides, knob_names = split_variant(name)
    batch, seq, _ = SCALES[scale]
    with knobs(knob_names):
        _, forward, update = training_parts(scale, overrides, batch, seq, compile_=True)
        for _ in range(2):  # bench_training's step: compiles, allocates the optimiser's state
            forward().backward()
            update()
        entries = []
        original = tr._RouteFunction.backward

        def spy(ctx, *grads):
            entries.append(torch.cuda.memory_allocated())
            return original(ctx, *grads)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = forward()
        torch.cuda.synchronize()
        fwd_peak, after_fwd = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tr._RouteFunction.backward = staticmethod(spy)
        try:
            loss.backward()
        finally:
            tr._RouteFunction.backward = staticmethod(original)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        update()
        torch.cuda.synchronize()
        opt_peak = torch.cuda.max_memory_allocated()
    top = max(range(len(entries)), key=entries.__getitem__) if entries else -1
    return dict(
        fwd_peak_GiB=f"{fwd_peak / GiB:.2f}", after_fwd_GiB=f"{after_fwd / GiB:.2f}", bwd_peak_GiB=f"{bwd_peak / GiB:.2f}",
        opt_peak_GiB=f"{opt_peak / GiB:.2f}", bwd_calls=len(entries),
        bwd_entry_max_GiB=f"{entries[top] / GiB:.2f}" if entries else "", bwd_entry_argmax=top, status="ok",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=[s for s in SCALES if s != "debug"], default="350m")
    ap.add_argument("--variants", default="prenorm,mhar-full-H8,delta-full-H8,delta-full-H8:save-stream")
    ap.add_argument("--out", required=True, help="folder of memory_phases.csv (rows are appended)")
    args = ap.parse_args(argv)
    if DEVICE != "cuda" or not torch.cuda.is_available():
        raise SystemExit("memory_phases.py needs a CUDA GPU (peak memory is the CUDA allocator's)")
    names = args.variants.split(",")
    for name in names:
        split_variant(name)  # unknown names fail before any work
    path = os.path.join(args.out, "memory_phases.csv")
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        if fh.tell() == 0:
            w.writeheader()
        for name in names:
            try:
                row = dict(scale=args.scale, variant=name, **phases(args.scale, name))
            except Exception as e:  # noqa: BLE001 - one variant's failure is a result; the others still run
                row = dict(scale=args.scale, variant=name, status=f"error {e!r}"[:200])
            gc.collect()  # the variant's model and optimiser, gone with phases()'s frame
            torch.cuda.empty_cache()
            w.writerow(row)
            fh.flush()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
