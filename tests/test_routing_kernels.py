"""The fused Triton depth-routing kernels against the float64 reference: output and every gradient.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``use_backend("triton")``).
The kernel module builds its interpreted kernels explicitly and uses only Triton builtins, so this
works whatever was imported first in the pytest process and whether or not ``TRITON_INTERPRET``
is set. The CPU cases are a representative subset; the full grid is marked ``gpu``.
Every kernel output is filled with NaN before each launch (``POISON_OUTPUTS``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton

from lit_mhar import LM, ModelConfig
from lit_mhar.kernels import GradientSink, reference, use_backend
from lit_mhar.kernels import triton_routing as tr

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# ||out - ref|| / ||ref|| against float64: float32 arithmetic lands near 1e-7; bfloat16 outputs are
# rounded once (2^-9 relative per element), the bound is the usual band for bf16 results.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(tr, "POISON_OUTPUTS", True)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert torch.isfinite(x).all(), "non-finite values (an unwritten, NaN-poisoned element?)"
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def make_case(n, heads, d, tokens, dtype, additive, seed=0, device=DEVICE):
    """Random sources ``[2, tokens/2.., d]``-like, non-zero queries scaled so scores are O(1)."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    sources = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(n)]
    # different magnitudes per source, so rstd matters
    sources = [s * (0.5 + i % 3) for i, s in enumerate(sources)]
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    stream = torch.randn(shape, generator=g).to(device) if additive else None
    gate = torch.randn(d, generator=g).to(device) if additive else None
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    return sources, query, gain, stream, gate, grad


def check_route(n, heads, d, tokens, dtype, additive, seed=0):
    sources, query, gain, stream, gate, grad = make_case(n, heads, d, tokens, dtype, additive, seed)
    leaves = [*sources, query, gain] + ([stream, gate] if additive else [])
    leaves = [x.detach().requires_grad_() for x in leaves]
    ins = leaves[:n], *leaves[n:]

    def call(fn, srcs, q, g, st=None, ga=None):
        return fn(srcs, q, g, heads, st, ga, return_weights=True)

    out, weights = call(tr.depth_route, *ins)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref, ref_w = call(reference.depth_route, leaves64[:n], *leaves64[n:])
    ref_grads = torch.autograd.grad(ref, leaves64, grad)
    tol = TOL[dtype]
    assert out.dtype == (stream.dtype if additive else dtype)
    assert rel_err(out, ref) < tol
    assert rel_err(weights, ref_w) < 1e-5  # float32 softmax of exact bf16 inputs
    names = [f"source{i}" for i in range(n)] + ["query", "gain"] + (["stream", "gate"] if additive else [])
    for name, g_, r in zip(names, grads, ref_grads):
        assert g_.dtype == leaves[names.index(name)].dtype
        if n == 1 and name in ("query", "gain"):
            # a softmax over one source is constant: the exact gradient is 0, and ours is the
            # float32 rounding of a - D (a ~ sqrt(d/H), summed over tokens)
            assert torch.isfinite(g_).all() and g_.abs().max() < 1e-3 * tokens ** 0.5, f"d{name}: {g_.abs().max():.2e}"
            continue
        err = rel_err(g_, r)
        assert err < tol, f"d{name}: relative error {err:.2e}"


def case_id(n, heads, d, tokens, dtype, additive):
    return f"N{n}-H{heads}-d{d}-T{tokens}-{str(dtype).split('.')[-1]}-{'additive' if additive else 'replace'}"


# A representative CPU subset: every N, H, width, dtype and form appears, with token counts that are
# not multiples of the interpreter's 64-row tile (and one that spans several tiles).
CPU_CASES = [
    (1, 1, 64, 37, torch.float32, False),
    (2, 2, 96, 70, torch.bfloat16, True),
    (9, 8, 1024, 5, torch.bfloat16, False),
    (9, 4, 1000, 131, torch.float32, True),
    (33, 16, 64, 3, torch.float32, False),
    (73, 16, 96, 9, torch.bfloat16, True),
    (2, 1, 1000, 7, torch.bfloat16, False),
    (1, 8, 1024, 3, torch.float32, True),
]


@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive", CPU_CASES, ids=[case_id(*c) for c in CPU_CASES])
def test_route_matches_float64_reference(n, heads, d, tokens, dtype, additive):
    with use_backend("triton"):
        check_route(n, heads, d, tokens, dtype, additive)


GPU_CASES = [
    (n, h, d, t, dt, add)
    for n, h, d, dt, add in itertools.product((1, 2, 9, 33, 73), (1, 2, 4, 8, 16), (64, 96, 1000, 1024), (torch.float32, torch.bfloat16), (False, True))
    if d % h == 0
    for t in (1037,)  # several tiles, and not a multiple of any tile
] + [  # 1b's width, on its own tiles (TUNED_TILES)
    (n, h, 1280, 1037, dt, add) for n, h, dt, add in itertools.product((9, 73), (1, 8), (torch.float32, torch.bfloat16), (False, True))
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive", GPU_CASES, ids=[case_id(*c) for c in GPU_CASES])
def test_route_matches_float64_reference_full_grid(n, heads, d, tokens, dtype, additive):
    check_route(n, heads, d, tokens, dtype, additive)


def two_phase_vs_plain(n_completed, sites, heads, d, tokens, dtype, additive, device=DEVICE):
    """Route ``sites`` sites of one block: site 0 sees the completed blocks, site j > 0 also a partial block.

    Returns the relative errors of two-phase Triton against plain float64 routing (outputs, then
    gradients of completed blocks, partials, queries, gains, streams, gates).
    """
    g = torch.Generator().manual_seed(7)
    completed = [(torch.randn(tokens, d, generator=g) * (1 + i)).to(device, dtype) for i in range(n_completed)]
    partials = [torch.randn(tokens, d, generator=g).to(device, dtype) for _ in range(sites)]
    queries = (2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(device)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(device)
    streams = [torch.randn(tokens, d, generator=g).to(device) for _ in range(sites)] if additive else None
    gates = (torch.randn(sites, d, generator=g)).to(device) if additive else None
    douts = [torch.randn(tokens, d, generator=g, dtype=torch.float64).to(device) for _ in range(sites)]

    def run(two_phase, cast):
        c = [cast(x).requires_grad_() for x in completed]
        p = [cast(x).requires_grad_() for x in partials]
        q, gn = cast(queries).requires_grad_(), cast(gains).requires_grad_()
        st = [cast(x).requires_grad_() for x in streams] if additive else [None] * sites
        ga = cast(gates).requires_grad_() if additive else None
        outs = []
        if two_phase:
            inter, lse = tr.route_sites(c, q, gn, heads)
        for j in range(sites):
            gate_j = ga[j] if additive else None
            if two_phase:
                outs.append(tr.merge_route([p[j]] if j else [], q[j], gn[j], heads, inter[j], lse[j], st[j], gate_j))
            else:
                outs.append(reference.depth_route(c + ([p[j]] if j else []), q[j], gn[j], heads, st[j], gate_j))
        leaves = c + p[1:] + [q, gn] + (st + [ga] if additive else [])
        grads = torch.autograd.grad(sum((o.double() * d_).sum() for o, d_ in zip(outs, douts)), leaves)
        return outs, grads

    outs, grads = run(True, lambda x: x.detach().clone())
    ref_outs, ref_grads = run(False, lambda x: x.detach().double())
    return [rel_err(o, r) for o, r in zip(outs, ref_outs)], [rel_err(a, b) for a, b in zip(grads, ref_grads)]


TWO_PHASE_CPU = [(3, 3, 2, 64, 37, torch.float32, False), (4, 4, 4, 96, 70, torch.bfloat16, True), (2, 2, 1, 1000, 13, torch.float32, True), (8, 9, 8, 64, 5, torch.float32, False)]


def two_phase_id(nc, s, h, d, t, dt, add):
    return f"completed{nc}-S{s}-H{h}-d{d}-T{t}-{str(dt).split('.')[-1]}-{'additive' if add else 'replace'}"


@pytest.mark.parametrize("n_completed,sites,heads,d,tokens,dtype,additive", TWO_PHASE_CPU, ids=[two_phase_id(*c) for c in TWO_PHASE_CPU])
def test_two_phase_block_routing_equals_plain_routing(n_completed, sites, heads, d, tokens, dtype, additive):
    out_errs, grad_errs = two_phase_vs_plain(n_completed, sites, heads, d, tokens, dtype, additive)
    assert max(out_errs) < TOL[dtype] and max(grad_errs) < TOL[dtype], (out_errs, grad_errs)


TWO_PHASE_GPU = [
    (nc, s, h, d, 1037, dt, add)
    for nc, s, h, d, dt, add in itertools.product((1, 4, 8), (2, 3, 6, 9), (1, 8), (96, 1024, 1280), (torch.float32, torch.bfloat16), (False, True))
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_completed,sites,heads,d,tokens,dtype,additive", TWO_PHASE_GPU, ids=[two_phase_id(*c) for c in TWO_PHASE_GPU])
def test_two_phase_block_routing_equals_plain_routing_full_grid(n_completed, sites, heads, d, tokens, dtype, additive):
    out_errs, grad_errs = two_phase_vs_plain(n_completed, sites, heads, d, tokens, dtype, additive)
    assert max(out_errs) < TOL[dtype] and max(grad_errs) < TOL[dtype], (out_errs, grad_errs)


@pytest.mark.parametrize("d,heads", [(96, 8), (160, 8), (48, 1), (24, 8)], ids=["d96-H8", "d160-H8", "d48-H1", "d24-H8"])
def test_split_head_widths_match_float64_reference_and_padded_layout(monkeypatch, d, heads):
    """A head width d/H that is a sum of two powers of two (12 = 8 + 4, 20 = 16 + 4, 48 = 32 + 16,
    3 = 2 + 1; at full size 96 = 64 + 32 and 160 = 128 + 32) runs as two tiles per head
    (``SPLIT_WIDTH``), and with it off as one padded tile: both layouts' outputs and every gradient
    against float64, through the two-pass backward (additive), the site loop (9 sources; its pass
    two loading the saved key rstd and recomputing it), phase one with its merges (two-phase block
    routing)."""
    bh, bdh, dt, lanes = tr._lanes(d, heads)
    assert dt > 0 and bdh + dt == d // heads and lanes == bh * (d // heads)
    # pass two of the site loop loads the saved key rstd (a first run) or recomputes it (the second)
    for split, rstd_heads in ((True, heads), (True, heads - 1), (False, 0)):
        monkeypatch.setattr(tr, "SPLIT_WIDTH", split)
        monkeypatch.setattr(tr, "SPLIT_SOURCES_RSTD_HEADS", rstd_heads)
        assert (tr._tile("fwd", 1, d, heads, True)[5] > 0) == split
        with use_backend("triton"):
            check_route(2, heads, d, 37, torch.bfloat16, True)
            check_route(9, heads, d, 37, torch.float32, False)
        for additive in (False, True):
            out_errs, grad_errs = two_phase_vs_plain(3, 3, heads, d, 37, torch.float32, additive)
            assert max(out_errs) < TOL[torch.float32] and max(grad_errs) < TOL[torch.float32], (split, additive, out_errs, grad_errs)


def test_two_sources_in_flight_match_float64_reference(monkeypatch):
    """``PREFETCH`` = 2 (each loop over sources loads source i + 2 while working on i) in every
    loop that has it: one, two and nine sources (the loads ahead past the end masked off), split
    and power-of-two head widths, both forms, phase one with its merges, against float64."""
    monkeypatch.setitem(tr.PREFETCH, "fwd", 2)
    monkeypatch.setitem(tr.PREFETCH, "bwd", 2)
    monkeypatch.setitem(tr.PREFETCH, "bwd_stats", 2)
    with use_backend("triton"):
        check_route(1, 2, 96, 37, torch.bfloat16, True)
        check_route(2, 8, 96, 37, torch.float32, False)
        check_route(9, 4, 96, 37, torch.bfloat16, True)
        check_route(9, 8, 64, 37, torch.float32, False)
    out_errs, grad_errs = two_phase_vs_plain(3, 3, 8, 96, 37, torch.float32, False)
    assert max(out_errs) < TOL[torch.float32] and max(grad_errs) < TOL[torch.float32], (out_errs, grad_errs)


@pytest.mark.parametrize("fwd_sites", [1, 4, 8])
@pytest.mark.parametrize("stats_sites", [1, 2, 8])
def test_site_groups_match_float64_reference(monkeypatch, fwd_sites, stats_sites):
    """Phase one with the sites taken 1, 4 or 8 per forward program (``FWD_SITES``) and 1, 2 or 8
    per program of the backward's pass one (``STATS_SITES``). The backward's group size must divide
    S, so S = 8 runs the size asked, S = 6 at most 2 and S = 5 one; with ``FWD_SITES_PADDED``
    (off by default; run with 4 sites per forward program) the forward's need not (the last
    group's spare slots masked), at most the largest power of two <= S. Outputs, lse and every
    gradient against float64 routing, on a token count no tile divides."""
    monkeypatch.setattr(tr, "FWD_SITES", fwd_sites)
    monkeypatch.setattr(tr, "STATS_SITES", stats_sites)
    assert not tr.FWD_SITES_PADDED
    padded = fwd_sites == 4  # the kernels run padded groups there, groups dividing S elsewhere
    monkeypatch.setattr(tr, "FWD_SITES_PADDED", padded)
    for sites, expected, expected_stats in ((8, fwd_sites, stats_sites), (6, min(4, fwd_sites), min(2, stats_sites)), (5, min(4, fwd_sites), 1)):
        dividing = fwd_sites if sites == 8 else min(2, fwd_sites) if sites == 6 else 1
        assert tr._group_sites(sites, tr.FWD_SITES, 96, 4, padded=True) == expected
        assert tr._group_sites(sites, tr.FWD_SITES, 96, 4) == dividing
        assert tr._group_sites(sites, tr.FWD_SITES, 96, 4, padded=tr.FWD_SITES_PADDED) == (expected if padded else dividing)
        assert tr._group_sites(sites, tr.STATS_SITES, 96, 4) == expected_stats
        g = torch.Generator().manual_seed(11 + sites)
        srcs = [(torch.randn(67, 96, generator=g) * (1 + i)).to(DEVICE) for i in range(3)]
        queries = (0.6 * torch.randn(sites, 96, generator=g)).to(DEVICE)
        gains = (1 + 0.3 * torch.randn(sites, 96, generator=g)).to(DEVICE)
        douts = [torch.randn(67, 96, generator=g).to(DEVICE) for _ in range(sites)]
        dlse = torch.randn(sites, 67, 4, generator=g).to(DEVICE)

        def run(impl, cast):
            leaves = [cast(x).requires_grad_() for x in (*srcs, queries, gains)]
            outs, lse = impl.route_sites(leaves[:3], leaves[3], leaves[4], 4)
            loss = sum((o.double() * d_.double()).sum() for o, d_ in zip(outs, douts)) + (lse.double() * dlse.double()).sum()
            return [*outs, lse, *torch.autograd.grad(loss, leaves)]

        with use_backend("triton"):
            got = run(tr, lambda x: x.detach().clone())
        ref = run(reference, lambda x: x.detach().double())
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) < TOL[torch.float32], (sites, errs)


@pytest.mark.parametrize("sites,n", [(3, 4), (1, 9)], ids=["phase-one", "one-site-N9"])
def test_saved_rstd_matches_float64_reference(monkeypatch, sites, n):
    """The site loop's backward with each source's key rstd saved by the forward (``SAVE_RSTD``)
    and recomputing it: the saved values equal the float64 RMSNorm rstd, and both paths' outputs
    and gradients match float64 routing to the float32 tolerance."""
    g = torch.Generator().manual_seed(9)
    srcs = [(torch.randn(2, 23, 64, generator=g) * (0.5 + i)).to(DEVICE) for i in range(n)]
    queries = (0.5 * torch.randn(sites, 64, generator=g)).to(DEVICE)
    gains = (1 + 0.2 * torch.randn(sites, 64, generator=g)).to(DEVICE)
    douts = [torch.randn(2, 23, 64, generator=g).to(DEVICE) for _ in range(sites)]

    def run(impl, cast):
        leaves = [cast(x).requires_grad_() for x in (*srcs, queries, gains)]
        outs, lse = impl.route_sites(leaves[:n], leaves[n], leaves[n + 1], 4)
        loss = sum((o.double() * d_.double()).sum() for o, d_ in zip(outs, douts))
        return [*outs, lse, *torch.autograd.grad(loss, leaves)]

    ref = run(reference, lambda x: x.detach().double())
    for save in (True, False):
        monkeypatch.setattr(tr, "SAVE_RSTD", save)
        with use_backend("triton"):
            res = tr._route([x.detach().requires_grad_() for x in srcs], queries, gains, 4, 1e-6, None, None, None, None, False)
            got = run(tr, lambda x: x.detach().clone())
        if save:
            rstd64 = torch.stack([x.double().square().mean(-1).add(1e-6).rsqrt().flatten() for x in srcs])
            assert rel_err(res[sites + 2], rstd64) < 1e-6
        else:
            assert res[sites + 2].numel() == 0
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) < TOL[torch.float32], (save, errs)


def test_tuned_tiles_hold_at_their_width_and_head_count_only():
    """A tuned tile keyed by (kind, width) holds for every head count, one keyed by (kind, width,
    heads) for that count only; other counts and widths take the general rule, the interpreter its
    own rows."""
    tokens = lambda kind, d, heads: tr._tile(kind, 1, d, heads, False)[1:3]  # noqa: E731 - (tokens, warps)
    assert tokens("bwd_sources", 1280, 1) == (1, 1) and tokens("fwd", 1280, 1) == (2, 1)
    assert tokens("bwd_sources", 1280, 8) == (1, 4) and tokens("fwd", 1280, 8) == (2, 4)  # the rule: 2048 / 4096 elements, 4 warps at least
    assert tokens("bwd", 1280, 1) == tokens("bwd", 1280, 8) == (1, 2) and tokens("bwd_add", 1280, 8) == (1, 4)
    assert tokens("bwd_sources", 1024, 8) == (1, 2) and tokens("bwd_sources", 768, 8) == (2, 4)
    assert tokens("bwd_stats", 1024, 1) == (1, 1) and tokens("bwd_stats", 1024, 8) == (2, 2)  # (kind, 1024, 1) over (kind, 1024)
    assert tokens("fwd", 512, 1) == (4, 1) and tokens("fwd", 512, 8) == (4, 2)
    assert tokens("bwd_stats", 512, 1) == (2, 1) and tokens("bwd_sources", 1024, 1) == (2, 2) and tokens("bwd_sources", 512, 1) == (4, 2)
    assert tr._tile("bwd_sources", 1, 1280, 1, True)[1:3] == tr._tile("bwd_sources", 1, 1280, 8, True)[1:3] == (32, 4)


def test_host_launch_arithmetic_equals_tritons():
    """The wrappers' plain-Python ``_cdiv`` and ``_pow2`` give what ``triton.cdiv`` and
    ``triton.next_power_of_2`` give (grids, tiles and padded widths depend on them)."""
    assert [tr._pow2(n) for n in range(0, 5000)] == [triton.next_power_of_2(n) for n in range(0, 5000)]
    assert [tr._pow2(n) for n in (2**31 - 1, 2**31, 2**31 + 1)] == [2**31, 2**31, 2**32]
    pairs = [(a, b) for a in (0, 1, 2, 15, 16, 17, 1000, 131071, 131072, 2**40 + 3) for b in (1, 2, 3, 16, 64, 127, 4096)]
    assert [tr._cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


def site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, on_dots=True, pass_two=False, with_dlse=True):
    """Phase one (``route_sites``) with pass one (and with ``pass_two`` pass two) of the site loop
    on tensor cores or not: errors of the outputs, lse and every gradient (sources, queries, gains;
    with an lse gradient unless ``with_dlse`` is False) against float64, whether the tensor-core
    kernel ran, and the outputs and gradients themselves."""
    monkeypatch.setattr(tr, "DOT_STATS", on_dots)
    monkeypatch.setattr(tr, "DOT_FWD", on_dots)
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)  # small widths here, 128 and up in training
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_MIN_SOURCES", 1)  # the tensor-core kernels over one and two sources too (not in training)
    monkeypatch.setattr(tr, "DOT_MAX_SOURCES_ONE_SITE", tr.DOT_MAX_SOURCES)  # and for one site (not by default)
    monkeypatch.setattr(tr, "DOT_MAX_HEAD_WIDTH", 256)
    monkeypatch.setattr(tr, "DOT_SOURCES", pass_two)
    ran = []
    decide = tr._stats_on_dots
    monkeypatch.setattr(tr, "_stats_on_dots", lambda *a: ran.append(decide(*a)) or ran[-1])
    g = torch.Generator().manual_seed(100 + n + sites + d)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    srcs = [(torch.randn(shape, generator=g) * (0.5 + i % 3)).to(DEVICE, dtype) for i in range(n)]
    queries = (2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(DEVICE)
    douts = [torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(sites)]
    dlse = torch.randn(sites, *shape[:-1], heads, generator=g, dtype=torch.float64).to(DEVICE)

    def run(impl, cast):
        leaves = [cast(x).requires_grad_() for x in (*srcs, queries, gains)]
        outs, lse = impl.route_sites(leaves[:n], leaves[n], leaves[n + 1], heads)
        loss = sum((o.double() * d_).sum() for o, d_ in zip(outs, douts))
        if with_dlse:
            loss = loss + (lse.double() * dlse).sum()
        return [*outs, lse, *torch.autograd.grad(loss, leaves)]

    with use_backend("triton"):
        got = run(tr, lambda x: x.detach().clone())
    ref = run(reference, lambda x: x.detach().double())
    return [rel_err(a, b) for a, b in zip(got, ref)], any(ran), got


DOT_CPU = [
    (1, 3, 4, 64, 37, torch.bfloat16), (9, 8, 8, 256, 19, torch.bfloat16), (17, 8, 4, 128, 23, torch.bfloat16),
    (33, 16, 2, 64, 5, torch.bfloat16), (2, 2, 1, 32, 30, torch.bfloat16), (9, 1, 8, 512, 7, torch.bfloat16),
    (41, 8, 1, 32, 9, torch.bfloat16), (9, 8, 1, 128, 5, torch.bfloat16),
    (70, 3, 2, 64, 9, torch.bfloat16),  # over 64 sources: a tile of 128 source rows
    (9, 6, 2, 96, 13, torch.bfloat16), (5, 3, 1, 160, 11, torch.bfloat16),  # head widths 48 and 160: two column tiles
    (5, 3, 2, 80, 11, torch.bfloat16),  # head width 40, padded to 64
]


# every case on the default tiles (several tokens per tile), the lighter ones on tiles of one token too
DOT_CPU_TILES = [(*c, 4096) for c in DOT_CPU] + [(*c, 256) for c in DOT_CPU if c[0] * c[1] <= 72]


@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,tile_elements", DOT_CPU_TILES,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}-{str(c[5]).split('.')[-1]}-tile{c[6]}" for c in DOT_CPU_TILES],
)
def test_pass_one_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, tile_elements):
    """Pass one of the site loop as products of (token, site) and (token, source) rows
    (``_route_bwd_stats_dot``): N = 1 .. 70 sources, 1 to 16 sites, head widths 16 to 160 (48 and 160
    as two column tiles, 40 padded), bf16
    (float32 factors entering as bf16x2 splits), token counts no tile divides, tiles of several tokens
    and of one: the outputs, lse and every gradient against float64 within the bf16 tolerance, the
    query and gain gradients as close as the vector kernel's, and the tensor-core kernel ran."""
    monkeypatch.setattr(tr, "DOT_TILE_ELEMENTS", tile_elements)  # several tokens per tile, or one (sites padded)
    errs, ran, _ = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype)
    assert ran, "the tensor-core kernel did not run"
    assert max(errs) < TOL[dtype], errs
    vector, ran, _ = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, on_dots=False)
    assert not ran
    # query and gain gradients (float32 outputs: the last two) no further from float64 than the
    # vector kernel's, up to the bf16x2 splits' 2^-17 per product
    for e, v in zip(errs[-2:], vector[-2:]):
        assert e <= 1.5 * v + 4e-5, (errs, vector)


def test_pass_one_on_tensor_cores_stores_what_the_vector_kernel_stores(monkeypatch):
    """What pass one hands to pass two, compared directly (the source gradients' bf16 tolerance
    would hide a small error in them): the scores, <dr, v> and D of the tensor-core kernel against
    the vector kernel's, with and without an lse gradient."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_SOURCES", False)
    kernel = tr._kernel
    seen = {}

    class Spy:  # the launch of pass two: its arguments 8 and 9 are D and the scores with <dr, v>
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["dsum"], seen["score_a"] = args[8].clone(), args[9].clone()
                return self.fn[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tr, "_kernel", lambda name, interpret: Spy(kernel(name, interpret)) if name == "bwd_sources" else kernel(name, interpret))
    for with_dlse in (True, False):
        runs = []
        for on_dots in (True, False):
            site_loop_on_tensor_cores_vs_float64(monkeypatch, 9, 6, 4, 64, 21, torch.bfloat16, on_dots=on_dots, with_dlse=with_dlse)
            runs.append(dict(seen))
        dots, vector = runs
        scores, a = (dots["score_a"][..., k] for k in (0, 1))
        assert rel_err(scores, vector["score_a"][..., 0]) < 1e-5, with_dlse  # bf16x2 weights: ~2^-17 of <w, v>
        assert rel_err(a, vector["score_a"][..., 1]) < 1e-6, with_dlse  # exact products, float32 sums
        assert rel_err(dots["dsum"], vector["dsum"]) < 1e-5, with_dlse


@pytest.mark.parametrize("pass_two", [False, True], ids=["pass-one", "both-passes"])
def test_site_loop_on_tensor_cores_is_deterministic(monkeypatch, pass_two):
    """The tensor-core kernels (no atomics; per-program partials summed in a fixed order) give
    bit-identical gradients in two runs, over a grid where programs stride over several tiles."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_SOURCES", pass_two)
    runs = [site_loop_on_tensor_cores_vs_float64(monkeypatch, 9, 3, 4, 64, 45, torch.bfloat16, pass_two=pass_two)[2] for _ in range(2)]
    assert tr._dot_tile(3, 9, 16)[2] * 2 < 45  # two programs (the interpreter's grid), several tiles each
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, computing with the inf
@pytest.mark.parametrize("pass_two", [False, True], ids=["pass-one", "both-passes"])
def test_site_loop_on_tensor_cores_keeps_a_non_finite_value_to_its_token(monkeypatch, pass_two):
    """An inf in one token of one source makes that token's gradients non-finite, as in the vector
    kernel, but not those of the other tokens sharing its tile (products across tokens are masked
    with where, not multiplied by a zero weight), with pass one or both passes on tensor cores."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_SOURCES", pass_two)
    g = torch.Generator().manual_seed(8)
    srcs = [torch.randn(16, 32, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    srcs[1][5, 3] = float("inf")
    leaves = [x.clone().requires_grad_() for x in srcs]
    queries, gains = (0.3 * torch.randn(2, 32, generator=g)).to(DEVICE), torch.ones(2, 32, device=DEVICE)
    monkeypatch.setattr(tr, "POISON_OUTPUTS", False)
    with use_backend("triton"):
        outs, _ = tr.route_sites(leaves, queries, gains, 2)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs), leaves)
    assert tr._dot_tile(2, 3, 16)[2] > 1  # several tokens per tile
    for grad in grads:
        others = torch.cat([grad[:5], grad[6:]])
        assert torch.isfinite(others).all()


def bf16_flips(x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the elements of two bf16 tensors that differ: rounding flips only between two
    computations of the same float32-accurate value (about 1% here), a quarter to a half of them
    where one has lost a bf16x2 split's low half."""
    return (x != y).double().mean().item()


class Launches(list):
    """Names of the kernels launched, in order; ``warps``: each launch's ``num_warps``; ``flags``: its
    keyword arguments (the constexpr flags and launch options)."""

    def __init__(self):
        super().__init__()
        self.warps: list = []
        self.flags: list = []

    def clear(self):
        super().clear()
        self.warps.clear()
        self.flags.clear()


def spy_launches(monkeypatch) -> Launches:
    """The kernels launched from now on (through ``tr._kernel``), once per launch on a grid (not
    for a compile that reads a kernel's registers, ``.warmup``)."""
    launched = Launches()
    kernel = tr._kernel

    class Launch:
        def __init__(self, name, interpret):
            self.name, self.kernel = name, kernel(name, interpret)

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def launch(*args, **kwargs):
                launched.append(self.name)
                launched.warps.append(kwargs.get("num_warps"))
                launched.flags.append(kwargs)
                return run(*args, **kwargs)

            return launch

        def __getattr__(self, attr):
            return getattr(self.kernel, attr)

    monkeypatch.setattr(tr, "_kernel", Launch)
    return launched


# the lighter pass-one cases, one site, and a head count that is not a power of two (width 32)
DOT_PASS_TWO = [(*c, True) for c in DOT_CPU[:6] + DOT_CPU[-4:]] + [(9, 3, 3, 96, 13, torch.bfloat16, True), (9, 4, 2, 64, 11, torch.bfloat16, False)]


@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,with_dlse", DOT_PASS_TWO,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}" + ("" if c[6] else "-no-dlse") for c in DOT_PASS_TWO],
)
def test_pass_two_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, with_dlse):
    """Both passes of the site loop on tensor cores (``DOT_SOURCES``: pass two recomputes the
    scores and sums the key norm's term t over the heads from pass one's shares): the pass-two
    kernel ran; outputs, lse and every gradient against float64 within the bf16 tolerance; the
    source gradients within rounding of the vector pass two's."""
    launched = spy_launches(monkeypatch)
    monkeypatch.setattr(tr, "DOT_SOURCES_PADDED", True)  # padded widths too (the kernel takes them)
    errs, ran, got = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, pass_two=True, with_dlse=with_dlse)
    assert ran and "bwd_sources_dot" in launched and "bwd_sources" not in launched, launched
    assert launched.count("bwd_sources_dot") == -(-n // tr.DOT_SOURCES_CHUNK), launched  # one launch per chunk of sources
    assert max(errs) < TOL[dtype], errs
    _, _, vector = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, with_dlse=with_dlse)
    for a, b in zip(got[sites + 1:sites + 1 + n], vector[sites + 1:sites + 1 + n]):
        assert bf16_flips(a, b) < 0.05, bf16_flips(a, b)


@pytest.mark.parametrize("heads,chunk", [(3, 64), (2, 64), (3, 2)], ids=["width32", "width48-two-tiles", "width32-chunks-of-2"])
def test_pass_two_on_tensor_cores_adds_into_sink_slots_and_only_there(monkeypatch, heads, chunk):
    """Pass two on tensor cores writing into a gradient sink: two passes over collected sources
    (the later one, over sources 0 and 2, runs its backward first, so the earlier one adds to
    slots 0 and 2 and writes the others), and source 1 also fed to a plain use (its slot's target
    and addend then differ); with three heads of width 32, two of width 48 (two column tiles), and
    pass two launched two sources at a time (``DOT_SOURCES_CHUNK``: chunk edges between the slots
    it adds to and those it writes). Every source gradient against float64, and within rounding of
    the vector pass two's."""
    from lit_mhar.kernels.sink import GradientSink

    monkeypatch.setattr(tr, "DOT_SOURCES_CHUNK", chunk)
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_MIN_SOURCES", 1)  # the tensor-core kernels over one and two sources too (not in training)
    launched = spy_launches(monkeypatch)
    d, tokens = 96, 13
    assert (tr._dot_lanes(d // heads)[1] > 0) == (heads == 2)
    g = torch.Generator().manual_seed(12)
    xs = [(torch.randn(tokens, d, generator=g) * (0.5 + i % 3)).to(DEVICE, torch.bfloat16) for i in range(5)]
    q1, g1 = (2.0 * (heads / d) ** 0.5 * torch.randn(3, d, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(3, d, generator=g)).to(DEVICE)
    q2, g2 = (2.0 * (heads / d) ** 0.5 * torch.randn(2, d, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEVICE)
    plain = torch.randn(tokens, d, generator=g, dtype=torch.float64).to(DEVICE)
    douts = [torch.randn(tokens, d, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(5)]

    def run(impl, cast, sink):
        leaves = [cast(x).requires_grad_() for x in xs]
        srcs = [sink.collect(x) for x in leaves] if sink is not None else leaves
        outs, _ = impl.route_sites(srcs, cast(q1), cast(g1), heads, grad_sink=sink)
        outs2, _ = impl.route_sites([srcs[0], srcs[2]], cast(q2), cast(g2), heads, grad_sink=sink)
        fed = sink.feed([srcs[1]])[0] if sink is not None else srcs[1]
        loss = sum((o.double() * d_).sum() for o, d_ in zip(outs + outs2, douts)) + (fed.double() * plain).sum()
        return torch.autograd.grad(loss, leaves)

    got = {}
    for both in (True, False):
        monkeypatch.setattr(tr, "DOT_SOURCES", both)
        launched.clear()
        with use_backend("triton"):
            got[both] = run(tr, lambda x: x.detach().clone(), GradientSink())
        assert launched.count("bwd_sources_dot") == (0 if not both else 3 + 1 if chunk == 2 else 2), launched  # 5 and 2 sources
    ref = run(reference, lambda x: x.detach().double(), None)
    for i, (a, b, r) in enumerate(zip(got[True], got[False], ref)):
        assert rel_err(a, r) < TOL[torch.bfloat16], (i, rel_err(a, r))
        assert bf16_flips(a, b) < 0.05, (i, bf16_flips(a, b))


def test_pass_two_on_tensor_cores_adds_into_the_gradient_sink(monkeypatch):
    """With a gradient sink, pass two on tensor cores adds each source's gradient to what the sink
    holds (``ACC``): a model with block routing gives the same gradients with both passes on
    tensor cores as with the vector kernels."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_MIN_SOURCES", 1)  # the tensor-core kernels over one and two sources too (not in training)
    launched = spy_launches(monkeypatch)
    model = tiny_model("attnres", 2, 2, n_layer=3).to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = {}
    for name, stats, sources in (("vector", False, False), ("both", True, True)):
        monkeypatch.setattr(tr, "DOT_STATS", stats)
        monkeypatch.setattr(tr, "DOT_SOURCES", sources)
        runs[name] = triton_loss_and_grads(model, idx)
        assert ("bwd_sources_dot" in launched) == sources and ("bwd_stats_dot" in launched) == stats, launched
        launched.clear()
    (loss_v, grads_v), (loss_d, grads_d) = runs["vector"], runs["both"]
    assert torch.equal(loss_v, loss_d)
    for name in grads_v:
        if grads_v[name].abs().max() < 1e-6:  # the first site sees one source: 0 up to rounding
            continue
        assert rel_err(grads_d[name], grads_v[name]) < 2e-2, name


# phase-one passes (two sites or more) of DOT_CPU, head widths 48 and 160 (two column tiles) and 40
# (padded) among them, at the tests'
# score spread and at thirty times it (where a shift of the softmax by another token's maximum would
# underflow)
DOT_FWD_CASES = [(*c, 1.0) for c in DOT_CPU if c[1] >= 2] + [(9, 8, 8, 256, 19, torch.bfloat16, 30.0), (17, 3, 1, 160, 11, torch.bfloat16, 30.0)]


def fwd_dot_kernel(d: int, heads: int, n: int = 1) -> str:
    """The tensor-core forward kernel a phase-one pass at width ``d`` over ``heads`` heads and ``n``
    sources launches: ``fwd_sites_mix`` (DOT_FWD_MIX) where a head's width is one power-of-two tile
    and the sources are at most DOT_MIX_MAX_SOURCES, else ``fwd_sites_dot``."""
    dhp, dt = tr._dot_lanes(d // heads)
    mix = tr.DOT_FWD_MIX and dt == 0 and dhp == d // heads and n <= tr.DOT_MIX_MAX_SOURCES
    return "fwd_sites_mix" if mix else "fwd_sites_dot"


@pytest.mark.parametrize("mix", [True, False], ids=["mix", "block-diagonal"])
@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,spread", DOT_FWD_CASES,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}-x{c[6]:g}" for c in DOT_FWD_CASES],
)
def test_phase_one_forward_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, spread, mix):
    """Phase one's forward on tensor cores (``_route_fwd_sites_dot``, and with ``mix``
    ``_route_fwd_sites_mix`` where the head width is one power-of-two tile): the kernel ran; every site's
    output, the lse and the saved key rstd against float64 (the outputs within the bf16 tolerance,
    lse and rstd as float32 values, up to the bf16x2 split of the weights); the outputs within
    rounding of the vector kernel's and as close to float64; queries at ``spread`` times the usual
    scale too."""
    monkeypatch.setattr(tr, "DOT_FWD_MIX", mix)
    monkeypatch.setattr(tr, "DOT_MIX_MAX_SOURCES", 1 << 30)  # the mixed kernel over any number of sources here
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_MIN_SOURCES", 1)  # the tensor-core kernels over one and two sources too (not in training)
    monkeypatch.setattr(tr, "DOT_MAX_HEAD_WIDTH", 256)
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(200 + n + sites + d)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    srcs = [(torch.randn(shape, generator=g) * (0.5 + i % 3)).to(DEVICE, dtype) for i in range(n)]
    queries = (spread * 2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(DEVICE)
    runs = {}
    for on_dots in (True, False):
        monkeypatch.setattr(tr, "DOT_FWD", on_dots)
        launched.clear()
        runs[on_dots] = tr._forward(srcs, queries, gains, heads, 1e-6, None, None, None, None, False, save_rstd=True)
        assert (fwd_dot_kernel(d, heads, n) in launched) == on_dots and ("fwd" in launched) != on_dots, launched
        if on_dots and n > tr.DOT_WIDE_SOURCES and fwd_dot_kernel(d, heads, n) == "fwd_sites_dot":  # a one-token tile of more than 64 sources: its own warps
            assert launched.warps == [tr.DOT_WARPS_ONE_TOKEN_WIDE] != [tr.DOT_WARPS_ONE_TOKEN["fwd_sites_dot"]], launched.warps
    got = runs[True]
    ref_outs, ref_lse = reference.route_sites([x.double() for x in srcs], queries.double(), gains.double(), heads)
    for o, r in zip(got[:sites], ref_outs):
        assert rel_err(o, r) < TOL[dtype]
    assert rel_err(got[sites], ref_lse) < 1e-5
    rstd64 = torch.stack([x.double().square().mean(-1).add(1e-6).rsqrt().flatten() for x in srcs])
    assert rel_err(got[sites + 2], rstd64) < 1e-6
    for o, v, r in zip(got[:sites], runs[False][:sites], ref_outs):
        assert rel_err(o, r) <= 1.1 * rel_err(v, r) + 1e-4, (rel_err(o, r), rel_err(v, r))  # as close to float64 as the vector kernel
        # at the usual spread, few rounding flips against the vector kernel (a lost low half of a
        # bf16x2 split shows as many); wide spreads flip more (the weights' split is exact to about
        # 2^-17 of the score, an absolute error in the exponent)
        assert spread > 1 or bf16_flips(o, v) < 0.05, bf16_flips(o, v)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, computing with the inf
@pytest.mark.parametrize("mix", [True, False], ids=["mix", "block-diagonal"])
@pytest.mark.parametrize("d,column", [(32, 3), (96, 40)], ids=["width16", "width48-two-tiles-inf-in-the-second"])
def test_phase_one_forward_on_tensor_cores_keeps_a_non_finite_value_to_its_token(monkeypatch, d, column, mix):
    """An inf in one token of one source makes that token's outputs non-finite, as on the vector
    kernel, and leaves the other tokens of its tile finite and equal to a run without the inf; at
    head width 48 (two column tiles) with the inf in the second; on either forward kernel."""
    monkeypatch.setattr(tr, "DOT_FWD_MIX", mix)
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "POISON_OUTPUTS", False)
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(9)
    srcs = [torch.randn(16, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    queries, gains = (0.3 * torch.randn(2, d, generator=g)).to(DEVICE), torch.ones(2, d, device=DEVICE)
    clean = tr._forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    srcs[1][5, column] = float("inf")
    outs = tr._forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    dhp, dt = tr._dot_lanes(d // 2)
    assert dt == 0 if d == 32 else (dt > 0 and column % (d // 2) >= dhp)  # at width 48, a column of the second tile
    tokens_per_tile = tr._mix_tile(2, 3)[3] if fwd_dot_kernel(d, 2, 3) == "fwd_sites_mix" else tr._dot_tile(2, 3, d // 2)[2]
    assert fwd_dot_kernel(d, 2, 3) in launched and tokens_per_tile > 5  # several tokens per tile
    for k in range(2):
        assert not torch.isfinite(outs[k][5]).all()
        others = torch.cat([outs[k][:5], outs[k][6:]])
        assert torch.equal(others, torch.cat([clean[k][:5], clean[k][6:]]))


@pytest.mark.parametrize("n", [3, 8, 9])
def test_phase_one_forward_mixes_over_at_most_eight_sources(monkeypatch, n):
    """With the package's settings, a phase-one forward at a head width of one power-of-two tile
    launches the mixed kernel over 3 to DOT_MIX_MAX_SOURCES (8) sources and the block-diagonal one
    over more, and both give the same outputs up to rounding."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(40 + n)
    srcs = [torch.randn(11, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(n)]
    queries, gains = (0.5 * torch.randn(4, 64, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(4, 64, generator=g)).to(DEVICE)
    outs = tr._forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    assert launched == (["fwd_sites_mix"] if n <= 8 else ["fwd_sites_dot"]), launched
    monkeypatch.setattr(tr, "DOT_FWD_MIX", not tr.DOT_FWD_MIX if n <= 8 else tr.DOT_FWD_MIX)
    monkeypatch.setattr(tr, "DOT_MIX_MAX_SOURCES", 8 if n <= 8 else n)
    launched.clear()
    other = tr._forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    assert launched == (["fwd_sites_dot"] if n <= 8 else ["fwd_sites_mix"]), launched
    for k in range(4):
        assert bf16_flips(outs[k], other[k]) < 0.05 and rel_err(outs[k], other[k]) < 1e-2
    torch.testing.assert_close(outs[4], other[4], rtol=1e-5, atol=1e-5)  # lse


@pytest.mark.parametrize("n", [1, 2, 3])
def test_phase_one_over_fewer_than_three_sources_launches_the_vector_kernels(monkeypatch, n):
    """With the package's DOT_MIN_SOURCES (3), a phase-one pass over one or two sources (full
    routing's first group, block routing's first two blocks) launches the vector kernels forward
    and backward, one over three sources the tensor-core ones (head widths lowered to the test's)."""
    monkeypatch.setattr(tr, "DOT_MIN_HEAD_WIDTH", 16)
    monkeypatch.setattr(tr, "DOT_FWD_MIN_HEAD_WIDTH", 16)
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(n)
    srcs = [torch.randn(9, 32, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(n)]
    queries = (0.3 * torch.randn(3, 32, generator=g)).to(DEVICE).requires_grad_()
    gains = torch.ones(3, 32, device=DEVICE, requires_grad=True)
    with use_backend("triton"):
        outs, lse = tr.route_sites(srcs, queries, gains, 2)
        torch.autograd.grad([*outs, lse], [*srcs, queries, gains], [torch.ones_like(o) for o in outs] + [torch.ones_like(lse)])
    dots = n >= tr.DOT_MIN_SOURCES
    assert (fwd_dot_kernel(32, 2, n) in launched) == dots and ("fwd" in launched) != dots, launched
    assert ("bwd_stats_dot" in launched) == dots and ("bwd_stats" in launched) != dots, launched


def test_pass_one_on_tensor_cores_only_where_it_applies(monkeypatch):
    """The tensor-core kernel takes the replacement form with the key rstd saved, at most 16 sites and
    3 to 128 sources (a single site none: ``DOT_MAX_SOURCES_ONE_SITE``), a head width from 128 to 160 (DOT_MIN_HEAD_WIDTH and DOT_MAX_HEAD_WIDTH; 64 was slower
    in training for block routing's few sites) or from 64 with 8 sites or more (DOT_MANY_SITES), bf16; anything else keeps the vector kernel. Pass two takes widths held without
    padding only (a power of two, or two column tiles: ``_dot_lanes``). Its tiles hold at least 16 rows of each
    operand, about DOT_TILE_ELEMENTS elements of the padded head width and at most DOT_MAX_ROWS rows."""
    ok = dict(n_sites=8, n_src=41, d=1024, heads=8, gate=None, has_rstd=True, dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    assert tr._stats_on_dots(**ok)
    for change in (
        dict(gate=torch.ones(1)), dict(has_rstd=False), dict(n_sites=17), dict(n_src=129), dict(heads=1), dict(d=96, heads=8), dict(d=512, heads=8, n_sites=7),
        dict(d=2048), dict(d=64, heads=8), dict(dtype=torch.float16, grad_dtype=torch.float16),
        dict(dtype=torch.float32, grad_dtype=torch.float32), dict(grad_dtype=torch.float32),
    ):
        assert not tr._stats_on_dots(**{**ok, **change}), change
    assert [tr._dot_width(w) for w in (8, 16, 48, 128, 160)] == [16, 16, 64, 128, 256]
    # the forward: phase-one passes of two sites or more, without a prior, stream, norm or stored scores
    fwd = dict(n_sites=8, n_src=41, d=1024, heads=8, stream=None, prior_out=None, store_scores=False, norm_weight=None, dtype=torch.bfloat16)
    assert tr._fwd_on_dots(**fwd)
    # tiles of up to 128 sources for passes of several sites (a single site: below)
    assert tr._stats_on_dots(**{**ok, "n_src": 128}) and tr._fwd_on_dots(**{**fwd, "n_src": 128})
    # head width 64 (100m) for passes of DOT_MANY_SITES = 8 sites or more (full routing's groups: MHAR's
    # 12 or 13, Delta's 8 or 9), not fewer (block routing's blocks); without DOT_MANY_SITES_MIN_HEAD_WIDTH, none
    assert (tr.DOT_MANY_SITES, tr.DOT_MANY_SITES_MIN_HEAD_WIDTH) == (8, 64)
    assert [tr._stats_on_dots(**{**ok, "d": 512, "n_sites": s}) for s in (3, 4, 6, 7, 8, 9, 12, 13, 16)] == [False] * 4 + [True] * 5
    assert not tr._stats_on_dots(**{**ok, "d": 256, "n_sites": 12})  # head width 32
    monkeypatch.setattr(tr, "DOT_MANY_SITES_MIN_HEAD_WIDTH", 128)
    assert not tr._stats_on_dots(**{**ok, "d": 512, "n_sites": 12}) and tr._stats_on_dots(**{**ok, "n_sites": 3})
    monkeypatch.setattr(tr, "DOT_MANY_SITES_MIN_HEAD_WIDTH", 64)
    # a single site on the vector kernels (DOT_MAX_SOURCES_ONE_SITE = 0), at any count of sources
    assert tr.DOT_MAX_SOURCES_ONE_SITE == 0
    for n in (3, 9, 49, 64, 73):
        assert not tr._stats_on_dots(**{**ok, "n_src": n, "n_sites": 1}) and tr._stats_on_dots(**{**ok, "n_src": n, "n_sites": 2}), n
    monkeypatch.setattr(tr, "DOT_MAX_SOURCES_ONE_SITE", 64)
    assert tr._stats_on_dots(**{**ok, "n_src": 64, "n_sites": 1}) and not tr._stats_on_dots(**{**ok, "n_src": 65, "n_sites": 1})
    monkeypatch.setattr(tr, "DOT_MAX_SOURCES_ONE_SITE", 0)
    # passes over fewer than DOT_MIN_SOURCES = 3 sources (full routing's first group, block routing's
    # first two blocks) on the vector kernels, forward and backward
    assert tr.DOT_MIN_SOURCES == 3
    for n in (1, 2):
        assert not tr._stats_on_dots(**{**ok, "n_src": n}) and not tr._fwd_on_dots(**{**fwd, "n_src": n}), n
    assert tr._stats_on_dots(**{**ok, "n_src": 3}) and tr._fwd_on_dots(**{**fwd, "n_src": 3})
    # one-token tiles of more than 64 sources on DOT_WARPS_ONE_TOKEN_WIDE warps
    assert [tr._dot_launch("fwd_sites_dot", bm, bn)["num_warps"] for bm, bn in ((1, 64), (1, 128), (2, 64))] == [2, 4, tr.DOT_WARPS]
    for change in (
        dict(n_sites=1), dict(n_sites=17), dict(n_src=0), dict(n_src=129), dict(stream=torch.ones(1)), dict(prior_out=torch.ones(1)),
        dict(store_scores=True), dict(norm_weight=torch.ones(1)), dict(d=512), dict(d=2048), dict(dtype=torch.float32),
    ):
        assert not tr._fwd_on_dots(**{**fwd, **change}), change
    # 1b's head width 160, two column tiles of 128 and 32: the forward and both passes; a width that
    # only pads (40 = 32 + 8, under the 16 columns of a product) not pass two, nor 160 padded
    assert tr._stats_on_dots(**{**ok, "d": 1280}) and tr._fwd_on_dots(**{**fwd, "d": 1280})
    assert [tr._dot_lanes(w) for w in (16, 40, 48, 96, 112, 128, 160)] == [(16, 0), (64, 0), (32, 16), (64, 32), (128, 0), (128, 0), (128, 32)]
    assert tr._sources_on_dots(1024, 8, 8) and tr._sources_on_dots(1280, 8, 8) and tr._sources_on_dots(384, 8, 2) and not tr._sources_on_dots(320, 8, 8)
    # one site: two column tiles keep pass two on the vector kernel, a power of two does not
    assert tr._sources_on_dots(1024, 8, 1) and not tr._sources_on_dots(1280, 8, 1)
    monkeypatch.setattr(tr, "DOT_SPLIT_WIDTH", False)
    assert tr._dot_lanes(160) == (256, 0) and not tr._sources_on_dots(1280, 8, 8) and not tr._sources_on_dots(384, 8, 8)
    assert not tr._fwd_on_dots(**{**fwd, "n_sites": tr.DOT_FWD_MIN_SITES - 1})
    for sites, n, width in itertools.product((1, 3, 8, 16), (1, 2, 9, 41, 64, 65, 73, 128), (16, 48, 64, 128, 160)):
        bs, bn, bm = tr._dot_tile(sites, n, width)
        assert bs >= sites and bn >= n and bm * bs >= 16 and bm * bn >= 16, (sites, n, bs, bn, bm)
        one_token = max(16, triton.next_power_of_2(sites), triton.next_power_of_2(n))
        rows = min(tr.DOT_TILE_ELEMENTS // tr._dot_width(width), tr.DOT_MAX_ROWS)
        assert bm * max(bs, bn) <= max(rows, one_token), (sites, n, width, bm, bs, bn)


def test_saved_rstd_only_when_a_backward_will_run():
    """No key rstd is written under no_grad or when no input requires a gradient."""
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(7, 32, generator=g).to(DEVICE) for _ in range(3)]
    queries, gains = torch.randn(2, 32, generator=g).to(DEVICE), torch.ones(2, 32, device=DEVICE)
    with use_backend("triton"):
        assert tr._route(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)[4].numel() == 0
        q = queries.clone().requires_grad_()
        assert tr._route(srcs, q, gains, 2, 1e-6, None, None, None, None, False)[4].shape == (3, 7)
        with torch.no_grad():
            assert tr._route(srcs, q, gains, 2, 1e-6, None, None, None, None, False)[4].numel() == 0


def test_site_groups_shrink_to_fit_wide_widths(monkeypatch):
    """A width whose padded lanes times the site group exceed the tile budget routes fewer sites per
    program instead of refusing: d = 5120 (8192 lanes at H = 8) with groups of 8 asked for."""
    monkeypatch.setattr(tr, "FWD_SITES", 8)
    monkeypatch.setattr(tr, "STATS_SITES", 8)
    assert tr._group_sites(8, 8, 5120, 8) == 1 and tr._group_sites(8, 8, 1024, 8) == 8
    g = torch.Generator().manual_seed(6)
    srcs = [torch.randn(3, 5120, generator=g).to(DEVICE) for _ in range(2)]
    queries = (0.05 * torch.randn(2, 5120, generator=g)).to(DEVICE)
    gains = torch.ones(2, 5120, device=DEVICE)
    leaves = [x.clone().requires_grad_() for x in (*srcs, queries)]
    with use_backend("triton"):
        outs, lse = tr.route_sites(leaves[:2], leaves[2], gains, 8)
    grads = torch.autograd.grad(sum(o.sum() for o in outs), leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (*srcs, queries)]
    ref, ref_lse = reference.route_sites(ref_leaves[:2], ref_leaves[2], gains.double(), 8)
    ref_grads = torch.autograd.grad(sum(o.sum() for o in ref), ref_leaves)
    errs = [rel_err(a, b) for a, b in zip([*outs, lse, *grads], [*ref, ref_lse, *ref_grads])]
    assert max(errs) < TOL[torch.float32], errs


@pytest.mark.parametrize("eager_function", [True, False])
def test_double_backward_is_refused(monkeypatch, eager_function):
    """The kernels' gradients are not differentiable again: asking for a second derivative raises
    on both autograd paths instead of returning a wrong one."""
    monkeypatch.setattr(tr, "EAGER_FUNCTION", eager_function)
    g = torch.Generator().manual_seed(8)
    srcs = [torch.randn(5, 32, generator=g).to(DEVICE).requires_grad_() for _ in range(3)]
    queries, gains = torch.randn(2, 32, generator=g).to(DEVICE), torch.ones(2, 32, device=DEVICE).requires_grad_()
    with use_backend("triton"):
        outs, _ = tr.route_sites(srcs, queries, gains, 2)
    first = torch.autograd.grad(sum(o.square().sum() for o in outs), [*srcs, gains], create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(sum(x.sum() for x in first), [*srcs, gains])


@pytest.mark.parametrize("additive", [False, True], ids=["replace", "additive"])
def test_eager_function_and_custom_op_give_identical_results(monkeypatch, additive):
    """Eager calls run the op's autograd through a torch.autograd.Function (``EAGER_FUNCTION``),
    torch.compile through the custom op's registered autograd: same kernels, so the same bits, for
    phase one, a merge with a prior (and the additive form's stream and gate) and their gradients."""
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(2, 19, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]
    partial = torch.randn(2, 19, 64, generator=g).to(DEVICE, torch.bfloat16)
    queries, gains = (0.5 * torch.randn(2, 64, generator=g)).to(DEVICE), (1 + 0.2 * torch.randn(2, 64, generator=g)).to(DEVICE)
    stream = torch.randn(2, 19, 64, generator=g).to(DEVICE) if additive else None
    gate = torch.randn(64, generator=g).to(DEVICE) if additive else None
    dout = torch.randn(2, 19, 64, generator=g).to(DEVICE)

    def run(eager_function):
        monkeypatch.setattr(tr, "EAGER_FUNCTION", eager_function)
        leaves = [x.detach().clone().requires_grad_() for x in (*srcs, partial, queries, gains)]
        extra = [x.detach().clone().requires_grad_() for x in (stream, gate)] if additive else [None, None]
        with use_backend("triton"):
            outs, lse = tr.route_sites(leaves[:4], leaves[5], leaves[6], 2)
            merged = tr.merge_route([leaves[4]], leaves[5][1], leaves[6][1], 2, outs[1], lse[1], *extra)
        loss = (merged.float() * dout).sum() + outs[0].float().square().sum()
        grads = torch.autograd.grad(loss, leaves + [x for x in extra if x is not None])
        return [outs[0], merged, *grads]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def check_merge_route_norm(n, heads, d, tokens, dtype, additive=False, device=DEVICE, seed=0):
    """merge_route_norm on the kernels against the float64 reference: output and the gradient of
    every input (sources, query, gain, prior, its lse, the norm weight; stream and gate)."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    sources = [(torch.randn(shape, generator=g) * (0.5 + i)).to(device, dtype) for i in range(n)]
    prior = torch.randn(shape, generator=g).to(device, dtype)
    prior_lse = (torch.randn((*shape[:-1], heads), generator=g) + 1).to(device)
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device)
    extra = (torch.randn(shape, generator=g).to(device), torch.randn(d, generator=g).to(device)) if additive else ()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    leaves = [x.detach().requires_grad_() for x in (*sources, query, gain, prior, prior_lse, weight, *extra)]

    def call(fn, xs):
        return fn(xs[:n], xs[n], xs[n + 1], heads, xs[n + 2], xs[n + 3], xs[n + 4], 1e-5, *xs[n + 5:])

    y = call(tr.merge_route_norm, leaves)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True, materialize_grads=True)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref = call(reference.merge_route_norm, leaves64)
    ref_grads = torch.autograd.grad(ref, leaves64, dy, allow_unused=True, materialize_grads=True)
    assert y.dtype == dtype and rel_err(y, ref) < TOL[dtype]
    names = [f"source{i}" for i in range(n)] + ["query", "gain", "prior", "prior_lse", "norm_weight"] + (["stream", "gate"] if additive else [])
    for name, x, g_, r in zip(names, leaves, grads, ref_grads):
        assert g_.dtype == x.dtype, name
        if not r.any():  # no newer source: a softmax over the prior alone, constant; exact gradient 0
            assert n == 0 and name in ("query", "gain", "prior_lse"), name
            if name == "prior_lse":
                # p_alpha (<dr, prior>_h - D_h) with p_alpha = 1: two float32 sums over the head's
                # d/H products dr * prior that differ only in rounding, so within 2 (d/H) 2^-24 of
                # the sum of their magnitudes (dr is the reference's prior gradient here)
                k = d // heads
                terms = (ref_grads[n + 2] * leaves64[n + 2]).abs().reshape(*shape[:-1], heads, k).sum(-1)
                assert (g_.double().abs() <= 2 * k * 2.0**-24 * terms).all(), (g_.abs().max().item(), terms.max().item())
            else:  # no source, no score: nothing is summed
                assert g_.abs().max() == 0, name
            continue
        err = rel_err(g_, r)
        assert err < TOL[dtype], f"d{name}: relative error {err:.2e}"


# no newer source (a group's first site), one, several; split (20 = 16 + 4, 12 = 8 + 4) and padded
# (1000 / 4 = 250) head widths; token counts that are not multiples of the tile, one spanning several
MERGE_NORM_CPU = [
    (0, 4, 64, 5, torch.float32, False),
    (1, 1, 1000, 9, torch.float32, False),
    (2, 2, 96, 37, torch.bfloat16, False),
    (3, 8, 160, 70, torch.float32, False),
    (2, 4, 48, 131, torch.float32, False),
    (2, 4, 1000, 3, torch.bfloat16, False),
    (0, 2, 64, 7, torch.float32, True),
    (2, 8, 160, 37, torch.bfloat16, True),
    (1, 4, 48, 70, torch.float32, True),
    (3, 2, 96, 37, torch.bfloat16, True),  # the additive form at and above SAVE_ROUTED_MIN_SOURCES (two passes by default)
    (4, 4, 1000, 9, torch.float32, True),
]


def merge_norm_id(n, h, d, t, dt, add):
    return f"N{n}-H{h}-d{d}-T{t}-{str(dt)[6:]}-{'additive' if add else 'replace'}"


@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive", MERGE_NORM_CPU, ids=[merge_norm_id(*c) for c in MERGE_NORM_CPU])
def test_merge_route_norm_matches_float64_reference(n, heads, d, tokens, dtype, additive):
    check_merge_route_norm(n, heads, d, tokens, dtype, additive)


ONE_SOURCE_CASES = [
    (1, 64, 37, torch.bfloat16, False, False), (8, 256, 19, torch.bfloat16, False, True), (2, 128, 70, torch.float32, False, True),
    (4, 128, 9, torch.float32, True, False), (2, 64, 33, torch.bfloat16, True, True), (4, 1000, 5, torch.float32, False, False),
    (2, 64, 301, torch.bfloat16, False, True),  # tiles of 16 tokens here: each program takes several, loading the next during one
]


@pytest.mark.parametrize(
    "heads,d,tokens,dtype,additive,sink", ONE_SOURCE_CASES,
    ids=[f"H{c[0]}-d{c[1]}-T{c[2]}-{str(c[3])[6:]}-{'additive' if c[4] else 'replace'}{'-sink' if c[5] else ''}" for c in ONE_SOURCE_CASES],
)
def test_merge_over_one_source_reuses_pass_one_with_identical_results(monkeypatch, heads, d, tokens, dtype, additive, sink):
    """A fused-norm merge over one source (block routing's merges over the running sum) runs the
    two-pass backward with ONE (pass two reuses pass one's source, rstd, scores and weights), in the
    replacement form with TILE_PF too (each program loads its next tile's inputs during this one),
    and gives bit-identical outputs and gradients to ONE alone and to the general loop
    (ONE_SOURCE_MERGE off), with and without a gradient sink; within the bf16 / float32 tolerance
    of float64 (the sink's sums too)."""
    monkeypatch.setattr(tr, "INTERPRET_ROWS", 16)
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(d + tokens)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    source = torch.randn(shape, generator=g).to(DEVICE, dtype)
    prior = torch.randn(shape, generator=g).to(DEVICE, dtype)
    prior_lse = (torch.randn((*shape[:-1], heads), generator=g) + 1).to(DEVICE)
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(DEVICE)
    gain, weight = (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEVICE).unbind(0)
    extra = (torch.randn(shape, generator=g).to(DEVICE), torch.randn(d, generator=g).to(DEVICE)) if additive else ()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE)

    def run(impl, double=False):
        xs = [x.detach().double() if double else x.detach() for x in (source, query, gain, prior, prior_lse, weight, *extra)]
        xs = [x.requires_grad_() for x in xs]
        if sink:
            s_ = GradientSink()
            src = s_.collect(xs[0])
            y = impl([src], xs[1], xs[2], heads, xs[3], xs[4], xs[5], 1e-5, *xs[6:], grad_sink=s_)
        else:
            y = impl([xs[0]], xs[1], xs[2], heads, xs[3], xs[4], xs[5], 1e-5, *xs[6:])
        return [y, *torch.autograd.grad(y, xs, dy.to(y.dtype), allow_unused=True, materialize_grads=True)]

    runs = {}
    for one, prefetch in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(tr, "ONE_SOURCE_MERGE", one)
        monkeypatch.setattr(tr, "TILE_PREFETCH", prefetch)
        launched.clear()
        runs[one, prefetch] = run(tr.merge_route_norm)
        (bwd,) = [f for name, f in zip(launched, launched.flags) if name == "bwd"]
        assert bwd["ONE"] == one and bwd["TILE_PF"] == (one and prefetch and not additive), bwd
    for other in ((True, False), (False, True)):
        for a, b in zip(runs[True, True], runs[other]):
            assert torch.equal(a, b), other
    ref = run(reference.merge_route_norm, double=True)
    for a, r in zip(runs[True, True], ref):
        if r.any():
            assert rel_err(a, r) < TOL[dtype]


MERGE_NORM_GPU = [
    (n, h, d, 1037, dt, add)
    for n, h, d, dt, add in itertools.product((0, 1, 2, 7), (1, 2, 8), (64, 96, 1000, 1024, 1280), (torch.float32, torch.bfloat16), (False, True))
    if d % h == 0
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive", MERGE_NORM_GPU, ids=[merge_norm_id(*c) for c in MERGE_NORM_GPU])
def test_merge_route_norm_matches_float64_reference_full_grid(n, heads, d, tokens, dtype, additive):
    check_merge_route_norm(n, heads, d, tokens, dtype, additive)


def check_route_norm(n, heads, d, tokens, dtype, device=DEVICE, seed=0, sink=False):
    """route_norm (one site fused with the norm, no prior) on the kernels against the float64
    reference: output and the gradient of every input (sources, query, gain, the norm weight); with
    ``sink`` the sources' gradients summed in a GradientSink, as two-phase routing's first group does."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    sources = [(torch.randn(shape, generator=g) * (0.5 + i)).to(device, dtype) for i in range(n)]
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    leaves = [x.detach().requires_grad_() for x in (*sources, query, gain, weight)]

    def call(fn, xs):
        srcs = xs[:n]
        if not sink:
            return fn(srcs, xs[n], xs[n + 1], heads, xs[n + 2], 1e-5)
        s_ = GradientSink()
        collected = [s_.collect(x) for x in srcs]
        return fn(collected, xs[n], xs[n + 1], heads, xs[n + 2], 1e-5, grad_sink=s_)

    y = call(tr.route_norm, leaves)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True, materialize_grads=True)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref = call(reference.route_norm, leaves64)
    ref_grads = torch.autograd.grad(ref, leaves64, dy, allow_unused=True, materialize_grads=True)
    assert y.dtype == dtype and rel_err(y, ref) < TOL[dtype]
    names = [f"source{i}" for i in range(n)] + ["query", "gain", "norm_weight"]
    for name, x, g_, r in zip(names, leaves, grads, ref_grads):
        assert g_.dtype == x.dtype, name
        if n == 1 and name in ("query", "gain"):  # a softmax over one source is 1: exact gradient 0
            # the kernel's is float32 rounding: per token and head ds = alpha <dr, v>_h - <dr, r>_h,
            # two sums of the head's k products dr * v (r = v, alpha = 1 up to rounding), within
            # 16 k 2^-24 of the sum T of their magnitudes; dq = sum_tokens ds rstd v g (dg: q for g)
            k, v64, dr = d // heads, leaves64[0].detach(), ref_grads[0]  # one source: its gradient is dr
            t_sum = (dr * v64).abs().unflatten(-1, (heads, k)).sum(-1).repeat_interleave(k, -1)
            per = (t_sum * torch.rsqrt(v64.pow(2).mean(-1, keepdim=True) + 1e-6) * v64.abs()).reshape(-1, d).sum(0)
            bound = 16 * k * 2.0**-24 * per * (leaves64[n + 1] if name == "query" else leaves64[n]).detach().abs()
            assert (g_.double().abs() <= bound).all(), (name, g_.abs().max().item(), bound.max().item())
            continue
        err = rel_err(g_, r)
        assert err < TOL[dtype], f"d{name}: relative error {err:.2e}"


# one source (the first site of a model), two, several, past SITE_LOOP_MIN_SOURCES (the backward
# must stay on the two-pass kernel, which alone has the norm); split and padded head widths; token
# counts that are not multiples of the tile
ROUTE_NORM_CPU = [
    (1, 4, 64, 5, torch.float32, False),
    (2, 2, 96, 37, torch.bfloat16, True),
    (3, 8, 160, 70, torch.float32, False),
    (2, 1, 1000, 9, torch.float32, True),
    (9, 4, 48, 131, torch.bfloat16, True),
    (13, 2, 96, 3, torch.float32, False),
]


@pytest.mark.parametrize("n,heads,d,tokens,dtype,sink", ROUTE_NORM_CPU, ids=[merge_norm_id(*c[:5], False) + ("-sink" if c[5] else "") for c in ROUTE_NORM_CPU])
def test_route_norm_matches_float64_reference(n, heads, d, tokens, dtype, sink):
    check_route_norm(n, heads, d, tokens, dtype, sink=sink)


ROUTE_NORM_GPU = [
    (n, h, d, 1037, dt, sink)
    for n, h, d, dt, sink in itertools.product((1, 2, 9, 33), (1, 2, 8, 16), (64, 96, 1000, 1024, 1280), (torch.float32, torch.bfloat16), (False, True))
    if d % h == 0
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,heads,d,tokens,dtype,sink", ROUTE_NORM_GPU, ids=[merge_norm_id(*c[:5], False) + ("-sink" if c[5] else "") for c in ROUTE_NORM_GPU])
def test_route_norm_matches_float64_reference_full_grid(n, heads, d, tokens, dtype, sink):
    check_route_norm(n, heads, d, tokens, dtype, sink=sink)


@pytest.mark.parametrize("case", [(1, 2, 96, 37, torch.bfloat16, False), (3, 8, 160, 70, torch.float32, False), (2, 8, 160, 37, torch.bfloat16, True)],
                         ids=["N1-H2-d96-bf16", "N3-H8-d160-fp32", "N2-H8-d160-bf16-additive"])
def test_merges_with_saved_key_rstd_match_float64_reference(monkeypatch, case):
    """With SAVE_RSTD_MERGES the merges' forward saves each source's key rstd and the two-pass
    backward loads it (HAS_RSTD): output and every gradient still match float64, for merges with a
    prior (both forms) and for route_norm; and the backward is asked for the saved rstd."""
    monkeypatch.setattr(tr, "SAVE_RSTD_MERGES", True)
    seen = []
    original = tr._backward
    monkeypatch.setattr(tr, "_backward", lambda *a, **k: seen.append(a[11] is not None and a[11].numel() > 0) or original(*a, **k))
    check_merge_route_norm(*case)
    n, heads, d, tokens, dtype, additive = case
    if not additive:
        check_route_norm(n, heads, d, tokens, dtype, sink=True)
    assert seen and all(seen), seen


def test_route_norm_refuses_bad_input_before_any_work():
    """route_norm's errors name the bad argument, on either path, before a kernel runs."""
    x = [torch.randn(4, 8)]
    q, g, w = torch.zeros(8), torch.ones(8), torch.ones(8)
    for fn in (tr.route_norm, reference.route_norm):
        with pytest.raises(ValueError, match="sources is empty"):
            fn([], q, g, 2, w, 1e-5)
        with pytest.raises(ValueError, match="norm_weight must be a \\(8,\\) tensor"):
            fn(x, q, g, 2, torch.ones(4), 1e-5)
        with pytest.raises(ValueError, match="norm_eps=0"):
            fn(x, q, g, 2, w, 0)
        with pytest.raises(ValueError, match="heads=3"):
            fn(x, q, g, 3, w, 1e-5)


def merge_norm_side_inputs(g, tokens, d, heads, dtype):
    """Random prior ``[tokens, d]``, its lse ``[tokens, heads]``, query, gain, norm weight and gate
    ``[d]``, and an output gradient ``[tokens, d]`` for merge_route_norm."""
    prior = torch.randn((tokens, d), generator=g).to(DEVICE, dtype)
    prior_lse = torch.randn((tokens, heads), generator=g).to(DEVICE)
    query, gain, weight, gate = (torch.randn(d, generator=g).to(DEVICE) for _ in range(4))
    return prior, prior_lse, query, gain, weight, gate, torch.randn((tokens, d), generator=g).to(DEVICE, dtype)


# (sources, heads, d, tokens, dtype, form): below SAVE_ROUTED_MIN_SOURCES (the prior kept, two
# passes), at and above it, a split head width (96 = 64 + 32 lanes at H = 1; 48 = 32 + 16) and a
# padded one (1000 / 4); the additive form with its stream saved, or replayed from its start
SAVED_ROUTED_CASES = [
    (1, 4, 64, 37, torch.float32, "replace"), (2, 4, 64, 37, torch.float32, "replace"), (5, 1, 96, 70, torch.bfloat16, "replace"),
    (3, 4, 1000, 9, torch.bfloat16, "replace"), (2, 4, 64, 37, torch.float32, "additive"), (3, 2, 96, 70, torch.bfloat16, "additive"),
    (4, 4, 1000, 9, torch.float32, "additive-replayed"), (5, 4, 48, 37, torch.bfloat16, "additive-replayed"),
]


@pytest.mark.parametrize(
    "n,heads,d,tokens,dtype,form", SAVED_ROUTED_CASES,
    ids=[f"N{c[0]}-H{c[1]}-d{c[2]}-T{c[3]}-{str(c[4])[6:]}-{c[5]}" for c in SAVED_ROUTED_CASES],
)
def test_merge_route_norm_saves_its_routed_value_in_float32_instead_of_the_prior(monkeypatch, n, heads, d, tokens, dtype, form):
    """A fused merge over at least SAVE_ROUTED_MIN_SOURCES sources keeps the routed value r
    (float32; the norm's input in the replacement form, stream + gate * r its input in the additive
    form) for its one-pass backward and not the prior, which the caller may then free; below that
    it keeps the prior. The output is bit-identical to the two-pass backward's forward, and every
    gradient equals the two-pass one to float32 rounding (r unrounded: the prior's lse gradient
    from D - sum_i alpha_i <dr, v_i>_h - p_alpha D). The additive form's stream given as its start
    (``stream_start``) is rebuilt by adding the sources in the one pass too (the additive form saves
    r with ``SAVE_ROUTED_ADDITIVE``, off by default)."""
    if form != "replace":
        assert not tr.SAVE_ROUTED_ADDITIVE
        monkeypatch.setattr(tr, "SAVE_ROUTED_ADDITIVE", True)
    g = torch.Generator().manual_seed(n + d)
    shape = (tokens, d)
    sources = [(torch.randn(shape, generator=g) * (0.5 + i)).to(DEVICE, dtype) for i in range(n)]
    prior, prior_lse, query, gain, weight, gate, dy = merge_norm_side_inputs(g, tokens, d, heads, dtype)
    query = query * (heads / d) ** 0.5  # scores of order one: no source's weight vanishes
    additive, replayed = form != "replace", form == "additive-replayed"
    start = (4 * torch.randn(shape, generator=g)).to(DEVICE)
    stream = start
    for s_ in sources:
        stream = stream + s_
    results = []
    for save in (False, True):
        monkeypatch.setattr(tr, "SAVE_ROUTED", save)
        extra = (stream, gate) if additive else ()
        leaves = [x.detach().clone().requires_grad_() for x in (*sources, query, gain, prior, prior_lse, weight, *extra)]
        kw = dict(stream=leaves[n + 5], gate=leaves[n + 6], stream_start=start if replayed else None) if additive else {}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = tr.merge_route_norm(leaves[:n], leaves[n], leaves[n + 1], heads, leaves[n + 2], leaves[n + 3], leaves[n + 4], 1e-5, **kw)
        keeps_r = save and n >= tr.SAVE_ROUTED_MIN_SOURCES
        assert any(t is leaves[n + 2] for t in saved) != keeps_r
        routed = [
            t for t in saved
            if t.shape == prior.shape and t.dtype == torch.float32 and not any(t is x for x in (*leaves, start))
        ]
        assert len(routed) == keeps_r
        if additive:  # the stream kept as given, or its start
            assert any(t is (start if replayed else leaves[n + 5]) for t in saved)
        if keeps_r:  # the norm's input: y is its RMSNorm times the weight
            x = stream.float() + gate.float() * routed[0] if additive else routed[0]
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)  # (y rounded to bf16)
            torch.testing.assert_close(torch.nn.functional.rms_norm(x, (d,), weight.float(), 1e-5), y.float(), **tol)
        results.append([y, *torch.autograd.grad(y, leaves, dy)])
    (y0, *g0), (y1, *g1) = results
    assert torch.equal(y0, y1)
    names = [f"source{i}" for i in range(n)] + ["query", "gain", "prior", "prior_lse", "norm_weight"] + (["stream", "gate"] if additive else [])
    for name, a, b in zip(names, g1, g0):
        assert rel_err(a, b) < (1e-5 if dtype == torch.float32 else 1e-2), name


def test_additive_merge_saves_no_routed_value_where_its_running_sum_is_rebuilt(monkeypatch):
    """Block routing's fused merge rebuilt from a block's outputs (``block_outputs``) keeps them
    and its prior, never a routed value r (its backward's first pass rebuilds the running sum),
    even with ``SAVE_ROUTED_ADDITIVE``; without it, no additive merge saves r."""
    monkeypatch.setattr(tr, "SAVE_ROUTED_ADDITIVE", True)
    g = torch.Generator().manual_seed(5)
    outputs = [torch.randn(9, 32, generator=g).to(DEVICE) for _ in range(4)]
    running = outputs[0]
    for o in outputs[1:]:
        running = running + o
    start = torch.randn(9, 32, generator=g).to(DEVICE)
    stream = start + sum(outputs)
    prior, prior_lse, query, gain, weight, gate, _ = merge_norm_side_inputs(g, 9, 32, 4, torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in (query, prior, weight, gate)]
    assert not tr._saves_routed([running] * 3, leaves[0], gain, stream, leaves[1], prior_lse, leaves[2], block_outputs=outputs)
    assert tr._saves_routed([running] * 3, leaves[0], gain, stream, leaves[1], prior_lse, leaves[2])
    monkeypatch.setattr(tr, "SAVE_ROUTED_ADDITIVE", False)
    assert not tr._saves_routed([running] * 3, leaves[0], gain, stream, leaves[1], prior_lse, leaves[2])
    assert tr._saves_routed([running] * 3, leaves[0], gain, None, leaves[1], prior_lse, leaves[2])
    monkeypatch.setattr(tr, "SAVE_ROUTED_ADDITIVE", True)
    monkeypatch.setattr(tr, "SAVE_ROUTED_MIN_SOURCES", 1)  # the one running sum would qualify
    for rebuilt in (True, False):
        kw = dict(stream_start=start, block_outputs=outputs) if rebuilt else {}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = tr.merge_route_norm([running], leaves[0], gain, 4, leaves[1], prior_lse, leaves[2], 1e-5, stream=stream, gate=leaves[3], **kw)
        grads = torch.autograd.grad(y, leaves, torch.ones_like(y))  # the backward runs (SAVED_R with REBUILD raises)
        assert all(g_.isfinite().all() for g_ in grads)
        assert any(t is leaves[1] for t in saved) == rebuilt  # the prior, or r in its place
        assert all(any(t is o for t in saved) for o in outputs) == rebuilt  # the block's outputs, not the running sum
        assert any(t is start for t in saved) == rebuilt and any(t is stream for t in saved) != rebuilt


# the additive form with r saved (SAVE_ROUTED_ADDITIVE, off by default): at and above
# SAVE_ROUTED_MIN_SOURCES, one tile per head (16), a split head width (48 = 32 + 16) and a padded one (250)
SAVED_R_ADDITIVE_CPU = [(3, 4, 64, 37, torch.float32), (3, 2, 96, 37, torch.bfloat16), (4, 4, 1000, 9, torch.float32)]
SAVED_R_ADDITIVE_GPU = [
    (7, h, d, 1037, dt) for h, d, dt in itertools.product((1, 2, 8), (64, 96, 1000, 1024, 1280), (torch.float32, torch.bfloat16)) if d % h == 0
]


def check_additive_saved_r(monkeypatch, n, heads, d, tokens, dtype):
    """check_merge_route_norm of the additive form with its r saved (asserted: the forward was asked to save it)."""
    monkeypatch.setattr(tr, "SAVE_ROUTED_ADDITIVE", True)
    asked = []
    forward = tr._forward
    monkeypatch.setattr(tr, "_forward", lambda *a, **k: asked.append(k.get("save_routed", False)) or forward(*a, **k))
    check_merge_route_norm(n, heads, d, tokens, dtype, additive=True)
    assert asked == [True]


@pytest.mark.parametrize("n,heads,d,tokens,dtype", SAVED_R_ADDITIVE_CPU, ids=[merge_norm_id(*c, True) for c in SAVED_R_ADDITIVE_CPU])
def test_additive_merge_with_its_routed_value_saved_matches_float64_reference(monkeypatch, n, heads, d, tokens, dtype):
    check_additive_saved_r(monkeypatch, n, heads, d, tokens, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,heads,d,tokens,dtype", SAVED_R_ADDITIVE_GPU, ids=[merge_norm_id(*c, True) for c in SAVED_R_ADDITIVE_GPU])
def test_additive_merge_with_its_routed_value_saved_matches_float64_reference_full_grid(monkeypatch, n, heads, d, tokens, dtype):
    check_additive_saved_r(monkeypatch, n, heads, d, tokens, dtype)


def test_merge_route_norm_writes_no_routed_value_without_a_backward(monkeypatch):
    """The routed value r is written only where a backward will run: not under no_grad (validation,
    a prefill) nor where no input requires a gradient."""
    g = torch.Generator().manual_seed(4)
    sources = [torch.randn(9, 32, generator=g).to(DEVICE) for _ in range(3)]
    prior, prior_lse, query, gain, weight, _, _ = merge_norm_side_inputs(g, 9, 32, 4, torch.float32)
    asked = []
    forward = tr._forward
    monkeypatch.setattr(tr, "_forward", lambda *a, **k: asked.append(k.get("save_routed", False)) or forward(*a, **k))
    call = lambda q: tr.merge_route_norm(sources, q, gain, 4, prior, prior_lse, weight, 1e-5)  # noqa: E731
    with torch.no_grad():
        call(query.requires_grad_())
    call(query.detach())
    call(query.detach().requires_grad_())
    assert asked == [False, False, True]


# (sources, heads, d, tokens, sources' dtype, stream's dtype): one tile per head (16), split head
# widths (96 = 64 + 32), a bf16 stream (which the kernels save instead: they add in float32)
STREAM_START_CASES = [
    (0, 4, 64, 9, torch.float32, torch.float32), (3, 4, 64, 37, torch.bfloat16, torch.float32),
    (5, 2, 192, 70, torch.bfloat16, torch.float32), (2, 1, 48, 131, torch.float32, torch.float32),
    (3, 2, 64, 37, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize(
    "n,heads,d,tokens,dtype,stream_dtype", STREAM_START_CASES,
    ids=[f"N{c[0]}-H{c[1]}-d{c[2]}-T{c[3]}-{str(c[4])[6:]}-stream-{str(c[5])[6:]}" for c in STREAM_START_CASES],
)
def test_merge_route_norm_stream_start_gives_identical_gradients_and_saves_it(n, heads, d, tokens, dtype, stream_dtype):
    """merge_route_norm with ``stream_start`` (the stream a sum of it and the sources, in order, as
    the model's stream is): output and every gradient bit-identical to passing the stream alone,
    and autograd keeps ``stream_start`` instead of a float32 stream (a bf16 stream is kept as it
    is); the reference checks the sum."""
    g = torch.Generator().manual_seed(n + d)
    shape = (tokens, d)
    sources = [(torch.randn(shape, generator=g) * (0.5 + i)).to(DEVICE, dtype) for i in range(n)]
    start = (100 * torch.randn(shape, generator=g)).to(DEVICE, stream_dtype)  # large: each addition rounds
    stream = start
    for s_ in sources:
        stream = stream + s_
    prior, prior_lse, query, gain, weight, gate, dy = merge_norm_side_inputs(g, tokens, d, heads, dtype)
    results = []
    for given in (False, True):
        leaves = [x.detach().clone().requires_grad_() for x in (*sources, query, gain, prior, prior_lse, weight, stream, gate)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = tr.merge_route_norm(
                leaves[:n], leaves[n], leaves[n + 1], heads, leaves[n + 2], leaves[n + 3], leaves[n + 4], 1e-5,
                stream=leaves[n + 5], gate=leaves[n + 6], stream_start=start if given else None,
            )
        replayed = given and stream_dtype == torch.float32
        assert any(t is (start if replayed else leaves[n + 5]) for t in saved)
        assert not any(t is (leaves[n + 5] if replayed else start) for t in saved)
        results.append([y, *torch.autograd.grad(y, leaves, dy)])
    for k, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), k
    ref_args = dict(sources=sources, query=query, gain=gain, heads=heads, prior_out=prior, prior_lse=prior_lse, norm_weight=weight, norm_eps=1e-5, stream=stream, gate=gate)
    reference.merge_route_norm(**ref_args, stream_start=start)
    if n:
        with pytest.raises(ValueError, match="is not the stream"):
            reference.merge_route_norm(**{**ref_args, "sources": sources[::-1] if n > 1 else [2 * sources[0]]}, stream_start=start)


def merge_norm_saving(leaves, n, heads, **kw):
    """``(y, saved)``: ``tr.merge_route_norm`` over ``leaves`` = (n sources, query, gain, prior,
    prior_lse, norm weight, stream, gate) with ``kw``, and the tensors autograd saved for it."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = tr.merge_route_norm(
            leaves[:n], leaves[n], leaves[n + 1], heads, leaves[n + 2], leaves[n + 3], leaves[n + 4], 1e-5, stream=leaves[n + 5],
            gate=leaves[n + 6], **kw,
        )
    return y, saved


# (block outputs, heads, d, tokens, their dtype): one output (the running sum is it), bf16 running
# sums over several (rounded after each addition), float32, at split head widths (48 = 32 + 16
# lanes) and whole ones (16), and fp16, which the kernels do not rebuild (they save the running
# sum and the stream)
BLOCK_OUTPUTS_CASES = [
    (1, 2, 96, 9, torch.bfloat16), (4, 2, 96, 37, torch.bfloat16), (3, 2, 96, 70, torch.float32), (5, 4, 64, 131, torch.bfloat16),
    (3, 2, 64, 9, torch.float16),
]


@pytest.mark.parametrize(
    "k,heads,d,tokens,dtype", BLOCK_OUTPUTS_CASES, ids=[f"K{c[0]}-H{c[1]}-d{c[2]}-T{c[3]}-{str(c[4])[6:]}" for c in BLOCK_OUTPUTS_CASES]
)
def test_merge_route_norm_block_outputs_give_identical_gradients_and_are_saved_instead(request, k, heads, d, tokens, dtype):
    """merge_route_norm in block routing with ``stream_start`` and ``block_outputs`` (the one
    source their running sum, rounded after each addition; the float32 stream the start plus
    them): output and every gradient bit-identical to passing the stream and the running sum
    alone, and autograd keeps the start and the outputs instead of the stream and the running
    sum (bf16, float32; an fp16 running sum and the stream are kept as they are); the reference
    checks both sums."""
    if CUDA and dtype == torch.float32:  # known, not understood: BENCHMARKS.md, sixteenth set
        request.node.add_marker(pytest.mark.xfail(strict=True, reason="on the GPU the prior lse's gradient of the rebuilt float32 running sum is not bit-identical"))
    g = torch.Generator().manual_seed(k + d)
    shape = (tokens, d)
    outputs = [(torch.randn(shape, generator=g) * 4 ** i).to(DEVICE, dtype) for i in range(k)]  # growing: each sum rounds
    start = (100 * torch.randn(shape, generator=g)).to(DEVICE)
    stream, running = start, outputs[0]
    for i, o in enumerate(outputs):
        stream = stream + o
        running = running + o if i else running
    prior, prior_lse, query, gain, weight, gate, dy = merge_norm_side_inputs(g, tokens, d, heads, dtype)
    results = []
    for given in (False, True):
        leaves = [x.detach().clone().requires_grad_() for x in (running, query, gain, prior, prior_lse, weight, stream, gate)]
        y, saved = merge_norm_saving(leaves, 1, heads, stream_start=start if given else None, block_outputs=outputs if given else None)
        rebuilt = given and dtype != torch.float16
        kept = [start, *outputs] if rebuilt else [leaves[6], leaves[0]]
        dropped = [leaves[6], leaves[0]] if rebuilt else [start, *outputs[1:]]  # (outputs[0] is the running sum at k = 1)
        assert all(any(t is x for t in saved) for x in kept)
        assert not any(t is x for t in saved for x in dropped)
        results.append([y, *torch.autograd.grad(y, leaves, dy)])
    for n, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), n
    ref_args = dict(query=query, gain=gain, heads=heads, prior_out=prior, prior_lse=prior_lse, norm_weight=weight, norm_eps=1e-5, stream=stream, gate=gate)
    reference.merge_route_norm(**ref_args, sources=[running], stream_start=start, block_outputs=outputs)
    if k > 2:  # the same sum rounded once is not the running sum
        once = sum(o.double() for o in outputs).to(dtype)
        if dtype != torch.float32:
            assert not torch.equal(once, running)
            with pytest.raises(ValueError, match="running sum of block_outputs"):
                reference.merge_route_norm(**ref_args, sources=[once], stream_start=start, block_outputs=outputs)
        with pytest.raises(ValueError, match="stream_start plus block_outputs"):
            reference.merge_route_norm(**ref_args, sources=[running], stream_start=start, block_outputs=outputs[::-1])


# (earlier outputs, block outputs, heads, d, tokens, dtype, the prior's dtype): a block inside a
# span (REPLAY_SPAN_MAX_OUTPUTS) at its first site (no source: phase one saw every block) and
# later ones, at split head widths (48 = 32 + 16 lanes) and whole ones (16, 8); fp16 at a first
# site (replayed: fp16 adds to the float32 stream exactly); a float32 prior (phase one over a
# float32 block sum) and an fp16 running sum, which the kernels do not replay from earlier outputs
# (they save the stream and the running sum: fp16's running sum is not rebuilt)
EARLIER_OUTPUTS_CASES = [
    (3, 0, 2, 96, 9, torch.bfloat16, None), (3, 2, 2, 96, 37, torch.bfloat16, None), (2, 3, 4, 64, 131, torch.bfloat16, None),
    (2, 0, 2, 64, 33, torch.float16, None), (3, 0, 4, 32, 22, torch.bfloat16, torch.float32), (1, 1, 2, 64, 70, torch.float16, None),
]


@pytest.mark.parametrize(
    "p,k,heads,d,tokens,dtype,prior_dtype", EARLIER_OUTPUTS_CASES,
    ids=[f"P{c[0]}-K{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}-{str(c[5])[6:]}" + ("-prior-float32" if c[6] else "") for c in EARLIER_OUTPUTS_CASES],
)
def test_merge_route_norm_earlier_outputs_give_identical_gradients_and_are_saved_instead(p, k, heads, d, tokens, dtype, prior_dtype):
    """merge_route_norm with ``stream_start`` an earlier block's start and ``earlier_outputs`` the
    outputs since, up to this block (the float32 stream is the start plus them, then plus the
    block's outputs): output and every gradient bit-identical to passing the stream (and the
    running sum) alone, and autograd keeps the earlier start and all the outputs instead of the
    stream and the running sum (with an fp16 running sum or a prior of another dtype the stream and
    the running sum are kept as they are); the reference checks the sum."""
    g = torch.Generator().manual_seed(p + 10 * k + d)
    shape = (tokens, d)
    earlier = [(torch.randn(shape, generator=g) * 2 ** i).to(DEVICE, dtype) for i in range(p)]
    outputs = [(torch.randn(shape, generator=g) * 4 ** i).to(DEVICE, dtype) for i in range(k)]
    start = (100 * torch.randn(shape, generator=g)).to(DEVICE)
    stream = start
    for o in (*earlier, *outputs):
        stream = stream + o
    running = None
    for o in outputs:
        running = o if running is None else running + o
    prior, prior_lse, query, gain, weight, gate, dy = merge_norm_side_inputs(g, tokens, d, heads, dtype)
    if prior_dtype is not None:
        prior, dy = prior.to(prior_dtype), dy.to(prior_dtype)
    results = []
    for given in (False, True):
        srcs = [running] if k else []
        leaves = [x.detach().clone().requires_grad_() for x in (*srcs, query, gain, prior, prior_lse, weight, stream, gate)]
        n = len(srcs)
        y, saved = merge_norm_saving(
            leaves, n, heads, stream_start=start if given else None, block_outputs=outputs if given and k else None,
            earlier_outputs=earlier if given else None,
        )
        replayed = given and (dtype != torch.float16 or k == 0) and prior_dtype is None
        kept = [start, *earlier, *outputs] if replayed else [leaves[n + 5], *leaves[:n]]
        dropped = [leaves[n + 5], *leaves[:n]] if replayed else [start, *earlier]
        assert all(any(t is x for t in saved) for x in kept)
        assert not any(t is x for t in saved for x in dropped)
        results.append([y, *torch.autograd.grad(y, leaves, dy)])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), i
    ref_args = dict(query=query, gain=gain, heads=heads, prior_out=prior, prior_lse=prior_lse, norm_weight=weight, norm_eps=1e-5, stream=stream, gate=gate)
    rebuilt = dict(sources=[running], block_outputs=outputs) if k else dict(sources=[])
    reference.merge_route_norm(**ref_args, **rebuilt, stream_start=start, earlier_outputs=earlier)
    if p > 1:  # the outputs in another order do not add up to the stream bit for bit
        with pytest.raises(ValueError, match="stream_start plus earlier_outputs and"):
            reference.merge_route_norm(**ref_args, **rebuilt, stream_start=start, earlier_outputs=earlier[::-1])


@pytest.mark.parametrize("impl", [reference.merge_route_norm, tr.merge_route_norm], ids=["reference", "triton"])
def test_merge_route_norm_refuses_bad_arguments(impl):
    v, q, gn = [torch.randn(3, 8, device=DEVICE)], torch.randn(8, device=DEVICE), torch.ones(8, device=DEVICE)
    prior, lse, w = torch.randn(3, 8, device=DEVICE), torch.randn(3, 2, device=DEVICE), torch.ones(8, device=DEVICE)
    with use_backend("triton"):
        impl(v, q, gn, 2, prior, lse, w, 1e-5)  # the good call
        for bad, match in [
            (dict(norm_weight=torch.ones(7, device=DEVICE)), r"norm_weight must be a \(8,\) tensor"),
            (dict(norm_weight=torch.ones(8, dtype=torch.int64, device=DEVICE)), "norm_weight has dtype torch.int64"),
            (dict(norm_eps=-1.0), "norm_eps=-1.0 must be a finite number > 0"),
            (dict(norm_eps=0.0), "norm_eps=0.0 must be a finite number > 0"),
            (dict(eps=0), "eps=0 must be"),
            (dict(prior_lse=torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)), "prior_lse has dtype torch.int64"),
            (dict(norm_eps=float("nan")), "norm_eps=nan"),
            (dict(eps=float("inf")), "eps=inf"),
            (dict(prior_lse=torch.randn(3, 4, device=DEVICE)), r"prior_lse must be a \(3, 2\) tensor"),
            (dict(prior_out=torch.randn(3, 16, device=DEVICE)), "prior_out has shape"),
            (dict(heads=3), "heads=3"),
            (dict(stream=torch.randn(3, 8, device=DEVICE)), "stream and gate go together"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(5, device=DEVICE)), r"gate has shape \(5,\)"),
            (dict(sources=[torch.randn(4, 8, device=DEVICE)]), "prior_out has shape"),
            (dict(stream_start=torch.randn(3, 8, device=DEVICE)), "stream_start is given without a stream"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE, dtype=torch.float64)),
             "stream_start must be a tensor of the stream's shape"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), block_outputs=v), "block_outputs is given without stream_start"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  sources=[*v, *v], block_outputs=v), "block_outputs needs exactly one source .* got 2"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  block_outputs=[]), r"block_outputs must be a non-empty list .*got \[\]"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  block_outputs=v[0]), "block_outputs must be a non-empty list .*got a Tensor"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  block_outputs=[v[0], v[0].half()]), r"block_outputs\[1\] must be a tensor of the source's shape \(3, 8\), dtype torch.float32 .*dtype torch.float16"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), earlier_outputs=v), "earlier_outputs is given without stream_start"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  earlier_outputs=v[0]), "earlier_outputs must be a list of tensors, got a Tensor"),
            (dict(stream=torch.randn(3, 8, device=DEVICE), gate=torch.randn(8, device=DEVICE), stream_start=torch.randn(3, 8, device=DEVICE),
                  earlier_outputs=[v[0], torch.randn(3, 4, device=DEVICE)]), r"earlier_outputs\[1\] must be a floating tensor of the stream's shape \(3, 8\).*shape \(3, 4\)"),
        ]:
            args = dict(sources=v, query=q, gain=gn, heads=2, prior_out=prior, prior_lse=lse, norm_weight=w, norm_eps=1e-5, stream=None, gate=None, eps=1e-6)
            args.update(bad)
            with pytest.raises(ValueError, match=match):
                impl(**args)


@pytest.mark.parametrize("residual,block_size", [("attnres", 3), ("delta", 3), ("delta", 1)], ids=["mhar-block", "delta-block", "delta-full"])
def test_fused_norm_model_matches_unfused_and_saves_less(monkeypatch, residual, block_size):
    """A two-phase MHAR (Delta) model gives the same loss and gradients with the second phase
    fused with the RMSNorm as with the merge followed by the norm module, while autograd keeps fewer
    bytes, each storage counted once (the norm's input is not saved; the Delta form keeps its
    stream instead, as many bytes, or fewer where it is replayed)."""
    from lit_mhar import routing

    assert routing.FUSED_NORM_ADDITIVE_FULL  # the default: Delta full routing fused too
    model = tiny_model(residual, 4, block_size, n_layer=3)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = {}
    original, original_direct = routing.merge_route_norm, routing.route_norm
    for fused in (False, True):
        monkeypatch.setattr(routing, "FUSED_NORM", fused)
        calls = []
        monkeypatch.setattr(routing, "merge_route_norm", lambda *a, **k: calls.append("merge") or original(*a, **k))
        monkeypatch.setattr(routing, "route_norm", lambda *a, **k: calls.append("direct") or original_direct(*a, **k))
        model.zero_grad()
        saved = {}  # storage -> bytes: what autograd keeps alive, a tensor saved by several ops once

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes() if t.numel() else 0)
            return t

        with use_backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        # every site (6 sublayers and the final one) when fused; block MHAR's first block without phase one (FIRST_GROUP_DIRECT)
        direct = 3 if residual == "attnres" else 0
        assert calls == (["direct"] * direct + ["merge"] * (7 - direct) if fused else [])
        results[fused] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())
    (loss0, grads0, bytes0), (loss1, grads1, bytes1) = results[False], results[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for name in grads0:
        if grads0[name].abs().max() < 1e-6:  # the first site sees one source: exact gradient 0, float32 noise here
            assert grads1[name].abs().max() < 1e-6, name
            continue
        assert rel_err(grads1[name], grads0[name]) < 1e-5, name
    assert bytes1 < bytes0 if residual == "attnres" else bytes1 <= bytes0, (bytes1, bytes0)


def test_reference_two_phase_equals_plain_routing_in_float64():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(4, 5, 24, generator=g, dtype=torch.float64) for _ in range(4)]
    b = [torch.randn(4, 5, 24, generator=g, dtype=torch.float64)]
    q, gain = torch.randn(2, 24, generator=g, dtype=torch.float64), torch.rand(2, 24, generator=g, dtype=torch.float64) + 0.5
    outs, lse = reference.route_sites(a, q, gain, heads=4)
    for j in range(2):
        torch.testing.assert_close(reference.merge_route(b, q[j], gain[j], 4, outs[j], lse[j]), reference.depth_route(a + b, q[j], gain[j], 4), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outs[j], reference.depth_route(a, q[j], gain[j], 4), rtol=1e-12, atol=1e-12)


def sink_passes(impl, n_sources, passes, heads, d, tokens, dtype, sink_on, seed=11, device=DEVICE):
    """A depth history's backward as two-phase routing runs it: phase-one passes, pass k routing
    ``passes[k]`` sites over the first ``k + 1 + n_sources - len(passes)`` sources (each later
    pass reads one more, like the passes of successive blocks), then a block in progress after the
    last pass: two sublayer outputs summed into running sums that the next sites merge (fused with
    the norm). With ``sink_on`` through a GradientSink. Returns the gradients of the sources, the
    two outputs, queries and gains of a random linear function of every output and lse."""
    from lit_mhar.kernels import GradientSink

    g = torch.Generator().manual_seed(seed)
    math = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [(torch.randn(tokens, d, generator=g) * (0.5 + i % 3)).to(device, dtype).requires_grad_() for i in range(n_sources + 2)]
    qs = [(2.0 * (heads / d) ** 0.5 * torch.randn(s, d, generator=g)).to(device, math).requires_grad_() for s in passes]
    gs = [(1 + 0.3 * torch.randn(s, d, generator=g)).to(device, math).requires_grad_() for s in passes]
    nw = (1 + 0.3 * torch.randn(d, generator=g)).to(device, math)
    sink = GradientSink() if sink_on else None
    collect = sink.collect if sink_on else (lambda x: x)
    srcs = [collect(x) for x in leaves[:n_sources]]
    loss = sum((x.double() * 0.1).sum() for x in srcs)  # a use of each source outside the routing ops too

    def use(t):
        return (t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64).to(device)).sum()

    first = n_sources - len(passes) + 1
    for k, (q, gn) in enumerate(zip(qs, gs)):
        outs, lse = impl.route_sites(srcs[: first + k], q, gn, heads, grad_sink=sink)
        loss = loss + sum(use(o) for o in outs) + use(lse)
    # the block in progress: its sites 1 and 2 merge the running sums with the last pass's sites
    q, gn = qs[-1], gs[-1]
    partial = collect(leaves[n_sources])
    for j in (1, 2):
        if j < len(outs):
            loss = loss + use(impl.merge_route_norm([partial], q[j], gn[j], heads, outs[j], lse[j], nw, 1e-5, grad_sink=sink))
        if j == 1:
            output = leaves[n_sources + 1]
            partial = collect(sink.sum(partial, output) if sink_on else partial + output)
    loss = loss + use(partial)
    return torch.autograd.grad(loss, leaves + qs + gs)


@pytest.mark.parametrize(
    "n_sources,passes,heads,d,tokens,dtype",
    [(4, (3, 2, 3), 2, 64, 37, torch.float32), (9, (2, 3), 4, 96, 70, torch.bfloat16), (3, (1, 1, 1), 1, 48, 13, torch.float32)],
    # (1, 1, 1): one site over 1-3 sources takes the two-pass backward; the others the site loop
    ids=["site-loop-fp32", "site-loop-9-sources-bf16", "two-pass-fp32"],
)
@pytest.mark.parametrize("impl", [reference, tr], ids=["reference", "triton"])
def test_gradient_sink_sums_source_gradients_like_autograd(monkeypatch, impl, n_sources, passes, heads, d, tokens, dtype):
    """Source gradients summed in a GradientSink over the phase-one passes and merges that read
    them (the Triton kernels add inside) against float64 plain autograd; and the kernels really
    added into the sink's buffers."""
    from lit_mhar.kernels import GradientSink

    seen = []
    original = GradientSink.targets

    def targets(self, slots, like, new=None):
        out = original(self, slots, like, new)
        seen.append((len(slots), out[2]))
        return out

    monkeypatch.setattr(GradientSink, "targets", targets)
    with use_backend("triton" if impl is tr else "reference"):
        got = sink_passes(impl, n_sources, passes, heads, d, tokens, dtype, True)
        plain = sink_passes(impl, n_sources, passes, heads, d, tokens, dtype, False)
    ref = sink_passes(reference, n_sources, passes, heads, d, tokens, torch.float64, False)
    # (no further from float64 than autograd's summation, up to a factor: Triton 3.9's interpreter
    # truncates float32 to bf16 on store where torch rounds to nearest, so on the CPU the in-kernel
    # sums of bf16 gradients land up to ~1.3x further; on an H200 the two agree, BENCHMARKS.md)
    for a, b, r in zip(got, plain, ref):
        assert rel_err(a, r) < TOL[dtype], rel_err(a, r)
        assert rel_err(a, r) < 2 * rel_err(b, r) + 1e-12, (rel_err(a, r), rel_err(b, r))
    # every Triton backward asked the sink where to put its source gradients, in reverse order of
    # the forward: the merges (one running sum each: the second's holds nothing yet, the first's
    # what the sum after it handed on, added in the kernel), then the passes (a pass reads a prefix
    # of what later passes read: all of its slots hold a sum already, except for the last pass);
    # the reference leaves the sums to add()
    sizes = [n_sources - len(passes) + 1 + k for k in range(len(passes))]
    merges = [[], [(1, 1)], [(1, 0), (1, 1)]][min(passes[-1], 3) - 1]
    expected = merges + [(n, 0 if k == len(sizes) - 1 else n) for k, n in enumerate(sizes)][::-1]
    assert seen == (expected if impl is tr else [])


SINK_GPU = [
    (n, passes, h, d, 1037, dt)
    for n, passes, h, d, dt in itertools.product((9, 17), ((6, 6, 6), (1, 1, 3)), (1, 8), (96, 1024, 1280), (torch.float32, torch.bfloat16))
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_sources,passes,heads,d,tokens,dtype", SINK_GPU, ids=[f"N{c[0]}-passes{'-'.join(map(str, c[1]))}-H{c[2]}-d{c[3]}-{str(c[5]).split('.')[-1]}" for c in SINK_GPU])
def test_gradient_sink_sums_source_gradients_like_autograd_full_grid(monkeypatch, n_sources, passes, heads, d, tokens, dtype):
    test_gradient_sink_sums_source_gradients_like_autograd(monkeypatch, tr, n_sources, passes, heads, d, tokens, dtype)


@pytest.mark.parametrize("impl", [reference, tr], ids=["reference", "triton"])
@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf"), True])
def test_routing_ops_refuse_a_key_epsilon_that_is_not_positive(impl, eps):
    """eps = 0 would give NaN gradients on a source row of zeros (padding): refused, and the error
    names the op that was called."""
    v = [torch.randn(5, 32, device=DEVICE) for _ in range(2)]
    q, gn = torch.randn(32, device=DEVICE), torch.ones(32, device=DEVICE)
    with use_backend("triton" if impl is tr else "reference"):
        with pytest.raises(ValueError, match=r"^depth_route: eps="):
            impl.depth_route(v, q, gn, 2, eps=eps)
        with pytest.raises(ValueError, match=r"^route_sites: eps="):
            impl.route_sites(v, q[None], gn[None], 2, eps=eps)
        outs, lse = impl.route_sites(v[:1], q[None], gn[None], 2)
        with pytest.raises(ValueError, match=r"^merge_route: eps="):
            impl.merge_route(v[1:], q, gn, 2, outs[0], lse[0], eps=eps)


@pytest.mark.parametrize("impl", [reference, tr], ids=["reference", "triton"])
def test_gradient_sink_refuses_sources_it_did_not_collect(impl):
    from lit_mhar.kernels import GradientSink

    sink = GradientSink()
    a, b = torch.randn(5, 32, device=DEVICE), torch.randn(5, 32, device=DEVICE)
    collected = [sink.collect(a), sink.collect(b)]
    q, gn = torch.randn(2, 32, device=DEVICE), torch.ones(2, 32, device=DEVICE)
    with use_backend("triton" if impl is tr else "reference"):
        for bad in ([a], [collected[1], a], [collected[0], collected[0]]):
            with pytest.raises(ValueError, match="grad_sink"):
                impl.route_sites(bad, q, gn, 2, grad_sink=sink)
            outs, lse = impl.route_sites(collected, q, gn, 2)
            for merge in (impl.merge_route, lambda *args, **kw: impl.merge_route_norm(*args[:6], torch.ones(32, device=DEVICE), 1e-5, **kw)):
                with pytest.raises(ValueError, match="grad_sink"):
                    merge(bad, q[0], gn[0], 2, outs[0], lse[0], grad_sink=sink)
        impl.route_sites(collected[1:], q, gn, 2, grad_sink=sink)  # any collected aliases, each once


@pytest.mark.parametrize("residual,block_size", [("attnres", 3), ("delta", 2), ("attnres", 1)], ids=["block-S3", "delta-block-S2", "full"])
def test_model_gradient_sink_matches_autograd_summation(monkeypatch, residual, block_size):
    """The model's two-phase routing with the sink (default) against SINK_SOURCE_GRADIENTS off:
    same loss, gradients equal to float32 rounding; the sink is dropped when gradients are off."""
    from lit_mhar import routing

    model = tiny_model(residual, 4, block_size, n_layer=7 if block_size == 1 else 5)  # full MHAR: two groups of sites (12, 3)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for on in (True, False):
        monkeypatch.setattr(routing, "SINK_SOURCE_GRADIENTS", on)
        results.append(triton_loss_and_grads(model, idx))
    (loss_on, g_on), (loss_off, g_off) = results
    assert torch.equal(loss_on, loss_off) and g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-6, msg=name)
    monkeypatch.setattr(routing, "SINK_SOURCE_GRADIENTS", True)
    assert routing.DepthHistory(torch.zeros(2, 3, 8), 2, model.routing_sites(), two_phase=True).sink is not None
    with torch.no_grad():
        assert routing.DepthHistory(torch.zeros(2, 3, 8), 2, model.routing_sites(), two_phase=True).sink is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_partial", [True, False], ids=["running-sum", "first-of-block"])
def test_gradient_sink_advance_matches_autograd(dtype, with_partial):
    """GradientSink.advance (stream + output, partial + output) against plain autograd: the stream's
    and the partial's gradients reach their leaves through the sink's slots, the output's is their
    sum, rounded once to its dtype (autograd rounds the stream's first: within one bf16 step)."""
    from lit_mhar.kernels import GradientSink

    g = torch.Generator().manual_seed(5)
    shape = (3, 5, 24)
    stream0 = torch.randn(shape, generator=g)  # float32, as under autocast
    partial0 = torch.randn(shape, generator=g).to(dtype)
    output0 = torch.randn(shape, generator=g).to(dtype)
    w = [torch.randn(shape, generator=g) for _ in range(4)]
    grads = []
    for sunk in (True, False):
        stream, partial, output = (t.clone().requires_grad_() for t in (stream0, partial0, output0))
        if sunk:
            sink = GradientSink()
            s_alias, p_alias = sink.collect(stream), sink.collect(partial)
            h, p = sink.advance(s_alias, p_alias if with_partial else None, output)
            assert (p is None) != with_partial
        else:
            s_alias, p_alias = stream, partial
            h, p = stream + output, (partial + output if with_partial else None)
        # the aliases have other readers too, as in the model (the routing ops)
        loss = (h * w[0]).sum() + (s_alias * w[2]).sum() + (p_alias.float() * w[3]).sum()
        if p is not None:
            loss = loss + (p.float() * w[1]).sum()
        loss.backward()
        grads.append([t.grad for t in (stream, partial, output)])
    for got, want, name in zip(*grads, ("stream", "partial", "output")):
        assert got.dtype == want.dtype, name
        if dtype == torch.float32 or name == "stream":
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        else:  # one rounding against two
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2, msg=name)


def test_gradient_sink_advance_refuses_what_it_did_not_collect():
    from lit_mhar.kernels import GradientSink

    sink = GradientSink()
    x = torch.randn(2, 3, 8, requires_grad=True)
    alias = sink.collect(x)
    with pytest.raises(ValueError, match="both None"):
        sink.advance(None, None, x)
    with pytest.raises(ValueError, match="GradientSink.advance"):
        sink.advance(x * 1, None, x)  # not an alias the sink returned
    with pytest.raises(ValueError, match="GradientSink.advance"):
        sink.advance(alias, alias, x)  # the same alias twice
    stream, partial = sink.advance(alias, None, x)
    assert partial is None and torch.equal(stream, 2 * x)


@pytest.mark.parametrize("block_size", [2, 1], ids=["delta-block-S2", "delta-full"])
def test_model_stream_sink_matches_autograd(monkeypatch, block_size):
    """Delta's residual stream summed in the sink (SINK_STREAM, the default) against autograd's
    summation: same loss and gradients; on, the fused norms bind the stream's slot, off, none does."""
    from lit_mhar import routing
    from lit_mhar.kernels import sink as sink_module

    model = tiny_model("delta", 4, block_size, n_layer=3)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    bound = {}
    original = sink_module.SinkBinding.__init__

    def spy(self, sink, slots, stream_slot=None):
        bound.setdefault(on, []).append(stream_slot)
        original(self, sink, slots, stream_slot)

    monkeypatch.setattr(sink_module.SinkBinding, "__init__", spy)
    results = []
    for on in (True, False):
        monkeypatch.setattr(routing, "SINK_STREAM", on)
        results.append(triton_loss_and_grads(model, idx))
    sites = 2 * 3 + 1
    assert sum(slot is not None for slot in bound[True]) == sites  # every fused norm bound the stream
    assert all(slot is None for slot in bound[False])
    (loss_on, g_on), (loss_off, g_off) = results
    assert torch.equal(loss_on, loss_off) and g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-6, msg=name)


# (block size, model dtype or bf16 autocast, what a forward hook changes, the stream's gradient in
# the sink, width d, REPLAY_SPAN_MAX_OUTPUTS, float32 [B, T, d] tensors no longer saved); 11 sites.
# Full routing (groups of 8 sites, and 3): replayed; a bf16 stream is not (the kernel adds in
# float32); with the stream changed outside DepthHistory.append before site 4, sites 4-7 are not,
# the next group is again. Block routing, S = 3 (blocks start at sites 0, 3, 6, 9; the final site
# 10 joins the last): sites 1, 2, 4, 5, 7, 8, 10 save no stream (the outputs they save instead
# replace the running sums they saved), and with spans of two blocks (at most 3 earlier outputs;
# spans start at sites 0 and 6) sites 3 and 9 neither; under autocast (bf16 running sums, rebuilt
# with bf16 rounding) at split head widths (48 / 4 = 8 + 4 lanes), with spans, without (0) and
# with at most 2 earlier outputs (no span at S = 3); in float32 with the stream changed before
# site 4, out of place without the stream sink or in place (sites 4 and 5 save it, a span starts
# again at site 6; a span keeps a block's last output, float32 there, for the stream it does not
# keep); with sublayer 3's output in float32 under autocast (a running sum or earlier outputs of
# two dtypes are not replayed: site 4 with spans, 5; from block 2 on phase one's prior is float32,
# and the merges cast their bf16 running sums to it or do not take bf16 earlier outputs: sites 7,
# 8, 9, 10). Blocks of 2 (blocks start at sites 0, 2, 4, 6, 8, the final site 10 joining the block
# of 8 and 9; spans start at 0, 4 and 8): under autocast with spans, in float32 without.
REPLAY_MODEL_CASES = [
    (1, torch.float32, None, True, 32, 3, 9), (1, torch.bfloat16, None, True, 32, 3, 0), (1, torch.float32, "stream", True, 32, 3, 5),
    (3, "autocast", None, True, 48, 3, 9), (3, "autocast", None, True, 48, 0, 7), (3, "autocast", None, True, 48, 2, 7),
    (3, torch.float32, "stream", False, 32, 3, 5), (3, torch.float32, "stream-in-place", True, 32, 3, 5),
    (3, "autocast", "float32-output", True, 32, 3, 3), (3, "autocast", "float32-output", True, 32, 0, 3), (2, "autocast", None, True, 32, 3, 8),
    (2, torch.float32, None, True, 32, 0, 6),
]


@pytest.mark.parametrize(
    "block_size,dtype,changed,sink,d_model,span,fewer", REPLAY_MODEL_CASES,
    ids=["delta-full", "delta-full-bf16", "delta-full-stream-changed", "delta-block-S3-autocast-split-width",
         "delta-block-S3-autocast-split-width-no-spans", "delta-block-S3-autocast-split-width-spans-of-2-outputs",
         "delta-block-S3-stream-changed-no-stream-sink", "delta-block-S3-stream-changed-in-place", "delta-block-S3-autocast-float32-output",
         "delta-block-S3-autocast-float32-output-no-spans", "delta-block-S2-autocast-final-site-joins", "delta-block-S2-final-site-joins-no-spans"],
)
def test_model_stream_replay_saves_one_stream_per_group_with_identical_gradients(
    monkeypatch, block_size, dtype, changed, sink, d_model, span, fewer
):
    """Delta routing with the stream replayed in the fused norms' backward (REPLAY_STREAM, the
    default) against saved: the same loss and bit-identical gradients, over one graph twice
    (retain_graph); autograd keeps one float32 stream per group of sites (2 for 11 sites in groups
    of 8 in full routing; in block routing one per span of blocks, REPLAY_SPAN_MAX_OUTPUTS), not one per
    site, where the stream is float32 and made by DepthHistory.append since the span's first site;
    otherwise it saves the site's stream (``fewer``: float32 ``[B, T, d]`` tensors, streams, no
    longer saved)."""
    from lit_mhar import routing

    monkeypatch.setattr(routing, "SINK_STREAM", sink)
    monkeypatch.setattr(routing, "REPLAY_SPAN_MAX_OUTPUTS", span)
    autocast = dtype == "autocast"
    dtype = torch.float32 if autocast else dtype
    model = tiny_model("delta", 4, block_size, n_layer=5, d_model=d_model).to(dtype)  # 11 sites
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    embed = {}

    def embedded(module, args, out):
        embed["ptr"] = out.untyped_storage().data_ptr()

    model.embed.register_forward_hook(embedded)
    if changed == "stream":  # the stream after block 1 (before site 4) is not the one append() returned
        model.blocks[1].register_forward_hook(lambda module, args, out: out + 1000)
    elif changed == "stream-in-place":  # ... the same tensor, changed in place
        model.blocks[1].register_forward_hook(lambda module, args, out: (out.mul_(1.5), None)[1])
    elif changed == "float32-output":
        model.blocks[1].mlp.register_forward_hook(lambda module, args, out: out.float())
    results = {}
    for on in (True, False):
        monkeypatch.setattr(routing, "REPLAY_STREAM", on)
        streams = set()

        def pack(t):  # [B, T, d] streams saved, other than the embedding (a source too)
            if t.dim() == 3 and t.shape[:2] == idx.shape and t.shape[-1] == d_model and t.dtype == dtype and t.untyped_storage().data_ptr() != embed.get("ptr"):
                streams.add(t.untyped_storage().data_ptr())
            return t

        grads = []
        model.zero_grad()
        with use_backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten())
        for retain in (True, False):
            model.zero_grad()
            loss.backward(retain_graph=retain)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        results[on] = loss.detach(), grads, len(streams)
    (loss_on, grads_on, n_on), (loss_off, grads_off, n_off) = results[True], results[False]
    assert torch.equal(loss_on, loss_off)
    assert n_off - n_on == fewer
    differ = []
    for got, want in zip(grads_on, grads_off):
        assert got.keys() == want.keys()
        differ += [name for name in want if not torch.equal(got[name], want[name])]
    head_width = d_model // 4
    if CUDA and tr.SPLIT_WIDTH and head_width & (head_width - 1):  # known, not understood: BENCHMARKS.md, eighteenth set
        # benchmarks/replay_rounding.py: at d = 48 under bf16 autocast 10 of 91 gradients differ (embed.weight by
        # 1.5e-8 of 0.23), 82 of 91 in float32; identical run to run, and padded (SPLIT_WIDTH = False) or at d = 32
        # under autocast bit-identical
        assert differ, "the replay is bit-identical on the GPU at split head widths now: drop this branch"
        pytest.xfail(f"on the GPU, at split head widths ({head_width} lanes as two column tiles), the replayed stream's "
                     f"gradients differ from the saved stream's by float32 rounding: {differ[:3]}")
    assert not differ, differ


def test_activation_checkpointing_keeps_no_more_sublayer_outputs_alive_with_the_replay(monkeypatch):
    """Under activation checkpointing (where nothing replays: the sublayers route from snapshots),
    the outputs the live history collects for the replay are not held by the snapshots that
    checkpointing keeps until the backward: as many sublayer outputs are alive after the forward
    with REPLAY_STREAM as without, fewer than all of them."""
    import weakref

    from lit_mhar import routing

    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    alive = {}
    for on in (True, False):
        monkeypatch.setattr(routing, "REPLAY_STREAM", on)
        model = tiny_model("delta", 4, 3, n_layer=3)
        model.activation_checkpointing = True
        refs = []
        for block in model.blocks:
            for sub in (block.attn, block.mlp):
                sub.register_forward_hook(lambda module, args, out: refs.append(weakref.ref(out)))
        with use_backend("triton"):  # (the backward recomputes the sublayers: on the same backend)
            loss = model(idx).float().logsumexp(-1).mean()
            alive[on] = sum(r() is not None for r in refs)
            assert len(refs) == 6
            loss.backward()
    assert alive[True] == alive[False] < 6, alive


@pytest.mark.parametrize("block_size", [2, 1], ids=["delta-block-S2", "delta-full"])
def test_hooks_on_delta_block_outputs_see_the_whole_stream_gradient(monkeypatch, block_size):
    """A tensor hook on a Delta block's output (the residual stream between blocks) sees the same
    gradient with the stream summed in the sink as without, and what it returns is used: a hook
    that halves it changes the parameter gradients the same way on both paths."""
    from lit_mhar import routing

    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(routing, "SINK_STREAM", on)
        model = tiny_model("delta", 2, block_size, n_layer=3)
        seen = []

        def block_hook(module, args, out):
            out.register_hook(lambda g: seen.append(g) or g * 0.5)

        for block in model.blocks:
            block.register_forward_hook(block_hook)
        results[on] = seen, triton_loss_and_grads(model, idx)[1]
    (seen_on, g_on), (seen_off, g_off) = results[True], results[False]
    assert len(seen_on) == len(seen_off) == 3 and all(g is not None for g in seen_on)
    for a, b in zip(seen_on, seen_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in g_off:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("residual,block_size", [("delta", 2), ("attnres", 2)], ids=["delta-block", "mhar-block"])
def test_double_backward_through_the_gradient_sink_is_refused(residual, block_size):
    """The sink's sums carry no graph: a backward with create_graph=True raises a clear error
    instead of returning second derivatives that miss every path through them."""
    model = tiny_model(residual, 2, block_size, n_layer=2)
    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with use_backend("triton"):
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(loss, [model.blocks[0].mlp.down_proj.weight], create_graph=True)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gradient_sink_backward_over_some_inputs_then_all(monkeypatch, backend):
    """A backward over one pseudo-query (retain_graph) runs the routing ops but not every
    source's alias, so sums stay in the sink; the next backward over the graph must not add them
    again: both give what autograd's summation gives."""
    from lit_mhar import routing

    idx = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for on in (True, False):
        monkeypatch.setattr(routing, "SINK_SOURCE_GRADIENTS", on)
        model = tiny_model("attnres", 2, 2, n_layer=3)
        with use_backend(backend):
            loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        (first,) = torch.autograd.grad(loss, [model.final_site.query], retain_graph=True)
        loss.backward()
        results.append((first, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (first_on, g_on), (first_off, g_off) = results
    torch.testing.assert_close(first_on, first_off, rtol=1e-5, atol=1e-7)
    assert g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("residual", ["attnres", "delta"])
def test_blocks_compiled_one_by_one_match_the_eager_model(residual):
    """Blocks compiled on their own inside the eager model (the depth history, made eagerly, has a
    sink; the compiled code must neither trace it nor lose the gradients of what it routes)."""
    import copy

    model = tiny_model(residual, 2, 2, n_layer=3)
    compiled = copy.deepcopy(model)
    for block in compiled.blocks:
        block.compile(backend="aot_eager")
    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = []
    for m in (model, compiled):
        with use_backend("triton"):  # under compile the custom op, whose gradients bypass the sink
            loss = torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    torch._dynamo.reset()
    (loss_e, g_e), (loss_c, g_c) = grads
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert g_c.keys() == g_e.keys()
    for name in g_e:
        torch.testing.assert_close(g_c[name], g_e[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("residual, checkpointing", [("attnres", False), ("delta", False), ("attnres", True), ("delta", True)])
def test_sublayers_compiled_keep_routing_eager_on_the_sink_and_match_the_eager_model(residual, checkpointing, monkeypatch):
    """``LM.compile_sublayers``: attention, MLP and norms compiled, routing eager, so the depth
    history keeps its gradient sink (which a compiled caller would bypass) and loss and gradients
    equal the eager model's; also with every sublayer checkpointed around its compiled modules."""
    import copy

    from lit_mhar.kernels import sink as sink_mod

    model = tiny_model(residual, 2, 2, n_layer=3)
    model.activation_checkpointing = checkpointing
    compiled = copy.deepcopy(model)
    compiled.compile_sublayers(backend="aot_eager")
    assert compiled.blocks[0].attn._compiled_call_impl is not None and compiled._compiled_call_impl is None
    advances = []
    real_advance = sink_mod.GradientSink.advance
    monkeypatch.setattr(sink_mod.GradientSink, "advance", lambda self, *a: advances.append(1) or real_advance(self, *a))
    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads, counts = [], []
    try:
        for m in (model, compiled):
            with use_backend("triton"):  # (the backward too: checkpointed sublayers recompute in it)
                loss = torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
                loss.backward()
            grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
            counts.append(len(advances))
            advances.clear()
    finally:
        torch._dynamo.reset()
    assert counts[0] > 0 and counts[1] == counts[0]  # the running sums advanced through the sink in both
    (loss_e, g_e), (loss_c, g_c) = grads
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert g_c.keys() == g_e.keys()
    for name in g_e:
        torch.testing.assert_close(g_c[name], g_e[name], rtol=1e-4, atol=1e-6, msg=name)


def test_backward_is_deterministic():
    with use_backend("triton"):
        sources, query, gain, stream, gate, grad = make_case(9, 4, 96, 301, torch.float32, True, seed=5)
        leaves = [x.requires_grad_() for x in [*sources, query, gain, stream, gate]]
        runs = []
        for _ in range(2):
            out = tr.depth_route(leaves[:9], *leaves[9:11], 4, leaves[11], leaves[12])
            runs.append(torch.autograd.grad(out, leaves, grad.float()))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


def test_site_loop_backward_is_deterministic():
    """Several sites per pass (phase one of Block AttnRes) take the site-loop kernels: bit-identical too."""
    with use_backend("triton"):
        sources, *_ = make_case(5, 4, 96, 301, torch.float32, False, seed=6)
        g = torch.Generator().manual_seed(6)
        queries, gains = torch.randn(3, 96, generator=g).to(DEVICE), (1 + 0.3 * torch.randn(3, 96, generator=g)).to(DEVICE)
        douts, dlse = torch.randn(3, 301, 96, generator=g).to(DEVICE), torch.randn(3, 301, 4, generator=g).to(DEVICE)
        leaves = [x.requires_grad_() for x in [*sources, queries, gains]]
        runs = []
        for _ in range(2):
            outs, lse = tr.route_sites(leaves[:5], leaves[5], leaves[6], 4)
            loss = sum((o * t).sum() for o, t in zip(outs, douts)) + (lse * dlse).sum()
            runs.append(torch.autograd.grad(loss, leaves))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
def test_persistent_grids_sized_by_occupancy_match_the_fixed_grids(monkeypatch):
    """The backward kernels' persistent grids are sized by the programs an SM holds (from the
    compiled kernel's registers): a whole number in 1 .. 32 per kernel, and the gradients equal
    those of the fixed 32-warps-per-SM grids up to the order of the float32 partial sums."""
    sources, query, gain, stream, gate, grad = make_case(9, 8, 1024, 8192, torch.bfloat16, True, seed=7)
    g = torch.Generator().manual_seed(7)
    queries, gains = torch.randn(3, 1024, generator=g).to(DEVICE), (1 + 0.3 * torch.randn(3, 1024, generator=g)).to(DEVICE)
    douts = [torch.randn(sources[0].shape, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    leaves = [x.requires_grad_() for x in [*sources, queries, gains, query, gain, gate]]
    runs = []
    for occupancy in (frozenset({"bwd", "bwd_stats"}), frozenset()):
        monkeypatch.setattr(tr, "OCCUPANCY_GRIDS", occupancy)
        outs, lse = tr.route_sites(leaves[:9], leaves[9], leaves[10], 8)  # site loop
        merged = tr.merge_route(leaves[:1], leaves[11], leaves[12], 8, outs[0], lse[0])  # two-pass kernel (a prior)
        loss = sum((o.float() * t.float()).sum() for o, t in zip(outs[1:], douts[1:])) + (merged.float() * douts[0].float()).sum()
        runs.append(torch.autograd.grad(loss, leaves[:13]))
    assert not tr._RESIDENT_FALLBACKS, tr._RESIDENT_FALLBACKS  # sized from the compiled kernels, not guessed
    for kind in ("bwd", "bwd_stats"):
        sized = [v for k, v in tr._RESIDENT.items() if k[0] == kind]
        assert sized and all(isinstance(v, int) and 1 <= v <= 32 for v in sized), (kind, sized)
    for a, b in zip(*runs):
        assert rel_err(a, b.double()) < 1e-3


@gpu
@pytest.mark.gpu
def test_offset_tables_are_reused_and_correct():
    """A source layout seen before gets the same device table back (no copy per call); the table
    holds each tensor's element offset from the base, then the two spare 0s."""
    buf = torch.empty(4, 8, 16, device=DEVICE, dtype=torch.bfloat16)
    parts = [buf[i] for i in (0, 2, 3)]
    first = tr._offsets(parts, buf[0])
    assert tr._offsets(parts, buf[0]) is first
    assert first.tolist() == [0, 256, 384, 0, 0]
    other = tr._offsets([buf[1]], buf[0])
    assert other is not first and other.tolist() == [128, 0, 0]


def captured_training(residual, heads, block_size, batches, graphed):
    """Losses and final parameters of ``len(batches)`` AdamW steps (bf16 autocast, clipping) of a
    tiny model; with ``graphed``, the first three run on a side stream, the step is then captured
    as one CUDA graph and the rest are replays of it (new tokens copied into the captured input)."""
    model = tiny_model(residual, heads, block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    tokens = torch.empty_like(batches[0])

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = []
    side = torch.cuda.Stream() if graphed else torch.cuda.current_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in batches[:3] if graphed else batches:
            tokens.copy_(batch)
            losses.append(step().detach().clone())
    torch.cuda.current_stream().wait_stream(side)
    if graphed:
        graph = torch.cuda.CUDAGraph()
        before = [p.detach().clone() for p in model.parameters()]
        with torch.cuda.graph(graph):
            loss = step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # capturing runs no kernel
        # pinned host memory freed since is handed out again and overwritten: a captured offset
        # table's host side must not be among it
        junk = [torch.full((n,), 7, dtype=torch.int64, pin_memory=True) for n in range(1, 65) for _ in range(8)]  # every small size class
        for batch in batches[3:]:
            tokens.copy_(batch)
            graph.replay()
            losses.append(loss.detach().clone())
        del junk
    torch.cuda.synchronize()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("residual,heads,block_size", [("attnres", 2, 2), ("attnres", 2, 1), ("delta", 2, 2), ("delta", 2, 1)])
def test_training_step_captured_as_a_cuda_graph_replays_the_eager_steps(residual, heads, block_size):
    """A whole training step (routing on the fused kernels, forward, backward, clipping, AdamW)
    captured as a CUDA graph replays exactly what eager steps compute: the same losses on new
    tokens after the capture and the same parameters at the end, bit for bit (the kernels are
    deterministic). The routing op's offset tables made during capture keep their pinned host
    memory, which the captured copies re-read at every replay."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (2, 17), generator=g).to(DEVICE) for _ in range(6)]
    eager_losses, eager_params = captured_training(residual, heads, block_size, batches, graphed=False)
    graph_losses, graph_params = captured_training(residual, heads, block_size, batches, graphed=True)
    assert torch.isfinite(eager_losses).all() and len(set(eager_losses.tolist())) == 6  # the steps differ
    assert torch.equal(graph_losses, eager_losses), (graph_losses, eager_losses)
    for a, b in zip(graph_params, eager_params):
        assert torch.equal(a, b)


def tiny_model(residual, heads, block_size, n_layer=3, d_model=32):
    cfg = ModelConfig.from_name(
        "debug", residual=residual, heads=heads, block_size=block_size, d_model=d_model, n_layer=n_layer,
        n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=16,
    )
    torch.manual_seed(0)
    model = LM(cfg)
    g = torch.Generator().manual_seed(0)
    for site in model.routing_sites():  # non-zero queries and gates: routing is not uniform
        site.query.data = torch.randn(site.query.shape, generator=g)
        site.key_gain.data = 1 + 0.5 * torch.randn(site.key_gain.shape, generator=g)
        if site.gate is not None:
            site.gate.data = torch.randn(site.gate.shape, generator=g)
    # on a GPU machine the compiled kernels; on CPU the interpreter
    return model.to(DEVICE)


def triton_loss_and_grads(model, idx):
    """(loss, {name: gradient}) of one forward and backward of ``model`` on the Triton path."""
    model.zero_grad()
    with use_backend("triton"):
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "residual,heads,block_size,n_layer",
    [("attnres", 2, 1, 3), ("attnres", 4, 3, 3), ("delta", 2, 2, 3), ("delta", 8, 1, 3), ("attnres", 2, 1, 7), ("delta", 4, 1, 5),
     ("attnres", 2, 1, 6), ("delta", 2, 1, 4)],
    # more layers: a second group of sites (of 12 in full MHAR, 8 in Delta) whose phase one routes
    # over 13 (9) sources, where the site-loop backward takes over, and merges of up to 11 (7) sources;
    # the last site joining the group before it (JOIN_FINAL_SITE): blocks of 3 and 2 over 6
    # sublayers, full routing over 13 and 9 sites (merges of 12 and 8 sources)
    ids=["full-H2", "block-S3-H4-two-phase", "delta-block-S2-H2-two-phase", "delta-full-H8", "full-H2-15-sources", "delta-full-H4-11-sources",
         "full-H2-13-sites", "delta-full-H2-9-sites"],
)
def test_model_on_triton_path_matches_reference_path(residual, heads, block_size, n_layer):
    """Loss and every parameter gradient of the model on the Triton path (two-phase routing, the
    merges fused with the next RMSNorm) against the same model in float64 on the reference path.
    A gradient's float32 error is bounded by 1e-5 or, where it nearly cancels (the routing
    parameters' gradients are sums of products of O(1) terms giving 1e-4), by 3x the error of the
    float32 reference path, which routes the same way site by site."""
    import copy

    model = tiny_model(residual, heads, block_size, n_layer=n_layer)
    model64 = copy.deepcopy(model).double()
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = {}
    for name, m, backend in (("float64", model64, "reference"), ("reference", model, "reference"), ("triton", model, "triton")):
        m.zero_grad()
        with use_backend(backend):
            loss = torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        results[name] = loss.detach().double(), {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}
    (loss64, grads64), (_, grads_ref), (loss_tri, grads_tri) = results["float64"], results["reference"], results["triton"]
    torch.testing.assert_close(loss_tri, loss64, rtol=1e-6, atol=1e-6)
    assert grads_tri.keys() == grads64.keys()
    for name in grads64:
        if grads64[name].abs().max() < 1e-12:  # the first site sees one source: its query and gain get exactly 0
            assert grads_tri[name].abs().max() < 1e-6, name
            continue
        err = rel_err(grads_tri[name], grads64[name])
        assert err < max(1e-5, 3 * rel_err(grads_ref[name], grads64[name])), f"{name}: {err:.2e}"


@pytest.mark.parametrize("direct", [True, False], ids=["first-block-direct", "first-block-pass"])
@pytest.mark.parametrize(
    "join,max_sites", [(True, 16), (False, 16), (True, 4), (True, 3)], ids=["final-site-joins", "lone-final-site", "group-to-the-limit", "group-past-the-limit"]
)
def test_two_phase_model_calls_route_sites_once_per_block(monkeypatch, join, max_sites, direct):
    """Phase one runs once per block of sites: 6 sublayers + the final site in blocks of 3 are groups
    {0, 1, 2} and {3, 4, 5, 6}, the final site joining the block before it (JOIN_FINAL_SITE, the
    default; also where a group may hold 4 sites, JOIN_FINAL_SITE_MAX_SITES), or without it, or
    where a group may hold only 3 sites, {0, 1, 2}, {3, 4, 5}, {6}. The first block's sites, whose
    pass would see the embedding alone, are routed directly (FIRST_GROUP_DIRECT, the default)."""
    from lit_mhar import routing

    assert routing.JOIN_FINAL_SITE and routing.JOIN_FINAL_SITE_MAX_SITES == 16 and routing.FIRST_GROUP_DIRECT
    monkeypatch.setattr(routing, "JOIN_FINAL_SITE", join)
    monkeypatch.setattr(routing, "JOIN_FINAL_SITE_MAX_SITES", max_sites)
    monkeypatch.setattr(routing, "FIRST_GROUP_DIRECT", direct)
    model = tiny_model("attnres", 2, 3, n_layer=3)
    calls = []
    original = routing.route_sites
    monkeypatch.setattr(routing, "route_sites", lambda srcs, q, *a, **kw: calls.append((len(srcs), q.shape[0])) or original(srcs, q, *a, **kw))
    with use_backend("triton"):
        model(torch.randint(0, 97, (1, 5)).to(DEVICE))
    expected = [(1, 3), (2, 4)] if join and max_sites > 3 else [(1, 3), (2, 3), (3, 1)]
    assert calls == (expected[1:] if direct else expected)


@pytest.mark.parametrize("block_size,n_layer,direct_sites", [(3, 3, 3), (1, 7, 12), (1, 6, 13)], ids=["block-S3", "full-15-sources", "full-13-sites"])
def test_first_group_routed_directly_gives_the_pass_and_merge_results(monkeypatch, block_size, n_layer, direct_sites):
    """The first group's sites routed directly over their sources (route_norm, FIRST_GROUP_DIRECT;
    FIRST_GROUP_DIRECT_FULL in full routing) give the loss and every parameter gradient of phase one over the embedding alone and the
    merges, up to float32 rounding: route_norm runs once per site of the group (the final site too
    where it joins it), and the other groups still run phase one and the merges."""
    from lit_mhar import routing

    model = tiny_model("attnres", 2, block_size, n_layer=n_layer)
    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    runs, direct_calls = {}, []
    original = routing.route_norm
    monkeypatch.setattr(routing, "route_norm", lambda srcs, *a, **kw: direct_calls.append(len(srcs)) or original(srcs, *a, **kw))
    monkeypatch.setattr(routing, "FIRST_GROUP_DIRECT_FULL", True)  # (full routing's default: the pass)
    for direct in (False, True):
        monkeypatch.setattr(routing, "FIRST_GROUP_DIRECT", direct)
        runs[direct] = triton_loss_and_grads(model, idx)
        if not direct:
            assert direct_calls == []
    # the group's sites see the embedding and the sources added since: block routing the running
    # sum of the first block (site 0: the embedding alone), full routing each sublayer output
    expected = [1] + [2] * (direct_sites - 1) if block_size > 1 else list(range(1, direct_sites + 1))
    assert direct_calls == expected
    (loss_p, grads_p), (loss_d, grads_d) = runs[False], runs[True]
    assert (loss_d - loss_p).abs() <= 1e-6 * loss_p.abs()
    assert grads_d.keys() == grads_p.keys()
    for name in grads_p:
        if name.startswith("blocks.0.attn_site."):  # the model's first site routes over the embedding alone:
            # exact gradient 0; each path gives its float32 rounding (on the interpreter the direct one 0)
            scale = grads_p[name.replace("attn_site", "mlp_site")].abs().max()
            assert max(grads_d[name].abs().max(), grads_p[name].abs().max()) <= 1e-4 * scale, name
            continue
        scale = grads_p[name].abs().max()
        assert scale > 0 and (grads_d[name] - grads_p[name]).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("direct", [False, True], ids=["first-group-pass", "first-group-direct"])
@pytest.mark.parametrize(
    "residual,n_layer,join,calls_expected",
    [("attnres", 7, True, [(1, 12), (13, 3)]), ("delta", 7, True, [(1, 8), (9, 7)]), ("attnres", 6, True, [(1, 13)]),
     ("attnres", 6, False, [(1, 12), (13, 1)]), ("delta", 4, True, [(1, 9)]), ("delta", 4, False, [(1, 8), (9, 1)])],
)
def test_two_phase_full_routing_calls_route_sites_once_per_group(monkeypatch, residual, n_layer, join, calls_expected, direct):
    """Full routing's phase one runs once per group of sites: 12 in the replacement form
    (FULL_ROUTING_GROUP), 8 in the additive one (FULL_ROUTING_GROUP_ADDITIVE); the final site, where
    it would be alone (2L + 1 sites, 2L a multiple of the group), joins the group before it
    (JOIN_FINAL_SITE, the default). With FIRST_GROUP_DIRECT_FULL (not the default) the replacement
    form's first group, whose pass would see the embedding alone, is routed site by site; the
    additive form keeps that pass."""
    from lit_mhar import routing

    assert routing.JOIN_FINAL_SITE and routing.FIRST_GROUP_DIRECT and not routing.FIRST_GROUP_DIRECT_FULL
    monkeypatch.setattr(routing, "JOIN_FINAL_SITE", join)
    monkeypatch.setattr(routing, "FIRST_GROUP_DIRECT_FULL", direct)
    if direct and residual == "attnres":
        calls_expected = calls_expected[1:]
    model = tiny_model(residual, 2, 1, n_layer=n_layer)  # 2L sublayers + final site
    calls = []
    original = routing.route_sites
    monkeypatch.setattr(routing, "route_sites", lambda srcs, q, *a, **kw: calls.append((len(srcs), q.shape[0])) or original(srcs, q, *a, **kw))
    with use_backend("triton"):
        model(torch.randint(0, 97, (1, 5)).to(DEVICE))
    assert (routing.FULL_ROUTING_GROUP, routing.FULL_ROUTING_GROUP_ADDITIVE) == (12, 8) and calls == calls_expected


def test_compiled_model_has_no_graph_break_around_the_op():
    model = tiny_model("delta", 2, 2)
    idx = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with use_backend("triton"):
        eager = model(idx)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(idx)
        out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    assert all(p.grad is not None for p in model.routing_parameters() if p.requires_grad)


def test_custom_ops_pass_opcheck():
    sources, query, gain, stream, gate, grad = make_case(3, 2, 64, 5, torch.float32, True)
    args = ([s.requires_grad_() for s in sources], query[None].requires_grad_(), gain[None], 2, 1e-6, stream, gate, None, None, False, False, None, 0.0)
    torch.library.opcheck(torch.ops.lit_mhar.route_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    lse = torch.ops.lit_mhar.route_fwd(*args)[1].detach()
    for gate_ in (gate, None):  # the backward op too, with and without the outputs a form leaves empty
        bwd_args = ([s.detach() for s in sources], query[None], gain[None], 2, 1e-6, gate_, None, None, lse, [grad.float()], None, None, None, 0.0, None)
        torch.library.opcheck(torch.ops.lit_mhar.route_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))
    # two sites (the site loop): the forward saves each source's key rstd, which the backward takes
    queries2, gains2 = torch.stack([query, 0.5 * query]), torch.stack([gain, gain])
    args2 = ([s.detach().requires_grad_() for s in sources], queries2.requires_grad_(), gains2, 2, 1e-6, None, None, None, None, False, True, None, 0.0)
    torch.library.opcheck(torch.ops.lit_mhar.route_fwd, args2, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    res = torch.ops.lit_mhar.route_fwd(*args2)
    assert res[4].shape == (3, grad.numel() // 64)
    bwd_args = ([s.detach() for s in sources], queries2.detach(), gains2, 2, 1e-6, None, None, None, res[2].detach(), [grad.float()] * 2, None, res[4], None, 0.0, None)
    torch.library.opcheck(torch.ops.lit_mhar.route_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))
    # a merge fused with the next RMSNorm: a prior, one site, the norm's weight
    prior, prior_lse, weight = torch.randn_like(sources[0]), torch.randn(*sources[0].shape[:-1], 2, device=DEVICE), torch.rand(64, device=DEVICE) + 0.5
    args3 = ([s.detach().requires_grad_() for s in sources], query[None], gain[None], 2, 1e-6, None, None, prior.requires_grad_(), prior_lse, False, False, weight.requires_grad_(), 1e-5)
    torch.library.opcheck(torch.ops.lit_mhar.route_fwd, args3, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    lse3 = torch.ops.lit_mhar.route_fwd(*args3)[1].detach()
    bwd_args = ([s.detach() for s in sources], query[None], gain[None], 2, 1e-6, None, prior.detach(), prior_lse, lse3, [grad.float()], None, None, weight.detach(), 1e-5, None)
    torch.library.opcheck(torch.ops.lit_mhar.route_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))
    # the same in the additive form: the stream enters the norm, the backward takes it and returns its gradient
    args4 = (*args3[:5], stream, gate.requires_grad_(), *args3[7:])
    torch.library.opcheck(torch.ops.lit_mhar.route_fwd, args4, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    lse4 = torch.ops.lit_mhar.route_fwd(*args4)[1].detach()
    bwd_args = (*bwd_args[:5], gate.detach(), *bwd_args[6:8], lse4, *bwd_args[9:14], stream)
    torch.library.opcheck(torch.ops.lit_mhar.route_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))
    # bf16 sources and prior with a float32 stream (Delta under autocast): the output is bf16, also in the fake
    half = [s.detach().bfloat16().requires_grad_() for s in sources]
    args5 = (half, *args4[1:7], prior.detach().bfloat16(), *args4[8:])
    assert torch.ops.lit_mhar.route_fwd(*args5)[0].dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.lit_mhar.route_fwd, args5, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # the decode ops (no autograd): phase one of a group, and a site merging its prior
    history = torch.randn(6, 3, 64, device=DEVICE)
    queries, gains = torch.randn(2, 64, device=DEVICE), torch.ones(2, 64, device=DEVICE)
    with torch.no_grad():
        torch.library.opcheck(torch.ops.lit_mhar.route_sites_decode, (history, 3, queries, gains, 2, 1e-6), test_utils=("test_schema", "test_faketensor"))
        out, lse = torch.ops.lit_mhar.route_sites_decode(history, 3, queries, gains, 2, 1e-6)
        args = (history, 4, torch.randn(3, 64, device=DEVICE), True, queries[0], gains[0], 2, torch.ones(64, device=DEVICE), 1e-5, None, None, 1e-6, out[0], lse[0], 3)
        torch.library.opcheck(torch.ops.lit_mhar.route_norm_decode, args, test_utils=("test_schema", "test_faketensor"))


def test_split_decode_ignores_accumulate_without_a_pending_output():
    """accumulate has no meaning without a pending output: the never-written slot after the history
    (NaN here) is not read, on the split path (17 slots) as on the single-program one (3)."""
    for n in (3, 17):
        g = torch.Generator().manual_seed(n)
        history = torch.randn(n + 1, 2, 64, generator=g).to(DEVICE)
        history[n] = float("nan")
        q, gain, norm_w = 0.3 * torch.randn(64, generator=g), torch.ones(64), torch.ones(64)
        q, gain, norm_w = q.to(DEVICE), gain.to(DEVICE), norm_w.to(DEVICE)
        with torch.no_grad():
            y = tr.route_norm_decode(history.clone(), n, None, True, q, gain, 4, norm_w, 1e-5)
            ref = reference.route_norm_decode(history.double(), n, None, True, q.double(), gain.double(), 4, norm_w.double(), 1e-5)
        assert rel_err(y, ref) < TOL[torch.float32], n


def test_unsupported_sizes_raise_clear_errors():
    with use_backend("triton"):
        v = [torch.randn(3, 1024)]
        with pytest.MonkeyPatch.context() as mp:  # the two-pass backward, which holds every site's gradient
            mp.setattr(tr, "SITE_LOOP_MIN_SITES", 100)
            with pytest.raises(ValueError, match="route at most 8 sites per pass"):
                tr.route_sites(v, torch.randn(9, 1024), torch.ones(9, 1024))
        with pytest.raises(ValueError, match="more than the 16384"):
            tr.depth_route([torch.randn(2, 16385)], torch.randn(16385), torch.ones(16385))
        with pytest.raises(ValueError, match="dtype torch.float64"):
            tr.depth_route([torch.randn(2, 8, dtype=torch.float64)], torch.randn(8), torch.ones(8))
        with pytest.raises(ValueError, match="heads=3"):
            tr.depth_route([torch.randn(2, 8)], torch.randn(8), torch.ones(8), heads=3)


def test_dispatcher_picks_reference_on_cpu_and_triton_when_forced():
    from lit_mhar.kernels import resolve_backend

    x = torch.randn(2, 8)
    with use_backend("auto"):
        assert resolve_backend(x) == ("triton" if x.is_cuda else "reference")
    with use_backend("triton"):
        assert resolve_backend(x) == "triton"
    with use_backend("reference"):
        assert resolve_backend(x) == "reference"


@gpu
@pytest.mark.gpu
@pytest.mark.slow
def test_offsets_past_2_to_the_31_elements():
    """73 sources x 32768 tokens x 1280 channels = 3.06e9 elements: the gradient buffer [N, M, d]
    is indexed past 2**31. Rows far into the buffer are checked against the reference on a slice."""
    n, tokens, d, heads = 73, 32768, 1280, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.randn(tokens, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_() for _ in range(n)]
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    out = tr.depth_route(sources, query, gain, heads)
    grad = torch.randn(tokens, d, device="cuda", generator=g, dtype=torch.bfloat16)
    d_src = torch.autograd.grad(out, sources, grad)
    rows = slice(tokens - 97, tokens)
    sl = [s.detach()[rows].double().requires_grad_() for s in sources]
    ref = reference.depth_route(sl, query.detach().double(), gain.detach().double(), heads)
    ref_grads = torch.autograd.grad(ref, sl, grad[rows].double())
    assert rel_err(out[rows], ref) < TOL[torch.bfloat16]
    for i in (0, n // 2, n - 1):
        assert rel_err(d_src[i][rows], ref_grads[i]) < TOL[torch.bfloat16]
    assert all(torch.isfinite(x).all() for x in d_src)


@gpu
@pytest.mark.gpu
def test_site_loop_offsets_past_2_to_the_31_elements():
    """The site-loop backward (route_sites, 2 sites) at 73 x 32768 x 1280: source gradients indexed
    past 2**31, checked against the reference on the last rows."""
    n, tokens, d, heads, sites = 73, 32768, 1280, 8, 2
    g = torch.Generator(device="cuda").manual_seed(1)
    sources = [torch.randn(tokens, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_() for _ in range(n)]
    queries = 2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, device="cuda", generator=g)
    gains = 1 + 0.3 * torch.randn(sites, d, device="cuda", generator=g)
    douts = [torch.randn(tokens, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(sites)]
    outs, _ = tr.route_sites(sources, queries, gains, heads)
    d_src = torch.autograd.grad(outs, sources, douts)
    rows = slice(tokens - 97, tokens)
    sl = [s.detach()[rows].double().requires_grad_() for s in sources]
    ref, _ = reference.route_sites(sl, queries.double(), gains.double(), heads)
    ref_grads = torch.autograd.grad(ref, sl, [t[rows].double() for t in douts])
    for j in range(sites):
        assert rel_err(outs[j][rows], ref[j]) < TOL[torch.bfloat16]
    for i in (0, n // 2, n - 1):
        assert rel_err(d_src[i][rows], ref_grads[i]) < TOL[torch.bfloat16]
    assert all(torch.isfinite(x).all() for x in d_src)


def check_decode(n, heads, d, tokens, dtype, additive, pending, accumulate, seed=0, device=DEVICE):
    """The fused decode op (routing + next RMSNorm, pending output stored in its slot) against float64."""
    g = torch.Generator().manual_seed(seed)
    slots = n + 2
    history = (torch.randn(slots, tokens, d, generator=g) * (0.5 + torch.arange(slots) % 3)[:, None, None]).to(device, dtype)
    out_new = torch.randn(tokens, d, generator=g).to(device, dtype) if pending else None
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    norm_w = (1 + 0.2 * torch.randn(d, generator=g)).to(device)
    stream = torch.randn(tokens, d, generator=g).to(device) if additive else None
    gate = torch.randn(d, generator=g).to(device) if additive else None
    h_tri, h_ref = history.clone(), history.double()
    with torch.no_grad():
        y = tr.route_norm_decode(h_tri, n, out_new, accumulate, query, gain, heads, norm_w, 1e-5, stream, gate)
        d64 = (lambda t: None if t is None else t.double())
        y_ref = reference.route_norm_decode(h_ref, n, d64(out_new), accumulate, query.double(), gain.double(), heads, norm_w.double(), 1e-5, d64(stream), d64(gate))
    assert y.dtype == torch.promote_types(stream.dtype if additive else dtype, norm_w.dtype)
    assert rel_err(y, y_ref) < TOL[dtype]
    if pending:  # the slot now holds the (accumulated) output, in the history's dtype
        assert rel_err(h_tri[n], h_ref[n]) < TOL[dtype]
    untouched = [i for i in range(slots) if not (pending and i == n)]
    assert torch.equal(h_tri[untouched], history[untouched])


DECODE_CPU = [
    (1, 1, 64, 3, torch.float32, False, False, False),
    (1, 2, 96, 5, torch.float32, False, True, False),
    (4, 8, 1024, 2, torch.bfloat16, False, True, True),
    (9, 4, 1000, 7, torch.float32, True, True, True),
    (33, 16, 64, 1, torch.bfloat16, True, True, False),
    (73, 16, 96, 3, torch.float32, False, True, True),
    # around the split of long histories over programs (16 slots each): 16 in one program; 17 with
    # the pending output alone in the second; 32 exactly two
    (15, 2, 64, 2, torch.bfloat16, True, True, True),
    (16, 2, 64, 2, torch.float32, False, True, True),
    (32, 4, 96, 3, torch.bfloat16, False, False, False),
    # head counts that are not powers of two (padding heads) on the split path
    (17, 3, 96, 2, torch.float32, False, True, True),
    (20, 6, 96, 3, torch.bfloat16, True, False, False),
]
DECODE_GPU = list(itertools.product((1, 2, 9, 33, 73), (1, 8), (64, 1000, 1024, 1280), (1, 37), (torch.float32, torch.bfloat16), (False, True), (True,), (False, True)))


def decode_id(n, h, d, t, dt, add, pend, acc):
    return f"N{n}-H{h}-d{d}-T{t}-{str(dt).split('.')[-1]}-{'additive' if add else 'replace'}-{'pending-' + ('add' if acc else 'new') if pend else 'first'}"


@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive,pending,accumulate", DECODE_CPU, ids=[decode_id(*c) for c in DECODE_CPU])
def test_route_norm_decode_matches_float64_reference(n, heads, d, tokens, dtype, additive, pending, accumulate):
    check_decode(n, heads, d, tokens, dtype, additive, pending, accumulate)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,heads,d,tokens,dtype,additive,pending,accumulate", DECODE_GPU, ids=[decode_id(*c) for c in DECODE_GPU])
def test_route_norm_decode_matches_float64_reference_full_grid(n, heads, d, tokens, dtype, additive, pending, accumulate):
    check_decode(n, heads, d, tokens, dtype, additive, pending, accumulate)


def check_grouped_decode(n, n_prior, heads, d, tokens, dtype, additive, pending, accumulate, group=3, seed=0, device=DEVICE):
    """Phase one of a group of decode sites (route_sites_decode over slots 0 .. n_prior - 1) and each
    site's fused op merging that prior with the later slots, against float64 per-site routing."""
    g = torch.Generator().manual_seed(seed)
    slots = n + 2
    history = (torch.randn(slots, tokens, d, generator=g) * (0.5 + torch.arange(slots) % 3)[:, None, None]).to(device, dtype)
    history[n + 1] = float("nan")  # never read
    out_new = torch.randn(tokens, d, generator=g).to(device, dtype) if pending else None
    queries = (2.0 * (heads / d) ** 0.5 * torch.randn(group, d, generator=g)).to(device)
    gains = (1 + 0.3 * torch.randn(group, d, generator=g)).to(device)
    norm_w = (1 + 0.2 * torch.randn(d, generator=g)).to(device)
    stream = torch.randn(tokens, d, generator=g).to(device) if additive else None
    gate = torch.randn(d, generator=g).to(device) if additive else None
    d64 = (lambda t: None if t is None else t.double())
    with torch.no_grad():
        prior_out, prior_lse = tr.route_sites_decode(history, n_prior, queries, gains, heads)
        ref_out, ref_lse = reference.route_sites_decode(history.double(), n_prior, queries.double(), gains.double(), heads)
        assert prior_out.dtype == prior_lse.dtype == torch.float32
        assert prior_out.shape == (group, tokens, d) and prior_lse.shape == (group, tokens, heads)
        assert rel_err(prior_out, ref_out) < TOL[torch.float32] and rel_err(prior_lse, ref_lse) < TOL[torch.float32]
        for k in range(group):
            h_tri, h_ref = history.clone(), history.double()
            y = tr.route_norm_decode(
                h_tri, n, out_new, accumulate, queries[k], gains[k], heads, norm_w, 1e-5, stream, gate, 1e-6,
                prior_out[k], prior_lse[k], n_prior,
            )
            y_ref = reference.route_norm_decode(  # per site, no prior
                h_ref, n, d64(out_new), accumulate, queries[k].double(), gains[k].double(), heads, norm_w.double(), 1e-5, d64(stream), d64(gate)
            )
            assert rel_err(y, y_ref) < TOL[dtype], k
            if pending:
                assert rel_err(h_tri[n], h_ref[n]) < TOL[dtype]
            untouched = [i for i in range(slots) if not (pending and i == n)]
            torch.testing.assert_close(h_tri[untouched], history[untouched], rtol=0, atol=0, equal_nan=True)
            # the reference with the float64 prior gives the same as without one
            y_ref_prior = reference.route_norm_decode(
                history.double(), n, d64(out_new), accumulate, queries[k].double(), gains[k].double(), heads, norm_w.double(), 1e-5,
                d64(stream), d64(gate), 1e-6, ref_out[k], ref_lse[k], n_prior,
            )
            assert rel_err(y_ref_prior, y_ref) < 1e-12


GROUPED_DECODE_CPU = [
    # n, n_prior, heads, d, tokens, dtype, additive, pending, accumulate
    (20, 16, 8, 64, 3, torch.float32, False, True, False),
    (23, 16, 3, 96, 2, torch.bfloat16, True, True, True),  # padding heads
    (16, 16, 2, 64, 1, torch.float32, False, True, False),  # only the pending output after the prior
    (18, 18, 4, 64, 2, torch.float32, True, False, False),  # nothing after the prior
    (40, 1, 1, 1000, 2, torch.float32, False, True, True),  # more than one tile after the prior
]
GROUPED_DECODE_GPU = [
    (n, p, h, d, t, dt, add, pend, acc)
    for (n, p) in ((16, 16), (23, 16), (48, 40), (73, 1), (73, 64))
    for h, d, t, dt, add, pend, acc in itertools.product((1, 8), (1000, 1024), (1, 37), (torch.float32, torch.bfloat16), (False, True), (True,), (False,))
]


@pytest.mark.parametrize("case", GROUPED_DECODE_CPU, ids=[decode_id(c[0], *c[2:]) + f"-prior{c[1]}" for c in GROUPED_DECODE_CPU])
def test_grouped_decode_matches_float64_per_site_routing(case):
    check_grouped_decode(*case)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", GROUPED_DECODE_GPU, ids=[decode_id(c[0], *c[2:]) + f"-prior{c[1]}" for c in GROUPED_DECODE_GPU])
def test_grouped_decode_matches_float64_per_site_routing_full_grid(case):
    check_grouped_decode(*case)


@pytest.mark.parametrize("impl", [reference, tr], ids=["reference", "triton"])
def test_grouped_decode_refuses_bad_arguments_before_writing(impl):
    history = torch.randn(6, 3, 8)
    before = history.clone()
    q, gain = torch.randn(2, 8), torch.ones(2, 8)
    bad_sites = [
        ((history, 0, q, gain, 2), "n_sources=0"),
        ((history, 7, q, gain, 2), "n_sources=7"),
        ((history, 2, q[0], gain[0], 2), "must both be \\[G, 8\\]"),
        ((history, 2, q, gain[:1], 2), "must both be"),
        ((history, 2, q, gain, 3), "heads=3"),
        ((history[:, :, :4].transpose(0, 1), 2, q[:, :4], gain[:, :4], 2), "contiguous"),
    ]
    args = dict(query=q[0], gain=gain[0], heads=2, norm_weight=torch.ones(8), norm_eps=1e-5)
    out, lse = torch.zeros(3, 8), torch.zeros(3, 2)
    bad_prior = [
        (dict(prior_out=out), "prior_out and prior_lse together"),
        (dict(n_prior=2), "n_prior=2 without a prior"),
        (dict(prior_out=out, prior_lse=lse, n_prior=0), "n_prior=0 must be"),
        (dict(prior_out=out, prior_lse=lse, n_prior=4), "n_prior=4 must be"),
        (dict(prior_out=out[:2], prior_lse=lse, n_prior=1), "prior_out must be a floating \\(3, 8\\)"),
        (dict(prior_out=out, prior_lse=torch.zeros(3, 4), n_prior=1), "prior_lse must be a floating \\(3, 2\\)"),
    ]
    bad_prior.append((dict(prior_out=out.long(), prior_lse=lse, n_prior=1), "got \\(3, 8\\) torch.int64 on cpu"))
    bad_sites.append(((history, 2, q.long(), gain, 2), "queries and gains must be floating"))
    bad_sites.append(((history, 2, q, gain.to("meta"), 2), "site 0 of queries / gains: .*meta"))
    if impl is tr:
        bad_prior.append((dict(prior_out=out.double(), prior_lse=lse, n_prior=1), "float32"))
    with use_backend("triton"), torch.no_grad():
        for call_args, match in bad_sites:
            with pytest.raises(ValueError, match=match):
                impl.route_sites_decode(*call_args)
        for kw, match in bad_prior:
            with pytest.raises(ValueError, match=match):
                impl.route_norm_decode(history, 3, torch.randn(3, 8), False, **args, eps=1e-6, **kw)
            assert torch.equal(history, before), match
    with pytest.raises(ValueError, match="inference"):
        impl.route_sites_decode(history, 2, q.requires_grad_(), gain, 2)


def test_dispatchers_refuse_a_history_that_is_not_a_tensor():
    from lit_mhar import kernels

    with pytest.raises(ValueError, match="route_sites_decode: history: expected a tensor, got list"):
        kernels.route_sites_decode([torch.randn(3, 8)], 1, torch.randn(1, 8), torch.ones(1, 8), 2)
    with pytest.raises(ValueError, match="route_norm_decode: history: expected a tensor, got list"):
        kernels.route_norm_decode([torch.randn(3, 8)], 1, None, False, torch.randn(8), torch.ones(8), 2, torch.ones(8), 1e-5)


@pytest.mark.parametrize("impl", [reference.route_norm_decode, tr.route_norm_decode], ids=["reference", "triton"])
def test_route_norm_decode_refuses_bad_arguments_before_writing(impl):
    history = torch.randn(4, 3, 8)
    before = history.clone()
    args = dict(query=torch.randn(8), gain=torch.ones(8), heads=2, norm_weight=torch.ones(8), norm_eps=1e-5)
    pending = torch.randn(3, 8)
    bad = [
        ((history, 4, pending, False), {}, "n_sources=4"),
        ((history, None, pending, False), {}, "n_sources=None"),
        ((history, 1, torch.randn(2, 8), False), {}, "pending has shape"),
        ((history, 1, pending.long(), False), {}, "pending must be a floating tensor"),
        ((history, 1, pending.to("meta"), False), {}, "pending must be a floating tensor on cpu"),
        ((history, 1, pending, 1), {}, "accumulate=1"),
        ((history, 1, None, False), {"heads": 3}, "heads=3"),
        ((history, 1, pending, False), {"query": None}, "query is None"),
        ((history, 1, pending, False), {"gain": torch.ones(8, device="meta")}, "gain is on meta"),
        ((history, 1, pending, False), {"norm_weight": None}, "norm_weight must be a"),
        ((history, 1, pending, False), {"norm_eps": -1.0}, "norm_eps=-1.0"),
        ((history, 1, pending, False), {"eps": float("nan")}, "eps=nan"),
        ((history[0].expand(4, 3, 8), 1, pending, False), {}, "must be contiguous"),
        ((torch.randn(4, 3, 0), 1, torch.randn(3, 0), False), {"query": torch.randn(0), "gain": torch.ones(0), "norm_weight": torch.ones(0)}, "width d=0"),
    ]
    with use_backend("triton"), torch.no_grad():
        for call_args, kw, match in bad:
            with pytest.raises(ValueError, match=match):
                impl(*call_args, **{**args, **kw})
            assert torch.equal(history, before), match
    with pytest.raises(ValueError, match="inference"):
        impl(history, 1, torch.randn(3, 8, requires_grad=True), False, **args)
    assert torch.equal(history, before)
