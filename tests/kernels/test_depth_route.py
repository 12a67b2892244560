"""``depth_route`` (one site, AttnRes eqs. 2-6, MHAR, Delta AttnRes) on the fused kernels against
the float64 reference: the output, the weights and every gradient (sources, query, gain, stream,
gate) over N = 1 to 73 sources, head counts 1 to 16, power-of-two and split head widths, both
dtypes and forms, odd token counts; the same bits on the eager path and the custom op's; a second
derivative refused; deterministic gradients; the custom ops' schemas; offsets past 2^31 (GPU).

Without a GPU the kernels run in Triton's interpreter on CPU tensors; the CPU cases are a
representative subset, the full grid is marked ``gpu``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import DEVICE, TOL, case_id, check_route, gpu, make_case, rel_err, two_phase_vs_plain

from lit_mhar.kernels import dispatch, launch, reference, use_backend
from lit_mhar.kernels import triton_routing as tr


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


@pytest.mark.parametrize("d,heads", [(96, 8), (160, 8), (48, 1), (24, 8)], ids=["d96-H8", "d160-H8", "d48-H1", "d24-H8"])
def test_split_head_widths_match_float64_reference(d, heads):
    """A head width d/H that is a sum of two powers of two (12 = 8 + 4, 20 = 16 + 4, 48 = 32 + 16,
    3 = 2 + 1; at full size 96 = 64 + 32 and 160 = 128 + 32) runs as two tiles per head: outputs
    and every gradient against float64, through the two-pass backward (additive), the site loop
    (9 sources; its pass two loading the saved key rstd, and, with fewer heads allowed to, recomputing
    it), phase one with its merges (two-phase block routing)."""
    bh, bdh, dt, lanes = dispatch.lanes(d, heads)
    assert dt > 0 and bdh + dt == d // heads and lanes == bh * (d // heads)
    assert dispatch.vector_tile("fwd", 1, d, heads, True)["DT"] == dt
    for rstd_heads in (heads, heads - 1):  # pass two of the site loop loads the saved key rstd, then recomputes it
        with dispatch.overrides(SPLIT_SOURCES_RSTD_HEADS=rstd_heads), use_backend("triton"):
            check_route(2, heads, d, 37, torch.bfloat16, True)
            check_route(9, heads, d, 37, torch.float32, False)
        for additive in (False, True):
            out_errs, grad_errs = two_phase_vs_plain(3, 3, heads, d, 37, torch.float32, additive)
            assert max(out_errs) < TOL[torch.float32] and max(grad_errs) < TOL[torch.float32], (additive, out_errs, grad_errs)


@pytest.mark.parametrize("eager_function", [True, False], ids=["eager", "custom-op"])
def test_double_backward_is_refused(monkeypatch, eager_function):
    """The kernels' gradients are not differentiable again: asking for a second derivative raises
    on both autograd paths (eager, and the custom op torch.compile runs) instead of returning a
    wrong one."""
    if not eager_function:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
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
    """Eager calls run the op's autograd through a torch.autograd.Function, torch.compile through
    the custom op's registered autograd (here: ``torch.compiler.is_compiling`` made true): same
    kernels, so the same bits, for phase one, a merge with a prior (and the additive form's stream
    and gate) and their gradients."""
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(2, 19, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]
    partial = torch.randn(2, 19, 64, generator=g).to(DEVICE, torch.bfloat16)
    queries, gains = (0.5 * torch.randn(2, 64, generator=g)).to(DEVICE), (1 + 0.2 * torch.randn(2, 64, generator=g)).to(DEVICE)
    stream = torch.randn(2, 19, 64, generator=g).to(DEVICE) if additive else None
    gate = torch.randn(64, generator=g).to(DEVICE) if additive else None
    dout = torch.randn(2, 19, 64, generator=g).to(DEVICE)

    def run(eager_function):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: not eager_function)
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


@gpu
@pytest.mark.gpu
def test_offset_tables_are_reused_and_correct():
    """A source layout seen before gets the same device table back (no copy per call); the table
    holds each tensor's element offset from the base, then the two spare 0s."""
    buf = torch.empty(4, 8, 16, device=DEVICE, dtype=torch.bfloat16)
    parts = [buf[i] for i in (0, 2, 3)]
    first = launch.offsets(parts, buf[0])
    assert launch.offsets(parts, buf[0]) is first
    assert first.tolist() == [0, 256, 384, 0, 0]
    other = launch.offsets([buf[1]], buf[0])
    assert other is not first and other.tolist() == [128, 0, 0]


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
