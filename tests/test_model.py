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
    """Non-zero queries, gains away from 1 and non-zero gates, so routing is not uniform; hyper-connections
    moved away from their init (copies mixed, output weights off 1, non-zero dynamic weights and scales)."""
    g = torch.Generator().manual_seed(seed)
    for site in [m for m in model.modules() if type(m).__name__ == "RoutingSite"]:
        site.query.data = torch.randn(site.query.shape, generator=g, dtype=site.query.dtype)
        site.key_gain.data = 1 + 0.5 * torch.randn(site.key_gain.shape, generator=g, dtype=site.query.dtype)
        if site.gate is not None:
            site.gate.data = torch.randn(site.gate.shape, generator=g, dtype=site.query.dtype)
    for hc in [m for m in model.modules() if type(m).__name__ == "HyperConnection"]:
        for name, p in hc.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if name.endswith("_scale"):  # s_alpha, s_beta of order 1 (not 0.01), so the dynamic part matters
                p.data = 0.5 * (1 + 0.2 * noise)
            elif name.startswith("dynamic_"):  # W_alpha, W_beta: tanh arguments of order 1
                p.data = 0.3 * noise
            else:  # static [A_m | A_r], B and the norm gain: away from e_l, I, 1 and 1
                p.data = p.data + 0.3 * noise


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


@pytest.mark.parametrize("name", ["query", "gain", "gate", "stream"])
def test_routing_op_refuses_integer_parameters_naming_them(name):
    sources = [torch.randn(3, 8) for _ in range(2)]
    args = dict(query=torch.randn(8), gain=torch.ones(8), stream=torch.randn(3, 8), gate=torch.randn(8))
    args[name] = args[name].long()
    with pytest.raises(ValueError, match=f"depth_route: {name} has dtype torch.int64; expected a floating dtype"):
        depth_route(sources, args["query"], args["gain"], 2, stream=args["stream"], gate=args["gate"])


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
        (dict(residual="attnres", block_size=9), r"block_size=9 is more than the model's 8 sublayers .*valid: 1 to 8"),
        (dict(residual="attnres", heads=0), "heads"),
        (dict(residual="hyperloop"), "residual"),
        (dict(n_kv_head=3), "n_kv_head"),
        (dict(heads=2), "heads"),
        (dict(residual="hyper", hc_rate=0), "hc_rate"),
        (dict(residual="hyper", hc_rate=2.0), "hc_rate"),
        (dict(residual="hyper", hc_dynamic="yes"), "hc_dynamic"),
        (dict(residual="hyper", heads=2), "heads"),
        (dict(residual="hyper", block_size=2), r"heads and block_size must be left at 1 \(got block_size=2\)"),
        (dict(d_model=100, n_head=4), r"head_dim=25 \(d_model=100 / n_head=4; change either, or set head_dim\) must be an even integer"),
        (dict(residual="prenorm", hc_rate=2), "hc_rate"),
        (dict(residual="delta", hc_dynamic=False), "hc_dynamic"),
    ],
    ids=["heads-not-dividing-d", "block-size-zero", "block-size-past-the-sublayers", "heads-zero", "unknown-variant", "kv-heads", "prenorm-with-heads",
         "hc-rate-zero", "hc-rate-float", "hc-dynamic-not-bool", "hyper-with-heads", "hyper-with-blocks", "odd-derived-head-dim",
         "hc-rate-without-hyper", "hc-dynamic-without-hyper"],
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


# ----------------------------------------------------------------------------- Hyper-Connections


def naive_hyper_forward(model: LM, idx: torch.Tensor) -> torch.Tensor:
    """Hyper-Connections (Zhu et al., arXiv 2409.19606) written out copy by copy, token-wise scalars.

    H = (H_1 .. H_n), each [B, T, d], starts as n copies of the embedding. Around sublayer T, with
    alpha = [A_m | A_r] ([n, n+1]) and B ([n]), plus for DHC alpha += s_a tanh(norm(H_k) . W_alpha[:, c])
    and B_k += s_b tanh(norm(H_k) . W_beta) per copy k and token:
        x = sum_k A_m[k] H_k;   H'_j = B_j T(x) + sum_k A_r[k, j] H_k.
    The LM head reads sum_k H_k.
    """
    cfg, n = model.cfg, model.cfg.hc_rate
    T = idx.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    H = [model.embed(idx) for _ in range(n)]

    def rmsnorm(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    for block in model.blocks:
        for norm, hc, fn in ((block.attn_norm, block.attn_hc, lambda x: block.attn(x, cos, sin)), (block.mlp_norm, block.mlp_hc, block.mlp)):
            a = [[hc.static_alpha[k, c] for c in range(n + 1)] for k in range(n)]  # a[k][0] = A_m[k], a[k][1 + j] = A_r[k, j]
            b = [hc.static_beta[k] for k in range(n)]
            if cfg.hc_dynamic:
                for k in range(n):
                    hbar = rmsnorm(H[k], hc.norm.weight)
                    a[k] = [a[k][c] + hc.alpha_scale * torch.tanh((hbar * hc.dynamic_alpha[:, c]).sum(-1, keepdim=True)) for c in range(n + 1)]
                    b[k] = b[k] + hc.beta_scale * torch.tanh((hbar * hc.dynamic_beta).sum(-1, keepdim=True))
            x = sum(a[k][0] * H[k] for k in range(n))
            out = fn(norm(x))
            H = [b[j] * out + sum(a[k][1 + j] * H[k] for k in range(n)) for j in range(n)]
    return model.lm_head(model.norm(sum(H)))


def hyper(rate: int, dynamic: bool, **kw) -> ModelConfig:
    return tiny("hyper", hc_rate=rate, hc_dynamic=dynamic, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fresh_hyper_model_with_one_copy_equals_prenorm_exactly(dynamic, dtype):
    torch.manual_seed(0)
    model = LM(hyper(1, dynamic)).to(dtype)
    pre = LM(tiny("prenorm")).to(dtype)
    missing, unexpected = pre.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected and all("_hc." in k for k in unexpected)
    idx = tokens(pre.cfg)
    torch.testing.assert_close(model(idx), pre(idx), rtol=0, atol=0)


@pytest.mark.parametrize("rate,dynamic", [(2, False), (3, True), (4, False), (4, True)], ids=lambda v: str(v))
def test_fresh_hyper_model_is_prenorm_on_every_copy(rate, dynamic):
    """The paper's init: every sublayer reads prenorm's input exactly, and the LM head reads n * prenorm's
    last state, which the final RMSNorm maps to prenorm's with epsilon / n**2."""
    torch.manual_seed(0)
    model = LM(hyper(rate, dynamic)).double()
    pre = LM(tiny("prenorm")).double()
    pre.load_state_dict(model.state_dict(), strict=False)
    inputs = {}

    def record(key):
        return lambda module, args: inputs.setdefault(key, []).append(args[0].detach().clone())

    for key, m in (("hyper", model), ("prenorm", pre)):
        for block in m.blocks:
            block.attn_norm.register_forward_pre_hook(record(key))
            block.mlp_norm.register_forward_pre_hook(record(key))
    idx = tokens(pre.cfg)
    logits, reference = model(idx), pre(idx)
    assert len(inputs["hyper"]) == len(inputs["prenorm"]) == 2 * pre.cfg.n_layer
    for mine, theirs in zip(inputs["hyper"], inputs["prenorm"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert not torch.allclose(logits, reference, rtol=0, atol=1e-6), "the sum of n copies is n * h, not h"
    pre.norm.eps = pre.cfg.norm_eps / rate**2
    torch.testing.assert_close(logits, pre(idx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rate,dynamic", [(1, False), (1, True), (2, False), (3, True), (4, False), (4, True)], ids=lambda v: str(v))
def test_hyper_model_matches_naive_equations(rate, dynamic):
    model = build(hyper(rate, dynamic))
    hc = model.blocks[1].mlp_hc
    assert hc.static_alpha.abs().min() > 0 and (hc.static_beta - 1).abs().min() > 0
    if dynamic:
        assert hc.dynamic_alpha.abs().min() > 0 and hc.alpha_scale.abs() > 0.05
    idx = tokens(model.cfg)
    torch.testing.assert_close(model(idx), naive_hyper_forward(model, idx), rtol=1e-10, atol=1e-10)


def test_dynamic_hyper_connections_depend_on_the_input():
    model = build(hyper(3, True))
    hc = model.blocks[0].mlp_hc
    H = torch.randn(2, 5, 3, model.cfg.d_model, dtype=torch.float64)
    x, carried, beta = hc.width(H)
    assert x.shape == (2, 5, 32) and carried.shape == (2, 5, 3, 32) and beta.shape == (2, 5, 3)
    assert beta.std(dim=(0, 1)).min() > 1e-3, "DHC's beta must vary over tokens"
    static = build(hyper(3, False)).blocks[0].mlp_hc
    assert static.width(H)[2].shape == (3,)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gradients_reach_every_hyper_connection_parameter(dynamic):
    model = build(hyper(3, dynamic))
    names = [name for name, _ in model.named_parameters() if "_hc." in name]
    assert len(names) == 2 * model.cfg.n_layer * (7 if dynamic else 2)
    assert {id(p) for name, p in model.named_parameters() if name in names} == {id(p) for p in model.routing_parameters()}
    idx = tokens(model.cfg)
    torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {name}"


def test_hyper_model_has_no_routing_sites():
    cfg = hyper(4, True)
    model = LM(cfg)
    assert not cfg.routed and model.routing_sites() == [] and model.final_site is None
    logits, weights = model(tokens(cfg), return_routing=True)
    assert weights == [] and logits.shape == (2, 11, cfg.vocab_size)


def test_hyper_forward_compiles_to_one_graph_and_keeps_the_stream_in_float32_under_autocast():
    torch.manual_seed(0)
    model = LM(hyper(3, True, n_layer=1))
    randomize_routing(model)
    idx = tokens(model.cfg)
    seen = []
    width = model.blocks[-1].mlp_hc.width
    model.blocks[-1].mlp_hc.width = lambda H: seen.append(H.dtype) or width(H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(idx)
    assert seen == [torch.float32], "the n-copy stream must not be rounded to bf16"
    del model.blocks[-1].mlp_hc.width
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(idx), eager)


def test_rmsnorm_takes_torch_fused_kernel_for_a_narrower_input():
    """A bf16 routed input with a float32 gain: torch's nn.RMSNorm leaves its fused kernel for a
    chain of float32 ops; the model's RMSNorm casts the input up and stays on it, same values."""
    from lit_mhar.model import RMSNorm

    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours, theirs = RMSNorm(40, eps=1e-5), torch.nn.RMSNorm(40, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    with torch.profiler.profile() as prof:
        y = ours(x)
    assert "aten::_fused_rms_norm" in {e.name for e in prof.events()}
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.bfloat16(), theirs(x), rtol=0, atol=0)  # identical once rounded to bf16


@pytest.mark.parametrize("residual, routed", [("prenorm", {}), ("attnres", {"heads": 2, "block_size": 2}), ("delta", {"heads": 2}), ("hyper", {})])
def test_bf16_autocast_keeps_every_rms_norm_on_the_fused_path(residual, routed):
    """QK-RMSNorm under bf16 autocast got bf16 projections and float32 gains: torch could not use its
    fused kernel and warned at every call ("Mismatch dtype between input and weight ... Cannot
    dispatch to fused implementation"). Every RMSNorm now computes in one dtype."""
    import warnings

    model = LM(ModelConfig.from_name("debug", residual=residual, n_layer=2, d_model=32, ffn_dim=64, vocab_size=50, seq_len=16, **routed))
    tokens = torch.randint(0, 50, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().sum().backward()
    assert not [str(w.message) for w in caught if "fused implementation" in str(w.message)]
    assert torch.isfinite(logits.float()).all()
