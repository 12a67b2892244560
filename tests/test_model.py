"""The model's residual variants against an explicit, loop-by-loop float64 reading of the papers' equations."""

from __future__ import annotations

import math

import pytest
import torch

from lit_mhar import LM, ModelConfig
from lit_mhar.kernels import depth_route

EPS = 1e-6


def naive_route(sources, query, gain, heads, eps=EPS):
    """AttnRes eqs. 2-6 with MHAR heads, one head and one source at a time (key norm over full width)."""
    d = sources[0].shape[-1]
    width = d // heads
    out = torch.zeros_like(sources[0])
    for h in range(heads):
        sl = slice(h * width, (h + 1) * width)
        scores = []
        for v in sources:
            key = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain
            scores.append((query[sl] * key[..., sl]).sum(-1))
        alpha = torch.softmax(torch.stack(scores), dim=0)
        for a, v in zip(alpha, sources):
            out[..., sl] += a.unsqueeze(-1) * v[..., sl]
    return out


def naive_sources(embedding, outputs, block_size):
    """Embedding, completed block sums of S outputs each, and the partial block if started."""
    n_blocks = len(outputs) // block_size
    sources = [embedding] + [sum(outputs[b * block_size:(b + 1) * block_size]) for b in range(n_blocks)]
    if len(outputs) % block_size:
        sources.append(sum(outputs[n_blocks * block_size:]))
    return sources


def naive_forward(model: LM, idx: torch.Tensor) -> torch.Tensor:
    """Logits computed sublayer by sublayer from the written-out equations of each variant."""
    cfg = model.cfg
    T = idx.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    emb = model.embed(idx)
    h, outputs = emb, []

    def site_input(site, stream):
        if cfg.residual == "prenorm":
            return stream
        routed = naive_route(naive_sources(emb, outputs, cfg.block_size), site.query, site.key_gain, cfg.heads)
        return routed if cfg.residual == "attnres" else stream + site.gate * routed

    for block in model.blocks:
        for norm, site, fn in ((block.attn_norm, block.attn_site, lambda x: block.attn(x, cos, sin)), (block.mlp_norm, block.mlp_site, block.mlp)):
            out = fn(norm(site_input(site, h)))
            outputs.append(out)
            h = h + out
    return model.lm_head(model.norm(site_input(model.final_site, h)))


def randomize_routing(model: LM, seed: int = 0) -> None:
    """Non-zero queries, gains away from 1 and non-zero gates, so routing is not uniform."""
    g = torch.Generator().manual_seed(seed)
    for site in [m for m in model.modules() if type(m).__name__ == "RoutingSite"]:
        site.query.data = torch.randn(site.query.shape, generator=g, dtype=site.query.dtype)
        site.key_gain.data = 1 + 0.5 * torch.randn(site.key_gain.shape, generator=g, dtype=site.query.dtype)
        if site.gate is not None:
            site.gate.data = torch.randn(site.gate.shape, generator=g, dtype=site.query.dtype)


def tiny(residual="prenorm", **kw) -> ModelConfig:
    base = dict(d_model=32, n_layer=3, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=16)
    base.update(kw)
    return ModelConfig.from_name("debug", residual=residual, **base)


def build(cfg: ModelConfig, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    model = LM(cfg).double()
    randomize_routing(model, seed)
    return model


def tokens(cfg: ModelConfig, B: int = 2, T: int = 11) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("residual", ["prenorm", "attnres", "delta"])
@pytest.mark.parametrize("heads,block_size", [(1, 1), (4, 1), (1, 2), (8, 4), (2, 5)], ids=lambda v: str(v))
def test_model_matches_naive_equations(residual, heads, block_size):
    if residual == "prenorm" and (heads, block_size) != (1, 1):
        pytest.skip("prenorm has no routing")
    cfg = tiny(residual, heads=heads, block_size=block_size)
    model = build(cfg)
    idx = tokens(cfg)
    torch.testing.assert_close(model(idx), naive_forward(model, idx), rtol=1e-10, atol=1e-10)


def test_routing_op_with_one_head_is_single_head_attnres():
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(5, 7, 24, generator=g, dtype=torch.float64) for _ in range(6)]
    q, gain = torch.randn(24, generator=g, dtype=torch.float64), torch.rand(24, generator=g, dtype=torch.float64) + 0.5
    # AttnRes as Kimi writes it: alpha_i = softmax_i(q . RMSNorm(v_i)), h = sum_i alpha_i v_i
    keys = torch.stack([v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * gain for v in sources])
    alpha = torch.softmax(keys @ q, dim=0)
    expected = (alpha.unsqueeze(-1) * torch.stack(sources)).sum(0)
    torch.testing.assert_close(depth_route(sources, q, gain, heads=1), expected, rtol=1e-12, atol=1e-12)


def test_mhar_heads_normalise_keys_over_full_width_then_slice():
    g = torch.Generator().manual_seed(4)
    sources = [torch.randn(3, 4, 32, generator=g, dtype=torch.float64) for _ in range(5)]
    q, gain = torch.randn(32, generator=g, dtype=torch.float64), torch.rand(32, generator=g, dtype=torch.float64) + 0.5
    out, weights = depth_route(sources, q, gain, heads=4, return_weights=True)
    torch.testing.assert_close(out, naive_route(sources, q, gain, 4), rtol=1e-12, atol=1e-12)
    assert weights.shape == (5, 3, 4, 4) and weights.dtype == torch.float64
    # heads really differ: per-slice softmaxes are not all the same distribution
    assert (weights[..., 0] - weights[..., 1]).abs().max() > 1e-3


def test_mhar_with_one_head_model_is_attnres_and_more_heads_route_differently():
    cfg = tiny("attnres", heads=1)
    model = build(cfg)
    idx = tokens(cfg)
    torch.testing.assert_close(model(idx), naive_forward(model, idx), rtol=1e-10, atol=1e-10)
    cfg4 = tiny("attnres", heads=4)
    model4 = build(cfg4)
    model4.load_state_dict(model.state_dict())
    assert not torch.allclose(model4(idx), model(idx)), "H=4 must route differently from H=1 with the same weights"


def test_block_size_one_equals_full_routing():
    full = build(tiny("attnres", heads=2, block_size=1))
    idx = tokens(full.cfg)
    # full routing written out directly: sources are the embedding and every raw sublayer output
    cfg = full.cfg
    T = idx.shape[1]
    cos, sin = full.rope_cos[:T], full.rope_sin[:T]
    sources = [full.embed(idx)]
    for block in full.blocks:
        for norm, site, fn in ((block.attn_norm, block.attn_site, lambda x: block.attn(x, cos, sin)), (block.mlp_norm, block.mlp_site, block.mlp)):
            sources.append(fn(norm(naive_route(sources, site.query, site.key_gain, cfg.heads))))
    final = naive_route(sources, full.final_site.query, full.final_site.key_gain, cfg.heads)
    torch.testing.assert_close(full(idx), full.lm_head(full.norm(final)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_layer,block_size", [(3, 4), (3, 5), (5, 3), (2, 3)])
def test_block_bookkeeping_when_sublayers_not_multiple_of_block_size(n_layer, block_size):
    cfg = tiny("attnres", n_layer=n_layer, block_size=block_size, heads=2)
    assert (2 * n_layer) % block_size
    model = build(cfg)
    idx = tokens(cfg)
    logits, weights = model(idx, return_routing=True)
    assert len(weights) == 2 * n_layer + 1
    expected_n = [1 + l // block_size + (1 if l % block_size else 0) for l in range(2 * n_layer + 1)]
    assert [w.shape[0] for w in weights] == expected_n == [cfg.n_sources(l) for l in range(2 * n_layer + 1)]
    # the final site sees every completed block and the shorter last block
    assert weights[-1].shape[0] == 1 + (2 * n_layer) // block_size + 1
    torch.testing.assert_close(logits, naive_forward(model, idx), rtol=1e-10, atol=1e-10)


def test_zero_gated_delta_equals_prenorm():
    pre = build(tiny("prenorm"), seed=5)
    for heads, block_size in [(1, 1), (4, 1), (2, 3)]:
        delta = build(tiny("delta", heads=heads, block_size=block_size), seed=6)  # random queries and gains
        missing, unexpected = delta.load_state_dict(pre.state_dict(), strict=False)
        assert not unexpected and all(".query" in k or "key_gain" in k or ".gate" in k for k in missing)
        for m in delta.modules():
            if type(m).__name__ == "RoutingSite":
                torch.nn.init.zeros_(m.gate)
                assert m.query.abs().sum() > 0
        idx = tokens(pre.cfg)
        torch.testing.assert_close(delta(idx), pre(idx), rtol=0, atol=1e-12)


def test_fresh_delta_model_equals_prenorm_with_same_weights():
    torch.manual_seed(0)
    delta = LM(tiny("delta", heads=4, block_size=2))
    pre = LM(tiny("prenorm"))
    pre.load_state_dict(delta.state_dict(), strict=False)
    idx = tokens(pre.cfg)
    torch.testing.assert_close(delta(idx), pre(idx), rtol=0, atol=0)


def test_delta_block_sources_are_true_block_deltas():
    """Block sums equal the residual stream at the block's end minus the stream at its start (>= 3 blocks)."""
    from lit_mhar.routing import DepthHistory

    cfg = tiny("delta", n_layer=4, block_size=2, heads=2)  # 8 sublayers -> 4 blocks
    model = build(cfg)
    idx = tokens(cfg)
    seen = {}
    original = DepthHistory.sources

    def spy(self):
        srcs = original(self)
        seen[self.n_appended] = [s.detach().clone() for s in srcs]
        return srcs

    streams = []

    def stream_hook(module, args, output):
        streams.append(output.detach().clone())

    DepthHistory.sources = spy
    handles = [b.register_forward_hook(stream_hook) for b in model.blocks]
    try:
        model(idx)
    finally:
        DepthHistory.sources = original
        for handle in handles:
            handle.remove()
    # with S = 2 every block is one layer, so block n's delta = stream after layer n - stream before it
    final_sources = seen[2 * cfg.n_layer]
    assert len(final_sources) == 1 + 4
    stream_before = [model.embed(idx)] + streams[:-1]
    for n in range(4):
        torch.testing.assert_close(final_sources[1 + n], streams[n] - stream_before[n], rtol=1e-10, atol=1e-10)


def test_models_with_more_than_64_sources_work():
    cfg = tiny("attnres", n_layer=33, d_model=16, n_head=2, n_kv_head=1, ffn_dim=16, heads=2)
    model = build(cfg)
    idx = tokens(cfg, B=1, T=5)
    logits, weights = model(idx, return_routing=True)
    assert weights[-1].shape[0] == 67
    torch.testing.assert_close(logits, naive_forward(model, idx), rtol=1e-9, atol=1e-9)
    logits.sum().backward()
    assert torch.isfinite(model.final_site.query.grad).all() and model.final_site.query.grad.abs().sum() > 0


@pytest.mark.parametrize("residual,heads,block_size", [("attnres", 1, 1), ("attnres", 4, 3), ("delta", 2, 1), ("delta", 4, 2)])
def test_gradients_reach_every_query_and_gain(residual, heads, block_size):
    model = build(tiny(residual, heads=heads, block_size=block_size))
    idx = tokens(model.cfg)
    torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    for name, p in model.named_parameters():
        # the first site sees one source (the embedding): its softmax is constant, so only its gate learns
        if name.startswith("blocks.0.attn_site.") and not name.endswith(".gate"):
            assert p.grad is None or p.grad.abs().sum() == 0
        elif name.endswith((".query", ".key_gain", ".gate")):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {name}"


def test_zero_initialised_queries_route_uniformly():
    torch.manual_seed(0)
    model = LM(tiny("attnres", heads=4, block_size=1))
    _, weights = model(tokens(model.cfg), return_routing=True)
    for w in weights:
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / w.shape[0]))


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(residual="attnres", heads=3), "heads"),
        (dict(residual="attnres", block_size=0), "block_size"),
        (dict(residual="attnres", heads=0), "heads"),
        (dict(residual="hyperloop"), "residual"),
        (dict(n_kv_head=3), "n_kv_head"),
        (dict(heads=2), "heads"),
    ],
    ids=["heads-not-dividing-d", "block-size-zero", "heads-zero", "unknown-variant", "kv-heads", "prenorm-with-heads"],
)
def test_bad_config_fails_at_construction_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_name("debug", **overrides)


def test_unknown_preset_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=r"name='7b'.*100m"):
        ModelConfig.from_name("7b")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_name("debug", width=3)


def test_presets_have_the_published_shapes():
    c = ModelConfig.from_name("350m")
    assert (c.d_model, c.n_layer, c.n_head, c.n_kv_head, c.ffn_dim) == (1024, 24, 16, 8, 4096)
    c = ModelConfig.from_name("1b", residual="attnres", heads=8, block_size=9)
    assert (c.d_model, c.n_layer, c.n_sublayers, c.n_sources(c.n_sublayers)) == (1280, 36, 72, 9)


def test_sequence_longer_than_config_is_refused():
    model = LM(tiny())
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = tiny()
    model = LM(cfg)
    n = model.num_params()
    assert n == sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.d_model
    assert math.isclose(model.flops_per_token(16), 6 * n + 6 * cfg.n_layer * cfg.d_model * 16)
