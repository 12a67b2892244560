"""Slots per tile and warps of the decode kernel (``route_norm_decode``, ``route_sites_decode``), on the GPU.

Decode steps are launch- and latency-bound, so each configuration is timed as a CUDA graph of
``--launches`` back-to-back launches of one routing site (replayed; median over ``do_bench``
repetitions, divided by the launches): the per-site cost inside a captured decode step. Shapes
at the scale's width (350m: d = 1024), bf16, H = 8, batch 1 and 32:

- ``block-N{n}``: a block-routing site over n complete slots and the pending output (written,
  not accumulated, so that repeated calls give the same result);
- ``full-prior-N{k}``: a full-routing site in a group: a prior over the slots at the group's start
  and k later slots, then the pending output;
- ``phase1-N{n}-G8``: phase one of a group of 8 full-routing sites over n slots.

Tried: the dispatch table's ``DECODE_TILE_ELEMENTS`` and ``DECODE_WARPS`` for a site's op,
``DECODE_SITES_TILE_ELEMENTS`` and ``DECODE_SITES_WARPS`` for phase one
(:func:`lit_mhar.kernels.dispatch.overrides`). Every configuration is checked against the default's
output first (relative L2 difference).

    python benchmarks/tune_decode.py --scale 350m --out OUT    # writes OUT/tune_decode.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

from lit_mhar.kernels import dispatch
from lit_mhar.kernels import triton_routing as tr

WIDTHS = {"100m": 512, "350m": 1024, "1b": 1280}
FIELDS = ["scale", "shape", "batch", "tile_elements", "warps", "us_per_launch", "rel_diff", "status"]
# (tile elements, warps) tried: a site's op (DECODE_TILE_ELEMENTS, DECODE_WARPS) and phase one of a
# group (DECODE_SITES_TILE_ELEMENTS, DECODE_SITES_WARPS)
SITE_CONFIGS = list(itertools.product((2048, 4096, 8192, 16384), (2, 4, 8)))
SITES_CONFIGS = list(itertools.product((4096, 8192, 16384), (1, 2, 4, 8)))


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(WIDTHS), default="350m")
    ap.add_argument("--launches", type=int, default=100)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    d, heads, dev = WIDTHS[args.scale], 8, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = 2.0 * (heads / d) ** 0.5 * torch.randn(8, d, device=dev, generator=g)
    gn = 1 + 0.3 * torch.randn(8, d, device=dev, generator=g)
    nw = 1 + 0.2 * torch.randn(d, device=dev, generator=g)
    entries = {False: ("DECODE_TILE_ELEMENTS", "DECODE_WARPS"), True: ("DECODE_SITES_TILE_ELEMENTS", "DECODE_SITES_WARPS")}
    path = os.path.join(args.out, "tune_decode.csv")
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        if fh.tell() == 0:
            w.writeheader()
        for batch in (1, 32):
            hist = torch.randn(50, batch, d, device=dev, generator=g).to(torch.bfloat16)
            pend = torch.randn(batch, d, device=dev, generator=g).to(torch.bfloat16)
            cases = {}
            for n in (3, 5, 9):  # accumulate=False: repeated calls write the same slot value
                cases[f"block-N{n}"] = lambda n=n: tr.route_norm_decode(hist, n, pend, False, q[0], gn[0], heads, nw, 1e-5)
            prior = tr.route_sites_decode(hist, 40, q, gn, heads)
            for k in (0, 3, 7):
                cases[f"full-prior-N{k}"] = lambda k=k: tr.route_norm_decode(
                    hist, 40 + k, pend, False, q[1], gn[1], heads, nw, 1e-5, None, None, 1e-6, prior[0][1], prior[1][1], 40
                )
            for n in (16, 40):
                cases[f"phase1-N{n}-G8"] = lambda n=n: torch.cat([t.flatten() for t in tr.route_sites_decode(hist, n, q, gn, heads)])
            for name, fn in cases.items():
                sites = name.startswith("phase1")
                names = entries[sites]
                ref = fn().clone()
                for elements, warps in SITES_CONFIGS if sites else SITE_CONFIGS:
                    row = dict(scale=args.scale, shape=name, batch=batch, tile_elements=elements, warps=warps)
                    try:
                        with dispatch.overrides(**{names[0]: elements, names[1]: warps}):
                            diff = rel(fn(), ref)
                            row["rel_diff"] = f"{diff:.1e}"
                            if diff > 1e-2:
                                row["status"] = "FAILED check"
                            else:
                                graph = torch.cuda.CUDAGraph()
                                side = torch.cuda.Stream()
                                side.wait_stream(torch.cuda.current_stream())
                                with torch.cuda.stream(side):
                                    fn()
                                torch.cuda.current_stream().wait_stream(side)
                                with torch.cuda.graph(graph):
                                    for _ in range(args.launches):
                                        fn()
                                ms = do_bench(graph.replay, warmup=5, rep=100, return_mode="median")
                                row.update(us_per_launch=f"{ms * 1e3 / args.launches:.3f}", status="ok")
                    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result
                        row.update(status=f"error {e!r}"[:160])
                    w.writerow(row)
                    fh.flush()
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
