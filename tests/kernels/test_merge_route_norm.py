"""``merge_route_norm`` (phase two of two-phase routing fused with the next RMSNorm: one kernel
forward, one backward) against the float64 reference: the output and every gradient (sources,
query, gain, prior and its lse, the norm weight; stream and gate), for 0 to 7 newer sources, both
forms, split and padded head widths; a one-source merge keeping its source for pass two; the routed
value r saved in float32 for a one-pass backward where the plan says so (and only where a backward
will run); the additive form's stream replayed from its start, a block's running sum rebuilt from
its outputs, earlier outputs added first, each giving the saved path's gradients; bad arguments
refused before any work.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import CUDA, DEVICE, TOL, check_merge_route_norm, gpu, merge_norm_id, rel_err, spy_launches

from lit_mhar.kernels import GradientSink, autograd, dispatch, launch, reference, use_backend
from lit_mhar.kernels import triton_routing as tr


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
    (3, 2, 96, 37, torch.bfloat16, True),  # the additive form at and above SAVE_ROUTED_MIN_SOURCES (two passes: no saved r)
    (4, 4, 1000, 9, torch.float32, True),
]


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
def test_merge_over_one_source_keeps_it_for_pass_two(monkeypatch, heads, d, tokens, dtype, additive, sink):
    """A fused-norm merge over one source (block routing's merges over the running sum) runs the
    two-pass backward with KEEP_SOURCE (pass two reuses pass one's source, rstd, scores and weights),
    in the replacement form with PREFETCH_TILE too (each program loads its next tile's inputs during
    this one; tiles of 16 tokens so that programs take several), with and without a gradient sink:
    output and every gradient within the bf16 / float32 tolerance of float64 (the sink's sums too)."""
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

    with dispatch.overrides(INTERPRET_ROWS=16):
        got = run(tr.merge_route_norm)
    (bwd,) = [f for name, f in zip(launched, launched.flags) if name == "bwd"]
    assert bwd["KEEP_SOURCE"] and bwd["PREFETCH_TILE"] == (not additive), bwd
    ref = run(reference.merge_route_norm, double=True)
    for a, r in zip(got, ref):
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


def merge_norm_side_inputs(g, tokens, d, heads, dtype):
    """Random prior ``[tokens, d]``, its lse ``[tokens, heads]``, query, gain, norm weight and gate
    ``[d]``, and an output gradient ``[tokens, d]`` for merge_route_norm."""
    prior = torch.randn((tokens, d), generator=g).to(DEVICE, dtype)
    prior_lse = torch.randn((tokens, heads), generator=g).to(DEVICE)
    query, gain, weight, gate = (torch.randn(d, generator=g).to(DEVICE) for _ in range(4))
    return prior, prior_lse, query, gain, weight, gate, torch.randn((tokens, d), generator=g).to(DEVICE, dtype)


# (sources, heads, d, tokens, dtype, form): below SAVE_ROUTED_MIN_SOURCES (the prior kept, two
# passes), at and above it, a split head width (96 = 64 + 32 lanes at H = 1; 48 = 32 + 16) and a
# padded one (1000 / 4); the additive form (never r) with its stream saved, or replayed from its start
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
    """An eager fused merge of the replacement form over at least SAVE_ROUTED_MIN_SOURCES sources
    keeps the routed value r (float32, the norm's input) for its one-pass backward and not the prior,
    which the caller may then free; below that, in the additive form, and through the custom op
    (``torch.compile``'s path, here ``torch.compiler.is_compiling`` made true) it keeps the prior and
    runs two passes. The output is bit-identical on both paths, and every gradient equal to float32
    rounding (r unrounded: the prior's lse gradient from D - sum_i alpha_i <dr, v_i>_h - p_alpha D).
    The additive form's stream given as its start (``stream_start``) is kept instead of the stream
    on the eager path."""
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
    for save in (False, True):  # the custom op's path, the eager one
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: not save)
        extra = (stream, gate) if additive else ()
        leaves = [x.detach().clone().requires_grad_() for x in (*sources, query, gain, prior, prior_lse, weight, *extra)]
        kw = dict(stream=leaves[n + 5], gate=leaves[n + 6], stream_start=start if replayed else None) if additive else {}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = tr.merge_route_norm(leaves[:n], leaves[n], leaves[n + 1], heads, leaves[n + 2], leaves[n + 3], leaves[n + 4], 1e-5, **kw)
        keeps_r = save and not additive and n >= dispatch.SAVE_ROUTED_MIN_SOURCES
        assert any(t is leaves[n + 2] for t in saved) != keeps_r
        routed = [
            t for t in saved
            if t.shape == prior.shape and t.dtype == torch.float32 and not any(t is x for x in (*leaves, start))
        ]
        assert len(routed) == keeps_r
        if additive:  # the stream kept as given, or (eager) its start
            assert any(t is (start if replayed and save else leaves[n + 5]) for t in saved)
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


def test_additive_merge_saves_no_routed_value_where_its_running_sum_is_rebuilt():
    """No fused merge of the additive form saves a routed value r (the replacement form's over 3 or
    more sources does): block routing's, rebuilt from a block's outputs (``block_outputs``), keeps
    them and its prior (its backward's first pass rebuilds the running sum), and the stream's start
    instead of the stream; also where a one-source merge would qualify."""
    g = torch.Generator().manual_seed(5)
    outputs = [torch.randn(9, 32, generator=g).to(DEVICE) for _ in range(4)]
    running = outputs[0]
    for o in outputs[1:]:
        running = running + o
    start = torch.randn(9, 32, generator=g).to(DEVICE)
    stream = start + sum(outputs)
    prior, prior_lse, query, gain, weight, gate, _ = merge_norm_side_inputs(g, 9, 32, 4, torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in (query, prior, weight, gate)]
    assert not autograd.saves_routed([running] * 3, leaves[0], gain, 4, stream, leaves[1], prior_lse, leaves[2])
    assert autograd.saves_routed([running] * 3, leaves[0], gain, 4, None, leaves[1], prior_lse, leaves[2])
    for rebuilt in (True, False):
        kw = dict(stream_start=start, block_outputs=outputs) if rebuilt else {}
        saved = []
        with dispatch.overrides(SAVE_ROUTED_MIN_SOURCES=1), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            assert autograd.saves_routed([running], leaves[0], gain, 4, None, leaves[1], prior_lse, leaves[2])
            y = tr.merge_route_norm([running], leaves[0], gain, 4, leaves[1], prior_lse, leaves[2], 1e-5, stream=stream, gate=leaves[3], **kw)
        grads = torch.autograd.grad(y, leaves, torch.ones_like(y))  # the backward runs (a saved r with REBUILD raises)
        assert all(g_.isfinite().all() for g_ in grads)
        assert any(t is leaves[1] for t in saved)  # the prior, not r in its place
        assert all(any(t is o for t in saved) for o in outputs) == rebuilt  # the block's outputs, not the running sum
        assert any(t is start for t in saved) == rebuilt and any(t is stream for t in saved) != rebuilt


def test_merge_route_norm_writes_no_routed_value_without_a_backward(monkeypatch):
    """The routed value r is written only where a backward will run: not under no_grad (validation,
    a prefill) nor where no input requires a gradient."""
    g = torch.Generator().manual_seed(4)
    sources = [torch.randn(9, 32, generator=g).to(DEVICE) for _ in range(3)]
    prior, prior_lse, query, gain, weight, _, _ = merge_norm_side_inputs(g, 9, 32, 4, torch.float32)
    asked = []
    forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a, **k: asked.append(k.get("save_routed", False)) or forward(*a, **k))
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
    if CUDA and dtype == torch.float32:  # known, not understood: docs/benchmarks/history, sixteenth set
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
