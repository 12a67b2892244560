"""``route_sites`` (phase one of two-phase routing: S sites over the same sources in one pass) and
its merges (``merge_route``, phase two) against plain per-site float64 routing: outputs, lse and
every gradient, for block routing's shapes, site groups of 1 to 8 per forward program (a group
narrowed to fit wide widths), the site loop's backward with the key rstd saved or recomputed; the
site loop deterministic; offsets past 2^31 (GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import DEVICE, TOL, gpu, make_case, rel_err, two_phase_id, two_phase_vs_plain

from lit_mhar.kernels import autograd, dispatch, reference, use_backend
from lit_mhar.kernels import triton_routing as tr


TWO_PHASE_CPU = [(3, 3, 2, 64, 37, torch.float32, False), (4, 4, 4, 96, 70, torch.bfloat16, True), (2, 2, 1, 1000, 13, torch.float32, True), (8, 9, 8, 64, 5, torch.float32, False)]


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


@pytest.mark.parametrize("fwd_sites", [1, 2, 4, 8])
def test_site_groups_match_float64_reference(fwd_sites):
    """Phase one with up to 1, 2 (the plan's), 4 or 8 sites per forward program (``FWD_SITES``):
    a group divides S, so S = 8 runs the size asked, S = 6 at most 2 and S = 5 one. Outputs, lse
    and every gradient against float64 routing, on a token count no tile divides."""
    for sites in (8, 6, 5):
        dividing = fwd_sites if sites == 8 else min(2, fwd_sites) if sites == 6 else 1
        assert dispatch.group_sites(sites, fwd_sites, 96, 4) == dividing
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

        with use_backend("triton"), dispatch.overrides(FWD_SITES=fwd_sites):
            assert dispatch.plan(dispatch.Call("route", 3, sites, 96, 4, torch.float32), True).forward[0].meta["BS"] == dividing
            got = run(tr, lambda x: x.detach().clone())
        ref = run(reference, lambda x: x.detach().double())
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) < TOL[torch.float32], (sites, errs)


@pytest.mark.parametrize("sites,n", [(3, 4), (1, 9)], ids=["phase-one", "one-site-N9"])
def test_saved_rstd_matches_float64_reference(monkeypatch, sites, n):
    """The site loop's backward with each source's key rstd saved by the forward and, where the
    forward saved none (a backward through the custom op called without it), recomputing it: the
    saved values equal the float64 RMSNorm rstd, and both paths' outputs and gradients match
    float64 routing to the float32 tolerance."""
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
        if not save:
            monkeypatch.setattr(autograd, "saves_rstd", lambda *args: False)
        with use_backend("triton"):
            res = autograd.route([x.detach().requires_grad_() for x in srcs], queries, gains, 4, 1e-6, None, None, None, None, False)
            got = run(tr, lambda x: x.detach().clone())
        if save:
            rstd64 = torch.stack([x.double().square().mean(-1).add(1e-6).rsqrt().flatten() for x in srcs])
            assert rel_err(res[sites + 2], rstd64) < 1e-6
        else:
            assert res[sites + 2].numel() == 0
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) < TOL[torch.float32], (save, errs)


def test_saved_rstd_only_when_a_backward_will_run():
    """No key rstd is written under no_grad or when no input requires a gradient."""
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(7, 32, generator=g).to(DEVICE) for _ in range(3)]
    queries, gains = torch.randn(2, 32, generator=g).to(DEVICE), torch.ones(2, 32, device=DEVICE)
    with use_backend("triton"):
        assert autograd.route(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)[4].numel() == 0
        q = queries.clone().requires_grad_()
        assert autograd.route(srcs, q, gains, 2, 1e-6, None, None, None, None, False)[4].shape == (3, 7)
        with torch.no_grad():
            assert autograd.route(srcs, q, gains, 2, 1e-6, None, None, None, None, False)[4].numel() == 0


def test_site_groups_shrink_to_fit_wide_widths():
    """A width whose padded lanes times the site group exceed the tile budget routes fewer sites per
    program instead of refusing: d = 5120 (8192 lanes at H = 8) with groups of 8 asked for."""
    assert dispatch.group_sites(8, 8, 5120, 8) == 1 and dispatch.group_sites(8, 8, 1024, 8) == 8
    g = torch.Generator().manual_seed(6)
    srcs = [torch.randn(3, 5120, generator=g).to(DEVICE) for _ in range(2)]
    queries = (0.05 * torch.randn(2, 5120, generator=g)).to(DEVICE)
    gains = torch.ones(2, 5120, device=DEVICE)
    leaves = [x.clone().requires_grad_() for x in (*srcs, queries)]
    with use_backend("triton"), dispatch.overrides(FWD_SITES=8):
        outs, lse = tr.route_sites(leaves[:2], leaves[2], gains, 8)
    grads = torch.autograd.grad(sum(o.sum() for o in outs), leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (*srcs, queries)]
    ref, ref_lse = reference.route_sites(ref_leaves[:2], ref_leaves[2], gains.double(), 8)
    ref_grads = torch.autograd.grad(sum(o.sum() for o in ref), ref_leaves)
    errs = [rel_err(a, b) for a, b in zip([*outs, lse, *grads], [*ref, ref_lse, *ref_grads])]
    assert max(errs) < TOL[torch.float32], errs


def test_reference_two_phase_equals_plain_routing_in_float64():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(4, 5, 24, generator=g, dtype=torch.float64) for _ in range(4)]
    b = [torch.randn(4, 5, 24, generator=g, dtype=torch.float64)]
    q, gain = torch.randn(2, 24, generator=g, dtype=torch.float64), torch.rand(2, 24, generator=g, dtype=torch.float64) + 0.5
    outs, lse = reference.route_sites(a, q, gain, heads=4)
    for j in range(2):
        torch.testing.assert_close(reference.merge_route(b, q[j], gain[j], 4, outs[j], lse[j]), reference.depth_route(a + b, q[j], gain[j], 4), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outs[j], reference.depth_route(a, q[j], gain[j], 4), rtol=1e-12, atol=1e-12)


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
