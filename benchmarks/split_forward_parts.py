"""Phase one's split forward (``DOT_FWD_SPLIT``) kernel by kernel, on the GPU machine.

For each pass shape (S sites over N bf16 sources at 350m's width, H = 8, 32768 tokens) times, with
``triton.testing.do_bench_cudagraph`` (median ms; the copy with ``do_bench``): the whole forward without the split (the kernel the
package launches otherwise), the split forward, its scores kernel alone and its weighted-sum kernel
alone (the other one's launch skipped), each by tile, and the copy of one source as the bandwidth
reference; every split configuration's outputs are first checked against the unsplit forward's.

    python benchmarks/split_forward_parts.py --out OUT      # prints a table, writes OUT/split_parts.csv
"""

from __future__ import annotations

import argparse
import csv
import os
from unittest import mock

import torch
from triton.testing import do_bench, do_bench_cudagraph

from lit_mhar.kernels import triton_routing as tr

SCORES = [(64, 4, None), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 3)]  # rows, warps, stages
WEIGH = [(16, 128, 8, 4), (8, 128, 8, 2), (8, 128, 8, 4), (4, 128, 8, 2), (4, 128, 8, 1), (2, 128, 8, 1), (8, 64, 8, 2), (4, 64, 8, 1),
         (16, 128, 8, 8), (8, 128, 4, 2), (16, 128, 4, 4), (32, 128, 2, 4)]  # rows, columns, sites, warps


def skipping(name: str):
    """``tr._kernel`` with launches of kernel ``name`` turned into no-ops."""
    kernel = tr._kernel

    def patched(n, interpret):
        if n != name:
            return kernel(n, interpret)

        class Skip:
            def __getitem__(self, grid):
                return lambda *a, **k: None

        return Skip()

    return mock.patch.object(tr, "_kernel", patched)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d", type=int, default=1024)
    args = ap.parse_args()
    M, d, heads = args.tokens, args.d, 8
    rows = []
    bench = lambda fn: do_bench_cudagraph(fn, rep=40, return_mode="median")  # noqa: E731
    x = torch.randn(M, d, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), warmup=5, rep=40, return_mode="median")
    print(f"copy of one source [{M}, {d}] bf16: {copy_ms:.4f} ms, {2 * x.numel() * 2 / copy_ms / 1e6:.0f} GB/s")
    rows.append(dict(shape="copy", part="copy", config="", ms=f"{copy_ms:.4f}", rel_diff=""))
    for n, sites in ((3, 6), (8, 6), (37, 12)):
        g = torch.Generator(device="cuda").manual_seed(n)
        srcs = [(torch.randn(M, d, device="cuda", generator=g) * (0.5 + i % 3)).to(torch.bfloat16) for i in range(n)]
        q = 2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, device="cuda", generator=g)
        gn = 1 + 0.3 * torch.randn(sites, d, device="cuda", generator=g)
        fwd = lambda: tr._forward(srcs, q, gn, heads, 1e-6, None, None, None, None, False, save_rstd=True)  # noqa: E731
        shape = f"N{n}-S{sites}"
        with mock.patch.multiple(tr, DOT_FWD_SPLIT=False):
            ref = fwd()[:sites]
            rows.append(dict(shape=shape, part="unsplit", config="", ms=f"{bench(fwd):.4f}", rel_diff="0"))
        configs = [("scores", c, WEIGH[0]) for c in SCORES] + [("weigh", SCORES[0], c) for c in WEIGH[1:]]
        for which, (sr, sw, st), (wr, wc, ws, ww) in configs:
            values = dict(DOT_SPLIT_MAX_SOURCES=1 << 30, DOT_SPLIT_SCORE_ROWS=sr, DOT_SPLIT_SCORE_WARPS=sw, DOT_SPLIT_ROWS=wr,
                          DOT_SPLIT_COLS=wc, DOT_SPLIT_SITES=ws, DOT_SPLIT_WARPS=ww,
                          DOT_STAGES={**tr.DOT_STAGES, **({"fwd_scores": st} if st else {})})
            config = f"s{sr}w{sw}st{st}-r{wr}c{wc}s{ws}w{ww}"
            with mock.patch.multiple(tr, **values):
                try:
                    out = fwd()[:sites]
                    diff = max(((o.double() - r.double()).norm() / r.double().norm()).item() for o, r in zip(out, ref))
                    ok = diff < 1e-2
                    parts = [("split", None)] + ([("scores-alone", "fwd_weigh")] if which == "scores" else [("weigh-alone", "fwd_scores")])
                    for part, skip in parts:
                        if skip is None:
                            ms = bench(fwd) if ok else float("nan")
                        else:
                            with skipping(skip):
                                ms = bench(fwd) if ok else float("nan")
                        rows.append(dict(shape=shape, part=part, config=config, ms=f"{ms:.4f}", rel_diff=f"{diff:.1e}"))
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result
                    rows.append(dict(shape=shape, part="error", config=config, ms="", rel_diff=repr(e)[:120]))
            print(rows[-1], flush=True)
        del srcs
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "split_parts.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["shape", "part", "config", "ms", "rel_diff"])
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r["shape"], r["part"], r["config"], r["ms"], r["rel_diff"])


if __name__ == "__main__":
    main()
