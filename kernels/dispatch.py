"""The dispatch plan: which kernel family and which tile serve a routing call of a given shape.

:func:`plan` is a pure function of a :class:`Call` (its form, sources N, sites S, width d, heads
H, dtypes): no globals, no device queries, so it is tested on a CPU against a recorded table
(``tests/kernels/test_dispatch.py``). Head width ``dh = d / H``; BENCHMARKS.md has the
measurements behind each row.

Training ops (forward | backward):

=================================================  =================  ==================================
call                                               forward            backward
=================================================  =================  ==================================
phase one (``route``, 2 <= S <= 16), bf16,         ``fwd_sites_mix``  ``bwd_stats_dot`` +
3 <= N <= 8, dh = 128                                                 ``bwd_sources_dot``
phase one, 2 <= S <= 16, bf16, 3 <= N <= 128,      ``fwd_sites_dot``  ``bwd_stats_dot`` +
128 <= dh <= 160                                                      ``bwd_sources_dot``
phase one, bf16, 8 <= S <= 16, 3 <= N <= 128,      ``fwd``            ``bwd_stats_dot`` +
64 <= dh < 128                                                        ``bwd_sources_dot``
other ``route`` passes of S >= 2, and one site     ``fwd``            ``bwd_stats`` + ``bwd_sources``
over N >= 9 sources (``route``, ``route-additive``)                   (the site loop)
one site over N < 9 sources; every merge (a        ``fwd``            ``bwd`` (two passes per tile
prior) and every fused norm                                           of tokens)
=================================================  =================  ==================================

Pass two on tensor cores (``bwd_sources_dot``) takes at most :data:`DOT_SOURCES_CHUNK` sources per
launch; at a head width that is neither a power of two nor two column tiles (112 = 64 + 48) it is
``bwd_sources`` instead. On tensor cores a float32 factor enters as a bf16x2 split (hi + lo), the
products accumulate in float32.

Tiles of the vector kernels (``fwd``, ``bwd``, ``bwd_stats``, ``bwd_sources``): a
token's width is held as ``[BH heads, BDH lanes]`` (a head width that is a sum of two powers of two,
96 = 64 + 32 or 160 = 128 + 32, as two tiles of BDH and DT lanes, :func:`lanes`); a program takes
``BM`` tokens of ``BS`` sites, ``BS * BM * lanes`` about :data:`TILE_ELEMENTS` [kind] float32
elements on warps of :data:`ELEMENTS_PER_THREAD` [kind] each (4 to 16), except where
:data:`TUNED_TILES` has the (elements, warps) measured for the kind at that many lanes (and heads).
Launch kinds: ``fwd`` (phase one, a single site), ``merge_fwd`` (a forward with a prior or a fused
norm), ``bwd`` / ``bwd_add`` (the two-pass backward, replacement / additive form), ``bwd_stats`` /
``bwd_sources`` (the site loop's two passes). Tensor-core tiles: :func:`dot_tile`,
:func:`mix_tile`. In Triton's interpreter (CPU tensors) a program takes up to
:data:`INTERPRET_ROWS` tokens on 4 warps: larger tiles only mean fewer numpy calls there.

Decoding (``decode``, ``decode-merge``, ``decode-sites``; no backward): one program per token loops
over its slots in tiles of :data:`DECODE_TILE_ELEMENTS` float32 elements on :data:`DECODE_WARPS`
warps; a history of more than :data:`DECODE_CHUNK` slots without a prior is split over programs of
that many slots whose partials a second launch merges; phase one of a group of decode sites takes
tiles of :data:`DECODE_SITES_TILE_ELEMENTS` on :data:`DECODE_SITES_WARPS` warps.

Raises ValueError for a width whose padded lanes exceed :data:`MAX_BLOCK_D` or a pass whose sites
do not fit :data:`MAX_TILE_ELEMENTS` lanes in the two-pass backward: never a silent cap.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

# Forms of a training call: no prior (``route``: phase one, or one site; ``route-additive``: one
# site of Delta AttnRes; ``route-norm``: one site fused with the next RMSNorm), or a merge with a
# prior (``merge``, ``merge-additive``, ``merge-norm``, ``merge-norm-additive``).
TRAINING_FORMS = ("route", "route-additive", "route-norm", "merge", "merge-additive", "merge-norm", "merge-norm-additive")
DECODE_FORMS = ("decode", "decode-merge", "decode-sites")

# Largest padded width (next power of two of d) one program keeps in registers.
MAX_BLOCK_D = 16384
# Sites x lanes of the two-pass backward, which holds every site's gradient of a token.
MAX_TILE_ELEMENTS = 8192
# Per launch kind: float32 elements of a program's tile, elements per thread (warps follow).
TILE_ELEMENTS = {"fwd": 4096, "merge_fwd": 4096, "bwd": 2048, "bwd_add": 2048, "bwd_stats": 2048, "bwd_sources": 2048}
ELEMENTS_PER_THREAD = {"fwd": 32, "merge_fwd": 32, "bwd": 8, "bwd_add": 8, "bwd_stats": 16, "bwd_sources": 16}
# (elements, warps) where measured better than the rule: (kind, lanes) for every head count,
# (kind, lanes, heads) for that head count only (benchmarks/tune_tiles.py; BENCHMARKS.md, "Why the dispatch plan is what it is").
TUNED_TILES: dict[tuple, tuple[int, int]] = {
    ("fwd", 512): (2048, 2), ("fwd", 1024): (2048, 2), ("merge_fwd", 512): (2048, 2), ("merge_fwd", 1024): (2048, 2),
    ("bwd_add", 512): (1024, 2), ("bwd_add", 1024): (1024, 2),
    ("bwd_stats", 512): (2048, 2), ("bwd_stats", 1024): (2048, 2),
    ("bwd_sources", 512): (2048, 2), ("bwd_sources", 1024): (1024, 2),
    ("fwd", 1280, 1): (2560, 1), ("merge_fwd", 1280): (1280, 1), ("bwd", 1280): (1280, 2),
    ("bwd_stats", 1280, 1): (1280, 1), ("bwd_sources", 1280, 1): (1280, 1),
    ("fwd", 512, 1): (2048, 1), ("bwd_stats", 512, 1): (1024, 1),
    ("bwd_stats", 1024, 1): (1024, 1), ("bwd_sources", 1024, 1): (2048, 2),
    ("bwd", 1024, 8): (1024, 4),
}
INTERPRET_ROWS = 64
# Sites one vector forward program routes together (a power of two dividing the pass's sites): a
# source tile is loaded and normalised once for the group.
FWD_SITES = 2
# The site loop serves passes without a prior or norm of at least this many sites, or one site
# over at least this many sources; the two-pass backward the rest.
SITE_LOOP_MIN_SITES = 2
SITE_LOOP_MIN_SOURCES = 9
# At split head widths pass two of the site loop loads the saved key rstd only up to this many heads
# (with more, Triton's one-site specialisation shuffles its tiles through shared memory).
SPLIT_SOURCES_RSTD_HEADS = 2
# A fused-norm merge of the replacement form over at least this many sources saves its routed value
# r in float32 in place of the prior, so that its backward reads the sources once (eager calls).
SAVE_ROUTED_MIN_SOURCES = 3

# Tensor cores (bf16 phase-one passes): which passes, and their tiles.
DOT_MIN_SOURCES = 3  # fewer: the vector kernels hold a token's sources unpadded
DOT_MAX_SOURCES = 128  # all of a token's sources in one tile
DOT_MAX_SITES = 16
DOT_MIN_HEAD_WIDTH = 128  # the site loop on tensor cores from this head width ...
DOT_MANY_SITES = 8  # ... or, for passes of at least this many sites,
DOT_MANY_SITES_MIN_HEAD_WIDTH = 64  # from this one
DOT_MAX_HEAD_WIDTH = 160
DOT_FWD_MIN_HEAD_WIDTH = 128  # phase one's forward on tensor cores from this head width
DOT_MIX_MAX_SOURCES = 8  # ... as fwd_sites_mix (scores on tensor cores, the weighted sum on vector units)
DOT_MIX_ROWS = 32  # (token, source) rows of a fwd_sites_mix tile
DOT_MIX_WARPS = 4
DOT_TILE_ELEMENTS = 4096  # elements of (token, row) x padded head width per tensor-core tile
DOT_MAX_ROWS = 64  # rows of either operand (shared memory grows as their square)
DOT_WARPS = 2
DOT_WARPS_ONE_TOKEN = {"fwd_sites_dot": 2, "bwd_stats_dot": 4, "bwd_sources_dot": 4}  # tiles of one token
DOT_WIDE_SOURCES = 64  # a one-token tile of more sources than this takes DOT_WARPS_ONE_TOKEN_WIDE warps
DOT_WARPS_ONE_TOKEN_WIDE = 4
DOT_STAGES = {"bwd_sources_dot": 1}  # software-pipelining stages where not Triton's default
DOT_SOURCES_CHUNK = 64  # sources per launch of bwd_sources_dot

# Decoding.
DECODE_TILE_ELEMENTS = 2048
DECODE_WARPS = 8
DECODE_CHUNK = 16
DECODE_SITES_TILE_ELEMENTS = 8192
DECODE_SITES_WARPS = 2


@dataclass(frozen=True)
class Call:
    """The shape of one routing call: everything :func:`plan` reads.

    Args:
        form: one of :data:`TRAINING_FORMS` or :data:`DECODE_FORMS`.
        sources: N, the sources the kernel reads (a merge may have 0; a rebuilt block's running
            sum counts 1; decoding: the slots the loop routes, after any prior's).
        sites: S routed in one pass (phase one; decode-sites: the group's sites), else 1.
        width: d. heads: H, dividing d.
        dtype: the sources' dtype (after promotion).
        grad_dtype: the output gradients' dtype (default ``dtype``).
        eager: not under ``torch.compile`` (which runs the custom op: no saved routed value).
        rebuild: a fused norm's backward rebuilding a block's running sum from its outputs.
        rstd_saved: the forward saved each source's key rstd (the site loop's backward).
        pending: decoding adds a pending sublayer output as the newest slot.
    """

    form: str
    sources: int
    sites: int
    width: int
    heads: int
    dtype: torch.dtype
    grad_dtype: Optional[torch.dtype] = None
    eager: bool = True
    rebuild: bool = False
    rstd_saved: bool = True
    pending: bool = False


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: the kernel family (a name of :data:`KERNELS`), its constexprs and
    launch options (``meta``, passed as keyword arguments); for a chunk of ``bwd_sources_dot`` its
    first source and ``count`` sources; for decoding, ``count`` programs per token (the split)."""

    kernel: str
    meta: dict = field(hash=False)
    first: int = 0
    count: Optional[int] = None


@dataclass(frozen=True)
class Plan:
    """:func:`plan`'s answer: the forward's launches, the backward's, and what the forward saves for
    the backward (each source's key rstd ``[N, tokens]`` float32; the routed value r in float32)."""

    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]
    saves_rstd: bool = False
    saves_routed: bool = False


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's launch arithmetic (``triton.cdiv`` goes through Triton's
    constexpr-function wrapper, about 1.5 us a call: hundreds of calls a step)."""
    return -(-a // b)


def geometry(d: int, heads: int) -> tuple[int, int, int]:
    """(BH, BDH, padded width) of the ``[heads, d/heads]`` register layout padded to powers of two.
    Raises ValueError for a padded width over :data:`MAX_BLOCK_D`."""
    bh, bdh = pow2(heads), pow2(d // heads)
    if bh * bdh > MAX_BLOCK_D:
        raise ValueError(
            f"triton depth routing: width d={d} with heads={heads} pads to {bh * bdh} lanes per token, "
            f"more than the {MAX_BLOCK_D} one program holds; use the reference backend"
        )
    return bh, bdh, bh * bdh


def lanes(d: int, heads: int) -> tuple[int, int, int, int]:
    """(BH, BDH, DT, lanes per token) of the vector kernels' layout: a head width that is a sum of
    two powers of two (96 = 64 + 32, 160 = 128 + 32) is two tiles of BDH and DT lanes, else one
    padded to a power of two (DT = 0). Raises ValueError for too wide a d."""
    bh, bdh, bd = geometry(d, heads)
    dh = d // heads
    if dh != bdh:
        head, rest = bdh // 2, dh - bdh // 2
        if rest & (rest - 1) == 0:  # rest < head, a power of two
            return bh, head, rest, bh * dh
    return bh, bdh, 0, bd


def vector_tile(kind: str, n_sites: int, d: int, heads: int, interpret: bool = False) -> dict:
    """Constexprs and warps of a vector kernel's launch of ``kind`` over ``n_sites`` sites a program:
    ``BS, BM, BH, BDH, DT, num_warps``. Raises ValueError for an unsupported size."""
    bh, bdh, dt, bd = lanes(d, heads)
    bs = pow2(n_sites)
    if bs * bd > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"triton depth routing: {n_sites} sites at width d={d} (heads={heads}) in one pass need "
            f"{bs * bd} fp32 registers per token in the two-pass backward, more than {MAX_TILE_ELEMENTS}; "
            f"route at most {max(1, MAX_TILE_ELEMENTS // bd)} sites per pass with it"
        )
    tuned = None if interpret else TUNED_TILES.get((kind, bd, heads), TUNED_TILES.get((kind, bd)))
    if interpret:
        rows = max(1, min(INTERPRET_ROWS, 65536 // (bs * bd)))
    else:
        rows = max(1, (tuned[0] if tuned else TILE_ELEMENTS[kind]) // (bs * bd))
    rows = 1 << (rows.bit_length() - 1)  # a power of two, rounded down
    if interpret:
        warps = 4
    elif tuned:
        warps = tuned[1]
    else:  # about ELEMENTS_PER_THREAD elements each, a power of two from 4 to 16
        warps = max(1, bs * rows * bd // (32 * ELEMENTS_PER_THREAD[kind]))
        warps = max(4, min(16, 1 << (warps.bit_length() - 1)))
    return dict(BS=bs, BM=rows, BH=bh, BDH=bdh, DT=dt, num_warps=warps)


def group_sites(n_sites: int, most: int, d: int, heads: int) -> int:
    """Sites per program: the largest power of two <= ``most`` dividing ``n_sites`` whose tile of one
    token per site fits :data:`MAX_TILE_ELEMENTS` at width ``d`` (1 always fits)."""
    most = min(most, max(1, MAX_TILE_ELEMENTS // lanes(d, heads)[3]))
    group = 1
    while group * 2 <= most and n_sites % (group * 2) == 0:
        group *= 2
    return group


def dot_width(head_width: int) -> int:
    """The head width the tensor-core kernels compute on: the next power of two, at least 16 (the
    smallest ``tl.dot`` operand); the padding columns are masked off."""
    return max(16, pow2(head_width))


def dot_lanes(head_width: int) -> tuple[int, int]:
    """(DHP, DT): the tensor-core kernels' column tiles per head. A head width that is a power of two
    plus a smaller one of at least 16 (160 = 128 + 32) is two tiles, DHP + DT; any other is one tile
    padded to :func:`dot_width` (DT = 0)."""
    padded = dot_width(head_width)
    rest = head_width - padded // 2
    if padded != head_width and rest >= 16 and rest & (rest - 1) == 0:
        return padded // 2, rest
    return padded, 0


def dot_tile(n_sites: int, n_src: int, head_width: int) -> tuple[int, int, int]:
    """(BS, BN, BM) of the tensor-core kernels' tiles: sites and sources padded to powers of two,
    tokens per tile so that a tile holds about :data:`DOT_TILE_ELEMENTS` elements of (token, source)
    or (token, site) rows of the padded head width, at most :data:`DOT_MAX_ROWS` rows unless one
    token's sources or sites alone are more (a tile of one token), and sites or sources padded
    further where a token's rows alone are fewer than 16 (the smallest ``tl.dot`` operand)."""
    bs, bn = pow2(n_sites), pow2(n_src)
    rows = min(DOT_TILE_ELEMENTS // dot_width(head_width), DOT_MAX_ROWS)
    bm = max(1, rows // max(bs, bn))
    return max(bs, 16 // bm), max(bn, 16 // bm), bm


def mix_tile(n_sites: int, n_src: int) -> tuple[int, int, int, int]:
    """(BS, BSO, BN, BM) of ``fwd_sites_mix``'s tiles: the score dot's weight rows (sites padded to a
    power of two, at least 16), the output's sites (a power of two), the sources (a power of two)
    and the tokens, :data:`DOT_MIX_ROWS` (token, source) rows a tile and at least 16."""
    bso, bn = pow2(n_sites), pow2(n_src)
    return max(16, bso), bso, bn, max(1, DOT_MIX_ROWS // bn, 16 // bn)


def dot_warps(kernel: str, bm: int, bn: int) -> dict:
    """Launch options of tensor-core kernel ``kernel`` on tiles of ``bm`` tokens and ``bn`` sources."""
    one_token = DOT_WARPS_ONE_TOKEN_WIDE if bn > DOT_WIDE_SOURCES else DOT_WARPS_ONE_TOKEN[kernel]
    opts = dict(num_warps=DOT_WARPS if bm > 1 else one_token)
    if kernel in DOT_STAGES:
        opts["num_stages"] = DOT_STAGES[kernel]
    return opts


def uses_site_loop(n_sites: int, n_src: int, prior: bool, norm: bool) -> bool:
    """Whether the backward of such a pass runs the site loop (else the two-pass kernel, which alone
    has a prior's and the fused norm's backward)."""
    return not prior and not norm and n_src > 0 and (n_sites >= SITE_LOOP_MIN_SITES or n_src >= SITE_LOOP_MIN_SOURCES)


def _dots_apply(call: Call) -> bool:
    """Whether a phase-one pass's sources and head width suit the tensor-core kernels at all."""
    return call.form == "route" and 2 <= call.sites <= DOT_MAX_SITES and DOT_MIN_SOURCES <= call.sources <= DOT_MAX_SOURCES


def _forward(call: Call, interpret: bool) -> Launch:
    d, heads, dh = call.width, call.heads, call.width // call.heads
    if _dots_apply(call) and DOT_FWD_MIN_HEAD_WIDTH <= dh <= DOT_MAX_HEAD_WIDTH and call.dtype == torch.bfloat16:
        dhp, dt = dot_lanes(dh)
        if dt == 0 and dhp == dh and call.sources <= DOT_MIX_MAX_SOURCES:
            bs, bso, bn, bm = mix_tile(call.sites, call.sources)
            return Launch("fwd_sites_mix", dict(BS=bs, BSO=bso, BN=bn, BM=bm, num_warps=DOT_MIX_WARPS))
        bs, bn, bm = dot_tile(call.sites, call.sources, dh)
        return Launch("fwd_sites_dot", dict(DHP=dhp, DT=dt, BS=bs, BN=bn, BM=bm, **dot_warps("fwd_sites_dot", bm, bn)))
    group = group_sites(call.sites, FWD_SITES, d, heads)
    kind = "fwd" if call.form in ("route", "route-additive") else "merge_fwd"
    return Launch("fwd", vector_tile(kind, group, d, heads, interpret))


def _site_loop(call: Call, interpret: bool) -> tuple[Launch, ...]:
    d, heads, dh = call.width, call.heads, call.width // call.heads
    grad_dtype = call.grad_dtype or call.dtype
    min_width = DOT_MIN_HEAD_WIDTH if call.sites < DOT_MANY_SITES else min(DOT_MIN_HEAD_WIDTH, DOT_MANY_SITES_MIN_HEAD_WIDTH)
    on_dots = (
        _dots_apply(call) and call.rstd_saved and min_width <= dh <= DOT_MAX_HEAD_WIDTH
        and call.dtype == torch.bfloat16 and grad_dtype == call.dtype
    )
    dhp, dt_dot = dot_lanes(dh)
    # pass two on tensor cores where a head's width needs no padding columns
    both = on_dots and (dot_width(dh) == dh or dhp + dt_dot == dh)
    single = call.sources == 1  # a softmax over one source: its weight is exactly 1
    if on_dots:
        bs, bn, bm = dot_tile(call.sites, call.sources, dh)
        one = Launch("bwd_stats_dot", dict(
            DHP=dhp, DT=dt_dot, BS=bs, BN=bn, BM=bm, STORE_SA=not both, STORE_T=both, **dot_warps("bwd_stats_dot", bm, bn),
        ))
    else:
        tile = vector_tile("bwd_stats", 1, d, heads, interpret)
        del tile["BS"]  # one site a program
        one = Launch("bwd_stats", dict(tile, HAS_RSTD=call.rstd_saved, LONE_SOURCE=single))
    if not both:
        tile = vector_tile("bwd_sources", 1, d, heads, interpret)
        del tile["BS"]
        load_rstd = call.rstd_saved and (tile["DT"] == 0 or heads <= SPLIT_SOURCES_RSTD_HEADS)
        return one, Launch("bwd_sources", dict(tile, HAS_RSTD=load_rstd, LONE_SOURCE=single))
    two = []
    for first in range(0, call.sources, DOT_SOURCES_CHUNK):
        count = min(call.sources - first, DOT_SOURCES_CHUNK)
        bs, bn, bm = dot_tile(call.sites, count, dh)
        meta = dict(BH=pow2(heads), DHP=dhp, DT=dt_dot, BS=bs, BN=bn, BM=bm, **dot_warps("bwd_sources_dot", bm, bn))
        two.append(Launch("bwd_sources_dot", meta, first, count))
    return (one, *two)


def _two_pass(call: Call, saved_routed: bool, interpret: bool) -> Launch:
    additive = call.form in ("route-additive", "merge-additive", "merge-norm-additive")
    prior, norm = call.form.startswith("merge"), "norm" in call.form
    tile = vector_tile("bwd_add" if additive else "bwd", call.sites, call.width, call.heads, interpret)
    # over exactly one source pass one keeps the source and its scores for pass two; with the
    # replacement form's fused-norm merge each program loads its next tile during this one
    reuse = call.sources == 1 and tile["DT"] == 0 and not call.rebuild and not saved_routed
    return Launch("bwd", dict(
        tile, KEEP_SOURCE=reuse, PREFETCH_TILE=reuse and norm and prior and not additive, LONE_SOURCE=call.sources == 1 and not prior,
    ))


@functools.lru_cache(maxsize=4096)  # (called twice per routing op: a hash instead of the decisions)
def plan(call: Call, interpret: bool = False) -> Plan:
    """The kernel launches for ``call`` (forward, and backward for training forms), and what the
    forward saves for its backward; ``interpret``: the tiles for Triton's interpreter (CPU tensors).

    Raises:
        ValueError: an unknown form, H not dividing d, a width over :data:`MAX_BLOCK_D`, a pass of
            more sites than the two-pass backward holds.
    """
    if call.form not in TRAINING_FORMS + DECODE_FORMS:
        raise ValueError(f"dispatch plan: form {call.form!r} is unknown; valid: {list(TRAINING_FORMS + DECODE_FORMS)}")
    if call.heads < 1 or call.width % call.heads:
        raise ValueError(f"dispatch plan: heads={call.heads} must divide the width d={call.width}")
    if call.form in DECODE_FORMS:
        return Plan(_decode(call, interpret), ())
    prior, norm = call.form.startswith("merge"), "norm" in call.form
    forward = _forward(call, interpret)
    if uses_site_loop(call.sites, call.sources, prior, norm):
        return Plan((forward,), _site_loop(call, interpret), saves_rstd=True)
    saves_routed = call.form == "merge-norm" and call.eager and call.sources >= SAVE_ROUTED_MIN_SOURCES
    return Plan((forward,), (_two_pass(call, saves_routed, interpret),), saves_routed=saves_routed)


def decode_slots(n: int, elements: int, bd: int) -> int:
    """Slots per tile: a power of two, at most ``elements // bd`` (at least 1) and no more than ``n`` needs."""
    cap = max(1, elements // bd)
    cap = 1 << (cap.bit_length() - 1)
    return min(pow2(max(1, n)), cap)


def _decode(call: Call, interpret: bool) -> tuple[Launch, ...]:
    bh, bdh, bd = geometry(call.width, call.heads)
    layout = dict(BH=bh, BDH=bdh)
    if call.form == "decode-sites":
        chunk = decode_slots(call.sources, DECODE_SITES_TILE_ELEMENTS, bd)
        return (Launch("decode", dict(layout, CH=chunk, NSP=1, PHASE=3, num_warps=4 if interpret else DECODE_SITES_WARPS)),)
    # without a prior, a history longer than DECODE_CHUNK slots is split over programs of that many
    cap = max(1, DECODE_CHUNK * 2048 // max(bd, 2048))
    n_split = 1 if call.form == "decode-merge" else cdiv(call.sources + call.pending, cap)
    if n_split == 1:
        chunk = decode_slots(call.sources, DECODE_TILE_ELEMENTS, bd)
        return (Launch("decode", dict(layout, CH=chunk, NSP=1, PHASE=0, num_warps=4 if interpret else DECODE_WARPS), count=1),)
    split = dict(layout, CH=cap, NSP=pow2(n_split))
    return (
        Launch("decode", dict(split, PHASE=1, num_warps=4 if interpret else 8), count=n_split),
        Launch("decode", dict(split, PHASE=2, num_warps=4), count=n_split),
    )


@contextlib.contextmanager
def overrides(**values) -> Iterator[None]:
    """Replace entries of this module's table (its upper-case names) inside a ``with`` block: tests
    reach other kernels and tiles at small shapes, tuning runs time other tiles. The plan's cache is
    cleared on entry and exit. Raises ValueError for a name that is not one of the table's."""
    module = sys.modules[__name__]
    unknown = [k for k in values if not (k.isupper() and hasattr(module, k))]
    if unknown:
        raise ValueError(f"dispatch.overrides: {unknown} are not entries of the dispatch table")
    previous = {k: getattr(module, k) for k in values}
    plan.cache_clear()
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in previous.items():
            setattr(module, k, v)
        plan.cache_clear()
