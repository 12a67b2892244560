"""Gradient sink: sums a depth history's source gradients over the routing passes that read them.

In two-phase routing (AttnRes, Sec. 4) every complete source of the depth history (the embedding
and each block sum; in full routing every sublayer output) is read by the phase-one pass of every
later group of sites. Autograd sums a tensor's gradient over its uses with one addition kernel per
extra use: at 8 blocks that is 36 additions of a ``[tokens, d]`` tensor per training step. With a
:class:`GradientSink` the phase-one passes add their source gradients into one buffer per source
(the Triton site-loop backward adds in place, inside the kernel that computes them) and give
autograd no gradient for those sources; the source's alias made by :meth:`GradientSink.collect`
hands the summed gradient to autograd. The alias is an input of every pass that read the source,
so autograd runs its backward only after theirs: the sum is complete when it is handed on.

The running sum of a block in progress is kept the same way (:meth:`GradientSink.sum`): the
gradient reaching ``partial + output`` is handed to the partial's slot instead of being added by
autograd to the gradient of the merge that read the partial, and the merge's backward kernel adds
it to the gradient it computes.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from torch import Tensor


class GradientSink:
    """Per-source gradient buffers of one forward pass's depth history (slot = order of :meth:`collect`).

    Usage: pass every source ``[..., d]`` of the depth history through :meth:`collect` (complete
    sources and each running sum of a block in progress) and route with the returned aliases;
    give ``grad_sink=sink`` to :func:`lit_mhar.kernels.route_sites`, :func:`~lit_mhar.kernels.merge_route`
    or :func:`~lit_mhar.kernels.merge_route_norm` with collected aliases as sources. The result
    equals autograd's summation up to the rounding of the sum (each addition rounds to the
    sources' dtype, as autograd's does; the kernels add in float32 and round once, and
    :meth:`advance` rounds an output's gradient once where autograd casts, then adds). The
    additive form's residual stream may be collected too (:meth:`advance`, the fused norm).
    Backward with ``create_graph=True`` raises RuntimeError: the sums carry no graph.

    A sink belongs to one forward pass; it holds no reference to the aliases (weak references
    only), so it keeps no graph alive. A routing op given no sink returns its gradients through
    autograd, and a collected alias adds those to the slot's sum, so ops with and without the sink
    may mix (the custom op under ``torch.compile`` takes none). A sum belongs to the backward pass
    (autograd graph task) that wrote it: one that a backward over only some inputs left behind
    (its alias's backward did not run) is dropped by the next backward over the graph.
    """

    def __init__(self) -> None:
        self._aliases: list[weakref.ref] = []
        self._grads: dict[int, Tensor] = {}
        self._owned: set[int] = set()  # slots whose buffer the sink allocated: updated in place
        self._task: dict[int, int] = {}  # slot -> the autograd graph task that wrote its sum

    def collect(self, x: Tensor) -> Tensor:
        """An alias of source ``x`` ``[..., d]`` at the next slot, whose gradient is the sum of
        autograd's and of the gradients added into this slot. Same values, dtype and device."""
        alias = _Collect.apply(x, self, len(self._aliases))
        self._aliases.append(weakref.ref(alias))
        return alias

    def sum(self, partial: Tensor, output: Tensor) -> Tensor:
        """``partial + output`` ``[..., d]`` (a block's running sum), ``partial`` a collected alias:
        the sum's gradient goes to ``output`` through autograd and into ``partial``'s slot."""
        return self.advance(None, partial, output)[1]

    def advance(
        self, stream: Optional[Tensor], partial: Optional[Tensor], output: Tensor
    ) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """One sublayer's ``output`` ``[..., d]`` added to the residual stream (Delta AttnRes) and to
        the running sum of the block in progress: ``(stream + output, partial + output)``, None in
        place of either that is None (not both). ``stream`` and ``partial`` are collected aliases:
        their gradients go into their slots (where the routing ops' backward kernels add to them),
        and ``output``'s gradient, the sum of the two, is computed in one operation in ``output``'s
        dtype (rounded once) instead of autograd's cast and addition. ValueError for an argument
        the sink did not collect."""
        given = [t for t in (stream, partial) if t is not None]
        if not given:
            raise ValueError("GradientSink.advance: stream and partial are both None; give at least one")
        slots = iter(self.slots(given, "GradientSink.advance"))
        stream_slot = None if stream is None else next(slots)
        partial_slot = None if partial is None else next(slots)
        return _Advance.apply(stream, partial, output, self, stream_slot, partial_slot)

    def holds(self, sources: Sequence[Tensor]) -> bool:
        """Whether every one of ``sources`` is an alias :meth:`collect` returned (once each)."""
        alive = {id(ref()) for ref in self._aliases if ref() is not None}
        return all(id(s) in alive for s in sources) and len({id(s) for s in sources}) == len(sources)

    def slots(self, sources: Sequence[Tensor], name: str = "route_sites") -> list[int]:
        """The slot of each of ``sources``; ValueError names any that :meth:`collect` did not return."""
        index = {id(ref()): slot for slot, ref in enumerate(self._aliases) if ref() is not None}
        slots = [index.get(id(s)) for s in sources]
        bad = [i for i, slot in enumerate(slots) if slot is None]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(
                f"{name}: with grad_sink, every source must be an alias the sink's collect() returned, each once; "
                f"sources {bad or 'repeated'} of {len(sources)} are not"
            )
        return slots

    def bind(self, sources: Sequence[Tensor], name: str = "route_sites", stream: Optional[Tensor] = None) -> "SinkBinding":
        """The sink seen by one routing op over ``sources`` (slots checked now, before any work); with
        ``stream`` (the additive form's residual stream) the stream's slot too where this sink
        collected it (else its gradient goes through autograd)."""
        stream_slot = self.slots([stream], name)[0] if stream is not None and self.holds([stream]) else None
        return SinkBinding(self, self.slots(sources, name), stream_slot)

    def _current(self, slot: int) -> Optional[Tensor]:
        """The slot's sum if this backward pass wrote it; a stale one is dropped."""
        if slot in self._grads and self._task[slot] != torch._C._current_graph_task_id():
            self.pop(slot)
        return self._grads.get(slot)

    def add(self, slot: int, grad: Tensor) -> None:
        """Add ``grad`` (the shape of the slot's source) into ``slot``'s buffer."""
        cur = self._current(slot)
        self._task[slot] = torch._C._current_graph_task_id()
        if cur is None:
            self._grads[slot] = grad  # not owned: it may be shared with other gradients, never written
        elif slot in self._owned:
            cur.add_(grad)
        else:
            self._grads[slot] = cur + grad
            self._owned.add(slot)

    def targets(self, slots: Sequence[int], like: Tensor, new=None) -> tuple[list[Tensor], list[Tensor], int]:
        """Where a kernel puts the gradients of sources in ``slots``: ``(outs, addends, n_acc)``.

        The kernel adds ``addends[k]`` to source k's gradient for ``k < n_acc`` and stores the
        result in ``outs[k]``, which becomes the slot's sum (the same tensor as the addend where the
        sink owns the slot's buffer: in place). All are contiguous, 16-byte aligned, of ``like``'s
        shape and dtype; a slot before the last one holding a sum that holds none adds zeros;
        ``new(shape, dtype, device)`` allocates outputs.
        """
        new = new or (lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))
        has = [k for k, slot in enumerate(slots) if self._current(slot) is not None]
        task = torch._C._current_graph_task_id()
        n_acc = has[-1] + 1 if has else 0
        outs, addends = [], []
        for k, slot in enumerate(slots):
            cur = self._grads.get(slot)
            usable = cur is not None and cur.dtype == like.dtype and cur.shape == like.shape and cur.is_contiguous() and cur.data_ptr() % 16 == 0
            if cur is None:
                out = new(like.shape, like.dtype, like.device)
                addend = torch.zeros(like.shape, dtype=like.dtype, device=like.device) if k < n_acc else out
            elif usable and slot in self._owned:
                out = addend = cur
            elif usable:
                out, addend = new(like.shape, like.dtype, like.device), cur
            else:
                out = addend = cur.to(like.dtype, memory_format=torch.contiguous_format, copy=True).reshape(like.shape)
            self._grads[slot], self._task[slot] = out, task
            self._owned.add(slot)
            outs.append(out)
            addends.append(addend)
        return outs, addends, n_acc

    def pop(self, slot: int) -> Optional[Tensor]:
        """The summed gradient of ``slot`` this backward pass added (None if none); the sink forgets it."""
        stale = slot in self._grads and self._task[slot] != torch._C._current_graph_task_id()
        self._owned.discard(slot)
        self._task.pop(slot, None)
        grad = self._grads.pop(slot, None)
        return None if stale else grad

    def feed(self, sources: Sequence[Tensor], name: str = "route_sites") -> list[Tensor]:
        """Aliases of the collected ``sources`` (checked) whose gradients autograd adds into the
        sink instead of passing them on: how an op without an in-kernel sum (the plain PyTorch
        reference) routes with a sink."""
        return list(_Feed.apply(self.bind(sources, name), *sources))


class SinkBinding:
    """A :class:`GradientSink` and the slots of one routing op's sources (its backward's view);
    ``stream_slot``: the slot of the op's residual stream (additive form), or None."""

    def __init__(self, sink: GradientSink, slots: list[int], stream_slot: Optional[int] = None) -> None:
        self.sink, self.slots, self.stream_slot = sink, slots, stream_slot

    def add(self, k: int, grad: Tensor) -> None:
        """Add the gradient of the op's source ``k`` into its slot."""
        self.sink.add(self.slots[k], grad)

    def targets(self, like: Tensor, new=None) -> tuple[list[Tensor], list[Tensor], int]:
        """:meth:`GradientSink.targets` of the op's sources."""
        return self.sink.targets(self.slots, like, new)


def _refuse_double_backward() -> None:
    """The sums a sink holds carry no autograd graph: a backward that builds one (``create_graph``,
    for a second derivative) would miss every path through them, so it is refused."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "GradientSink: backward with create_graph=True (double backward) is not supported: the gradients the "
            "sink sums carry no graph; the fused routing kernels' gradients are not differentiable either. Route "
            "with the reference backend (lit_mhar.kernels.use_backend('reference')) for higher derivatives"
        )


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sink: GradientSink, slot: int) -> Tensor:
        ctx.sink, ctx.slot = sink, slot
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]):
        _refuse_double_backward()
        acc = ctx.sink.pop(ctx.slot)
        if acc is None:
            return grad, None, None
        return (acc if grad is None else acc + grad), None, None


class _Advance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stream, partial, output, sink, stream_slot, partial_slot):
        ctx.sink, ctx.slots, ctx.dtype = sink, (stream_slot, partial_slot), output.dtype
        ctx.set_materialize_grads(False)
        return (None if stream is None else stream + output), (None if partial is None else partial + output)

    @staticmethod
    def backward(ctx, d_stream: Optional[Tensor], d_partial: Optional[Tensor]):
        _refuse_double_backward()
        for slot, grad in zip(ctx.slots, (d_stream, d_partial)):
            if grad is not None:
                ctx.sink.add(slot, grad)
        if d_stream is None or d_partial is None:
            grads = [g for g in (d_stream, d_partial) if g is not None]
            d_output = grads[0].to(ctx.dtype) if grads else None
        else:  # one kernel, one rounding (autograd would cast d_stream, then add)
            d_output = torch.add(d_stream, d_partial, out=torch.empty(d_partial.shape, dtype=ctx.dtype, device=d_partial.device))
        return None, None, d_output, None, None, None


class _Feed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, binding: SinkBinding, *sources: Tensor):
        ctx.binding = binding
        ctx.set_materialize_grads(False)
        return tuple(s.view_as(s) for s in sources)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        _refuse_double_backward()
        for k, g in enumerate(grads):
            if g is not None:
                ctx.binding.add(k, g)
        return (None, *(None for _ in grads))
