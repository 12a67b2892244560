"""Tile sizes and warp counts of the routing kernels, tried one launch kind at a time (GPU).

For each shape (350m unless ``--scale``: phase one of Block AttnRes, S = 2L/8 sites against 8
completed blocks; one site over N = 9 .. 2L+1 sources; ``merge``: the second phase fused with the
next RMSNorm, over one newer source (block routing, replacement and additive form) or four or eight
(full routing)), every configuration of one launch kind (``fwd``, ``bwd_stats``, ``bwd_sources``; for
the merges ``merge_fwd`` and ``bwd`` (``bwd_add`` for the additive form), timed replaying a CUDA graph of the calls, forward and
backward together for ``bwd``: a merge's kernel takes a fraction of a millisecond, less than the
host needs to launch it) is checked against the package's default configuration
(relative L2 difference of the output or of every gradient) and then timed with
``triton.testing.do_bench`` (median), the other kinds at their defaults. A configuration whose
check fails gets no time. It also times the two backward kernels against each other at one site
and N sources, which sets ``SITE_LOOP_MIN_SOURCES``, and (``--shapes dots``) pass one of the site
loop on tensor cores against the vector kernel, by warps and elements per tile,
(``--shapes passes``) pass one, then both passes, on tensor cores against the vector kernels, and
(``--shapes dot-tune``) each tensor-core kernel by warps and pipelining stages, then by tile, and
(``--shapes wide``) passes over more than 64 sources on the vector kernels against tensor-core
tiles of up to 128 sources, (``--shapes min-sources``) passes over 1 to 4 sources on either, and (``--shapes saved-r``) the fused-norm merge of 1 to 7 sources with
its backward in two passes against one pass on the routed value r saved in float32 or bf16, and
(``--shapes padded-sites``) the vector forward of passes whose site count ``FWD_SITES`` does not
divide, in groups that divide it against padded groups and the tensor-core forward, and (``--shapes
mix``) phase one's forward on the block-diagonal tensor-core kernel against the mixed one by tile.

    python benchmarks/tune_tiles.py --scale 350m --out OUT    # writes OUT/tune_tiles.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import sys
from unittest import mock

import torch
from triton.testing import do_bench, do_bench_cudagraph

from bench_routing_op import use_backward  # the same switch between the two backward kernels
from lit_mhar.kernels import triton_routing as tr

SCALES = {"100m": (512, 12, 64 * 2048), "350m": (1024, 24, 32 * 1024), "1b": (1280, 36, 32 * 1024), "tiny": (96, 8, 70)}
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": a dry run of this script (tiny scale, Triton's interpreter)
if DEVICE == "cpu":
    from lit_mhar.kernels import use_backend

    use_backend("triton").__enter__()

    def do_bench(fn, warmup=0, rep=0, return_mode="median"):  # noqa: F811 - no CUDA events on CPU
        fn()
        return float("nan")

    do_bench_cudagraph = do_bench  # noqa: F811
# Elements per tile by warps; a configuration giving the same tokens per program as one tried before
# at this width (1280 holds one token in 1024 and 2048 elements) is skipped (``tokens_per_program``).
CONFIGS = {
    "fwd": list(itertools.product((2048, 4096, 8192, 16384), (1, 2, 4, 8))),
    "bwd_stats": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
    "bwd_sources": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
}
MERGE_CONFIGS = {
    "merge_fwd": list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 4, 8))),
    "bwd": list(itertools.product((512, 1024, 2048, 4096, 8192), (1, 2, 4, 8))),
}
FIELDS = ["scale", "shape", "kind", "elements", "warps", "ms", "rel_diff", "status"]


def tokens_per_program(elements: int, d: int, heads: int) -> int:
    """Tokens of one program's tile of ``elements`` at width ``d`` (the rule of ``tr._tile`` at one
    site; at S sites it is a function of this one, so equal here means equal there)."""
    rows = max(1, elements // tr._lanes(d, heads)[3])
    return 1 << (rows.bit_length() - 1)


@contextlib.contextmanager
def kernel_settings(values: dict):
    """The kernels module's attributes ``{name: value}`` set for the duration, then restored
    (none: the package's own settings)."""
    with mock.patch.multiple(tr, **values) if values else contextlib.nullcontext():
        yield


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


def check_pass(row: dict, forward: bool, fwd, data, heads: int, ref_out, ref_grads, bench) -> dict:
    """``check_and_time`` of route_sites on ``data``: its forward alone (``forward``, against
    ``ref_out``) or its whole backward (against ``ref_grads``)."""
    if forward:
        return check_and_time(row, lambda: lambda: fwd()[0], ref_out, bench)
    return check_and_time(row, lambda: runner(*data, heads)[1], ref_grads, bench)


def time_pass_settings(emit, shape: str, data, settings: list) -> None:
    """A phase-one pass on ``data`` (``make``'s, H = 8) under each ``(label, kernel settings)`` of
    ``settings``: its forward and its whole backward timed apart (median of ``do_bench``), each
    checked against the result under the first settings; one row each through ``emit``."""
    with kernel_settings(settings[0][1]):
        fwd, bwd = runner(*data, 8)
        ref_out, ref_grads = [o.detach().clone() for o in fwd()[0]], [g.clone() for g in bwd()]
    bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
    for label, values in settings:
        with kernel_settings(values):
            for kind in ("fwd", "backward"):
                row = dict(shape=shape, kind=kind, elements=label, warps=tr.WARPS.get("bwd_stats_dot", "default"))
                emit(check_pass(row, kind == "fwd", fwd, data, 8, ref_out, ref_grads, bench))
    del data, fwd, bwd, ref_out, ref_grads
    torch.cuda.empty_cache()


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="350m")
    ap.add_argument("--out", required=True, help="folder of tune_tiles.csv (rows are appended)")
    ap.add_argument("--shapes", default="phase1,full,one-site", help="comma-separated: which shape families to run "
                    "(phase1, full, op: one site over 9 and 2L+1 sources at H = 1, merge, dots, passes, dot-tune, wide, min-sources, saved-r, one-site, padded-sites, mix)")
    ap.add_argument("--kinds", default="", help="comma-separated launch kinds to vary (fwd, bwd_stats, bwd_sources, merge_fwd, bwd, "
                    "bwd_add: the additive merge's backward); default all")
    args = ap.parse_args(argv)
    families = set(args.shapes.split(","))
    d, layers, M = SCALES[args.scale]
    S = 2 * layers // 8
    defaults = (dict(tr.TILE_ELEMENTS), dict(tr.WARPS))
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

        kinds = set(filter(None, args.kinds.split(",")))
        shapes = [(f"phase1-N8-S{S}-H8", 8, S, 8), (f"phase1-N8-S{S}-H1", 8, S, 1), (f"full-N{2 * layers + 1}-S1-H8", 2 * layers + 1, 1, 8),
                  ("op-N9-S1-H1", 9, 1, 1), (f"op-N{2 * layers + 1}-S1-H1", 2 * layers + 1, 1, 1),
                  ("merge-N1-H8", 1, 1, 8), ("merge-N1-H8-additive", 1, 1, 8), ("merge-N4-H8", 4, 1, 8),
                  ("merge-N8-H8", 8, 1, 8)]
        # the vector kernels' tiles: the tensor-core kernels off while these families run
        vector_only = {k: getattr(tr, k) for k in ("DOT_FWD", "DOT_STATS", "DOT_SOURCES")}
        for name, n, sites, heads in shapes:
            if name.split("-")[0] not in families:
                continue
            for k in vector_only:
                setattr(tr, k, False)
            if name.startswith("merge"):
                build, data, configs_by_kind = merge_runner, make_merge(M, d, n, heads, name.endswith("additive")), MERGE_CONFIGS
                bench = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")  # noqa: E731
            else:
                build, data, configs_by_kind = runner, make(M, d, n, sites, heads), CONFIGS
                bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
            fwd, bwd = build(*data, heads)
            ref_out, ref_grads = [o.detach().clone() for o in fwd()[0]], [g.clone() for g in bwd()]
            for kind, configs in configs_by_kind.items():
                kind = "bwd_add" if kind == "bwd" and name.endswith("additive") else kind  # the additive form's tile kind
                if kinds and kind not in kinds:
                    continue
                tried = set()
                for elements, warps in configs:
                    key = (tokens_per_program(elements, d, heads), warps)
                    if key in tried:
                        continue
                    tried.add(key)
                    tr.TILE_ELEMENTS.update(defaults[0])
                    tr.WARPS.clear()
                    tr.TILE_ELEMENTS[kind], tr.WARPS[kind] = elements, warps
                    row = dict(shape=name, kind=kind, elements=elements, warps=warps)
                    if kind in ("fwd", "merge_fwd"):
                        emit(check_and_time(row, lambda: lambda: fwd()[0], ref_out, bench))
                    else:
                        emit(check_and_time(row, lambda: build(*data, heads)[1], ref_grads, bench))
            del data, fwd, bwd, ref_out, ref_grads
            tr.TILE_ELEMENTS.update(defaults[0])
            tr.WARPS.clear()
            for k, v in vector_only.items():
                setattr(tr, k, v)
            torch.cuda.empty_cache()

        # the site loop on tensor cores against the vector kernels: the whole backward of phase one,
        # block routing's pass and full routing's groups of 8 sites (Delta's; MHAR's are 12 since the
        # sixteenth set, whose passes these shapes do not time). "dots": pass one by warps (set
        # for the kind whatever the tile) and elements per tile; "passes": pass one, then both passes.
        # The tensor-core kernels take any head width here up to 256 (1b's 160 padded to 256), pass
        # two too (``DOT_SOURCES_PADDED``).
        dot_shapes = [(f"dots-N8-S{S}-H8", 8, S), ("dots-N9-S8-H8", 9, 8), (f"dots-N{2 * layers - 7}-S8-H8", 2 * layers - 7, 8)]
        vector = dict(DOT_STATS=False, DOT_SOURCES=False)
        dot_configs = {
            "dots": [(dict(kind="bwd_stats"), vector)] + [
                (dict(kind="bwd_stats_dot", elements=f"tile{tile}", warps=warps), dict(DOT_STATS=True, DOT_MAX_HEAD_WIDTH=256, DOT_TILE_ELEMENTS=tile, WARPS={"bwd_stats_dot": warps}))
                for warps, tile in itertools.product((1, 2, 4), (2048, 4096, 8192))
            ],
            "passes": [
                (dict(kind="vector"), vector), (dict(kind="pass-one-dots"), dict(DOT_STATS=True, DOT_SOURCES=False, DOT_MAX_HEAD_WIDTH=256)),
                (dict(kind="both-dots"), dict(DOT_STATS=True, DOT_SOURCES=True, DOT_SOURCES_PADDED=True, DOT_MAX_HEAD_WIDTH=256)),
            ],
        }
        for family, configs in dot_configs.items():
            for name, n, sites in dot_shapes if family in families else ():
                data = make(M, d, n, sites, 8, seed=n)
                with kernel_settings(vector):
                    _, bwd = runner(*data, 8)
                    ref_grads = [g.clone() for g in bwd()]
                for fields, settings in configs:
                    with kernel_settings(settings):
                        row = dict(shape=name.replace("dots", family), **fields)
                        bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
                        emit(check_and_time(row, lambda: runner(*data, 8)[1], ref_grads, bench))
                del data, bwd, ref_grads
                torch.cuda.empty_cache()

        # "dot-tune": each tensor-core kernel by warps and pipelining stages (the other two at their
        # defaults), the forward timed alone, the two backward kernels by the whole backward; then
        # the tiles (elements per tile, which all three share) at the default warps and stages
        if "dot-tune" in families:
            for name, n, sites in dot_shapes:
                data = make(M, d, n, sites, 8, seed=n)
                fwd, bwd = runner(*data, 8)
                ref_out, ref_grads = [o.detach().clone() for o in fwd()[0]], [g.clone() for g in bwd()]
                bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
                trials = [(kind, f"tile{tr.DOT_TILE_ELEMENTS}", {"WARPS": {kind: warps}, "DOT_STAGES": {kind: stages}}, f"{warps}/s{stages}")
                          for kind in ("fwd_sites_dot", "bwd_stats_dot", "bwd_sources_dot") for warps, stages in itertools.product((2, 4, 8), (1, 2, 3))]
                trials += [(kind, f"tile{tile}", {"DOT_TILE_ELEMENTS": tile, "WARPS": {}, "DOT_STAGES": {}}, "default")
                           for tile in (2048, 4096, 8192) for kind in ("fwd_sites_dot", "backward")]
                for kind, elements, settings, warps in trials:
                    with kernel_settings(settings):
                        row = dict(shape=name.replace("dots", "dot-tune"), kind=kind, elements=elements, warps=warps)
                        emit(check_pass(row, kind == "fwd_sites_dot", fwd, data, 8, ref_out, ref_grads, bench))
                del data, fwd, bwd, ref_out, ref_grads
                torch.cuda.empty_cache()

        # "wide": phase-one passes over more sources than one tensor-core tile held before
        # (DOT_MAX_SOURCES = 64): full routing's last group in groups of 8 (2L - 7 sources, 8 sites; Delta's before
        # the final site joined it, JOIN_FINAL_SITE) and one site over every source (2L + 1: the final site alone, as
        # it was), H = 8, on the vector kernels against the tensor-core kernels with
        # tiles of up to 128 sources for every pass (one site too, pass two in one launch), by warps
        # of the three tensor-core kernels, and the package's defaults; forward and the whole
        # backward timed apart, each checked against the vector kernels' result
        if "wide" in families:
            wide_settings = [("vector", dict(DOT_FWD=False, DOT_STATS=False, DOT_SOURCES=False, WARPS={}))] + [
                (f"dots128-w{w or 'default'}", dict(DOT_FWD=True, DOT_STATS=True, DOT_SOURCES=True, DOT_MAX_SOURCES=128, DOT_MAX_SOURCES_ONE_SITE=128,
                                                    DOT_SOURCES_CHUNK=128,
                                                    WARPS={k: w for k in ("fwd_sites_dot", "bwd_stats_dot", "bwd_sources_dot")} if w else {}))
                for w in (0, 2, 4, 8)
            ] + [("package-defaults", {})]
            for n, sites in ((2 * layers - 7, 8), (2 * layers + 1, 1)):
                time_pass_settings(emit, f"wide-N{n}-S{sites}-H8", make(M, d, n, sites, 8, seed=n), wide_settings)

        # "min-sources": phase-one passes over few sources (full routing's first group over the
        # embedding alone, 12 sites; block routing's first blocks, S sites), H = 8, on the
        # tensor-core kernels against the vector kernels (DOT_MIN_SOURCES); forward and the whole
        # backward timed apart, each checked against the vector kernels' result; a shape whose
        # pass the tensor-core kernels do not take at this width (``_stats_on_dots``) is skipped
        for n, sites in ((1, 12), (2, 12), (1, S), (2, S), (4, S)) if "min-sources" in families else ():
            with kernel_settings(dict(DOT_MIN_SOURCES=1)):
                on_dots = tr._stats_on_dots(sites, n, d, 8, None, True, torch.bfloat16, torch.bfloat16)
            if not on_dots:
                emit(dict(shape=f"min-sources-N{n}-S{sites}-H8", status=f"skipped: {sites} sites at head width {d // 8} take no tensor-core kernels"))
                continue
            settings = [("vector", dict(DOT_MIN_SOURCES=n + 1)), ("dots", dict(DOT_MIN_SOURCES=1))]
            time_pass_settings(emit, f"min-sources-N{n}-S{sites}-H8", make(M, d, n, sites, 8, seed=n), settings)

        # "mix": phase one's forward alone, H = 8: block routing's passes (S sites over 3, 5 and 8
        # sources) and full routing's groups of 12 sites (13, 25 and 37 sources, L = 24) on the
        # block-diagonal tensor-core kernel against the mixed one (DOT_FWD_MIX) by (token, source)
        # rows per tile and warps; each checked against the first setting's outputs
        if "mix" in families:
            mix_settings = [("block-diag", dict(DOT_FWD_MIX=False))] + [
                (f"mix-rows{rows}-w{warps}", dict(DOT_FWD_MIX=True, DOT_MIX_ROWS=rows, DOT_MIX_WARPS=warps, DOT_MIX_MAX_SOURCES=1 << 30))
                for rows, warps in ((32, 4), (16, 4), (64, 4), (32, 2), (32, 8), (64, 8), (128, 8))
            ]
            for n, sites in ((3, S), (5, S), (8, S), (13, 12), (25, 12), (37, 12)):
                data = make(M, d, n, sites, 8, seed=n)
                with kernel_settings(mix_settings[0][1]):
                    fwd, _ = runner(*data, 8)
                    ref_out = [o.detach().clone() for o in fwd()[0]]
                bench = lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median")  # noqa: E731
                for label, values in mix_settings:
                    with kernel_settings(values):
                        row = dict(shape=f"mix-N{n}-S{sites}-H8", kind="fwd", elements=label, warps=values.get("DOT_MIX_WARPS", "default"))
                        emit(check_and_time(row, lambda: lambda: fwd()[0], ref_out, bench))
                del data, fwd, ref_out
                torch.cuda.empty_cache()

        # "padded-sites": phase-one passes whose site count FWD_SITES does not divide, H = 8: L + 1
        # sites over L + 1 sources (at 100m full MHAR's second group of 12, joined by the final
        # site), 9 sites over 2L - 7 sources (at 100m Delta full's last group of 8, joined by it),
        # a block of 3 sites over 5 sources (100m's S = 3); the vector forward in groups
        # that divide the sites against padded ones (FWD_SITES_PADDED), of 2 and of 4, and the
        # tensor-core forward from head width 64; forward and whole backward timed apart
        if "padded-sites" in families:
            padded_settings = [
                ("divide", dict(FWD_SITES_PADDED=False)), ("padded", dict(FWD_SITES_PADDED=True)),
                ("padded-fwd4", dict(FWD_SITES_PADDED=True, FWD_SITES=4)), ("dots-fwd-at-64", dict(DOT_FWD_MIN_HEAD_WIDTH=64)),
            ]
            for n, sites in ((layers + 1, layers + 1), (2 * layers - 7, 9), (5, 3)):
                time_pass_settings(emit, f"padded-sites-N{n}-S{sites}-H8", make(M, d, n, sites, 8, seed=n), padded_settings)

        # "saved-r": the replacement form's merge fused with the norm (n newer sources, H = 8) with
        # its backward in two passes over the sources (r recomputed from the prior) against one
        # pass on the routed value r the forward saves in float32 or bf16 (SAVE_ROUTED,
        # SAVED_ROUTED_DTYPE); forward alone and forward + backward in one CUDA graph, each
        # checked against the two-pass result
        if "saved-r" in families:
            settings = [("two-pass", dict(SAVE_ROUTED=False)),
                        ("r-float32", dict(SAVE_ROUTED=True, SAVED_ROUTED_DTYPE=torch.float32, SAVE_ROUTED_MIN_SOURCES=1)),
                        ("r-bf16", dict(SAVE_ROUTED=True, SAVED_ROUTED_DTYPE=None, SAVE_ROUTED_MIN_SOURCES=1))]
            bench = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")  # noqa: E731
            for n in (1, 2, 4, 7):
                data = make_merge(M, d, n, 8, False, seed=n)
                refs = None
                for label, values in settings:
                    with kernel_settings(values):
                        fwd, both = merge_runner(*data, 8)
                        if refs is None:
                            refs = [o.detach().clone() for o in fwd()[0]], [g.clone() for g in both()]
                        for kind in ("merge_fwd", "fwd+bwd"):
                            row = dict(shape=f"saved-r-N{n}-H8", kind=kind, elements=label, warps="default")
                            if kind == "merge_fwd":
                                emit(check_and_time(row, lambda: lambda: fwd()[0], refs[0], bench))
                            else:
                                emit(check_and_time(row, lambda: both, refs[1], bench))
                del data, refs
                torch.cuda.empty_cache()

        # one site over N sources: two-pass against site-loop backward
        for n in sorted({9, 13, 17, 25, 33, 2 * layers + 1}) if "one-site" in families else ():
            for heads in (1, 8):
                data = make(M, d, n, 1, heads, seed=n)
                grads = {}
                for kind in ("twopass", "siteloop"):
                    use_backward(f"triton-{kind}")
                    _, b = runner(*data, heads)
                    grads[kind] = b()
                    diff = max(rel(g, r) for g, r in zip(grads[kind], grads["twopass"]))
                    emit(dict(shape=f"one-site-N{n}-H{heads}", kind=f"bwd_{kind}", rel_diff=f"{diff:.1e}",
                              ms=f"{do_bench(b, warmup=5, rep=50, return_mode='median'):.4f}" if diff < 1e-2 else "", status="ok" if diff < 1e-2 else "FAILED check"))
                use_backward("triton")
                del data, grads
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
