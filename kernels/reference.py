"""Plain PyTorch depth routing: the reference every fused kernel is tested against.

One op serves every routed residual variant (AttnRes, Block AttnRes, MHAR, Delta AttnRes):

    rstd_i      = 1 / sqrt(mean_c v_i[c]^2 + eps)                       key RMSNorm (full width d)
    s_i^h       = sum_{c in slice h} q[c] * g[c] * v_i[c] * rstd_i        score of source i, head h
    alpha_i^h   = softmax_i(s_i^h)                                        routing weights over depth
    r[c]        = sum_i alpha_i^{h(c)} * v_i[c]                           routed value (raw sources)
    out         = r                        (replacement form, AttnRes eqs. 2-6)
    out         = stream + gate * r        (additive form, Delta AttnRes)

Head h owns the contiguous channel slice [h*d/H, (h+1)*d/H) (MHAR); H = 1 is AttnRes exactly.
Arithmetic is float32 for half-precision inputs (float64 inputs stay float64, for tests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lit_mhar.kernels.sink import GradientSink


def check_route_args(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    stream: Optional[Tensor],
    gate: Optional[Tensor],
    eps: Optional[float] = None,
    name: str = "depth_route",
) -> None:
    """Validate the arguments of :func:`depth_route` (or of the op ``name``, whose errors name it)
    before any work; raise ValueError naming the bad one. ``eps``, where given, must be a finite
    number > 0 (with 0 a source row of zeros, such as padding, gives NaN gradients)."""
    if len(sources) == 0:
        raise ValueError(f"{name}: sources is empty; a routing site needs at least one source")
    shape = sources[0].shape
    if len(shape) == 0:
        raise ValueError(f"{name}: sources must have a channel dimension, got a scalar")
    d = shape[-1]
    if d < 1:
        raise ValueError(f"{name}: sources have width d={d}; expected d >= 1")
    device = sources[0].device
    for i, v in enumerate(sources):
        if v.shape != shape:
            raise ValueError(f"{name}: sources[{i}] has shape {tuple(v.shape)}, sources[0] has {tuple(shape)}")
        if not v.is_floating_point():
            raise ValueError(f"{name}: sources[{i}] has dtype {v.dtype}; expected a floating dtype")
        if v.device != device:
            raise ValueError(f"{name}: sources[{i}] is on {v.device}, sources[0] on {device}; all on one device")
    for arg, p in (("query", query), ("gain", gain), ("gate", gate)):
        if p is None and arg != "gate":
            raise ValueError(f"{name}: {arg} is None; expected a ({d},) tensor")
        if p is not None and tuple(p.shape) != (d,):
            raise ValueError(f"{name}: {arg} has shape {tuple(p.shape)}; expected ({d},)")
        if p is not None and p.device != device:
            raise ValueError(f"{name}: {arg} is on {p.device}, the sources on {device}; all on one device")
        if p is not None and not p.is_floating_point():
            raise ValueError(f"{name}: {arg} has dtype {p.dtype}; expected a floating dtype")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d % heads:
        raise ValueError(f"{name}: heads={heads!r} must be a positive divisor of the width d={d}")
    if (stream is None) != (gate is None):
        raise ValueError(f"{name}: stream and gate go together (additive form) or are both None")
    if stream is not None and stream.shape != shape:
        raise ValueError(f"{name}: stream has shape {tuple(stream.shape)}; expected {tuple(shape)}")
    if stream is not None and stream.device != device:
        raise ValueError(f"{name}: stream is on {stream.device}, the sources on {device}; all on one device")
    if stream is not None and not stream.is_floating_point():
        raise ValueError(f"{name}: stream has dtype {stream.dtype}; expected a floating dtype")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf")):
        raise ValueError(f"{name}: eps={eps!r} must be a finite number > 0 (the key RMSNorm epsilon)")


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
    """Route over the depth history at one routing site (AttnRes / MHAR / Delta AttnRes).

    Args:
        sources: N >= 1 tensors of one shape ``[..., d]`` (e.g. ``[B, T, d]``), any floating
            dtype (float32 / bfloat16 / float16; they may differ): the embedding and the sublayer
            outputs, or the block sums and the partial block (Block AttnRes).
        query: ``[d]`` pseudo-query q of this routing site (AttnRes eq. 3; zero-initialised).
        gain: ``[d]`` gain g of the key RMSNorm.
        heads: H, a divisor of d. Head h scores and mixes the channel slice ``[h*d/H, (h+1)*d/H)``
            with its own softmax over depth (MHAR). 1 is AttnRes.
        stream: ``[..., d]`` residual stream for the additive (Delta AttnRes) form, or None.
        gate: ``[d]`` output gate of the additive form (zero-initialised), or None.
        eps: RMSNorm epsilon.
        return_weights: also return the routing weights.

    Returns:
        ``out`` of shape ``[..., d]``: ``r`` (replacement) or ``stream + gate * r`` (additive), in
        the dtype of ``stream`` when given, else the promoted dtype of the sources. With
        ``return_weights``, also ``weights`` ``[N, ..., H]``, summing to 1 over N, float32
        (float64 when the sources are float64).

    Raises:
        ValueError: empty sources, mismatched shapes, H not dividing d, a stream without a gate,
            ``eps`` not a finite number > 0.
    """
    check_route_args(sources, query, gain, heads, stream, gate, eps)
    d = sources[0].shape[-1]
    dtype = sources[0].dtype
    for s in sources[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    math_dtype = torch.promote_types(dtype, torch.float32)
    v = torch.stack([s.to(math_dtype) for s in sources])  # [N, ..., d]
    rstd = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    keys = v * rstd * gain.to(math_dtype)
    scores = (keys * query.to(math_dtype)).unflatten(-1, (heads, d // heads)).sum(-1)  # [N, ..., H]
    weights = torch.softmax(scores, dim=0)
    routed = (weights.unsqueeze(-1) * v.unflatten(-1, (heads, d // heads))).sum(0).flatten(-2)
    if stream is not None:
        out = (stream.to(math_dtype) + gate.to(math_dtype) * routed).to(stream.dtype)
    else:
        out = routed.to(dtype)
    return (out, weights) if return_weights else out


def route_sites(
    sources: Sequence[Tensor], queries: Tensor, gains: Tensor, heads: int = 1, eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> tuple[list[Tensor], Tensor]:
    """First phase of two-phase Block AttnRes: S routing sites against the same sources.

    The pseudo-queries do not depend on the input, so every site of a block can be routed against
    the completed blocks before the block runs (AttnRes, Sec. 4: batched inter-block attention).

    Args:
        sources: N >= 1 tensors ``[..., d]`` (the completed block sums).
        queries, gains: ``[S, d]``: pseudo-query and key-norm gain of each site.
        heads, eps: as in :func:`depth_route`.
        grad_sink: a :class:`lit_mhar.kernels.sink.GradientSink` whose collected aliases
            ``sources`` are (each once, any of them): the sources' gradients are added into it rather
            than returned through autograd (the aliases hand the sums on). None: plain autograd.

    Returns:
        ``(outs, lse)``: S routed values ``[..., d]`` (promoted source dtype) and the log-sum-exp of
        the scores ``[S, ..., H]`` (float32; float64 for float64 sources), which
        :func:`merge_route` needs to add more sources exactly.

    Raises:
        ValueError: as :func:`depth_route`, or queries/gains not ``[S, d]``.
    """
    if queries.dim() != 2 or gains.shape != queries.shape:
        raise ValueError(f"route_sites: queries {tuple(queries.shape)} and gains {tuple(gains.shape)} must both be [S, d]")
    if grad_sink is not None:
        check_route_args(sources, queries[0], gains[0], heads, None, None, eps, "route_sites")
        sources = grad_sink.feed(sources, "route_sites")
    outs, lses = [], []
    for q, g in zip(queries, gains):
        check_route_args(sources, q, g, heads, None, None, eps, "route_sites")
        out, scores = _route_with_prior(sources, q, g, heads, None, None, eps)
        outs.append(out)
        lses.append(torch.logsumexp(scores, dim=0))
    return outs, torch.stack(lses)


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
    """Second phase: route over {the sources behind ``prior_out``} and ``sources`` exactly.

    ``prior_out`` ``[..., d]`` with ``prior_lse`` ``[..., H]`` (from :func:`route_sites`) enters the
    softmax as one more source whose score is ``prior_lse`` (online-softmax merge), so
    ``merge_route(B, q, g, H, *route_sites(A, q[None], g[None], H))`` equals
    ``depth_route(A + B, q, g, H)``. ``sources`` may be empty (then ``out = prior_out``, or
    ``stream + gate * prior_out``). ``grad_sink``: as in :func:`route_sites`.

    Returns:
        ``[..., d]`` in the dtype of ``stream`` when given, else of ``prior_out`` promoted with the sources.
    """
    if sources:
        check_route_args(sources, query, gain, heads, stream, gate, eps, "merge_route")
    elif (stream is None) != (gate is None):
        raise ValueError("merge_route: stream and gate go together (additive form) or are both None")
    if grad_sink is not None:
        sources = grad_sink.feed(sources, "merge_route")
    out, _ = _route_with_prior(sources, query, gain, heads, (prior_out, prior_lse), (stream, gate), eps)
    return out


def check_merge_norm_args(
    sources: Sequence[Tensor], query: Tensor, gain: Tensor, heads: int, prior_out: Tensor, prior_lse: Tensor,
    norm_weight: Tensor, norm_eps: float, eps: float, stream: Optional[Tensor] = None, gate: Optional[Tensor] = None,
    stream_start: Optional[Tensor] = None, block_outputs: Optional[Sequence[Tensor]] = None,
    earlier_outputs: Optional[Sequence[Tensor]] = None,
) -> None:
    """Validate :func:`merge_route_norm`'s arguments before any work; raise ValueError naming the bad one."""
    if not isinstance(prior_out, Tensor) or prior_out.dim() < 1 or not prior_out.is_floating_point():
        raise ValueError(f"merge_route_norm: prior_out must be a floating [..., d] tensor, got {getattr(prior_out, 'shape', prior_out)!r}")
    d = prior_out.shape[-1]
    check_route_args(list(sources) or [prior_out], query, gain, heads, stream, gate, None, "merge_route_norm")
    if sources and sources[0].shape != prior_out.shape:
        raise ValueError(f"merge_route_norm: prior_out has shape {tuple(prior_out.shape)}, the sources {tuple(sources[0].shape)}")
    if prior_out.device != query.device:
        raise ValueError(f"merge_route_norm: prior_out is on {prior_out.device}, the query on {query.device}; all on one device")
    want = (*prior_out.shape[:-1], heads)
    if not isinstance(prior_lse, Tensor) or tuple(prior_lse.shape) != want or prior_lse.device != prior_out.device:
        raise ValueError(f"merge_route_norm: prior_lse must be a {want} tensor on {prior_out.device}, got {getattr(prior_lse, 'shape', prior_lse)!r}")
    if not prior_lse.is_floating_point():
        raise ValueError(f"merge_route_norm: prior_lse has dtype {prior_lse.dtype}; expected a floating dtype")
    if not isinstance(norm_weight, Tensor) or tuple(norm_weight.shape) != (d,) or norm_weight.device != prior_out.device:
        raise ValueError(f"merge_route_norm: norm_weight must be a ({d},) tensor on {prior_out.device}, got {getattr(norm_weight, 'shape', norm_weight)!r}")
    if not norm_weight.is_floating_point():
        raise ValueError(f"merge_route_norm: norm_weight has dtype {norm_weight.dtype}; expected a floating dtype")
    for name, value in (("norm_eps", norm_eps), ("eps", eps)):  # > 0: a token of zeros (or a padding row) stays finite
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"merge_route_norm: {name}={value!r} must be a finite number > 0")
    if stream_start is not None:
        if stream is None:
            raise ValueError("merge_route_norm: stream_start is given without a stream (it belongs to the additive form)")
        if not isinstance(stream_start, Tensor) or stream_start.shape != stream.shape or stream_start.dtype != stream.dtype or stream_start.device != stream.device:
            got = (
                f"shape {tuple(stream_start.shape)}, dtype {stream_start.dtype}, device {stream_start.device}"
                if isinstance(stream_start, Tensor) else repr(stream_start)
            )
            raise ValueError(
                f"merge_route_norm: stream_start must be a tensor of the stream's shape {tuple(stream.shape)}, dtype {stream.dtype} "
                f"and device {stream.device}, got {got}"
            )
    if block_outputs is not None:
        if stream_start is None:
            raise ValueError("merge_route_norm: block_outputs is given without stream_start (it rebuilds the stream from the block's start)")
        if len(sources) != 1:
            raise ValueError(f"merge_route_norm: block_outputs needs exactly one source (the running sum of the block in progress), got {len(sources)}")
        if not isinstance(block_outputs, (list, tuple)) or len(block_outputs) == 0:
            got = "[]" if isinstance(block_outputs, (list, tuple)) else f"a {type(block_outputs).__name__}"
            raise ValueError(
                f"merge_route_norm: block_outputs must be a non-empty list of tensors (the block's sublayer outputs so far), got {got}"
            )
        for k, o in enumerate(block_outputs):
            if not isinstance(o, Tensor) or o.shape != sources[0].shape or o.dtype != sources[0].dtype or o.device != sources[0].device:
                got = f"shape {tuple(o.shape)}, dtype {o.dtype}, device {o.device}" if isinstance(o, Tensor) else repr(o)
                raise ValueError(
                    f"merge_route_norm: block_outputs[{k}] must be a tensor of the source's shape {tuple(sources[0].shape)}, "
                    f"dtype {sources[0].dtype} and device {sources[0].device}, got {got}"
                )
    if earlier_outputs is not None:
        if stream_start is None:
            raise ValueError("merge_route_norm: earlier_outputs is given without stream_start (they are added to it)")
        if not isinstance(earlier_outputs, (list, tuple)):
            raise ValueError(f"merge_route_norm: earlier_outputs must be a list of tensors, got a {type(earlier_outputs).__name__}")
        for k, o in enumerate(earlier_outputs):
            if not isinstance(o, Tensor) or o.shape != stream.shape or not o.is_floating_point() or o.device != stream.device:
                got = f"shape {tuple(o.shape)}, dtype {o.dtype}, device {o.device}" if isinstance(o, Tensor) else repr(o)
                raise ValueError(
                    f"merge_route_norm: earlier_outputs[{k}] must be a floating tensor of the stream's shape {tuple(stream.shape)} "
                    f"on {stream.device}, got {got}"
                )


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
    """Second phase of two-phase routing fused with the next sublayer's RMSNorm (training).

    ``RMSNorm(x) * norm_weight`` of the site's output ``x`` as :func:`merge_route` computes it:
    ``x = r`` (AttnRes / MHAR) or ``x = stream + gate * r`` (Delta AttnRes), the norm over the
    whole width d:

        y = x * norm_weight / sqrt(mean_c x[c]^2 + norm_eps)

    ``x`` is kept in the arithmetic dtype (float32 for half-precision inputs) between the two, not
    rounded; only ``y`` is. ``sources`` may be empty: then ``r = prior_out`` (the first site of a
    group, whose phase one saw every source).

    Args:
        sources: N >= 0 tensors ``[..., d]`` added since phase one (one shape and device).
        query, gain: ``[d]`` the site's pseudo-query and key-norm gain. heads: H dividing d.
        prior_out: ``[..., d]`` phase one's routed value; prior_lse ``[..., H]`` its log-sum-exp.
        norm_weight: ``[d]`` the RMSNorm's weight; norm_eps: its epsilon (> 0).
        stream, gate: ``[..., d]`` and ``[d]``, the additive form (Delta AttnRes), or both None.
        eps: the key RMSNorm epsilon (> 0).
        grad_sink: as in :func:`route_sites` (the sources' gradients go into the sink). A stream
            the sink collected gets its gradient through autograd here, which its alias adds to
            the slot's sum (the fused kernel adds it into the slot: the same sum).
        stream_start: with the additive form, the stream at the start of the group of sites,
            such that ``stream`` equals ``stream_start`` plus the sources added one by one in
            order, in the stream's dtype (full routing: each source is a sublayer output added
            to the stream). The fused kernels then save it instead of ``stream`` (one stream per
            group instead of one per site) and recompute ``stream`` in the backward, where it is
            float32 (they add in float32; other dtypes: the stream is saved). Here it is checked
            (shape, dtype, device, and the sum itself) and otherwise unused.
        block_outputs: with ``stream_start``, in block routing (Block AttnRes): the sublayer
            outputs ``[..., d]`` of the block in progress so far, in order (at least one), such
            that the one source is their running sum, added one by one in the source's dtype
            (each addition rounded to it, as the model's additions are), and ``stream`` is
            ``stream_start`` plus them added one by one. The fused kernels then save the outputs
            and the block's start instead of the running sum and the stream, and recompute both
            in the backward, where the stream is float32 and the source bf16 or float32 (else
            both are saved). Checked here (shapes, dtypes, devices and both sums), otherwise unused.
        earlier_outputs: with ``stream_start``, the sublayer outputs ``[..., d]`` between an
            earlier group's start, which ``stream_start`` then is, and this group's, in order:
            ``stream`` is ``stream_start`` plus these, then the sources (or ``block_outputs``),
            added one by one. The fused kernels save them instead of this group's start (in block
            routing, a block's start replayed from the block before it: 2 bytes per element
            kept instead of 4), where they have the sources' and the prior's dtype (else the
            stream is saved).
            Checked here (shapes, devices and the sum), otherwise unused.

    Returns:
        ``y`` ``[..., d]`` in the dtype of ``prior_out`` promoted with the sources (not with
        ``norm_weight`` or the stream: under autocast the next linear layer rounds to that dtype
        anyway).

    Raises:
        ValueError: a shape, device, dtype, ``heads`` or epsilon that does not fit; ``stream``
            without ``gate`` or the reverse; ``stream_start`` without ``stream``, or one from
            which ``earlier_outputs`` and the sources (or ``block_outputs``) do not add up to
            ``stream``; ``earlier_outputs`` without ``stream_start``, not a list, or with an
            entry that is not a floating tensor of the stream's shape and device;
            ``block_outputs`` without ``stream_start``, with other than one source, empty, of
            another shape, dtype or device than the source, or whose running sum is not the source.
    """
    check_merge_norm_args(
        sources, query, gain, heads, prior_out, prior_lse, norm_weight, norm_eps, eps, stream, gate, stream_start, block_outputs,
        earlier_outputs,
    )
    if stream_start is not None:
        replayed = stream_start.detach()
        for s_ in [*(earlier_outputs or ()), *(block_outputs if block_outputs is not None else sources)]:
            replayed = replayed + s_.detach()
        if not torch.equal(replayed, stream.detach()):
            what = "block_outputs" if block_outputs is not None else "the sources"
            what = f"earlier_outputs and {what}" if earlier_outputs else what
            raise ValueError(f"merge_route_norm: stream_start plus {what}, added in order, is not the stream; pass stream_start=None")
    if block_outputs is not None:
        running = block_outputs[0].detach()
        for o in block_outputs[1:]:
            running = running + o.detach()
        if not torch.equal(running, sources[0].detach()):
            raise ValueError("merge_route_norm: the running sum of block_outputs, added in order, is not the source; pass block_outputs=None")
    if grad_sink is not None:
        sources = grad_sink.feed(sources, "merge_route_norm")
    routed, _ = _route_with_prior(sources, query, gain, heads, (prior_out, prior_lse), None, eps, round_out=False)
    if stream is not None:
        routed = stream.to(routed.dtype) + gate.to(routed.dtype) * routed
    y = torch.nn.functional.rms_norm(routed, (routed.shape[-1],), norm_weight.to(routed.dtype), norm_eps)
    dtype = prior_out.dtype
    for s_ in sources:
        dtype = torch.promote_types(dtype, s_.dtype)
    return y.to(dtype)


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
    """One routing site fused with the next sublayer's RMSNorm, without a prior (training).

    ``RMSNorm(r) * norm_weight`` of the routed value ``r`` that :func:`depth_route` gives over
    ``sources`` (AttnRes / MHAR, the replacement form; AttnRes, Eq. 2-4, with H heads as MHAR
    splits them), the norm over the whole width d:

        y = r * norm_weight / sqrt(mean_c r[c]^2 + norm_eps)

    ``r`` is kept in the arithmetic dtype (float32 for half-precision inputs) between the two, not
    rounded; only ``y`` is. Two-phase routing (:class:`lit_mhar.routing.DepthHistory`) routes the
    sites of block routing's first block this way: with one complete source phase one's softmax
    is 1 and its routed value that source, so the pass, which writes one copy of it per site, is
    left out.

    Args:
        sources: N >= 1 tensors ``[..., d]`` (one shape and device), oldest first.
        query, gain: ``[d]`` the site's pseudo-query and key-norm gain. heads: H dividing d.
        norm_weight: ``[d]`` the RMSNorm's weight; norm_eps: its epsilon (> 0).
        eps: the key RMSNorm epsilon (> 0).
        grad_sink: as in :func:`route_sites` (the sources' gradients go into the sink).

    Returns:
        ``y`` ``[..., d]`` in the sources' promoted dtype.

    Raises:
        ValueError: no sources; a shape, device, dtype, ``heads`` or epsilon that does not fit.
    """
    check_route_norm_args(sources, query, gain, heads, norm_weight, norm_eps, eps)
    if grad_sink is not None:
        sources = grad_sink.feed(sources, "route_norm")
    routed, _ = _route_with_prior(sources, query, gain, heads, None, None, eps, round_out=False)
    y = torch.nn.functional.rms_norm(routed, (routed.shape[-1],), norm_weight.to(routed.dtype), norm_eps)
    dtype = sources[0].dtype
    for s_ in sources[1:]:
        dtype = torch.promote_types(dtype, s_.dtype)
    return y.to(dtype)


def check_route_norm_args(
    sources: Sequence[Tensor], query: Tensor, gain: Tensor, heads: int, norm_weight: Tensor, norm_eps: float, eps: float
) -> None:
    """Validate :func:`route_norm`'s arguments before any work; raise ValueError naming the bad one."""
    check_route_args(sources, query, gain, heads, None, None, None, "route_norm")
    d = sources[0].shape[-1]
    if not isinstance(norm_weight, Tensor) or tuple(norm_weight.shape) != (d,) or norm_weight.device != sources[0].device:
        raise ValueError(f"route_norm: norm_weight must be a ({d},) tensor on {sources[0].device}, got {getattr(norm_weight, 'shape', norm_weight)!r}")
    if not norm_weight.is_floating_point():
        raise ValueError(f"route_norm: norm_weight has dtype {norm_weight.dtype}; expected a floating dtype")
    for name, value in (("norm_eps", norm_eps), ("eps", eps)):  # > 0: a token of zeros (or a padding row) stays finite
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"route_norm: {name}={value!r} must be a finite number > 0")


def _route_with_prior(sources, query, gain, heads, prior, additive, eps, round_out=True):
    """Routed output and the scores ``[N(+1), ..., H]``; the prior, if any, is score row 0.
    ``round_out=False`` returns the replacement form's output in the arithmetic dtype."""
    like = sources[0] if sources else prior[0]
    d = like.shape[-1]
    dtype = like.dtype
    for s in list(sources) + ([prior[0]] if prior is not None else []):
        dtype = torch.promote_types(dtype, s.dtype)
    math_dtype = torch.promote_types(dtype, torch.float32)
    values = [s.to(math_dtype) for s in sources]
    scores = []
    for v in values:
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain.to(math_dtype)
        scores.append((keys * query.to(math_dtype)).unflatten(-1, (heads, d // heads)).sum(-1))
    if prior is not None:
        values.insert(0, prior[0].to(math_dtype))
        scores.insert(0, prior[1].to(math_dtype))
    scores = torch.stack(scores)
    weights = torch.softmax(scores, dim=0)
    routed = (weights.unsqueeze(-1) * torch.stack(values).unflatten(-1, (heads, d // heads))).sum(0).flatten(-2)
    if additive is not None and additive[0] is not None:
        stream, gate = additive
        return (stream.to(math_dtype) + gate.to(math_dtype) * routed).to(stream.dtype), scores
    return (routed.to(dtype) if round_out else routed), scores


def check_decode_args(
    history: Tensor, n_sources: int, pending: Optional[Tensor], accumulate: bool, norm_weight: Tensor, norm_eps: float,
    query: Tensor, gain: Tensor, heads: int, stream: Optional[Tensor], gate: Optional[Tensor], eps: float,
    prior_out: Optional[Tensor] = None, prior_lse: Optional[Tensor] = None, n_prior: int = 0,
) -> None:
    """Validate :func:`route_norm_decode`'s arguments before any work (nothing is written on an
    error); raise ValueError naming the bad one."""
    if not isinstance(history, Tensor) or history.dim() < 2 or not history.is_floating_point():
        raise ValueError(f"route_norm_decode: history must be a floating [slots, ..., d] tensor, got {getattr(history, 'shape', history)!r}")
    if not history.is_contiguous():
        raise ValueError("route_norm_decode: history must be contiguous (one [slots, ..., d] buffer whose slots do not overlap)")
    slots = history.shape[0]
    if isinstance(n_sources, bool) or not isinstance(n_sources, int) or n_sources < 1 or n_sources + (pending is not None) > slots:
        raise ValueError(
            f"route_norm_decode: n_sources={n_sources!r} must be an integer >= 1 that leaves room for the pending "
            f"output in the {slots} slots of history"
        )
    if not isinstance(accumulate, bool):
        raise ValueError(f"route_norm_decode: accumulate={accumulate!r} must be True or False")
    if pending is not None:
        if pending.shape != history.shape[1:]:
            raise ValueError(f"route_norm_decode: pending has shape {tuple(pending.shape)}; expected {tuple(history.shape[1:])}")
        if not pending.is_floating_point() or pending.device != history.device:
            raise ValueError(f"route_norm_decode: pending must be a floating tensor on {history.device}, got {pending.dtype} on {pending.device}")
    check_route_args([history[0]], query, gain, heads, stream, gate, None, "route_norm_decode")
    d = history.shape[-1]
    if not isinstance(norm_weight, Tensor) or tuple(norm_weight.shape) != (d,) or norm_weight.device != history.device:
        raise ValueError(f"route_norm_decode: norm_weight must be a ({d},) tensor on {history.device}, got {getattr(norm_weight, 'shape', norm_weight)!r}")
    for name, value in (("norm_eps", norm_eps), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"route_norm_decode: {name}={value!r} must be a finite number >= 0")
    _check_decode_prior(history, n_sources, heads, prior_out, prior_lse, n_prior)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (history, pending, query, gain, norm_weight, stream, gate, prior_out, prior_lse)
    ):
        raise ValueError("route_norm_decode is for inference (it has no backward): call it under torch.no_grad() or inference_mode")


def _check_decode_prior(history: Tensor, n_sources: int, heads: int, prior_out: Optional[Tensor], prior_lse: Optional[Tensor], n_prior: int) -> None:
    if (prior_out is None) != (prior_lse is None):
        raise ValueError("route_norm_decode: give prior_out and prior_lse together (both from route_sites_decode) or neither")
    if prior_out is None:
        if n_prior != 0:
            raise ValueError(f"route_norm_decode: n_prior={n_prior!r} without a prior; it must be 0")
        return
    if isinstance(n_prior, bool) or not isinstance(n_prior, int) or not 1 <= n_prior <= n_sources:
        raise ValueError(f"route_norm_decode: n_prior={n_prior!r} must be an integer in 1 .. n_sources={n_sources} (the slots the prior covers)")
    lse_shape = (*history.shape[1:-1], heads)
    for name, t, shape in (("prior_out", prior_out, tuple(history.shape[1:])), ("prior_lse", prior_lse, lse_shape)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.device != history.device or not t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor) else repr(t)
            raise ValueError(f"route_norm_decode: {name} must be a floating {shape} tensor on {history.device}, got {got}")


def check_sites_decode_args(history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float) -> None:
    """Validate :func:`route_sites_decode`'s arguments before any work; raise ValueError naming the bad one."""
    if not isinstance(history, Tensor) or history.dim() < 2 or not history.is_floating_point():
        raise ValueError(f"route_sites_decode: history must be a floating [slots, ..., d] tensor, got {getattr(history, 'shape', history)!r}")
    if not history.is_contiguous():
        raise ValueError("route_sites_decode: history must be contiguous (one [slots, ..., d] buffer)")
    slots, d = history.shape[0], history.shape[-1]
    if isinstance(n_sources, bool) or not isinstance(n_sources, int) or not 1 <= n_sources <= slots:
        raise ValueError(f"route_sites_decode: n_sources={n_sources!r} must be an integer in 1 .. {slots} (the slots of history)")
    if (
        not isinstance(queries, Tensor) or not isinstance(gains, Tensor) or queries.dim() != 2 or queries.shape[0] < 1
        or queries.shape[1] != d or gains.shape != queries.shape
    ):
        raise ValueError(
            f"route_sites_decode: queries {tuple(getattr(queries, 'shape', ()))} and gains {tuple(getattr(gains, 'shape', ()))} "
            f"must both be [G, {d}] with G >= 1"
        )
    if not queries.is_floating_point() or not gains.is_floating_point():
        raise ValueError(f"route_sites_decode: queries and gains must be floating, got {queries.dtype} and {gains.dtype}")
    for i in range(queries.shape[0]):
        try:
            check_route_args([history[0]], queries[i], gains[i], heads, None, None, None, "route_sites_decode")
        except ValueError as e:
            raise ValueError(f"route_sites_decode: site {i} of queries / gains: {e}") from None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"route_sites_decode: eps={eps!r} must be a finite number >= 0")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (history, queries, gains)):
        raise ValueError("route_sites_decode is for inference (it has no backward): call it under torch.no_grad() or inference_mode")


def route_norm_decode(
    history: Tensor,
    n_sources: int,
    pending: Optional[Tensor],
    accumulate: bool,
    query: Tensor,
    gain: Tensor,
    heads: int,
    norm_weight: Tensor,
    norm_eps: float,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    prior_out: Optional[Tensor] = None,
    prior_lse: Optional[Tensor] = None,
    n_prior: int = 0,
) -> Tensor:
    """Decode-time routing site fused with the next sublayer's RMSNorm (inference only, no backward).

    The depth history of the tokens being decoded lives in one buffer ``history`` ``[slots, ..., d]``
    (slot 0 the embedding, then block sums; Block AttnRes, Sec. 3). The output of the sublayer that
    just ran, ``pending``, is first added to the depth history: slot ``n_sources`` becomes
    ``history[n_sources] + pending`` (``accumulate``: the partial block goes on) or ``pending`` (it
    starts a block), written in place. The site then routes over slots ``0 .. n_sources`` (or
    ``0 .. n_sources - 1`` without ``pending``) exactly as :func:`depth_route` does, and returns

        RMSNorm(out) * norm_weight,   out = r (replacement) or stream + gate * r (additive)

    with ``out`` rounded to the routed dtype first, as the training path's separate norm sees it.

    Args:
        history: ``[slots, ..., d]`` contiguous, float32 / bfloat16 / float16 (float64 in the
            reference), mutated.
        n_sources: completed slots before the pending one, >= 1.
        pending: ``[..., d]`` the newest sublayer output or None (the first site).
        accumulate: add ``pending`` to slot ``n_sources`` (True) or overwrite it (False).
        query, gain: ``[d]`` the site's pseudo-query and key-norm gain. heads: H dividing d.
        norm_weight: ``[d]`` the next RMSNorm's weight; norm_eps its epsilon.
        stream, gate: the additive form (Delta AttnRes), or None.
        eps: the key RMSNorm epsilon.
        prior_out, prior_lse, n_prior: optionally, this site's routing over slots ``0 .. n_prior - 1``
            from :func:`route_sites_decode` (``[..., d]`` and ``[..., H]``, float32 on the Triton
            path), merged as one more source whose score is ``prior_lse`` (two-phase computation,
            AttnRes Sec. 4); the site then reads only slots ``n_prior ..`` of ``history``. Same result
            as without it, up to rounding. ``1 <= n_prior <= n_sources``.

    Returns:
        ``[..., d]`` in ``promote(routed dtype, norm_weight.dtype)`` (as :class:`lit_mhar.model.RMSNorm` returns).

    Raises:
        ValueError: before anything is written: a shape, device, dtype, ``n_sources``, ``heads`` or
            epsilon that does not fit, a non-contiguous ``history``, or gradients asked for.
    """
    check_decode_args(
        history, n_sources, pending, accumulate, norm_weight, norm_eps, query, gain, heads, stream, gate, eps,
        prior_out, prior_lse, n_prior,
    )
    n = n_sources
    if pending is not None:
        history[n] = history[n] + pending if accumulate else pending
        n += 1
    if prior_out is None:
        out = depth_route(list(history[:n].unbind(0)), query, gain, heads, stream, gate, eps)
    else:
        out = merge_route(list(history[n_prior:n].unbind(0)), query, gain, heads, prior_out, prior_lse, stream, gate, eps)
        out = out.to(stream.dtype if stream is not None else history.dtype)  # the routed dtype, as without a prior
    x = out.to(torch.promote_types(out.dtype, norm_weight.dtype))
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight.to(x.dtype), norm_eps)


def route_sites_decode(
    history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Phase one of a group of decode-time routing sites (inference only, no backward).

    The pseudo-queries do not depend on the input, so the G sites of a group can all be routed
    against the slots complete at the group's start, ``0 .. n_sources - 1`` of ``history``, in one
    pass (two-phase computation, AttnRes Sec. 4, for full routing's long depth histories); each
    site then merges the slots written since through :func:`route_norm_decode`'s prior.

    Args:
        history: ``[slots, ..., d]`` contiguous, float32 / bfloat16 / float16 (float64 here too); read only.
        n_sources: slots routed over, ``1 <= n_sources <= slots``.
        queries, gains: ``[G, d]``: each site's pseudo-query and key-norm gain.
        heads: H dividing d. eps: the key RMSNorm epsilon.

    Returns:
        ``(out, lse)``: ``[G, ..., d]`` the routed values and ``[G, ..., H]`` the log-sum-exp of the
        scores per head, both float32 (float64 for a float64 history), unrounded.

    Raises:
        ValueError: before any work: a shape, device, dtype, ``n_sources``, ``heads`` or ``eps`` that
            does not fit, a non-contiguous ``history``, or gradients asked for.
    """
    check_sites_decode_args(history, n_sources, queries, gains, heads, eps)
    math_dtype = torch.promote_types(history.dtype, torch.float32)
    outs, lse = route_sites([s.to(math_dtype) for s in history[:n_sources].unbind(0)], queries, gains, heads, eps)
    return torch.stack(outs), lse
