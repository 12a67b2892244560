"""Cases and checks the kernel tests share: random routing problems, the float64 reference runs,
the tiny models, and a spy on the kernels launched."""

from __future__ import annotations

import pytest
import torch

from lit_mhar import LM, ModelConfig
from lit_mhar.kernels import decode as decode_module
from lit_mhar.kernels import launch as launch_module
from lit_mhar.kernels import reference, use_backend
from lit_mhar.kernels import triton_routing as tr

CUDA = torch.cuda.is_available()


DEVICE = "cuda" if CUDA else "cpu"


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# ||out - ref|| / ||ref|| against float64: float32 arithmetic lands near 1e-7; bfloat16 outputs are
# rounded once (2^-9 relative per element), the bound is the usual band for bf16 results.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert torch.isfinite(x).all(), "non-finite values (an unwritten, NaN-poisoned element?)"
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def make_case(n, heads, d, tokens, dtype, additive, seed=0, device=DEVICE):
    """Random sources ``[2, tokens/2.., d]``-like, non-zero queries scaled so scores are O(1)."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    sources = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(n)]
    # different magnitudes per source, so rstd matters
    sources = [s * (0.5 + i % 3) for i, s in enumerate(sources)]
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    stream = torch.randn(shape, generator=g).to(device) if additive else None
    gate = torch.randn(d, generator=g).to(device) if additive else None
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    return sources, query, gain, stream, gate, grad


def check_route(n, heads, d, tokens, dtype, additive, seed=0):
    sources, query, gain, stream, gate, grad = make_case(n, heads, d, tokens, dtype, additive, seed)
    leaves = [*sources, query, gain] + ([stream, gate] if additive else [])
    leaves = [x.detach().requires_grad_() for x in leaves]
    ins = leaves[:n], *leaves[n:]

    def call(fn, srcs, q, g, st=None, ga=None):
        return fn(srcs, q, g, heads, st, ga, return_weights=True)

    out, weights = call(tr.depth_route, *ins)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref, ref_w = call(reference.depth_route, leaves64[:n], *leaves64[n:])
    ref_grads = torch.autograd.grad(ref, leaves64, grad)
    tol = TOL[dtype]
    assert out.dtype == (stream.dtype if additive else dtype)
    assert rel_err(out, ref) < tol
    assert rel_err(weights, ref_w) < 1e-5  # float32 softmax of exact bf16 inputs
    names = [f"source{i}" for i in range(n)] + ["query", "gain"] + (["stream", "gate"] if additive else [])
    for name, g_, r in zip(names, grads, ref_grads):
        assert g_.dtype == leaves[names.index(name)].dtype
        if n == 1 and name in ("query", "gain"):  # a softmax over one source is constant: exactly 0
            assert torch.equal(g_, torch.zeros_like(g_)) and torch.equal(r, torch.zeros_like(r)), f"d{name}: {g_.abs().max():.2e}"
            continue
        err = rel_err(g_, r)
        assert err < tol, f"d{name}: relative error {err:.2e}"


def case_id(n, heads, d, tokens, dtype, additive):
    return f"N{n}-H{heads}-d{d}-T{tokens}-{str(dtype).split('.')[-1]}-{'additive' if additive else 'replace'}"


def two_phase_vs_plain(n_completed, sites, heads, d, tokens, dtype, additive, device=DEVICE):
    """Route ``sites`` sites of one block: site 0 sees the completed blocks, site j > 0 also a partial block.

    Returns the relative errors of two-phase Triton against plain float64 routing (outputs, then
    gradients of completed blocks, partials, queries, gains, streams, gates).
    """
    g = torch.Generator().manual_seed(7)
    completed = [(torch.randn(tokens, d, generator=g) * (1 + i)).to(device, dtype) for i in range(n_completed)]
    partials = [torch.randn(tokens, d, generator=g).to(device, dtype) for _ in range(sites)]
    queries = (2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(device)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(device)
    streams = [torch.randn(tokens, d, generator=g).to(device) for _ in range(sites)] if additive else None
    gates = (torch.randn(sites, d, generator=g)).to(device) if additive else None
    douts = [torch.randn(tokens, d, generator=g, dtype=torch.float64).to(device) for _ in range(sites)]

    def run(two_phase, cast):
        c = [cast(x).requires_grad_() for x in completed]
        p = [cast(x).requires_grad_() for x in partials]
        q, gn = cast(queries).requires_grad_(), cast(gains).requires_grad_()
        st = [cast(x).requires_grad_() for x in streams] if additive else [None] * sites
        ga = cast(gates).requires_grad_() if additive else None
        outs = []
        if two_phase:
            inter, lse = tr.route_sites(c, q, gn, heads)
        for j in range(sites):
            gate_j = ga[j] if additive else None
            if two_phase:
                outs.append(tr.merge_route([p[j]] if j else [], q[j], gn[j], heads, inter[j], lse[j], st[j], gate_j))
            else:
                outs.append(reference.depth_route(c + ([p[j]] if j else []), q[j], gn[j], heads, st[j], gate_j))
        leaves = c + p[1:] + [q, gn] + (st + [ga] if additive else [])
        grads = torch.autograd.grad(sum((o.double() * d_).sum() for o, d_ in zip(outs, douts)), leaves)
        return outs, grads

    outs, grads = run(True, lambda x: x.detach().clone())
    ref_outs, ref_grads = run(False, lambda x: x.detach().double())
    return [rel_err(o, r) for o, r in zip(outs, ref_outs)], [rel_err(a, b) for a, b in zip(grads, ref_grads)]


def two_phase_id(nc, s, h, d, t, dt, add):
    return f"completed{nc}-S{s}-H{h}-d{d}-T{t}-{str(dt).split('.')[-1]}-{'additive' if add else 'replace'}"


def bf16_flips(x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the elements of two bf16 tensors that differ: rounding flips only between two
    computations of the same float32-accurate value (about 1% here), a quarter to a half of them
    where one has lost a bf16x2 split's low half."""
    return (x != y).double().mean().item()


class Launches(list):
    """Names of the kernels launched, in order; ``warps``: each launch's ``num_warps``; ``flags``: its
    keyword arguments (the constexpr flags and launch options)."""

    def __init__(self):
        super().__init__()
        self.warps: list = []
        self.flags: list = []

    def clear(self):
        super().clear()
        self.warps.clear()
        self.flags.clear()


def spy_launches(monkeypatch) -> Launches:
    """The kernels launched from now on (through ``lit_mhar.kernels.launch.kernel``), once per launch
    on a grid (not for a compile that reads a kernel's registers, ``.warmup``)."""
    launched = Launches()
    kernel = launch_module.kernel

    class Launch:
        def __init__(self, name, interpret):
            self.name, self.kernel = name, kernel(name, interpret)

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def launch(*args, **kwargs):
                launched.append(self.name)
                launched.warps.append(kwargs.get("num_warps"))
                launched.flags.append(kwargs)
                return run(*args, **kwargs)

            return launch

        def __getattr__(self, attr):
            return getattr(self.kernel, attr)

    monkeypatch.setattr(launch_module, "kernel", Launch)
    monkeypatch.setattr(decode_module, "kernel", Launch)
    return launched


def check_merge_route_norm(n, heads, d, tokens, dtype, additive=False, device=DEVICE, seed=0):
    """merge_route_norm on the kernels against the float64 reference: output and the gradient of
    every input (sources, query, gain, prior, its lse, the norm weight; stream and gate)."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    sources = [(torch.randn(shape, generator=g) * (0.5 + i)).to(device, dtype) for i in range(n)]
    prior = torch.randn(shape, generator=g).to(device, dtype)
    prior_lse = (torch.randn((*shape[:-1], heads), generator=g) + 1).to(device)
    query = (2.0 * (heads / d) ** 0.5 * torch.randn(d, generator=g)).to(device)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device)
    weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device)
    extra = (torch.randn(shape, generator=g).to(device), torch.randn(d, generator=g).to(device)) if additive else ()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    leaves = [x.detach().requires_grad_() for x in (*sources, query, gain, prior, prior_lse, weight, *extra)]

    def call(fn, xs):
        return fn(xs[:n], xs[n], xs[n + 1], heads, xs[n + 2], xs[n + 3], xs[n + 4], 1e-5, *xs[n + 5:])

    y = call(tr.merge_route_norm, leaves)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True, materialize_grads=True)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref = call(reference.merge_route_norm, leaves64)
    ref_grads = torch.autograd.grad(ref, leaves64, dy, allow_unused=True, materialize_grads=True)
    assert y.dtype == dtype and rel_err(y, ref) < TOL[dtype]
    names = [f"source{i}" for i in range(n)] + ["query", "gain", "prior", "prior_lse", "norm_weight"] + (["stream", "gate"] if additive else [])
    for name, x, g_, r in zip(names, leaves, grads, ref_grads):
        assert g_.dtype == x.dtype, name
        if not r.any():  # no newer source: a softmax over the prior alone, constant; exact gradient 0
            assert n == 0 and name in ("query", "gain", "prior_lse"), name
            if name == "prior_lse":
                # p_alpha (<dr, prior>_h - D_h) with p_alpha = 1: two float32 sums over the head's
                # d/H products dr * prior that differ only in rounding, so within 2 (d/H) 2^-24 of
                # the sum of their magnitudes (dr is the reference's prior gradient here)
                k = d // heads
                terms = (ref_grads[n + 2] * leaves64[n + 2]).abs().reshape(*shape[:-1], heads, k).sum(-1)
                assert (g_.double().abs() <= 2 * k * 2.0**-24 * terms).all(), (g_.abs().max().item(), terms.max().item())
            else:  # no source, no score: nothing is summed
                assert g_.abs().max() == 0, name
            continue
        err = rel_err(g_, r)
        assert err < TOL[dtype], f"d{name}: relative error {err:.2e}"


def merge_norm_id(n, h, d, t, dt, add):
    return f"N{n}-H{h}-d{d}-T{t}-{str(dt)[6:]}-{'additive' if add else 'replace'}"


def tiny_model(residual, heads, block_size, n_layer=3, d_model=32):
    cfg = ModelConfig.from_name(
        "debug", residual=residual, heads=heads, block_size=block_size, d_model=d_model, n_layer=n_layer,
        n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=16,
    )
    torch.manual_seed(0)
    model = LM(cfg)
    g = torch.Generator().manual_seed(0)
    for site in model.routing_sites():  # non-zero queries and gates: routing is not uniform
        site.query.data = torch.randn(site.query.shape, generator=g)
        site.key_gain.data = 1 + 0.5 * torch.randn(site.key_gain.shape, generator=g)
        if site.gate is not None:
            site.gate.data = torch.randn(site.gate.shape, generator=g)
    # on a GPU machine the compiled kernels; on CPU the interpreter
    return model.to(DEVICE)


def triton_loss_and_grads(model, idx):
    """(loss, {name: gradient}) of one forward and backward of ``model`` on the Triton path."""
    model.zero_grad()
    with use_backend("triton"):
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def model_histories(monkeypatch, **kw) -> None:
    """Build the model's depth histories with ``kw`` from now on (keyword arguments of
    :class:`lit_mhar.routing.DepthHistory`: ``sink``, ``replay_stream``)."""
    import functools

    from lit_mhar import model as model_module
    from lit_mhar import routing

    monkeypatch.setattr(model_module, "DepthHistory", functools.partial(routing.DepthHistory, **kw))
