"""The host's cost of the Triton routing path, on the CPU: a training step with every kernel launch stubbed out.

The routed variants' steps at 350m are close to bound by the host's time to enqueue them
(``host_profile.py`` on the GPU machine). This script measures the part of that time spent in
Python and in PyTorch's dispatch, without a GPU: a model with a preset's layer count and routing
layout but tiny widths (``bench_training.py``'s variants and knobs) runs forward and backward on the CPU through the Triton path
(``use_backend("triton")``) with every Triton launch replaced by a no-op, so what is timed is the
wrappers (argument checks, tile choices, offset tables, allocations, the small reductions around
the kernels), autograd and the rest of the model at a negligible size. The numbers are this
CPU's, and a CUDA launch costs the host more than a no-op: compare variants and versions of the
code measured in one run, never against GPU timings.

    python benchmarks/host_overhead_cpu.py --scale 350m --variants prenorm,mhar-block8-H8,delta-block8-H8
    python benchmarks/host_overhead_cpu.py --scale 350m --variants mhar-block8-H8 --profile 25
    python benchmarks/host_overhead_cpu.py --scale 350m --rounds 4 --variants mhar-block8-H8,delta-block8-H8

Prints, per variant, the median over ``--steps`` steps of a step's host time in ms (forward and
backward, no optimiser) and the routing kernels' launches in a step, and with ``--profile N`` the
N functions of the routing path with the most own time under :mod:`cProfile`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from unittest import mock

import torch

from bench_training import SCALES, knobs, split_variant, variant_config
from lit_mhar import LM
from lit_mhar.kernels import decode, launch, use_backend

TINY = dict(d_model=128, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=128, seq_len=16)  # widths that cost nothing


class _NoLaunch:
    """Stands in for a compiled kernel: ``kernel[grid](*args, **kwargs)`` only counts the launch."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _NoLaunch.launches += 1

        return launch


def measure(scale: str, name: str, steps: int, warmup: int, profile: int) -> tuple[float, int, str]:
    """Median ms per step over ``steps`` steps after ``warmup`` of the variant ``name`` (as
    ``bench_training.py`` names variants and knobs) at :data:`TINY` widths, the routing kernels'
    launches in a step, and the cProfile table (or "")."""
    overrides, knob_names = split_variant(name)
    stub = lambda name, interpret: _NoLaunch()  # noqa: E731
    with knobs(knob_names), use_backend("triton"), mock.patch.object(launch, "kernel", stub), mock.patch.object(decode, "kernel", stub):
        torch.manual_seed(0)
        model = LM(variant_config(scale, overrides, **TINY))
        params = list(model.parameters())
        x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"] + 1))

        def step():
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
            for p in params:
                p.grad = None

        for _ in range(warmup):
            step()
        times = []
        before = _NoLaunch.launches
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        launches = (_NoLaunch.launches - before) // steps
        table = ""
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            step()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(r"kernels|lit_mhar", profile)
            table = buf.getvalue()
    return statistics.median(times), launches, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="350m")
    ap.add_argument("--variants", default="prenorm,mhar-block8-H8,mhar-full-H8,delta-block8-H8,delta-full-H8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="rows of the routing path's cProfile table to print (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over all the variants, interleaved; the median of the rounds' medians is reported")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    for name in names:
        try:
            split_variant(name)
        except ValueError as e:
            ap.error(f"--variants: {e}")
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--profile", args.profile, 0), ("--rounds", args.rounds, 1)):
        if value < least:
            ap.error(f"{flag} {value}: must be >= {least}")
    torch.set_num_threads(1)  # the host's one thread, as when it enqueues GPU work
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            ms, launches, table = measure(args.scale, name, args.steps, args.warmup, args.profile if r == 0 else 0)
            rounds[name].append(ms)
            print(f"{args.scale} {name}: {ms:.1f} ms per step (median of {args.steps}; {launches} routing launches a step, stubbed; CPU)", flush=True)
            if table:
                print(table, flush=True)
    if args.rounds > 1:
        for name, values in rounds.items():
            print(f"{args.scale} {name}: {statistics.median(values):.1f} ms per step, median of {args.rounds} rounds {[round(v, 1) for v in values]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
