"""Decoding on the fused kernels (``route_norm_decode``: one kernel per routing site adding the
newest output to its slot, routing and applying the next RMSNorm; ``route_sites_decode``: phase
one of a group of sites) against float64 per-site routing: every slot count (long histories split
over programs and merged), head counts, widths, both dtypes and forms, a pending output added or
accumulated, a prior merged; bad arguments refused before anything is written.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import DEVICE, TOL, gpu, rel_err

from lit_mhar.kernels import reference, use_backend
from lit_mhar.kernels import triton_routing as tr


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
