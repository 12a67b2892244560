"""The tensor-core kernels of phase one against float64 and against the vector kernels: pass one of
the site loop (``bwd_stats_dot``), pass two (``bwd_sources_dot``, in chunks of sources, into a
gradient sink), the forward (``fwd_sites_mix``, ``fwd_sites_dot``): outputs, lse, the saved key rstd
and every gradient within the bf16 tolerance and within rounding of the vector kernels'; a
non-finite value kept to its token; deterministic gradients; and the plan taking them exactly where
it should (sources, sites, head widths, dtypes, tiles).

The plan takes these kernels from head width 64 or 128 up; the tests lower those thresholds
(:func:`lit_mhar.kernels.dispatch.overrides`) to reach them at small widths in the interpreter.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
from routing_cases import DEVICE, TOL, bf16_flips, rel_err, spy_launches, tiny_model, triton_loss_and_grads

from lit_mhar.kernels import dispatch, launch, reference, use_backend
from lit_mhar.kernels import triton_routing as tr
from lit_mhar.kernels.dispatch import Call, plan
from lit_mhar.kernels.launch import poison_outputs

# the tensor-core kernels at the tests' small head widths, over one and two sources too (not in training)
ON_DOTS = dict(DOT_MIN_HEAD_WIDTH=16, DOT_FWD_MIN_HEAD_WIDTH=16, DOT_MIN_SOURCES=1, DOT_MAX_HEAD_WIDTH=256)
# ... and at none: the vector kernels
OFF_DOTS = dict(DOT_MIN_HEAD_WIDTH=1 << 30, DOT_MANY_SITES_MIN_HEAD_WIDTH=1 << 30, DOT_FWD_MIN_HEAD_WIDTH=1 << 30)


def site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, on_dots=True, with_dlse=True, **table):
    """Phase one (``route_sites``) with the site loop on tensor cores (pass two where the plan takes
    it: head widths held without padding columns) or on the vector kernels: errors of the outputs,
    lse and every gradient (sources, queries, gains; with an lse gradient unless ``with_dlse`` is
    False) against float64, whether pass one ran on tensor cores, and the outputs and gradients
    themselves. ``table``: further :func:`dispatch.overrides`."""
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(100 + n + sites + d)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    srcs = [(torch.randn(shape, generator=g) * (0.5 + i % 3)).to(DEVICE, dtype) for i in range(n)]
    queries = (2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(DEVICE)
    douts = [torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(sites)]
    dlse = torch.randn(sites, *shape[:-1], heads, generator=g, dtype=torch.float64).to(DEVICE)

    def run(impl, cast):
        leaves = [cast(x).requires_grad_() for x in (*srcs, queries, gains)]
        outs, lse = impl.route_sites(leaves[:n], leaves[n], leaves[n + 1], heads)
        loss = sum((o.double() * d_).sum() for o, d_ in zip(outs, douts))
        if with_dlse:
            loss = loss + (lse.double() * dlse).sum()
        return [*outs, lse, *torch.autograd.grad(loss, leaves)]

    with use_backend("triton"), dispatch.overrides(**(ON_DOTS if on_dots else OFF_DOTS), **table):
        got = run(tr, lambda x: x.detach().clone())
    ref = run(reference, lambda x: x.detach().double())
    return [rel_err(a, b) for a, b in zip(got, ref)], "bwd_stats_dot" in launched, got


def dots_pass_two(sites: int, d: int, heads: int) -> bool:
    """Whether the plan takes pass two on tensor cores where pass one is (a head width held without
    padding columns)."""
    dhp, dt = dispatch.dot_lanes(d // heads)
    return dhp + dt == d // heads


DOT_CPU = [
    (1, 3, 4, 64, 37, torch.bfloat16), (9, 8, 8, 256, 19, torch.bfloat16), (17, 8, 4, 128, 23, torch.bfloat16),
    (33, 16, 2, 64, 5, torch.bfloat16), (2, 2, 1, 32, 30, torch.bfloat16), (9, 4, 2, 48, 13, torch.bfloat16),
    (41, 8, 1, 32, 9, torch.bfloat16), (9, 8, 1, 128, 5, torch.bfloat16),
    (70, 3, 2, 64, 9, torch.bfloat16),  # over 64 sources: a tile of 128 source rows
    (9, 6, 2, 96, 13, torch.bfloat16), (5, 3, 1, 160, 11, torch.bfloat16),  # head widths 48 and 160: two column tiles
    (5, 3, 2, 80, 11, torch.bfloat16),  # head width 40, padded to 64 (and 24, padded to 32, above): pass two on the vector kernel
]


# every case on the default tiles (several tokens per tile), the lighter ones on tiles of one token too
DOT_CPU_TILES = [(*c, 4096) for c in DOT_CPU] + [(*c, 256) for c in DOT_CPU if c[0] * c[1] <= 72]


@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,tile_elements", DOT_CPU_TILES,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}-{str(c[5]).split('.')[-1]}-tile{c[6]}" for c in DOT_CPU_TILES],
)
def test_pass_one_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, tile_elements):
    """The site loop on tensor cores, pass one as products of (token, site) and (token, source) rows
    (``bwd_stats_dot``), pass two where the plan takes it: N = 1 .. 70 sources, 2 to 16 sites, head
    widths 16 to 160 (48 and 160 as two column tiles, 24 and 40 padded), bf16
    (float32 factors entering as bf16x2 splits), token counts no tile divides, tiles of several tokens
    and of one: the outputs, lse and every gradient against float64 within the bf16 tolerance, the
    query and gain gradients as close as the vector kernel's, and the tensor-core kernel ran."""
    # several tokens per tile, or one (sites padded)
    errs, ran, _ = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, DOT_TILE_ELEMENTS=tile_elements)
    assert ran, "the tensor-core kernel did not run"
    assert max(errs) < TOL[dtype], errs
    vector, ran, _ = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, on_dots=False)
    assert not ran
    # query and gain gradients (float32 outputs: the last two) no further from float64 than the
    # vector kernel's, up to the bf16x2 splits' 2^-17 per product
    for e, v in zip(errs[-2:], vector[-2:]):
        assert e <= 1.5 * v + 4e-5, (errs, vector)


def test_pass_one_on_tensor_cores_stores_what_the_vector_kernel_stores(monkeypatch):
    """What pass one hands to pass two, compared directly (the source gradients' bf16 tolerance
    would hide a small error in them): the scores, <dr, v> and D of the tensor-core kernel against
    the vector kernel's, with and without an lse gradient (head width 24, padded to 32 on tensor
    cores: pass two on the vector kernel)."""
    assert not dots_pass_two(6, 48, 2)
    kernel = launch.kernel
    seen = {}

    class Spy:  # the launch of pass two: its arguments 8 and 9 are D and the scores with <dr, v>
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["dsum"], seen["score_a"] = args[8].clone(), args[9].clone()
                return self.fn[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(launch, "kernel", lambda name, interpret: Spy(kernel(name, interpret)) if name == "bwd_sources" else kernel(name, interpret))
    for with_dlse in (True, False):
        runs = []
        for on_dots in (True, False):
            site_loop_on_tensor_cores_vs_float64(monkeypatch, 9, 6, 2, 48, 21, torch.bfloat16, on_dots=on_dots, with_dlse=with_dlse)
            runs.append(dict(seen))
        dots, vector = runs
        scores, a = (dots["score_a"][..., k] for k in (0, 1))
        assert rel_err(scores, vector["score_a"][..., 0]) < 1e-5, with_dlse  # bf16x2 weights: ~2^-17 of <w, v>
        assert rel_err(a, vector["score_a"][..., 1]) < 1e-6, with_dlse  # exact products, float32 sums
        assert rel_err(dots["dsum"], vector["dsum"]) < 1e-5, with_dlse


@pytest.mark.parametrize("d,heads", [(48, 2), (64, 4)], ids=["pass-one", "both-passes"])
def test_site_loop_on_tensor_cores_is_deterministic(monkeypatch, d, heads):
    """The tensor-core kernels (no atomics; per-program partials summed in a fixed order) give
    bit-identical gradients in two runs, over a grid where programs stride over several tiles; with
    pass one on them (head width 24, padded) and both passes (16)."""
    assert dots_pass_two(3, d, heads) == (heads == 4)
    runs = [site_loop_on_tensor_cores_vs_float64(monkeypatch, 9, 3, heads, d, 45, torch.bfloat16)[2] for _ in range(2)]
    assert dispatch.dot_tile(3, 9, d // heads)[2] * 2 < 45  # two programs (the interpreter's grid), several tiles each
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, computing with the inf
@pytest.mark.parametrize("d", [48, 32], ids=["pass-one", "both-passes"])
def test_site_loop_on_tensor_cores_keeps_a_non_finite_value_to_its_token(d):
    """An inf in one token of one source makes that token's gradients non-finite, as in the vector
    kernel, but not those of the other tokens sharing its tile (products across tokens are masked
    with where, not multiplied by a zero weight), with pass one (head width 24, padded) or both passes
    (16) on tensor cores."""
    assert dots_pass_two(2, d, 2) == (d == 32)
    g = torch.Generator().manual_seed(8)
    srcs = [torch.randn(16, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    srcs[1][5, 3] = float("inf")
    leaves = [x.clone().requires_grad_() for x in srcs]
    queries, gains = (0.3 * torch.randn(2, d, generator=g)).to(DEVICE), torch.ones(2, d, device=DEVICE)
    with poison_outputs(False), use_backend("triton"), dispatch.overrides(**ON_DOTS):
        outs, _ = tr.route_sites(leaves, queries, gains, 2)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs), leaves)
    assert dispatch.dot_tile(2, 3, d // 2)[2] > 1  # several tokens per tile
    for grad in grads:
        others = torch.cat([grad[:5], grad[6:]])
        assert torch.isfinite(others).all()


# the lighter cases that take pass two on tensor cores, and a head count that is not a power of two (width 32)
DOT_PASS_TWO = [(*c, True) for c in DOT_CPU[:6] + DOT_CPU[-4:] if dots_pass_two(c[1], c[3], c[2])] + [
    (9, 3, 3, 96, 13, torch.bfloat16, True), (9, 4, 2, 64, 11, torch.bfloat16, False),
]


@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,with_dlse", DOT_PASS_TWO,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}" + ("" if c[6] else "-no-dlse") for c in DOT_PASS_TWO],
)
def test_pass_two_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, with_dlse):
    """Both passes of the site loop on tensor cores (pass two recomputes the scores and sums the
    key norm's term t over the heads from pass one's shares): the pass-two kernel ran; outputs, lse
    and every gradient against float64 within the bf16 tolerance; the source gradients within
    rounding of the vector kernels'."""
    launched = spy_launches(monkeypatch)
    errs, ran, got = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, with_dlse=with_dlse)
    assert ran and "bwd_sources_dot" in launched and "bwd_sources" not in launched, launched
    assert launched.count("bwd_sources_dot") == -(-n // dispatch.DOT_SOURCES_CHUNK), launched  # one launch per chunk of sources
    assert max(errs) < TOL[dtype], errs
    _, _, vector = site_loop_on_tensor_cores_vs_float64(monkeypatch, n, sites, heads, d, tokens, dtype, on_dots=False, with_dlse=with_dlse)
    for a, b in zip(got[sites + 1:sites + 1 + n], vector[sites + 1:sites + 1 + n]):
        assert bf16_flips(a, b) < 0.05, bf16_flips(a, b)


@pytest.mark.parametrize("heads,chunk", [(3, 64), (2, 64), (3, 2)], ids=["width32", "width48-two-tiles", "width32-chunks-of-2"])
def test_pass_two_on_tensor_cores_adds_into_sink_slots_and_only_there(monkeypatch, heads, chunk):
    """Pass two on tensor cores writing into a gradient sink: two passes over collected sources
    (the later one, over sources 0 and 2, runs its backward first, so the earlier one adds to
    slots 0 and 2 and writes the others), and source 1 also fed to a plain use (its slot's target
    and addend then differ); with three heads of width 32, two of width 48 (two column tiles), and
    pass two launched two sources at a time (``DOT_SOURCES_CHUNK``: chunk edges between the slots
    it adds to and those it writes). Every source gradient against float64, and within rounding of
    the vector kernels'."""
    from lit_mhar.kernels.sink import GradientSink

    launched = spy_launches(monkeypatch)
    d, tokens = 96, 13
    assert (dispatch.dot_lanes(d // heads)[1] > 0) == (heads == 2)
    g = torch.Generator().manual_seed(12)
    xs = [(torch.randn(tokens, d, generator=g) * (0.5 + i % 3)).to(DEVICE, torch.bfloat16) for i in range(5)]
    q1, g1 = (2.0 * (heads / d) ** 0.5 * torch.randn(3, d, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(3, d, generator=g)).to(DEVICE)
    q2, g2 = (2.0 * (heads / d) ** 0.5 * torch.randn(2, d, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEVICE)
    plain = torch.randn(tokens, d, generator=g, dtype=torch.float64).to(DEVICE)
    douts = [torch.randn(tokens, d, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(5)]

    def run(impl, cast, sink):
        leaves = [cast(x).requires_grad_() for x in xs]
        srcs = [sink.collect(x) for x in leaves] if sink is not None else leaves
        outs, _ = impl.route_sites(srcs, cast(q1), cast(g1), heads, grad_sink=sink)
        outs2, _ = impl.route_sites([srcs[0], srcs[2]], cast(q2), cast(g2), heads, grad_sink=sink)
        fed = sink.feed([srcs[1]])[0] if sink is not None else srcs[1]
        loss = sum((o.double() * d_).sum() for o, d_ in zip(outs + outs2, douts)) + (fed.double() * plain).sum()
        return torch.autograd.grad(loss, leaves)

    got = {}
    for both in (True, False):
        launched.clear()
        with use_backend("triton"), dispatch.overrides(**(ON_DOTS if both else OFF_DOTS), DOT_SOURCES_CHUNK=chunk):
            got[both] = run(tr, lambda x: x.detach().clone(), GradientSink())
        assert launched.count("bwd_sources_dot") == (0 if not both else 3 + 1 if chunk == 2 else 2), launched  # 5 and 2 sources
    ref = run(reference, lambda x: x.detach().double(), None)
    for i, (a, b, r) in enumerate(zip(got[True], got[False], ref)):
        assert rel_err(a, r) < TOL[torch.bfloat16], (i, rel_err(a, r))
        assert bf16_flips(a, b) < 0.05, (i, bf16_flips(a, b))


def test_pass_two_on_tensor_cores_adds_into_the_gradient_sink(monkeypatch):
    """With a gradient sink, pass two on tensor cores adds each source's gradient to what the sink
    holds (``ACC``): a model with block routing gives the same gradients with both passes on
    tensor cores as with the vector kernels."""
    launched = spy_launches(monkeypatch)
    model = tiny_model("attnres", 2, 2, n_layer=3).to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = {}
    for name, stats, sources in (("vector", False, False), ("both", True, True)):
        with dispatch.overrides(**(ON_DOTS if stats else OFF_DOTS)):
            runs[name] = triton_loss_and_grads(model, idx)
        assert ("bwd_sources_dot" in launched) == sources and ("bwd_stats_dot" in launched) == stats, launched
        launched.clear()
    (loss_v, grads_v), (loss_d, grads_d) = runs["vector"], runs["both"]
    assert torch.equal(loss_v, loss_d)
    for name in grads_v:
        if grads_v[name].abs().max() == 0:  # the first site sees one source: exactly 0 on both
            assert grads_d[name].abs().max() == 0, name
            continue
        assert rel_err(grads_d[name], grads_v[name]) < 2e-2, name


# phase-one passes (two sites or more) of DOT_CPU, head widths 48 and 160 (two column tiles) and 40
# (padded) among them, at the tests'
# score spread and at thirty times it (where a shift of the softmax by another token's maximum would
# underflow)
DOT_FWD_CASES = [(*c, 1.0) for c in DOT_CPU if c[1] >= 2] + [(9, 8, 8, 256, 19, torch.bfloat16, 30.0), (17, 3, 1, 160, 11, torch.bfloat16, 30.0)]


def fwd_dot_kernel(d: int, heads: int, n: int = 1) -> str:
    """The tensor-core forward kernel a phase-one pass at width ``d`` over ``heads`` heads and ``n``
    sources launches: ``fwd_sites_mix`` where a head's width is one power-of-two tile and the
    sources are at most DOT_MIX_MAX_SOURCES, else ``fwd_sites_dot``."""
    dhp, dt = dispatch.dot_lanes(d // heads)
    mix = dt == 0 and dhp == d // heads and n <= dispatch.DOT_MIX_MAX_SOURCES
    return "fwd_sites_mix" if mix else "fwd_sites_dot"


@pytest.mark.parametrize("mix", [True, False], ids=["mix", "block-diagonal"])
@pytest.mark.parametrize(
    "n,sites,heads,d,tokens,dtype,spread", DOT_FWD_CASES,
    ids=[f"N{c[0]}-S{c[1]}-H{c[2]}-d{c[3]}-T{c[4]}-x{c[6]:g}" for c in DOT_FWD_CASES],
)
def test_phase_one_forward_on_tensor_cores_matches_float64_reference(monkeypatch, n, sites, heads, d, tokens, dtype, spread, mix):
    """Phase one's forward on tensor cores (``fwd_sites_dot``, and with ``mix`` ``fwd_sites_mix``
    where the head width is one power-of-two tile, over any number of sources): the kernel ran; every site's
    output, the lse and the saved key rstd against float64 (the outputs within the bf16 tolerance,
    lse and rstd as float32 values, up to the bf16x2 split of the weights); the outputs within
    rounding of the vector kernel's and as close to float64; queries at ``spread`` times the usual
    scale too."""
    mixing = dict(DOT_MIX_MAX_SOURCES=1 << 30 if mix else 0)  # the mixed kernel over any number of sources, or none
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(200 + n + sites + d)
    shape = (tokens, d) if tokens % 2 else (2, tokens // 2, d)
    srcs = [(torch.randn(shape, generator=g) * (0.5 + i % 3)).to(DEVICE, dtype) for i in range(n)]
    queries = (spread * 2.0 * (heads / d) ** 0.5 * torch.randn(sites, d, generator=g)).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(sites, d, generator=g)).to(DEVICE)
    runs = {}
    for on_dots in (True, False):
        launched.clear()
        with dispatch.overrides(**(ON_DOTS if on_dots else OFF_DOTS), **mixing):
            runs[on_dots] = launch.forward(srcs, queries, gains, heads, 1e-6, None, None, None, None, False, save_rstd=True)
            kernel = fwd_dot_kernel(d, heads, n)
        assert (kernel in launched) == on_dots and ("fwd" in launched) != on_dots, launched
        if on_dots and n > dispatch.DOT_WIDE_SOURCES and kernel == "fwd_sites_dot":  # a one-token tile of more than 64 sources: its own warps
            assert launched.warps == [dispatch.DOT_WARPS_ONE_TOKEN_WIDE] != [dispatch.DOT_WARPS_ONE_TOKEN["fwd_sites_dot"]], launched.warps
    got = runs[True]
    ref_outs, ref_lse = reference.route_sites([x.double() for x in srcs], queries.double(), gains.double(), heads)
    for o, r in zip(got[:sites], ref_outs):
        assert rel_err(o, r) < TOL[dtype]
    assert rel_err(got[sites], ref_lse) < 1e-5
    rstd64 = torch.stack([x.double().square().mean(-1).add(1e-6).rsqrt().flatten() for x in srcs])
    assert rel_err(got[sites + 2], rstd64) < 1e-6
    for o, v, r in zip(got[:sites], runs[False][:sites], ref_outs):
        assert rel_err(o, r) <= 1.1 * rel_err(v, r) + 1e-4, (rel_err(o, r), rel_err(v, r))  # as close to float64 as the vector kernel
        # at the usual spread, few rounding flips against the vector kernel (a lost low half of a
        # bf16x2 split shows as many); wide spreads flip more (the weights' split is exact to about
        # 2^-17 of the score, an absolute error in the exponent)
        assert spread > 1 or bf16_flips(o, v) < 0.05, bf16_flips(o, v)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, computing with the inf
@pytest.mark.parametrize("mix", [True, False], ids=["mix", "block-diagonal"])
@pytest.mark.parametrize("d,column", [(32, 3), (96, 40)], ids=["width16", "width48-two-tiles-inf-in-the-second"])
def test_phase_one_forward_on_tensor_cores_keeps_a_non_finite_value_to_its_token(monkeypatch, d, column, mix):
    """An inf in one token of one source makes that token's outputs non-finite, as on the vector
    kernel, and leaves the other tokens of its tile finite and equal to a run without the inf; at
    head width 48 (two column tiles) with the inf in the second; on either forward kernel."""
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(9)
    srcs = [torch.randn(16, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    queries, gains = (0.3 * torch.randn(2, d, generator=g)).to(DEVICE), torch.ones(2, d, device=DEVICE)
    with poison_outputs(False), dispatch.overrides(DOT_MIN_HEAD_WIDTH=16, DOT_FWD_MIN_HEAD_WIDTH=16, DOT_MIX_MAX_SOURCES=8 if mix else 0):
        clean = launch.forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
        srcs[1][5, column] = float("inf")
        outs = launch.forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
        kernel = fwd_dot_kernel(d, 2, 3)
    dhp, dt = dispatch.dot_lanes(d // 2)
    assert dt == 0 if d == 32 else (dt > 0 and column % (d // 2) >= dhp)  # at width 48, a column of the second tile
    tokens_per_tile = dispatch.mix_tile(2, 3)[3] if kernel == "fwd_sites_mix" else dispatch.dot_tile(2, 3, d // 2)[2]
    assert kernel in launched and tokens_per_tile > 5  # several tokens per tile
    for k in range(2):
        assert not torch.isfinite(outs[k][5]).all()
        others = torch.cat([outs[k][:5], outs[k][6:]])
        assert torch.equal(others, torch.cat([clean[k][:5], clean[k][6:]]))


@pytest.mark.parametrize("n", [3, 8, 9])
def test_phase_one_forward_mixes_over_at_most_eight_sources(monkeypatch, n):
    """With the package's settings, a phase-one forward at a head width of one power-of-two tile
    launches the mixed kernel over 3 to DOT_MIX_MAX_SOURCES (8) sources and the block-diagonal one
    over more, and both give the same outputs up to rounding."""
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(40 + n)
    srcs = [torch.randn(11, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(n)]
    queries, gains = (0.5 * torch.randn(4, 64, generator=g)).to(DEVICE), (1 + 0.3 * torch.randn(4, 64, generator=g)).to(DEVICE)
    with dispatch.overrides(DOT_MIN_HEAD_WIDTH=16, DOT_FWD_MIN_HEAD_WIDTH=16):
        outs = launch.forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    assert launched == (["fwd_sites_mix"] if n <= 8 else ["fwd_sites_dot"]), launched
    launched.clear()
    with dispatch.overrides(DOT_MIN_HEAD_WIDTH=16, DOT_FWD_MIN_HEAD_WIDTH=16, DOT_MIX_MAX_SOURCES=0 if n <= 8 else n):
        other = launch.forward(srcs, queries, gains, 2, 1e-6, None, None, None, None, False)
    assert launched == (["fwd_sites_dot"] if n <= 8 else ["fwd_sites_mix"]), launched
    for k in range(4):
        assert bf16_flips(outs[k], other[k]) < 0.05 and rel_err(outs[k], other[k]) < 1e-2
    torch.testing.assert_close(outs[4], other[4], rtol=1e-5, atol=1e-5)  # lse


@pytest.mark.parametrize("n", [1, 2, 3])
def test_phase_one_over_fewer_than_three_sources_launches_the_vector_kernels(monkeypatch, n):
    """With the package's DOT_MIN_SOURCES (3), a phase-one pass over one or two sources (full
    routing's first group, block routing's first two blocks) launches the vector kernels forward
    and backward, one over three sources the tensor-core ones (head widths lowered to the test's)."""
    launched = spy_launches(monkeypatch)
    g = torch.Generator().manual_seed(n)
    srcs = [torch.randn(9, 32, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(n)]
    queries = (0.3 * torch.randn(3, 32, generator=g)).to(DEVICE).requires_grad_()
    gains = torch.ones(3, 32, device=DEVICE, requires_grad=True)
    with use_backend("triton"), dispatch.overrides(DOT_MIN_HEAD_WIDTH=16, DOT_FWD_MIN_HEAD_WIDTH=16):
        outs, lse = tr.route_sites(srcs, queries, gains, 2)
        torch.autograd.grad([*outs, lse], [*srcs, queries, gains], [torch.ones_like(o) for o in outs] + [torch.ones_like(lse)])
    dots = n >= dispatch.DOT_MIN_SOURCES
    assert (fwd_dot_kernel(32, 2, n) in launched) == dots and ("fwd" in launched) != dots, launched
    assert ("bwd_stats_dot" in launched) == dots and ("bwd_stats" in launched) != dots, launched


def test_tensor_cores_only_where_the_plan_takes_them():
    """Pass one of the site loop runs on tensor cores for the replacement form with the key rstd
    saved, 2 to 16 sites and 3 to 128 sources (a single site never), a head width from 128 to 160
    (64 was slower in training for block routing's few sites) or from 64 with 8 sites or more, bf16
    sources and gradients; anything else keeps the vector kernels. Pass two takes widths held without
    padding only (a power of two, or two column tiles). The forward takes phase-one passes of 2 to 16
    sites without a prior, stream or norm from head width 128. Tensor-core tiles hold at least 16
    rows of each operand, about DOT_TILE_ELEMENTS elements of the padded head width and at most
    DOT_MAX_ROWS rows."""

    def kernels(form="route", n_src=41, n_sites=8, d=1024, heads=8, dtype=torch.bfloat16, grad_dtype=None, rstd_saved=True):
        p = plan(Call(form, n_src, n_sites, d, heads, dtype, grad_dtype or dtype, rstd_saved=rstd_saved))
        return p.forward[0].kernel, [launch.kernel for launch in p.backward]

    def stats_on_dots(**call):
        return kernels(**call)[1][0] == "bwd_stats_dot"

    def fwd_on_dots(**call):
        return kernels(**call)[0] in ("fwd_sites_dot", "fwd_sites_mix")

    assert stats_on_dots() and fwd_on_dots()
    for change in (
        dict(form="route-additive", n_sites=1), dict(rstd_saved=False), dict(n_sites=17), dict(n_src=129), dict(heads=1), dict(d=96, heads=8),
        dict(d=512, heads=8, n_sites=7), dict(d=2048), dict(d=64, heads=8), dict(dtype=torch.float16), dict(dtype=torch.float32),
        dict(grad_dtype=torch.float32),
    ):
        assert not stats_on_dots(**change), change
    assert [dispatch.dot_width(w) for w in (8, 16, 48, 128, 160)] == [16, 16, 64, 128, 256]
    # tiles of up to 128 sources for passes of several sites
    assert stats_on_dots(n_src=128) and fwd_on_dots(n_src=128)
    # head width 64 (100m) for passes of DOT_MANY_SITES = 8 sites or more (full routing's groups: MHAR's
    # 12 or 13, Delta's 8 or 9), not fewer (block routing's blocks)
    assert (dispatch.DOT_MANY_SITES, dispatch.DOT_MANY_SITES_MIN_HEAD_WIDTH) == (8, 64)
    assert [stats_on_dots(d=512, n_sites=s) for s in (3, 4, 6, 7, 8, 9, 12, 13, 16)] == [False] * 4 + [True] * 5
    assert not stats_on_dots(d=256, n_sites=12)  # head width 32
    with dispatch.overrides(DOT_MANY_SITES_MIN_HEAD_WIDTH=128):
        assert not stats_on_dots(d=512, n_sites=12) and stats_on_dots(n_sites=3)
    # a single site on the vector kernels, at any count of sources
    for n in (3, 9, 49, 64, 73):
        assert not stats_on_dots(n_src=n, n_sites=1) and stats_on_dots(n_src=n, n_sites=2), n
    # passes over fewer than DOT_MIN_SOURCES = 3 sources (full routing's first group, block routing's
    # first two blocks) on the vector kernels, forward and backward
    assert dispatch.DOT_MIN_SOURCES == 3
    for n in (1, 2):
        assert not stats_on_dots(n_src=n) and not fwd_on_dots(n_src=n), n
    assert stats_on_dots(n_src=3) and fwd_on_dots(n_src=3)
    # one-token tiles of more than 64 sources on DOT_WARPS_ONE_TOKEN_WIDE warps
    assert [dispatch.dot_warps("fwd_sites_dot", bm, bn)["num_warps"] for bm, bn in ((1, 64), (1, 128), (2, 64))] == [2, 4, dispatch.DOT_WARPS]
    for change in (
        dict(n_sites=1), dict(n_sites=17), dict(n_src=0), dict(n_src=129), dict(form="route-additive"), dict(form="merge"),
        dict(form="route-norm"), dict(d=512), dict(d=2048), dict(dtype=torch.float32),
    ):
        assert not fwd_on_dots(**change), change
    # 1b's head width 160, two column tiles of 128 and 32: the forward and both passes; a width that
    # only pads (40 = 32 + 8, under the 16 columns of a product) not pass two
    assert stats_on_dots(d=1280) and fwd_on_dots(d=1280)
    assert [dispatch.dot_lanes(w) for w in (16, 40, 48, 96, 112, 128, 160)] == [(16, 0), (64, 0), (32, 16), (64, 32), (128, 0), (128, 0), (128, 32)]
    for d, heads, both in ((1024, 8, True), (1280, 8, True), (768, 8, True), (320, 8, False), (896, 8, False)):
        assert kernels(d=d, heads=heads, n_sites=8)[1][1:] == (["bwd_sources_dot"] if both else ["bwd_sources"]), (d, heads)
    for sites, n, width in itertools.product((1, 3, 8, 16), (1, 2, 9, 41, 64, 65, 73, 128), (16, 48, 64, 128, 160)):
        bs, bn, bm = dispatch.dot_tile(sites, n, width)
        assert bs >= sites and bn >= n and bm * bs >= 16 and bm * bn >= 16, (sites, n, bs, bn, bm)
        one_token = max(16, triton.next_power_of_2(sites), triton.next_power_of_2(n))
        rows = min(dispatch.DOT_TILE_ELEMENTS // dispatch.dot_width(width), dispatch.DOT_MAX_ROWS)
        assert bm * max(bs, bn) <= max(rows, one_token), (sites, n, width, bm, bs, bn)
