"""Tiles of the routing kernels, tried one launch kind at a time, and any entry of the dispatch table (GPU).

For each shape (350m unless ``--scale``; heads ``--heads``: ``phase1``, phase one of Block AttnRes,
S = 2L/8 sites against 8 completed blocks; ``full``, one site over 2L + 1 sources; ``op``, one site
over 9 and over 2L + 1 sources; ``merge``, the second phase fused with the next RMSNorm over one
newer source (block routing, replacement and additive form) or four or eight (full routing)),
every (elements, warps) configuration of one vector launch kind (``fwd``, ``bwd_stats``,
``bwd_sources``; for the merges ``merge_fwd`` and ``bwd``, ``bwd_add`` in the additive form) is set
as that kind's tuned tile at this width and head count (``dispatch.TUNED_TILES``), checked against
the package's result (relative L2 difference of the output or of every gradient) and timed with
``triton.testing.do_bench`` (median; the merges replaying a CUDA graph of forward and backward: a
merge takes a fraction of a millisecond, less than the host needs to launch it). The vector
kernels' families run with the tensor cores off. A configuration whose check fails gets no time.

``--try NAME=VALUE`` (repeatable; VALUE a Python literal) times each shape's forward and whole
backward with those entries of the dispatch table (:func:`lit_mhar.kernels.dispatch.overrides`)
against the package's: tensor-core tiles (``DOT_TILE_ELEMENTS``, ``DOT_WARPS``, ``DOT_STAGES``),
thresholds (``DOT_MIN_SOURCES``, ``SITE_LOOP_MIN_SOURCES``), whole tile tables.

    python benchmarks/tune_tiles.py --scale 350m --heads 1,8 --out OUT           # writes OUT/tune_tiles.csv
    python benchmarks/tune_tiles.py --scale 100m --shapes phase1 --try DOT_WARPS=4 --try 'DOT_STAGES={"bwd_sources_dot": 2}' --out OUT
"""

from __future__ import annotations

import argparse
import ast
import csv
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

from lit_mhar.kernels import dispatch
from lit_mhar.kernels import triton_routing as tr

SCALES = {"20m": (384, 8, 64 * 1024), "100m": (512, 12, 64 * 2048), "350m": (1024, 24, 32 * 1024), "1b": (1280, 36, 32 * 1024), "tiny": (96, 8, 70)}
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": a dry run of this script (tiny scale, Triton's interpreter)
if DEVICE == "cpu":
    from lit_mhar.kernels import use_backend

    use_backend("triton").__enter__()

    def do_bench(fn, warmup=0, rep=0, return_mode="median"):  # noqa: F811 - no CUDA events on CPU
        fn()
        return float("nan")

    do_bench_cudagraph = do_bench  # noqa: F811
# Elements per tile by warps; a configuration giving the same tokens per program as one tried before
# at this width is skipped (``tokens_per_program``).
CONFIGS = {
    "fwd": list(itertools.product((1024, 2048, 4096, 8192, 16384), (1, 2, 4, 8))),
    "bwd_stats": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
    "bwd_sources": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
}
MERGE_CONFIGS = {
    "merge_fwd": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
    "bwd": list(itertools.product((512, 1024, 2048, 4096, 8192), (1, 2, 4, 8))),
}
# the vector kernels alone (tensor-core thresholds out of reach)
VECTOR_ONLY = dict(DOT_MIN_HEAD_WIDTH=1 << 30, DOT_MANY_SITES_MIN_HEAD_WIDTH=1 << 30, DOT_FWD_MIN_HEAD_WIDTH=1 << 30)
FIELDS = ["scale", "shape", "kind", "elements", "warps", "ms", "rel_diff", "status"]


def tokens_per_program(elements: int, d: int, heads: int) -> int:
    """Tokens of one program's tile of ``elements`` at width ``d`` (``dispatch.vector_tile``'s rule at
    one site; at S sites it is a function of this one, so equal here means equal there)."""
    rows = max(1, elements // dispatch.lanes(d, heads)[3])
    return 1 << (rows.bit_length() - 1)


def tile_table(kind: str, d: int, heads: int, elements: int, warps: int) -> dict:
    """The package's ``TUNED_TILES`` with the tile of ``kind`` at this width and head count set to
    ``(elements, warps)`` (a key with the head count: it takes precedence over the width's)."""
    return {**dispatch.TUNED_TILES, (kind, dispatch.lanes(d, heads)[3], heads): (elements, warps)}


def parse_try(text: str) -> dict:
    """``NAME=VALUE`` (VALUE a Python literal) as ``{NAME: VALUE}``; ValueError for another form."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise ValueError(f"--try {text!r}: expected NAME=VALUE, a dispatch table entry and a Python literal")
    return {name: ast.literal_eval(value)}


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_and_time(row: dict, build, refs, bench) -> dict:
    """``row`` with the largest relative L2 difference of ``build()()``'s outputs from ``refs``
    and, where it is within 1e-2, the time ``bench`` gives that function (ms); a configuration that
    does not compile or fails the check is a result too."""
    try:
        fn = build()
        diff = max(rel(o, r) for o, r in zip(fn(), refs))
        row["rel_diff"] = f"{diff:.1e}"
        if diff > 1e-2:
            row["status"] = "FAILED check"
        else:
            row.update(ms=f"{bench(fn):.4f}", status="ok")
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result
        row.update(status=f"error {e!r}"[:160])
    return row


def make(M, d, n, sites, heads, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    sources = [(torch.randn(M, d, device=DEVICE, generator=g) * (0.5 + i % 3)).to(torch.bfloat16).requires_grad_() for i in range(n)]
    q = (2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, device=DEVICE, generator=g)).requires_grad_()
    gn = (1 + 0.3 * torch.randn(sites, d, device=DEVICE, generator=g)).requires_grad_()
    douts = [torch.randn(M, d, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(sites)]
    dlse = torch.randn(sites, M, heads, device=DEVICE, generator=g)
    return sources, q, gn, douts, dlse


def runner(sources, q, gn, douts, dlse, heads):
    """(forward fn, backward fn on one recorded graph) of route_sites, gradients of outputs and lse."""
    inputs = sources + [q, gn]
    fwd = lambda: tr.route_sites(sources, q, gn, heads)  # noqa: E731
    outs, lse = fwd()
    bwd = lambda: torch.autograd.grad([*outs, lse], inputs, [*douts, dlse], retain_graph=True)  # noqa: E731
    return fwd, bwd


def make_merge(M, d, n, heads, additive, seed=0):
    """Inputs of one merge_route_norm call: n newer sources, a prior, the norm weight; the additive
    form's float32 stream and gate. Returns (tensors that get gradients, call kwargs, output gradient)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bf = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device=DEVICE, generator=g)).to(torch.bfloat16).requires_grad_()  # noqa: E731
    leaf = lambda t: t.requires_grad_()  # noqa: E731
    kw = dict(
        sources=[bf(M, d, scale=0.5 + i % 3) for i in range(n)], prior_out=bf(M, d),
        prior_lse=leaf(torch.randn(M, heads, device=DEVICE, generator=g)),
        query=leaf(2.0 * (heads / d) ** 0.5 * torch.randn(d, device=DEVICE, generator=g)),
        gain=leaf(1 + 0.3 * torch.randn(d, device=DEVICE, generator=g)),
        norm_weight=leaf(1 + 0.3 * torch.randn(d, device=DEVICE, generator=g)),
    )
    if additive:
        kw["stream"] = leaf(torch.randn(M, d, device=DEVICE, generator=g))
        kw["gate"] = leaf(0.5 * torch.randn(d, device=DEVICE, generator=g))
    inputs = [*kw["sources"], *(v for k, v in kw.items() if k != "sources")]
    return inputs, kw, torch.randn(M, d, device=DEVICE, generator=g).to(torch.bfloat16)


def merge_runner(inputs, kw, dout, heads):
    """(forward fn, forward + backward fn) of merge_route_norm. The backward runs on the stream its
    forward ran on, so both go into the one captured CUDA graph: the ``bwd`` rows time the two."""
    fwd = lambda: (tr.merge_route_norm(heads=heads, norm_eps=1e-6, **kw),)  # noqa: E731
    both = lambda: torch.autograd.grad(fwd(), inputs, [dout])  # noqa: E731
    return lambda: (fwd(), None), both


def shapes(layers: int, heads: int) -> list[tuple[str, int, int]]:
    """``(name, sources, sites)`` of the shape families at ``layers`` layers and ``heads`` heads."""
    S, N = 2 * layers // 8, 2 * layers + 1
    return [
        (f"phase1-N8-S{S}-H{heads}", 8, S), (f"full-N{N}-S1-H{heads}", N, 1), (f"op-N9-S1-H{heads}", 9, 1), (f"op-N{N}-S1-H{heads}", N, 1),
        (f"merge-N1-H{heads}", 1, 1), (f"merge-N1-H{heads}-additive", 1, 1), (f"merge-N4-H{heads}", 4, 1), (f"merge-N8-H{heads}", 8, 1),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="350m")
    ap.add_argument("--heads", default="8", help="comma-separated head counts")
    ap.add_argument("--out", required=True, help="folder of tune_tiles.csv (rows are appended)")
    ap.add_argument("--shapes", default="phase1,full,op,merge", help="comma-separated shape families: phase1, full, op, merge")
    ap.add_argument("--kinds", default="", help="comma-separated launch kinds to vary (fwd, bwd_stats, bwd_sources, merge_fwd, bwd, bwd_add); default all")
    ap.add_argument("--try", dest="tries", action="append", default=[], help="NAME=VALUE: time the shapes with this dispatch table entry (repeatable)")
    args = ap.parse_args(argv)
    try:
        tries = [parse_try(t) for t in args.tries]
        for t in tries:
            with dispatch.overrides(**t):
                pass
    except (ValueError, SyntaxError) as e:
        ap.error(str(e))
    families = set(args.shapes.split(","))
    kinds = set(filter(None, args.kinds.split(",")))
    d, layers, M = SCALES[args.scale]
    path = os.path.join(args.out, "tune_tiles.csv")
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        if fh.tell() == 0:
            w.writeheader()

        def emit(row):
            row = dict(scale=args.scale, **row)
            w.writerow(row)
            fh.flush()
            print(json.dumps(row), flush=True)

        for heads, (name, n, sites) in ((h, s) for h in map(int, args.heads.split(",")) for s in shapes(layers, h)):
            if name.split("-")[0] not in families:
                continue
            merge, additive = name.startswith("merge"), name.endswith("additive")
            if merge:
                build, data, configs_by_kind = merge_runner, make_merge(M, d, n, heads, additive), MERGE_CONFIGS
                bench = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")  # noqa: E731
            else:
                build, data, configs_by_kind = runner, make(M, d, n, sites, heads), CONFIGS
                bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
            with dispatch.overrides(**VECTOR_ONLY):
                fwd, bwd = build(*data, heads)
                ref_out, ref_grads = [o.detach().clone() for o in fwd()[0]], [g.clone() for g in bwd()]
            for kind, configs in configs_by_kind.items() if not tries else ():
                kind = "bwd_add" if kind == "bwd" and additive else kind  # the additive form's tile kind
                if kinds and kind not in kinds:
                    continue
                tried = set()
                for elements, warps in configs:
                    key = (tokens_per_program(elements, d, heads), warps)
                    if key in tried:
                        continue
                    tried.add(key)
                    row = dict(shape=name, kind=kind, elements=elements, warps=warps)
                    with dispatch.overrides(**VECTOR_ONLY, TUNED_TILES=tile_table(kind, d, heads, elements, warps)):
                        if kind in ("fwd", "merge_fwd"):
                            emit(check_and_time(row, lambda: lambda: fwd()[0], ref_out, bench))
                        else:
                            emit(check_and_time(row, lambda: build(*data, heads)[1], ref_grads, bench))
            for label, table in [("package", {})] + [(",".join(f"{k}={v!r}" for k, v in t.items()), t) for t in tries] if tries else []:
                with dispatch.overrides(**table):
                    fwd, bwd = build(*data, heads)
                    for kind in ("forward", "backward"):
                        row = dict(shape=name, kind=kind, elements=label, warps="")
                        if kind == "forward":
                            emit(check_and_time(row, lambda: lambda: fwd()[0], ref_out, bench))
                        else:
                            emit(check_and_time(row, lambda: build(*data, heads)[1], ref_grads, bench))
            if DEVICE == "cuda":  # (this shape's tensors are freed as the next shape's replace them)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
