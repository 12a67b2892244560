"""``route_norm`` (one routing site fused with the next RMSNorm, without a prior: block routing's
first block) against the float64 reference: output and every gradient (sources, query, gain, norm
weight), with and without a gradient sink, over 1 to 9 sources, split and padded head widths, both
dtypes; bad input refused before any work.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from routing_cases import DEVICE, TOL, gpu, merge_norm_id, rel_err

from lit_mhar.kernels import GradientSink, reference
from lit_mhar.kernels import triton_routing as tr


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
