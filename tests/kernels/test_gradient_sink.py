"""The gradient sink (:class:`lit_mhar.kernels.GradientSink`): the backward kernels of the routing
passes add each source's gradient into one buffer per source, and Delta's residual stream's too,
instead of autograd adding the gradients of every op that read it. Proves: the sums equal
autograd's (op level, float64 reference and Triton, also pass by pass and over a backward of some
inputs then all); the model's gradients with the sink equal those of histories built without it;
hooks on a Delta block's output see the whole stream gradient; sources the sink did not collect,
and a second derivative, are refused.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import DEVICE, TOL, gpu, model_histories, rel_err, tiny_model, triton_loss_and_grads

from lit_mhar.kernels import reference, use_backend
from lit_mhar.kernels import triton_routing as tr


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
    """The model's two-phase routing with the sink (default) against its depth histories built
    without one (``DepthHistory(sink=False)``): same loss, gradients equal to float32 rounding; the
    sink is dropped when gradients are off."""
    from lit_mhar import routing

    model = tiny_model(residual, 4, block_size, n_layer=7 if block_size == 1 else 5)  # full MHAR: two groups of sites (12, 3)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for on in (True, False):
        model_histories(monkeypatch, sink=on)
        results.append(triton_loss_and_grads(model, idx))
    (loss_on, g_on), (loss_off, g_off) = results
    assert torch.equal(loss_on, loss_off) and g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-6, msg=name)
    assert routing.DepthHistory(torch.zeros(2, 3, 8), 2, model.routing_sites(), two_phase=True, sink=False).sink is None
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
    """Delta's residual stream summed in the sink (with the sources' gradients, the default) against
    autograd's summation (``DepthHistory(sink=False)``): same loss and gradients; on, the fused
    norms bind the stream's slot, off, none does."""
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
        model_histories(monkeypatch, sink=on)
        results.append(triton_loss_and_grads(model, idx))
    sites = 2 * 3 + 1
    assert sum(slot is not None for slot in bound[True]) == sites  # every fused norm bound the stream
    assert all(slot is None for slot in bound.get(False, []))  # (without a sink nothing binds at all)
    (loss_on, g_on), (loss_off, g_off) = results
    assert torch.equal(loss_on, loss_off) and g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("block_size", [2, 1], ids=["delta-block-S2", "delta-full"])
def test_hooks_on_delta_block_outputs_see_the_whole_stream_gradient(monkeypatch, block_size):
    """A tensor hook on a Delta block's output (the residual stream between blocks) sees the same
    gradient with the stream summed in the sink as without (``DepthHistory(sink=False)``), and what
    it returns is used: a hook that halves it changes the parameter gradients the same way on both
    paths."""
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    results = {}
    for on in (True, False):
        model_histories(monkeypatch, sink=on)
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
    again: both give what autograd's summation gives (``DepthHistory(sink=False)``)."""
    idx = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for on in (True, False):
        model_histories(monkeypatch, sink=on)
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
