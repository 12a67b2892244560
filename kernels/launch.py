"""Host side of the training kernels: buffers, offset tables, grids, and the launches :func:`plan` names.

:func:`forward` and :func:`backward` build the :class:`~lit_mhar.kernels.dispatch.Call` of their
arguments, take its plan and launch it. Sources are addressed through a table of int64 element
offsets from the first source (no ``torch.stack``). Persistent backward grids are one wave: as
many programs as the SMs hold at once (read from the compiled kernel's registers), so the fixed
order of the partial sums, and so the gradients, are the same run to run.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from lit_mhar.kernels.common import interpreted
from lit_mhar.kernels.dispatch import Call, Launch, cdiv, plan, uses_site_loop
from lit_mhar.kernels.forward import _route_fwd
from lit_mhar.kernels.site_loop import _route_bwd_sources, _route_bwd_stats
from lit_mhar.kernels.sink import SinkBinding
from lit_mhar.kernels.tensor_cores import _route_bwd_sources_dot, _route_bwd_stats_dot, _route_fwd_sites_dot, _route_fwd_sites_mix
from lit_mhar.kernels.two_pass import _route_bwd

KERNELS = {
    "fwd": _route_fwd, "bwd": _route_bwd, "bwd_stats": _route_bwd_stats, "bwd_sources": _route_bwd_sources,
    "fwd_sites_mix": _route_fwd_sites_mix, "fwd_sites_dot": _route_fwd_sites_dot,
    "bwd_stats_dot": _route_bwd_stats_dot, "bwd_sources_dot": _route_bwd_sources_dot,
}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Kernels whose persistent grid is sized by the programs an SM holds (one wave); the vector site
# loop's pass one launches 32 warps' worth per SM (sized, it was slower: BENCHMARKS.md, "Why the dispatch plan is what it is").
ONE_WAVE_KERNELS = frozenset({"bwd", "fwd_sites_dot", "fwd_sites_mix", "bwd_stats_dot", "bwd_sources_dot"})
DOT_PROGRAMS_PER_SM = 16  # at most, in a tensor-core kernel's one-wave grid

_poison = False


@contextlib.contextmanager
def poison_outputs(on: bool = True) -> Iterator[None]:
    """Fill every kernel output with NaN before its launch inside a ``with`` block (tests; ``on``
    False: not, inside a poisoned block): an element a kernel fails to write cannot pass as a
    plausible value."""
    global _poison
    previous, _poison = _poison, on
    try:
        yield
    finally:
        _poison = previous


def kernel(name: str, interpret: bool):
    """Kernel family ``name`` (a key of :data:`KERNELS`, or ``decode``) compiled for CUDA, or built
    for Triton's interpreter (CPU tensors)."""
    if name == "decode":
        from lit_mhar.kernels.decode import _decode_route_norm as k
    else:
        k = KERNELS[name]
    return interpreted(k) if interpret else k


def new(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An output buffer (NaN-filled inside :func:`poison_outputs`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if _poison else t


def aligned(t: Tensor) -> Tensor:
    """``t`` contiguous and 16-byte aligned (the kernels load 16-byte vectors through offset tables)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


_OFFSET_TABLES: dict[tuple, Tensor] = {}
_OFFSET_TABLES_MAX = 4096
_CAPTURED_HOST_TABLES: list[Tensor] = []  # host sides of tables uploaded during CUDA graph capture


def offsets(tensors: Sequence[Tensor], base: Tensor) -> Tensor:
    """int64 element offsets of ``tensors`` from ``base`` (same dtype, 16-byte aligned), on its device,
    plus two spare 0s so that the kernels can read the entry after the last unconditionally."""
    size, start = base.element_size(), base.data_ptr()
    offs = tuple((t.data_ptr() - start) // size for t in tensors) + (0, 0)
    if base.device.type != "cuda":
        return torch.tensor(offs, dtype=torch.int64)
    # Training allocates the same buffers at the same addresses step after step, so a table is
    # usually one already on the device: reuse it (no host-to-device copy). Tables are read-only and
    # never freed (a captured CUDA graph may hold one), so the cache stops growing when full.
    key = (base.device.index, offs)
    table = _OFFSET_TABLES.get(key)
    if table is None:
        host = torch.tensor(offs, dtype=torch.int64, pin_memory=True)
        table = host.to(base.device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            # A CUDA graph captures the copy as a node that re-reads this pinned host memory at
            # every replay: keep it alive and unchanged as long as the process.
            _CAPTURED_HOST_TABLES.append(host)
        elif len(_OFFSET_TABLES) < _OFFSET_TABLES_MAX:
            _OFFSET_TABLES[key] = table
    return table


def check_dtypes(sources: Sequence[Tensor]) -> None:
    """Raise ValueError for a source dtype the kernels do not take (float64: the reference)."""
    for i, s in enumerate(sources):
        if s.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton depth routing: sources[{i}] has dtype {s.dtype}; supported: {list(SUPPORTED_DTYPES)}")


def form(stream: Optional[Tensor], prior: Optional[Tensor], norm: Optional[Tensor]) -> str:
    """The :data:`~lit_mhar.kernels.dispatch.TRAINING_FORMS` name of a call with these arguments."""
    name = ("merge" if prior is not None else "route") + ("-norm" if norm is not None else "")
    return name + ("-additive" if stream is not None else "")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_RESIDENT: dict = {}
_RESIDENT_FALLBACKS: dict = {}  # configurations whose registers could not be read, and why


def _resident_programs(name: str, device: torch.device, args: tuple, kwargs: dict) -> int:
    """Programs of kernel ``name`` compiled for these arguments that one SM holds at once (its
    registers, shared memory and threads), so that a persistent grid is a whole number of waves.

    Compiles (or finds in Triton's cache) without launching, once per configuration: the answer,
    and so the grid and the fixed order of the partial sums, is the same at every call. Falls back
    to 32 warps' worth of programs where Triton does not report its registers.
    """
    warps = kwargs["num_warps"]
    if name not in ONE_WAVE_KERNELS:
        return max(1, 32 // warps)
    # the compiled kernel also depends on which integer arguments are 1 or multiples of 16 (Triton
    # specialises them), so those facts are part of the configuration
    ints = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int))
    key = (name, device.index or 0, tuple(sorted(kwargs.items())), tuple(a.dtype for a in args if isinstance(a, Tensor)), ints)
    if key not in _RESIDENT:
        fallback = max(1, 32 // warps)
        try:
            compiled = kernel(name, False).warmup(*args, grid=(1,), **kwargs)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs_per_warp * warps)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
            shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // max(1, compiled.metadata.shared)
            _RESIDENT[key] = max(1, min(by_regs, by_threads, shared, 32))
        except Exception as e:  # noqa: BLE001 - an estimate for the grid only; the launch reports real errors
            _RESIDENT[key] = fallback
            _RESIDENT_FALLBACKS[key] = repr(e)
    return _RESIDENT[key]


def _dot_programs(name: str, device: torch.device, tiles: int, heads: int, args, meta: dict) -> int:
    """Programs per head of a tensor-core kernel's grid: one wave (at most
    :data:`DOT_PROGRAMS_PER_SM` per SM), each striding over the token tiles; two in the interpreter.
    ``args(programs)`` gives the launch arguments; the registers are read from a compile for as
    many programs as SMs (Triton specialises a count of 1)."""
    if device.type != "cuda":
        return min(tiles, 2)
    sms = _sm_count(device.index or 0)
    resident = min(DOT_PROGRAMS_PER_SM, _resident_programs(name, device, args(sms), meta))
    return min(tiles, max(1, sms * resident // heads))


def forward(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    stream: Optional[Tensor], gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    store_scores: bool, save_rstd: bool = False, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
    save_routed: bool = False,
) -> list[Tensor]:
    """The forward launch of :func:`lit_mhar.kernels.autograd.route_fwd` (its arguments and outputs),
    plus, with ``save_routed`` (a fused norm's merge), the routed value r float32 last."""
    like = sources[0] if sources else prior_out
    if norm_weight is not None and (queries.shape[0] != 1 or (prior_out is None and (stream is not None or not sources))):
        raise ValueError("triton depth routing: the fused RMSNorm (norm_weight) needs one site, with a prior or (replacement form) sources")
    if save_routed and (norm_weight is None or prior_out is None):
        raise ValueError("triton depth routing: save_routed is for the fused norm's merges (norm_weight and a prior)")
    shape, d = like.shape, like.shape[-1]
    n_sites, n_src, M = queries.shape[0], len(sources), like.numel() // d
    interpret = like.device.type != "cuda"
    (launch,) = plan(Call(form(stream, prior_out, norm_weight), n_src, n_sites, d, heads, like.dtype), interpret).forward
    srcs = [aligned(s) for s in sources]
    base = srcs[0] if srcs else aligned(prior_out)
    w = (queries.float() * gains.float()).contiguous()
    if stream is not None:  # the norm's output in the sources' dtype, else the stream's
        outs = [new(shape, like.dtype if norm_weight is not None else stream.dtype, like.device)]
    else:
        outs = [new(shape, like.dtype, like.device) for _ in range(n_sites)]
    lse = new((n_sites, *shape[:-1], heads), torch.float32, like.device)
    scores = new((n_src, *shape[:-1], heads) if store_scores else (0,), torch.float32, like.device)
    store_rstd = bool(save_rstd) and n_src > 0
    rstd = new((n_src, M) if store_rstd else (0,), torch.float32, like.device)
    routed = [new(shape, torch.float32, like.device)] if save_routed else []  # the norm's input r
    dummy = w
    if launch.kernel != "fwd":  # phase one on tensor cores: program p takes every progs-th tile of tokens, all heads
        w_hi = w.to(torch.bfloat16)
        w_lo = (w - w_hi.float()).to(torch.bfloat16)
        src_offs, out_offs = offsets(srcs, base), offsets(outs, outs[0])
        tiles = cdiv(M, launch.meta["BM"])
        meta = dict(launch.meta, D=d, H=heads, DH=d // heads, ALIGN=16 // base.element_size(), STORE_RSTD=store_rstd, DOT_F32=interpret)

        def args(progs: int) -> tuple:
            return (base, src_offs, n_src, w_hi, w_lo, n_sites, outs[0], out_offs, lse, rstd if store_rstd else dummy, M, eps, tiles, progs)

        progs = _dot_programs(launch.kernel, like.device, tiles, 1, args, meta)
        kernel(launch.kernel, interpret)[(progs,)](*args(progs), **meta)
        return [*outs, lse, scores, rstd]
    group = launch.meta["BS"]
    kernel("fwd", interpret)[(cdiv(M, launch.meta["BM"]) * cdiv(n_sites, group),)](
        base, offsets(srcs, base), n_src,
        w, n_sites,
        outs[0], offsets(outs, outs[0]),
        lse,
        aligned(stream) if stream is not None else dummy, gate.contiguous() if gate is not None else dummy,
        aligned(prior_out) if prior_out is not None else dummy, prior_lse.contiguous() if prior_lse is not None else dummy,
        scores if store_scores else dummy, rstd if store_rstd else dummy,
        norm_weight.contiguous() if norm_weight is not None else dummy, routed[0] if routed else dummy,
        M, eps, float(norm_eps),
        **launch.meta, D=d, H=heads, DH=d // heads, ALIGN=16 // base.element_size(),
        ADDITIVE=stream is not None, HAS_PRIOR=prior_out is not None, STORE_SCORES=store_scores, STORE_RSTD=store_rstd,
        NORM=norm_weight is not None, STORE_ROUTED=save_routed,
    )
    return [*outs, lse, scores, rstd, *routed]


def _source_grad_targets(sink: Optional[SinkBinding], n_src: int, like: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor], int]:
    """``(dsrc, targets, addends, n_acc)`` for a backward kernel: without a sink a new ``[N, ..., d]``
    gradient (``targets`` its slices, nothing to add); with one, an empty ``dsrc`` and the sink's
    slot buffers (the kernel adds ``addends[k]`` for ``k < n_acc``; see ``GradientSink.targets``)."""
    if sink is None:
        dsrc = new((n_src, *like.shape), like.dtype, like.device)
        targets = list(dsrc.unbind(0))
        return dsrc, targets, targets, 0
    targets, addends, n_acc = sink.targets(like, new)
    return new((0,), like.dtype, like.device), targets, addends, n_acc


def saves_rstd(sources: Sequence[Tensor], queries: Tensor, gains: Tensor, has_prior: bool, norm: bool = False) -> bool:
    """Whether the forward of such a pass writes each source's key rstd ``[N, tokens]`` for its
    backward: one that will run (gradients on) through the site loop, which then loads it instead of
    reducing each source tile over the width again."""
    return (
        uses_site_loop(queries.shape[0], len(sources), has_prior, norm)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (queries, gains, *sources))
    )


def backward(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    lse: Tensor, grad_outs: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor] = None,
    norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0, stream: Optional[Tensor] = None,
    sink: Optional[SinkBinding] = None, stream_replay: bool = False, rebuild: bool = False, saved_routed: bool = False,
    earlier_outputs: Sequence[Tensor] = (),
) -> list[Tensor]:
    """The fused backward (:func:`lit_mhar.kernels.autograd.route_bwd`'s outputs).

    With ``sink`` the source gradients are added into the sink's slots inside the kernels and the
    first returned gradient is an empty tensor. With ``stream_replay`` (fused norm, additive form)
    ``stream`` is the stream at the group's start, and the site's stream is that plus the sources
    in order (``merge_route_norm``'s ``stream_start``); with ``rebuild`` too, ``sources`` are a
    block's outputs, whose running sum is the one source and which the stream adds instead
    (``block_outputs``). With ``saved_routed`` (a fused norm's merge, eager) ``prior_out`` is the
    routed value r the forward stored: one pass with scores over the sources instead of two, and
    ``dprior`` has the sources' dtype. ``earlier_outputs`` (with ``stream_replay``; the sources'
    dtype): ``stream`` is the stream at an earlier group's start, to which these are added first.
    Raises ValueError for arguments that contradict each other.
    """
    like = sources[0] if sources else prior_out
    shape, d = like.shape, like.shape[-1]
    n_sites, n_src, M = queries.shape[0], (1 if rebuild else len(sources)), like.numel() // d
    device = like.device
    interpret = device.type != "cuda"
    grads = [aligned(g) for g in grad_outs]
    if any(g.dtype != grads[0].dtype for g in grads):
        grads = [aligned(g.to(grads[0].dtype)) for g in grads]
    has_rstd = rstd is not None and rstd.numel() > 0
    call = Call(
        form(gate, prior_out, norm_weight), n_src, n_sites, d, heads, like.dtype, grads[0].dtype, eager=saved_routed, rebuild=rebuild,
        rstd_saved=has_rstd,
    )
    decided = plan(call, interpret)
    if decided.saves_routed != saved_routed:
        raise ValueError("triton depth routing: a saved routed value stands for the prior of a fused norm's merge over 3 or more sources")
    if uses_site_loop(n_sites, n_src, prior_out is not None, norm_weight is not None):
        if has_rstd and tuple(rstd.shape) != (n_src, M):
            raise ValueError(f"triton depth routing: saved rstd has shape {tuple(rstd.shape)}, expected {(n_src, M)}")
        empty = [new((0,), torch.float32, device) for _ in range(2)]  # no norm: d_norm_weight, d_stream
        return [*_site_loop(decided.backward, sources, queries, gains, heads, eps, gate, lse, grads, grad_lse, rstd, sink), *empty]
    (launch,) = decided.backward
    srcs = [aligned(s) for s in sources]
    earlier = [aligned(o) for o in earlier_outputs]
    base = srcs[0] if srcs else earlier[0] if earlier else aligned(prior_out)
    if earlier and (not stream_replay or any(o.dtype != base.dtype for o in earlier)):
        raise ValueError(
            f"triton depth routing: earlier outputs (dtypes {sorted({str(o.dtype) for o in earlier})}) need a replayed stream "
            f"(stream_replay={stream_replay}) and the dtype of the sources' table, {base.dtype}"
        )
    w = (queries.float() * gains.float()).contiguous()
    dsrc, targets, addends, n_acc = _source_grad_targets(sink, n_src, like) if n_src else (new((0,), like.dtype, device), [w], [w], 0)
    prior_dtype = like.dtype if saved_routed else prior_out.dtype if prior_out is not None else torch.float32  # (r's may differ)
    dprior = new(shape if prior_out is not None else (0,), prior_dtype, device)
    dprior_lse = new(prior_lse.shape if prior_lse is not None else (0,), torch.float32, device)
    dummy = w
    norm_stream = norm_weight is not None and gate is not None  # the additive form's stream enters the norm
    if norm_stream and stream is None:
        raise ValueError("triton depth routing: the additive form's fused norm needs the stream in its backward")
    if rebuild and not (norm_stream and stream_replay):
        raise ValueError("triton depth routing: rebuilding a block's running sum needs the fused norm's replayed stream")
    if norm_stream and sink is not None and sink.stream_slot is not None:  # the stream's gradient into its slot
        (dstream,), (dstream_acc,), stream_acc = sink.sink.targets([sink.stream_slot], stream, new)
    else:
        dstream = new(shape if norm_stream else (0,), stream.dtype if norm_stream else torch.float32, device)
        dstream_acc, stream_acc = dstream, 0
    meta = dict(
        launch.meta, D=d, H=heads, DH=d // heads, ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size(),
        ADDITIVE=gate is not None, HAS_PRIOR=prior_out is not None, HAS_DLSE=grad_lse is not None, NORM=norm_weight is not None,
        ACC=n_acc > 0, STREAM_ACC=stream_acc > 0, REPLAY=norm_stream and stream_replay, REBUILD=rebuild, SAVED_ROUTED=saved_routed,
        N_EARLIER=len(earlier),
    )
    head = (
        base, offsets(srcs, base), n_src, len(srcs), offsets(earlier, base),
        w, n_sites,
        grads[0], offsets(grads, grads[0]),
        lse.contiguous(), grad_lse.contiguous() if grad_lse is not None else dummy,
        gate.contiguous() if gate is not None else dummy,
        aligned(prior_out) if prior_out is not None else dummy, prior_lse.contiguous() if prior_lse is not None else dummy,
        targets[0], offsets(targets, targets[0]), addends[0], offsets(addends, addends[0]), n_acc,
    )
    nw = norm_weight.contiguous() if norm_weight is not None else dummy
    num_tiles = cdiv(M, meta["BM"])

    def args(dw: Tensor, dgate: Tensor, dnw: Tensor) -> tuple:
        return (
            *head, dw, dgate, dprior if prior_out is not None else dummy, dprior_lse if prior_lse is not None else dummy,
            nw, dnw, aligned(stream) if norm_stream else dummy, dstream if norm_stream else dummy, dstream_acc if norm_stream else dummy,
            M, eps, num_tiles, float(norm_eps),
        )

    # persistent programs: as many as the SMs hold at once (one wave), each over a fixed range of tiles
    if interpret:
        programs = min(num_tiles, 2)
    else:
        programs = min(num_tiles, _sm_count(device.index or 0) * _resident_programs("bwd", device, args(dummy, dummy, dummy), meta))
    dw = new((programs, n_sites, d), torch.float32, device)
    dgate = new((programs, d) if gate is not None else (0,), torch.float32, device)
    dnw = new((programs, d) if norm_weight is not None else (0,), torch.float32, device)
    kernel("bwd", interpret)[(programs,)](*args(dw, dgate if gate is not None else dummy, dnw if norm_weight is not None else dummy), **meta)
    dw = dw.sum(0)  # fixed-order reduction over programs: deterministic
    q, g = queries.float(), gains.float()
    return [
        dsrc,
        (dw * g).to(queries.dtype),
        (dw * q).to(gains.dtype),
        dgate.sum(0).to(gate.dtype) if gate is not None else dgate,
        dprior,
        dprior_lse,
        dnw.sum(0).to(norm_weight.dtype) if norm_weight is not None else dnw,  # fixed order, like dw
        dstream,
    ]


def _site_loop(
    launches: tuple[Launch, ...], sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    gate: Optional[Tensor], lse: Tensor, grads: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor],
    sink: Optional[SinkBinding],
) -> list[Tensor]:
    """Backward of several sites (phase one of Block AttnRes), or of one site over many sources, in
    two kernels: pass one (``bwd_stats`` or ``bwd_stats_dot``) forms each site's ``D`` and the
    query-gradient (and gate-gradient) partials; pass two (``bwd_sources``, or ``bwd_sources_dot``
    in chunks of sources) writes each source's gradient, looping over the sites. With ``sink`` the
    source gradients are added into its slots ``0 .. N - 1`` inside pass two (the returned source
    gradient is then an empty tensor). ``rstd`` ``[N, tokens]`` float32: each source's key rstd as
    the forward computed it, or None / empty to recompute it."""
    one, *two = launches
    like = sources[0]
    d, n_sites, n_src, M = like.shape[-1], queries.shape[0], len(sources), like.numel() // like.shape[-1]
    device = like.device
    interpret = device.type != "cuda"
    srcs = [aligned(s) for s in sources]
    base = srcs[0]
    w = (queries.float() * gains.float()).contiguous()
    src_offs, g_offs = offsets(srcs, base), offsets(grads, grads[0])
    dsum = new(lse.shape, torch.float32, device)
    both_on_dots = two[0].kernel == "bwd_sources_dot"  # no scores round trip: t's head shares instead
    # s_i and <dr, v_i>_h per site and source, for the vector pass two
    score_a = new((0,) if both_on_dots else (n_sites, n_src, *lse.shape[1:], 2), torch.float32, device)
    t_part = new((n_src, M, heads) if both_on_dots else (0,), torch.float32, device)
    dsrc, targets, addends, n_acc = _source_grad_targets(sink, n_src, like)
    gate_c = gate.contiguous() if gate is not None else w
    geometry = dict(D=d, H=heads, DH=d // heads, ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size())
    lse = lse.contiguous()
    rstd = rstd.contiguous() if rstd is not None and rstd.numel() > 0 else w
    dlse = grad_lse.contiguous() if grad_lse is not None else w
    if one.kernel == "bwd_stats_dot":  # program (p, h) takes head h of every progs-th tile of tokens
        w_hi = w.to(torch.bfloat16)
        w_lo = (w - w_hi.float()).to(torch.bfloat16)
        tiles = cdiv(M, one.meta["BM"])
        meta = dict(one.meta, **geometry, HAS_DLSE=grad_lse is not None, DOT_F32=interpret)

        def dot_args(dw: Tensor, progs: int) -> tuple:
            return (base, src_offs, n_src, w_hi, w_lo, n_sites, grads[0], g_offs, lse, dlse, dsum, dw, score_a, rstd, t_part, M, tiles, progs)

        per_site = _dot_programs("bwd_stats_dot", device, tiles, heads, lambda p: dot_args(w, p), meta)
        dw = new((per_site * n_sites, d), torch.float32, device)
        dgate = new((0,), torch.float32, device)
        kernel("bwd_stats_dot", interpret)[(per_site, heads)](*dot_args(dw, per_site), **meta)
    else:
        meta = dict(one.meta, **geometry, HAS_DLSE=grad_lse is not None, ADDITIVE=gate is not None)
        num_tiles = cdiv(M, meta["BM"])

        def stats_args(dw: Tensor, dgate: Tensor, per_site: int) -> tuple:
            return (base, src_offs, n_src, w, n_sites, grads[0], g_offs, lse, dlse, gate_c, dgate, dsum, dw, score_a, rstd, M, eps, num_tiles, per_site)

        # persistent programs, spread over the sites
        if interpret:
            per_site = min(num_tiles, 2)
        else:
            resident = _resident_programs("bwd_stats", device, stats_args(w, w, max(1, 32 // meta["num_warps"])), meta)
            per_site = min(num_tiles, cdiv(_sm_count(device.index or 0) * resident, n_sites))
        dw = new((per_site * n_sites, d), torch.float32, device)
        dgate = new((per_site, d) if gate is not None else (0,), torch.float32, device)
        kernel("bwd_stats", interpret)[(per_site * n_sites,)](*stats_args(dw, dgate if gate is not None else w, per_site), **meta)
    target_offs, addend_offs = offsets(targets, targets[0]), offsets(addends, addends[0])
    if both_on_dots:
        # each source's gradient needs only its own scores once pass one has D and t: chunks of sources, each on its own tiles
        for launch in two:
            c0, c1 = launch.first, launch.first + launch.count
            acc_c = min(max(n_acc - c0, 0), c1 - c0)
            tiles = cdiv(M, launch.meta["BM"])
            meta = dict(launch.meta, **geometry, DOT_F32=interpret, ACC=acc_c > 0)

            def src_args(progs: int, c0=c0, c1=c1, acc_c=acc_c, tiles=tiles) -> tuple:
                return (
                    base, src_offs[c0:], c1 - c0, w_hi, w_lo, n_sites, grads[0], g_offs, lse, dsum, rstd[c0:c1], t_part[c0:c1],
                    targets[0], target_offs[c0:], addends[0], addend_offs[c0:], acc_c, M, tiles, progs,
                )

            progs = _dot_programs("bwd_sources_dot", device, tiles, heads, src_args, meta)
            kernel("bwd_sources_dot", interpret)[(progs, heads)](*src_args(progs), **meta)
    else:
        (launch,) = two
        kernel("bwd_sources", interpret)[(cdiv(M, launch.meta["BM"]) * n_src,)](
            base, src_offs, n_src, w, n_sites, grads[0], g_offs,
            lse, dsum, score_a, gate_c, targets[0], target_offs, addends[0], addend_offs, n_acc, rstd,
            M, eps,
            **launch.meta, **geometry, ADDITIVE=gate is not None, ACC=n_acc > 0,
        )
    dw = dw.view(-1, n_sites, d).sum(0)  # fixed-order reduction over programs: deterministic
    q, g = queries.float(), gains.float()
    empty = [torch.empty(0, dtype=torch.float32, device=device) for _ in range(2)]  # outputs may not alias
    dgate = dgate.sum(0).to(gate.dtype) if gate is not None else dgate  # fixed order, like dw
    return [dsrc, (dw * g).to(queries.dtype), (dw * q).to(gains.dtype), dgate, *empty]
