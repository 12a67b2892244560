"""A softmax over a single source is constant: its weight is 1 whatever the score, so the score's
gradient is the log-sum-exp's gradient alone, and exactly 0 without one. The model's first routing
site sees the embedding alone, so its pseudo-query and key-norm gain get exactly 0 (AttnRes eqs.
2-6), not a rounding residue that Adam would turn into drift.

Proves, on the fused kernels (Triton's interpreter here) and on the reference: the first site's
query and gain gradients are exactly 0 in full and block routing, MHAR and Delta AttnRes, under
bf16 autocast (float32: ``test_model_routing.py``); and at the op level, over one source, each kernel family that serves such a pass
(the site loop, the two-pass kernel, the fused norm) gives a score gradient of exactly the lse's.
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import DEVICE, rel_err, tiny_model

from lit_mhar.kernels import reference, use_backend
from lit_mhar.kernels import triton_routing as tr

FIRST_SITE = ("blocks.0.attn_site.query", "blocks.0.attn_site.key_gain")


# float32 on the Triton path is test_model_routing.py's (every model there); here bf16 autocast, and
# the reference
@pytest.mark.parametrize(
    "residual,heads,block_size,n_layer,autocast,backend",
    [("delta", 2, 2, 3, True, "triton"), ("delta", 8, 1, 3, True, "triton"), ("attnres", 2, 1, 7, True, "triton"),
     ("delta", 2, 2, 3, False, "reference"), ("attnres", 2, 1, 3, False, "reference")],
    ids=["delta-block-S2-bf16-autocast", "delta-full-bf16-autocast", "mhar-full-two-groups-bf16-autocast", "delta-block-S2-reference",
         "mhar-full-reference"],
)
def test_first_site_query_and_gain_get_exactly_zero_gradients(residual, heads, block_size, n_layer, autocast, backend):
    model = tiny_model(residual, heads, block_size, n_layer=n_layer)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with use_backend(backend), torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in FIRST_SITE:
        assert grads[name] is not None and not grads[name].any(), f"{name}: {grads[name].abs().max():.2e}"
    for name in ("blocks.0.mlp_site.query", "final_site.query"):  # later sites see more sources
        assert grads[name].abs().max() > 0, name


@pytest.mark.parametrize("sites", [3, 1], ids=["site-loop", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_source_passes_give_the_score_gradient_of_the_lse_alone(sites, dtype):
    """Phase one over one source (full routing's first group: the site loop; a single site: the
    two-pass kernel): with no lse gradient for site 0 its query and gain get exactly 0; the other
    sites', through their lse gradient alone, match float64."""
    g = torch.Generator().manual_seed(3)
    source = (2 * torch.randn(2, 7, 96, generator=g)).to(DEVICE, dtype)
    queries = torch.randn(sites, 96, generator=g).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(sites, 96, generator=g)).to(DEVICE)
    douts = torch.randn(sites, 2, 7, 96, generator=g).to(DEVICE)
    dlse = torch.randn(sites, 2, 7, 4, generator=g).to(DEVICE)
    dlse[0] = 0  # site 0: no lse gradient (the model's first site, whose merge adds nothing)

    def run(impl, cast):
        leaves = [cast(x).requires_grad_() for x in (source, queries, gains)]
        outs, lse = impl.route_sites([leaves[0]], leaves[1], leaves[2], 4)
        loss = sum((o.double() * d_.double()).sum() for o, d_ in zip(outs, douts)) + (lse.double() * dlse.double()).sum()
        return torch.autograd.grad(loss, leaves)

    with use_backend("triton"):
        d_src, d_q, d_g = run(tr, lambda x: x.detach().clone())
    ref = run(reference, lambda x: x.detach().double())
    assert not d_q[0].any() and not d_g[0].any() and not ref[1][0].any()
    assert torch.equal(d_src.float(), douts.sum(0).to(dtype).float()) if sites == 1 else rel_err(d_src, ref[0]) < 1e-2
    if sites > 1:
        assert rel_err(d_q[1:], ref[1][1:]) < 1e-5 and rel_err(d_g[1:], ref[2][1:]) < 1e-5


def test_route_norm_over_one_source_gives_exactly_zero():
    """Block routing's first site, routed directly with the next RMSNorm fused (``route_norm``)."""
    g = torch.Generator().manual_seed(4)
    source = torch.randn(9, 64, generator=g).to(DEVICE).requires_grad_()
    query, gain = torch.randn(64, generator=g).to(DEVICE).requires_grad_(), torch.ones(64, device=DEVICE, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(64, generator=g)).to(DEVICE).requires_grad_()
    for impl in (tr, reference):
        with use_backend("triton"):
            y = impl.route_norm([source], query, gain, 2, weight, 1e-5)
        d_q, d_g = torch.autograd.grad((y * torch.randn(y.shape, generator=g).to(DEVICE)).sum(), [query, gain])
        assert not d_q.any() and not d_g.any(), impl.__name__
