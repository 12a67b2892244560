"""Fused Triton depth routing: the public functions, with the signatures of :mod:`lit_mhar.kernels.reference`.

Same math as the reference (AttnRes eqs. 2-6, MHAR's heads, Delta AttnRes's additive form), one
pass over the sources forward and recomputing passes backward, extended in the ways the model's
two-phase routing uses: several sites per pass (:func:`route_sites`, phase one), a prior merged as
one more source (:func:`merge_route`, phase two), the next RMSNorm fused into a merge
(:func:`merge_route_norm`) or into a single site (:func:`route_norm`), and decoding
(:func:`route_norm_decode`, :func:`route_sites_decode`). Which kernel and tile serve a call:
:func:`lit_mhar.kernels.dispatch.plan`; the map of ops, kernels and tests: ``kernels/README.md``.
On CPU tensors the kernels run in Triton's interpreter (tests, through ``use_backend("triton")``),
on CUDA tensors compiled.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lit_mhar.kernels.autograd import route
from lit_mhar.kernels.decode import route_norm_decode, route_sites_decode
from lit_mhar.kernels.launch import SUPPORTED_DTYPES, check_dtypes
from lit_mhar.kernels.reference import check_merge_norm_args, check_route_args, check_route_norm_args
from lit_mhar.kernels.sink import GradientSink, SinkBinding

# Running sums the backward kernel rebuilds from a block's outputs (merge_route_norm's
# block_outputs): bf16, rounded to nearest even after each addition as torch's additions are, and
# float32; an fp16 running sum is saved.
REBUILD_DTYPES = (torch.float32, torch.bfloat16)


def _bind(sink: Optional[GradientSink], sources: Sequence[Tensor], name: str) -> Optional[SinkBinding]:
    """``sink``'s binding to ``sources`` (ValueError before any work for sources it did not collect), or None."""
    return None if sink is None else sink.bind(sources, name)


def _uncast(binding: Optional[SinkBinding], srcs: Sequence[Tensor], sources: Sequence[Tensor]) -> Optional[SinkBinding]:
    """``binding`` where the kernels read the collected ``sources`` themselves, None where they read cast copies."""
    return binding if binding is not None and all(a is b for a, b in zip(srcs, sources)) else None


def _common_dtype(sources: Sequence[Tensor]) -> list[Tensor]:
    """Sources in their promoted dtype (one element type for the offset table); a cast is a copy."""
    check_dtypes(sources)
    dtype = sources[0].dtype
    for s in sources[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return [s if s.dtype == dtype else s.to(dtype) for s in sources]


def depth_route(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int = 1,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused depth routing at one site; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.depth_route` (AttnRes eqs. 2-6, MHAR, Delta AttnRes).

    Args:
        sources: N >= 1 tensors ``[..., d]``, float32 / bfloat16 / float16 (mixed dtypes are cast
            to the promoted one, a copy).
        query, gain: ``[d]``. heads: H dividing d. stream, gate: the additive form, or None.
        eps: key RMSNorm epsilon. return_weights: also return ``[N, ..., H]`` float32 weights.

    Returns:
        ``out`` ``[..., d]`` in the promoted source dtype (replacement) or the stream's dtype
        (additive); with ``return_weights`` also the weights, which carry no gradient here.

    Raises:
        ValueError: the reference's argument errors, float64 sources, a width over the kernel's
            register budget.
    """
    check_route_args(sources, query, gain, heads, stream, gate, eps)
    srcs = _common_dtype(sources)
    res = route(srcs, query[None], gain[None], heads, eps, stream, gate, None, None, return_weights)
    if not return_weights:
        return res[0]
    lse, scores = res[1], res[2]
    return res[0], torch.exp(scores - lse).detach()


def route_sites(
    sources: Sequence[Tensor], queries: Tensor, gains: Tensor, heads: int = 1, eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> tuple[list[Tensor], Tensor]:
    """First phase of two-phase Block AttnRes: S sites routed against the same sources in one pass.

    Same contract as :func:`lit_mhar.kernels.reference.route_sites`: ``queries``/``gains``
    ``[S, d]``; returns S routed values ``[..., d]`` (source dtype) and their log-sum-exp
    ``[S, ..., H]`` float32. Any number of sites: the backward loops over them. With
    ``grad_sink`` the backward kernels add each source's gradient into the sink's buffer (no
    separate addition kernel).
    """
    if queries.dim() != 2 or gains.shape != queries.shape:
        raise ValueError(f"route_sites: queries {tuple(queries.shape)} and gains {tuple(gains.shape)} must both be [S, d]")
    check_route_args(sources, queries[0], gains[0], heads, None, None, eps, "route_sites")
    binding = _bind(grad_sink, sources, "route_sites")
    srcs = _common_dtype(sources)
    res = route(srcs, queries, gains, heads, eps, None, None, None, None, False, sink=_uncast(binding, srcs, sources))
    S = queries.shape[0]
    return list(res[:S]), res[S]


def merge_route(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    prior_out: Tensor,
    prior_lse: Tensor,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> Tensor:
    """Second phase: merge a routed value ``prior_out`` (log-sum-exp ``prior_lse``) with more sources.

    Same contract as :func:`lit_mhar.kernels.reference.merge_route`; ``sources`` may be empty.
    With ``grad_sink`` the backward kernel adds the sources' gradients into the sink.
    """
    if sources:
        check_route_args(sources, query, gain, heads, stream, gate, eps, "merge_route")
    binding = _bind(grad_sink, sources, "merge_route")
    srcs = _common_dtype(sources) if sources else []
    sink = _uncast(binding, srcs, sources)
    return route(srcs, query[None], gain[None], heads, eps, stream, gate, prior_out, prior_lse.float(), False, sink=sink)[0]


def merge_route_norm(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    prior_out: Tensor,
    prior_lse: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
    stream_start: Optional[Tensor] = None,
    block_outputs: Optional[Sequence[Tensor]] = None,
    earlier_outputs: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """Second phase fused with the next sublayer's RMSNorm: one kernel forward, one backward.

    Same contract as :func:`lit_mhar.kernels.reference.merge_route_norm` (``y = RMSNorm(x) *
    norm_weight``, ``x = r`` or ``stream + gate * r``, never rounded). The backward
    recomputes ``r`` from the prior and the sources, so the forward saves what the merge saves (the
    prior, its lse, the sources; where a backward will run, the replacement form over at least
    :data:`~lit_mhar.kernels.dispatch.SAVE_ROUTED_MIN_SOURCES` sources writes ``r`` in float32 and
    saves it instead of the prior, and the backward reads the sources once with scores; in the
    additive form the stream, or ``stream_start`` where given
    and float32, from which the backward kernel recomputes the stream by adding the sources it
    reads anyway; with ``block_outputs`` too, block routing, the block's outputs so far instead of
    its running sum and the stream: the backward kernel rebuilds the running sum, rounding after
    each addition as torch does, and the stream from them, where the running sum is bf16 or
    float32 and read uncast; with ``earlier_outputs`` too, of the prior's and the sources' dtype,
    ``stream_start`` is an earlier group's start and these outputs, saved, are added to it first),
    not the norm's input; the
    weight's gradient is summed per persistent program and reduced in a fixed order (deterministic).
    With ``grad_sink`` the backward kernel adds the sources' gradients into the sink, and in the
    additive form the stream's where the sink collected the stream (:meth:`GradientSink.collect`);
    where the sources are cast to a common dtype first, the gradients go through autograd instead
    (the collected aliases add them to their sums: the same totals).
    """
    check_merge_norm_args(
        sources, query, gain, heads, prior_out, prior_lse, norm_weight, norm_eps, eps, stream, gate, stream_start, block_outputs,
        earlier_outputs,
    )
    check_dtypes([prior_out])
    if stream_start is not None and stream_start.dtype != torch.float32:
        stream_start = None  # the kernel adds in float32; a bf16 / fp16 stream rounds after each addition: saved instead
    binding = None if grad_sink is None else grad_sink.bind(sources, "merge_route_norm", stream=stream if gate is not None else None)
    srcs = _common_dtype(sources) if sources else []
    if srcs and srcs[0].dtype != prior_out.dtype:
        dtype = torch.promote_types(srcs[0].dtype, prior_out.dtype)
        srcs, prior_out = [s.to(dtype) for s in srcs], prior_out.to(dtype)
    if block_outputs is not None and (stream_start is None or srcs[0] is not sources[0] or srcs[0].dtype not in REBUILD_DTYPES):
        # the kernel rounds the rebuilt running sum as torch does for bf16 (and float32: no rounding
        # beyond the sum's); a cast source, another dtype, or a stream that is not replayed: saved
        stream_start = block_outputs = None
    if earlier_outputs and (
        stream_start is None or (srcs and srcs[0] is not sources[0])
        or any(o.dtype not in SUPPORTED_DTYPES or o.dtype != prior_out.dtype for o in earlier_outputs)
    ):
        # the kernel reads them off the sources' base pointer: the sources' dtype, uncast, and the
        # prior's (a float32 prior with bf16 outputs gave gradients off the saved stream's by float32
        # rounding on the GPU, cause not established); else the stream is saved
        stream_start = block_outputs = earlier_outputs = None
    return route(
        srcs, query[None], gain[None], heads, eps, stream, gate, prior_out, prior_lse.float(), False, norm_weight, float(norm_eps),
        sink=_uncast(binding, srcs, sources), stream_start=stream_start, block_outputs=block_outputs,
        earlier_outputs=earlier_outputs or None,
    )[0]


def route_norm(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    norm_weight: Tensor,
    norm_eps: float,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> Tensor:
    """One routing site fused with the next RMSNorm, without a prior: one kernel forward, one backward.

    Same contract as :func:`lit_mhar.kernels.reference.route_norm`. The forward reads each source
    once (online softmax) and writes only the norm's output; the backward (the two-pass kernel of
    the merges, without a prior) recomputes the routed value from the sources. With ``grad_sink``
    the backward kernel adds the sources' gradients into the sink; where the sources are cast to a
    common dtype first, they go through autograd instead (the same totals).
    """
    check_route_norm_args(sources, query, gain, heads, norm_weight, norm_eps, eps)
    binding = _bind(grad_sink, sources, "route_norm")
    srcs = _common_dtype(sources)
    return route(
        srcs, query[None], gain[None], heads, eps, None, None, None, None, False, norm_weight, float(norm_eps), sink=_uncast(binding, srcs, sources),
    )[0]


__all__ = ["depth_route", "route_sites", "merge_route", "merge_route_norm", "route_norm", "route_norm_decode", "route_sites_decode"]
