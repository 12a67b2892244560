"""The routing op's autograd: ``torch.library`` custom ops (opaque to ``torch.compile``) and the
``torch.autograd.Function`` eager calls take.

:func:`route_fwd` / :func:`route_bwd` are the custom ops (``lit_mhar::route_fwd``,
``lit_mhar::route_bwd``) with fake implementations and registered autograd, so a compiled model
keeps one graph around them. Eager calls run :class:`_RouteFunction`, which launches the same kernels
without the custom op's per-call argument handling and adds what only the eager path has: a
gradient sink's in-place sums, a fused-norm merge's routed value saved in place of the prior, the
additive form's stream replayed instead of saved. Inputs are made contiguous, statistics are
float32, non-tensor arguments get ``None`` gradients; a second derivative is refused.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_mhar.kernels import launch
from lit_mhar.kernels.dispatch import Call, plan
from lit_mhar.kernels.launch import form, saves_rstd


@torch.library.custom_op("lit_mhar::route_fwd", mutates_args=())
def route_fwd(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    stream: Optional[Tensor], gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    store_scores: bool, save_rstd: bool, norm_weight: Optional[Tensor], norm_eps: float,
) -> list[Tensor]:
    """Fused forward of ``S = queries.shape[0]`` routing sites over the same sources.

    Args: sources N tensors ``[..., d]`` of one dtype (N may be 0 with a prior); queries, gains
    ``[S, d]``; ``stream``/``gate`` the additive form (S = 1); ``prior_out`` ``[..., d]`` and
    ``prior_lse`` ``[..., H]`` float32 a routed value merged as one more source (S = 1);
    ``store_scores`` also returns each source's scores; ``save_rstd`` also returns each source's key
    rstd (for the site loop's backward); ``norm_weight`` ``[d]`` (with a prior, S = 1, replacement
    form) returns ``RMSNorm(out) * norm_weight`` (epsilon ``norm_eps``) in place of ``out``.

    Returns ``[out_0 .. out_{S-1}, lse [S, ..., H] float32, scores [N, ..., H] float32 or empty,
    rstd [N, tokens] float32 (each source's key rstd, for the backward) or empty]``.
    """
    return launch.forward(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps)


@route_fwd.register_fake
def _(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps):
    like = sources[0] if sources else prior_out
    lead = like.shape[:-1]
    if stream is not None:  # as launch.forward: the fused norm's output in the sources' dtype, else the stream's
        outs = [like.new_empty(like.shape) if norm_weight is not None else stream.new_empty(like.shape)]
    else:
        outs = [like.new_empty(like.shape) for _ in range(queries.shape[0])]
    lse = like.new_empty((queries.shape[0], *lead, heads), dtype=torch.float32)
    scores = like.new_empty((len(sources), *lead, heads) if store_scores else (0,), dtype=torch.float32)
    saves = bool(save_rstd) and len(sources) > 0
    rstd = like.new_empty((len(sources), like.numel() // like.shape[-1]) if saves else (0,), dtype=torch.float32)
    return [*outs, lse, scores, rstd]


@torch.library.custom_op("lit_mhar::route_bwd", mutates_args=())
def route_bwd(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    lse: Tensor, grad_outs: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor],
    norm_weight: Optional[Tensor], norm_eps: float, stream: Optional[Tensor],
) -> list[Tensor]:
    """Fused backward of :func:`route_fwd` (``rstd``: its saved key rstd, or None / empty;
    ``stream``: the additive form's stream where the norm is fused, else None). Returns
    ``[d_sources [N, ..., d], d_queries [S, d], d_gains [S, d], d_gate [d] or empty, d_prior_out or
    empty, d_prior_lse or empty, d_norm_weight [d] or empty, d_stream (fused norm, additive) or empty]``."""
    return launch.backward(
        sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, norm_eps, stream
    )


@route_bwd.register_fake
def _(sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, norm_eps, stream):
    like = sources[0] if sources else prior_out

    def empty():  # one per output: outputs may not alias each other
        return queries.new_empty(0, dtype=torch.float32)

    return [
        like.new_empty((len(sources), *like.shape)),
        queries.new_empty(queries.shape),
        gains.new_empty(gains.shape),
        gate.new_empty(gate.shape) if gate is not None else empty(),
        prior_out.new_empty(prior_out.shape) if prior_out is not None else empty(),
        prior_lse.new_empty(prior_lse.shape) if prior_lse is not None else empty(),
        norm_weight.new_empty(norm_weight.shape) if norm_weight is not None else empty(),
        stream.new_empty(stream.shape) if norm_weight is not None and gate is not None else empty(),
    ]


def _setup_context(ctx, inputs, output):
    sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps = inputs
    n_out = 1 if stream is not None else queries.shape[0]
    kept_stream = stream if norm_weight is not None else None  # the fused norm's backward needs the stream
    ctx.save_for_backward(queries, gains, gate, prior_out, prior_lse, norm_weight, kept_stream, output[n_out], output[n_out + 2], *sources)
    ctx.heads, ctx.eps, ctx.n_out, ctx.additive, ctx.norm_eps = heads, eps, n_out, stream is not None, norm_eps
    ctx.set_materialize_grads(False)


def _gradients(ctx, grads, backward) -> Optional[tuple]:
    """The backward both autograd paths share: ``(d_sources [N, ..., d], d_queries, d_gains,
    d_stream, d_gate, d_prior_out, d_prior_lse, d_norm_weight)`` (None where an input has no gradient) through
    ``backward`` (the custom op :func:`route_bwd` or :func:`lit_mhar.kernels.launch.backward`), or None when no output has
    a gradient. Missing output gradients are zeros."""
    queries, gains, gate, prior_out, prior_lse, norm_weight, stream, lse, rstd, *sources = ctx.saved_tensors
    grad_outs, grad_lse = list(grads[: ctx.n_out]), grads[ctx.n_out]
    if all(g is None for g in grad_outs) and grad_lse is None:
        return None
    like = sources[0] if sources else prior_out
    dtype = next((g.dtype for g in grad_outs if g is not None), like.dtype)
    grad_outs = [torch.zeros(like.shape, dtype=dtype, device=like.device) if g is None else g for g in grad_outs]
    d_src, d_q, d_g, d_gate, d_prior, d_prior_lse, d_nw, d_stream = backward(
        sources, queries, gains, ctx.heads, ctx.eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, ctx.norm_eps,
        stream,
    )
    if ctx.additive and norm_weight is None:
        d_stream = grad_outs[0]  # out = stream + gate * r: d stream = d out
    return (
        d_src, d_q, d_g,
        d_stream if ctx.additive else None,
        d_gate if gate is not None else None,
        d_prior if prior_out is not None else None,
        d_prior_lse if prior_lse is not None else None,
        d_nw if norm_weight is not None else None,
    )


def _backward_rule(ctx, grads):
    res = _gradients(ctx, grads, route_bwd)
    if res is None:
        return (None,) * 13
    d_src, d_q, d_g, d_stream, d_gate, d_prior, d_prior_lse, d_nw = res
    return list(d_src.unbind(0)), d_q, d_g, None, None, d_stream, d_gate, d_prior, d_prior_lse, None, None, d_nw, None


route_fwd.register_autograd(_backward_rule, setup_context=_setup_context)


class _RouteFunction(torch.autograd.Function):
    """Eager autograd of :func:`route_fwd`: the same kernels and gradients as the custom op's
    registered autograd, without the custom op's per-call Python (argument flattening and checks).

    ``apply(heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse,
    norm_weight, stream_start, block_outputs, earlier_outputs, *sources)`` returns the custom op's outputs as a tuple. With
    ``save_routed`` (:func:`saves_routed`) a fused norm's merge saves its routed value r in place of
    the prior and its backward runs one pass with scores over the sources, where the custom op runs
    two (the same gradients up to float32 rounding; a replayed stream takes a pass that only adds
    the sources). With
    ``sink`` (a :class:`SinkBinding` of the sources) the sources' gradients are added into the sink
    inside the backward kernels and autograd gets none for them. With ``stream_start`` (fused
    norm, additive form: ``stream`` equals it plus the sources added in order) that is saved
    instead of ``stream`` and the backward kernel adds the sources to it again; with
    ``block_outputs`` too (a tuple: the one source is their running sum, ``stream`` the start plus
    them) the outputs are saved instead of the source, and the kernel rebuilds both from them.
    ``earlier_outputs`` (a tuple, or None; with ``stream_start``): the outputs between an earlier
    group's start, which ``stream_start`` then is, and this group's, saved and added first.
    """

    @staticmethod
    def forward(
        ctx, heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse,
        norm_weight, stream_start, block_outputs, earlier_outputs, *sources,
    ):
        ctx.saved_routed = save_routed  # r saved in place of the prior
        outs = launch.forward(
            list(sources), queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps,
            save_routed=ctx.saved_routed,
        )
        if ctx.saved_routed:
            prior_out = outs.pop()  # r: what the backward reads where it read the prior
        n_out = 1 if stream is not None else queries.shape[0]
        # the fused norm's backward needs the stream: saved, or replayed from the group's start
        ctx.stream_replay = norm_weight is not None and stream is not None and stream_start is not None
        ctx.rebuild = ctx.stream_replay and block_outputs is not None and len(sources) == 1
        kept_stream = (stream_start if ctx.stream_replay else stream) if norm_weight is not None else None
        kept = block_outputs if ctx.rebuild else sources  # the block's outputs rebuild its running sum
        earlier = tuple(earlier_outputs or ()) if ctx.stream_replay else ()
        ctx.n_earlier = len(earlier)  # saved before the sources; the stream adds them first
        kept = (*earlier, *kept)
        ctx.save_for_backward(queries, gains, gate, prior_out, prior_lse, norm_weight, kept_stream, outs[n_out], outs[n_out + 2], *kept)
        ctx.heads, ctx.eps, ctx.n_out, ctx.additive, ctx.n_src = heads, eps, n_out, stream is not None, len(sources)
        ctx.norm_eps, ctx.sink, ctx.norm_weight_given = norm_eps, sink, norm_weight is not None
        ctx.mark_non_differentiable(outs[n_out + 1], outs[n_out + 2])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again (as with the custom op)
    def backward(ctx, *grads):
        sink, k = ctx.sink, ctx.n_earlier

        def backward(sources, *args):
            return launch.backward(
                sources[k:], *args, sink=sink, stream_replay=ctx.stream_replay, rebuild=ctx.rebuild, saved_routed=ctx.saved_routed,
                earlier_outputs=sources[:k],
            )

        res = _gradients(ctx, grads, backward)
        if res is None:
            return (None,) * (17 + ctx.n_src)
        d_src, *rest = res
        if sink is not None and sink.stream_slot is not None and ctx.norm_weight_given:
            rest[2] = None  # the stream's gradient went into its slot (the fused norm's backward kernel)
        return (None,) * 7 + (*rest, None, None, None, *(d_src.unbind(0) if sink is None else (None,) * ctx.n_src))


def saves_routed(
    sources: Sequence[Tensor], queries: Tensor, gains: Tensor, heads: int, stream: Optional[Tensor], prior_out: Optional[Tensor],
    prior_lse: Optional[Tensor], norm_weight: Optional[Tensor],
) -> bool:
    """Whether an eager call's forward writes and saves the routed value r (float32) in place of the
    prior, for a one-pass backward: where the plan says so (a fused-norm merge of the replacement
    form over enough sources of the prior's dtype) and a backward will run (gradients on, an input
    that requires one), so that inference writes no r."""
    if norm_weight is None or prior_out is None or not sources or prior_out.dtype != sources[0].dtype:
        return False
    d = prior_out.shape[-1]
    decided = plan(Call(form(stream, prior_out, norm_weight), len(sources), queries.shape[0], d, heads, sources[0].dtype), False)
    return (
        decided.saves_routed and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (queries, gains, prior_out, prior_lse, norm_weight, *sources))
    )


def route(
    sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, norm_weight=None, norm_eps=0.0, sink=None,
    stream_start=None, block_outputs=None, earlier_outputs=None,
):
    """:func:`route_fwd` with autograd: the custom op under ``torch.compile``, else
    :class:`_RouteFunction`, which runs the same kernels. Whether the forward saves the key rstd is
    decided here, outside the op, so that the op's output shapes follow from its arguments. ``sink``: the
    :class:`SinkBinding` of the sources (the callers bind it, and drop it where they cast the
    sources: the copies' gradients go back through autograd); used on the eager path only: the
    custom op returns the gradients through autograd, also correct for the aliases.
    ``stream_start``, ``block_outputs``, ``earlier_outputs``: see :func:`merge_route_norm`; used on
    the eager path only (the custom op saves the stream and the sources). Returns the outputs of
    :func:`route_fwd`."""
    save_rstd = saves_rstd(sources, queries, gains, prior_out is not None, norm_weight is not None)
    if not torch.compiler.is_compiling():
        save_routed = saves_routed(sources, queries, gains, heads, stream, prior_out, prior_lse, norm_weight)
        return _RouteFunction.apply(
            heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse, norm_weight,
            stream_start, None if block_outputs is None else tuple(block_outputs),
            None if earlier_outputs is None else tuple(earlier_outputs), *sources,
        )
    return torch.ops.lit_mhar.route_fwd(
        sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, float(norm_eps)
    )
