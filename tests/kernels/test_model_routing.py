"""The model on the fused kernels: loss and every parameter gradient against the float64 reference
path (full and block routing, MHAR and Delta, two groups of sites, the final site joining a
group); phase one once per block or group of sites; block routing's first block routed directly;
the fused norm against the merge then the norm module (and fewer bytes saved); compiled blocks and
sublayers against the eager model; no graph break around the op; persistent grids sized by
occupancy, and a training step captured as a CUDA graph (GPU).
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import DEVICE, gpu, make_case, rel_err, tiny_model, triton_loss_and_grads

from lit_mhar.kernels import launch, use_backend
from lit_mhar.kernels import triton_routing as tr


@pytest.mark.parametrize("residual,block_size", [("attnres", 3), ("delta", 3), ("delta", 1)], ids=["mhar-block", "delta-block", "delta-full"])
def test_fused_norm_model_matches_unfused_and_saves_less(monkeypatch, residual, block_size):
    """A two-phase MHAR (Delta) model gives the same loss and gradients with the second phase
    fused with the RMSNorm as with the merge followed by the norm module (the model's norms made
    plain modules, which ``DepthHistory.route_norm`` does not fuse), while autograd keeps fewer
    bytes, each storage counted once (the norm's input is not saved; the Delta form keeps its
    stream instead, as many bytes, or fewer where it is replayed)."""
    from lit_mhar import routing

    class PlainRMSNorm(torch.nn.Module):  # nn.RMSNorm's forward, not an nn.RMSNorm
        def forward(self, x):
            return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    model = tiny_model(residual, 4, block_size, n_layer=3)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm) and m.weight is not None]
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = {}
    original, original_direct = routing.merge_route_norm, routing.route_norm
    for fused in (False, True):
        for norm in norms:
            norm.__class__ = torch.nn.RMSNorm if fused else PlainRMSNorm
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
        # every site (6 sublayers and the final one) when fused; block MHAR's first block without phase one
        direct = 3 if residual == "attnres" else 0
        assert calls == (["direct"] * direct + ["merge"] * (7 - direct) if fused else [])
        results[fused] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())
    (loss0, grads0, bytes0), (loss1, grads1, bytes1) = results[False], results[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for name in grads0:
        if not grads0[name].any():  # the first site sees one source: exactly 0 on both paths
            assert not grads1[name].any(), name
            continue
        assert rel_err(grads1[name], grads0[name]) < 1e-5, name
    assert bytes1 < bytes0 if residual == "attnres" else bytes1 <= bytes0, (bytes1, bytes0)


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
        monkeypatch.setattr(launch, "ONE_WAVE_KERNELS", occupancy)
        outs, lse = tr.route_sites(leaves[:9], leaves[9], leaves[10], 8)  # site loop
        merged = tr.merge_route(leaves[:1], leaves[11], leaves[12], 8, outs[0], lse[0])  # two-pass kernel (a prior)
        loss = sum((o.float() * t.float()).sum() for o, t in zip(outs[1:], douts[1:])) + (merged.float() * douts[0].float()).sum()
        runs.append(torch.autograd.grad(loss, leaves[:13]))
    assert not launch._RESIDENT_FALLBACKS, launch._RESIDENT_FALLBACKS  # sized from the compiled kernels, not guessed
    for kind in ("bwd", "bwd_stats"):
        sized = [v for k, v in launch._RESIDENT.items() if k[0] == kind]
        assert sized and all(isinstance(v, int) and 1 <= v <= 32 for v in sized), (kind, sized)
    for a, b in zip(*runs):
        assert rel_err(a, b.double()) < 1e-3


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
            assert not grads_tri[name].any(), name
            continue
        err = rel_err(grads_tri[name], grads64[name])
        assert err < max(1e-5, 3 * rel_err(grads_ref[name], grads64[name])), f"{name}: {err:.2e}"


@pytest.mark.parametrize("max_sites", [16, 4, 3], ids=["final-site-joins", "group-to-the-limit", "group-past-the-limit"])
def test_two_phase_model_calls_route_sites_once_per_block(monkeypatch, max_sites):
    """Phase one runs once per block of sites: 6 sublayers + the final site in blocks of 3 are groups
    {0, 1, 2} and {3, 4, 5, 6}, the final site joining the block before it (where a group may hold 4
    sites or more, JOIN_FINAL_SITE_MAX_SITES), or, where a group may hold only 3 sites, {0, 1, 2},
    {3, 4, 5}, {6}. The first block's sites, whose pass would see the embedding alone, are routed
    directly (no phase one)."""
    from lit_mhar import routing

    assert routing.JOIN_FINAL_SITE_MAX_SITES == 16
    monkeypatch.setattr(routing, "JOIN_FINAL_SITE_MAX_SITES", max_sites)
    model = tiny_model("attnres", 2, 3, n_layer=3)
    calls = []
    original = routing.route_sites
    monkeypatch.setattr(routing, "route_sites", lambda srcs, q, *a, **kw: calls.append((len(srcs), q.shape[0])) or original(srcs, q, *a, **kw))
    with use_backend("triton"):
        model(torch.randint(0, 97, (1, 5)).to(DEVICE))
    assert calls == ([(2, 4)] if max_sites > 3 else [(2, 3), (3, 1)])


@pytest.mark.parametrize("block_size,n_layer,direct_sites", [(3, 3, 3), (1, 7, 0)], ids=["block-S3", "full-15-sources"])
def test_first_block_is_routed_directly(monkeypatch, block_size, n_layer, direct_sites):
    """Block routing's first block (whose phase one would see the embedding alone) is routed site by
    site with the next RMSNorm fused (route_norm), over the embedding and the block's running sum;
    full routing keeps phase one for its first group (its merges would each read one more source)."""
    from lit_mhar import routing

    model = tiny_model("attnres", 2, block_size, n_layer=n_layer)
    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    direct_calls = []
    original = routing.route_norm
    monkeypatch.setattr(routing, "route_norm", lambda srcs, *a, **kw: direct_calls.append(len(srcs)) or original(srcs, *a, **kw))
    triton_loss_and_grads(model, idx)
    # site 0 the embedding alone, then the embedding and the first block's running sum
    assert direct_calls == ([1] + [2] * (direct_sites - 1) if direct_sites else [])


@pytest.mark.parametrize(
    "residual,n_layer,join,calls_expected",
    [("attnres", 7, True, [(1, 12), (13, 3)]), ("delta", 7, True, [(1, 8), (9, 7)]), ("attnres", 6, True, [(1, 13)]),
     ("attnres", 6, False, [(1, 12), (13, 1)]), ("delta", 4, True, [(1, 9)]), ("delta", 4, False, [(1, 8), (9, 1)])],
)
def test_two_phase_full_routing_calls_route_sites_once_per_group(monkeypatch, residual, n_layer, join, calls_expected):
    """Full routing's phase one runs once per group of sites: 12 in the replacement form
    (FULL_ROUTING_GROUP), 8 in the additive one (FULL_ROUTING_GROUP_ADDITIVE); the final site, where
    it would be alone (2L + 1 sites, 2L a multiple of the group), joins the group before it, unless
    a group may hold no more sites than it has (JOIN_FINAL_SITE_MAX_SITES)."""
    from lit_mhar import routing

    if not join:
        monkeypatch.setattr(routing, "JOIN_FINAL_SITE_MAX_SITES", routing.FULL_ROUTING_GROUP_ADDITIVE if residual == "delta" else routing.FULL_ROUTING_GROUP)
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
