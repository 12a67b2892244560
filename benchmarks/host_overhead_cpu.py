"""The host's cost of the Triton routing path, on the CPU: a training step with every kernel launch stubbed out.

The routed variants' steps at 350m are close to bound by the host's time to enqueue them
(``host_profile.py`` on the GPU machine). This script measures the part of that time spent in
Python and in PyTorch's dispatch, without a GPU: a model with a preset's layer count and routing
layout but tiny widths runs forward and backward on the CPU through the Triton path
(``use_backend("triton")``) with every Triton launch replaced by a no-op, so what is timed is the
wrappers (argument checks, tile choices, offset tables, allocations, the small reductions around
the kernels), autograd and the rest of the model at a negligible size. The numbers are this
CPU's, and a CUDA launch costs the host more than a no-op: compare variants and versions of the
code measured in one run, never against GPU timings.

    python benchmarks/host_overhead_cpu.py --scale 350m --variants prenorm,mhar-block8-H8,delta-block8-H8
    python benchmarks/host_overhead_cpu.py --scale 350m --variants mhar-block8-H8 --profile 25

Prints, per variant, the median over ``--steps`` steps of a step's host time in ms (forward and
backward, no optimiser), and with ``--profile N`` the N functions of the routing path with the
most own time under :mod:`cProfile`.
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

from lit_mhar import LM, ModelConfig
from lit_mhar.config import PRESETS
from lit_mhar.kernels import triton_routing as tr
from lit_mhar.kernels import use_backend

VARIANTS = {  # as bench_training.py names them: 8 blocks of 2L / 8 sublayers for block routing
    "prenorm": dict(residual="prenorm"),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    "delta-block8-H8": dict(residual="delta", heads=8, block_size="8blocks"),
    "delta-full-H8": dict(residual="delta", heads=8, block_size=1),
}
TINY = dict(d_model=128, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=128, seq_len=16)  # widths that cost nothing


class _NoLaunch:
    """Stands in for a compiled kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def step_fn(scale: str, variant: str):
    """``(model, step)``: the preset's layers at :data:`TINY` widths; ``step()`` runs forward and backward."""
    kw = dict(VARIANTS[variant])
    if kw.get("block_size") == "8blocks":
        kw["block_size"] = 2 * PRESETS[scale]["n_layer"] // 8
    torch.manual_seed(0)
    model = LM(ModelConfig.from_name(scale, **TINY, **kw))
    params = list(model.parameters())
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"] + 1))

    def step():
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
        for p in params:
            p.grad = None

    return model, step


def measure(scale: str, variant: str, steps: int, warmup: int, profile: int) -> tuple[float, str]:
    """Median ms per step over ``steps`` steps after ``warmup``, and the cProfile table (or "")."""
    _, step = step_fn(scale, variant)
    with use_backend("triton"), mock.patch.object(tr, "_kernel", lambda name, interpret: _NoLaunch()):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        table = ""
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            step()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(r"kernels|lit_mhar", profile)
            table = buf.getvalue()
    return statistics.median(times), table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=[s for s in PRESETS if s != "debug"], default="350m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="rows of the routing path's cProfile table to print (0: none)")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; valid: {list(VARIANTS)}")
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--profile", args.profile, 0)):
        if value < least:
            ap.error(f"{flag} {value}: must be >= {least}")
    torch.set_num_threads(1)  # the host's one thread, as when it enqueues GPU work
    for name in names:
        ms, table = measure(args.scale, name, args.steps, args.warmup, args.profile)
        print(f"{args.scale} {name}: {ms:.1f} ms per step (median of {args.steps}; launches stubbed, CPU)", flush=True)
        if table:
            print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
