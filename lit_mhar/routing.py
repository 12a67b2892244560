"""Depth routing: the depth history a routing site reads, and the routing site itself.

Sources (Attention Residuals, Kimi, eqs. 2-6; Block AttnRes, Sec. 3):
- full routing (S = 1): v_0 = token embedding, v_i = raw output of sublayer i-1;
- block routing (S > 1): b_0 = embedding, b_n = sum of the outputs of the n-th completed block
  of S sublayers, plus the partial sum of the block in progress once it has started.
For the Delta form (Delta AttnRes) the same sources are the residual stream's deltas: a block sum
is exactly the stream at the block's end minus the stream at its start.

:class:`HyperConnection` is the comparator that wires depth without a history: Hyper-Connections
(Zhu et al., arXiv 2409.19606) widen the residual stream to n copies and mix them with learned
width and depth connections.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lit_mhar.kernels import GradientSink, depth_route, merge_route, merge_route_norm, route_norm, route_norm_decode, route_sites, route_sites_decode


# Defaults of the two-phase computation (BENCHMARKS.md, "Why the dispatch plan is what it is"). Full routing (S = 1)
# routes its sites in groups: each complete source is read once per group, not once per site; the
# replacement form's merges read their sources once (a saved routed value), so it takes larger groups
# than the additive form.
FULL_ROUTING_GROUP = 12
FULL_ROUTING_GROUP_ADDITIVE = 8
# The model's last site joins the group before it where it would start a group of its own, while the
# group then holds at most this many sites (the tensor-core kernels' most per pass).
JOIN_FINAL_SITE_MAX_SITES = 16
# Decoding with full routing: sites per phase-one group of a decode step, from this many complete
# slots on (shorter histories are routed site by site).
DECODE_ROUTING_GROUP = 8
DECODE_PREFIX_MIN_SOURCES = 16
# Delta block routing replays a block's stream from the start of a span of blocks while the span's
# earlier outputs number at most this many (0: a stream per block).
REPLAY_SPAN_MAX_OUTPUTS = 3


class DepthHistory:
    """The sources routing sites read: embedding, completed block sums, partial block.

    Block boundaries come from the sublayer index: sublayer ``l`` closes its block when
    ``(l + 1) % block_size == 0``. A model whose 2L sublayers are not a multiple of S ends on a
    shorter block, which the final routing site sees as the partial block.

    With ``two_phase``, :meth:`route` computes the routing of each group of sites in two phases
    (AttnRes, Sec. 4): when the group starts, all of its sites are routed against the sources
    complete at that moment in one pass (their pseudo-queries do not depend on the input), which
    reads each of those sources once instead of once per site; each site then merges that result
    by an online-softmax step with what was added since (the partial block; in full routing the
    sublayer outputs since the group started). A group is a block (Block AttnRes, S > 1) or
    ``FULL_ROUTING_GROUP`` consecutive sites (full routing, S = 1; ``FULL_ROUTING_GROUP_ADDITIVE``
    in the additive form, whose sites have a gate); the model's last site, where it would start a
    group of its own, joins the group before it (up to ``JOIN_FINAL_SITE_MAX_SITES`` sites). In block
    routing the first block's sites, whose phase one would see the embedding alone, are routed site by
    site instead in the replacement form (:func:`lit_mhar.kernels.route_norm`: each reads the
    embedding itself, no copy per site). Each site's second phase runs fused with the next
    sublayer's RMSNorm (:meth:`route_norm`). The result equals per-site routing over :meth:`sources`
    up to rounding (float64: to 1e-12).

    Args:
        embedding: ``[..., d]`` token embedding (source 0).
        block_size: S >= 1 sublayers per block.
        sites: the model's routing sites in depth order (site ``l`` runs before sublayer ``l``;
            the last one before the LM head); needed for ``two_phase``.
        two_phase: route groups of sites in two phases as above (ignored without ``sites``).
        group_size: sites per group; default S, or when S = 1 ``FULL_ROUTING_GROUP``
            (``FULL_ROUTING_GROUP_ADDITIVE`` for sites with a gate). 1 routes
            site by site.
        sink: with ``two_phase`` in eager code, sum each source's gradient (and in the additive
            form the stream's) over the ops that read it in a :class:`GradientSink`, inside the
            backward kernels, instead of one autograd addition per extra use; False: autograd's
            summation (the same result up to float32 rounding).
        replay_stream: the additive form's fused norms recompute their float32 stream in the
            backward from the stream at the group's (or span's) start and the outputs since, instead
            of saving it: 4 bytes per element and sublayer less memory, for reading those outputs
            again; False saves it (bit-identical gradients).

    Raises:
        ValueError: ``block_size`` or ``group_size`` below 1.
    """

    def __init__(
        self, embedding: Tensor, block_size: int, sites: Optional[Sequence["RoutingSite"]] = None, two_phase: bool = False,
        group_size: Optional[int] = None, *, sink: bool = True, replay_stream: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"DepthHistory: block_size={block_size} must be >= 1")
        if group_size is not None and group_size < 1:
            raise ValueError(f"DepthHistory: group_size={group_size} must be >= 1 (or None for the default)")
        self.block_size = block_size
        additive = sites is not None and len(sites) > 0 and sites[0].gate is not None  # (len: dynamo of torch 2.11 cannot trace bool(list))
        self.group_size = group_size or (block_size if block_size > 1 else FULL_ROUTING_GROUP_ADDITIVE if additive else FULL_ROUTING_GROUP)
        self.partial: Optional[Tensor] = None
        self.n_appended = 0
        self.sites = list(sites) if sites is not None else None
        self.two_phase = bool(two_phase) and self.group_size > 1 and self.sites is not None
        # the complete sources' gradients summed over the phase-one passes and merges
        sink = sink and self.two_phase and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        self.sink: Optional[GradientSink] = GradientSink() if sink else None
        self.replay_stream = replay_stream
        self.blocks: list[Tensor] = [self._collect(embedding)]
        # site -> (phase-one routed value, its lse, how many of self.blocks phase one covered)
        self._inter: dict[int, tuple[Tensor, Tensor, int]] = {}
        self._frozen = False  # a snapshot() for one site: read-only, routes that site any number of times
        # the additive form's stream for the replay: (first site of the span, its stream: in
        # block routing a span may cover several groups, REPLAY_SPAN_MAX_OUTPUTS), the stream the
        # last append() returned, (site, the stream track_stream() gave it), and the outputs
        # appended since the group's first site; each with its version counter at the time, so
        # that a tensor changed in place since (a hook's mul_) stops the replay
        self._replay: Optional[tuple[int, Tensor, int]] = None
        self._stream_next: Optional[tuple[Tensor, int]] = None
        self._stream_site: Optional[tuple[int, Tensor, int]] = None
        self._group_outputs: list[tuple[Tensor, int]] = []
        self._earlier: list[tuple[Tensor, int]] = []  # outputs of the span's groups before this one (REPLAY_SPAN_MAX_OUTPUTS)

    def sources(self) -> list[Tensor]:
        """Sources visible to the next routing site, oldest first (N = 1 + completed + started)."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def track_stream(self, stream: Tensor) -> Tensor:
        """The additive form's residual stream ``[..., d]`` as the next routing site and
        :meth:`append` read it: with a sink, an alias the sink collected, so that
        its gradient is summed there; else (or if already collected) ``stream`` itself.

        The model passes each stream through here right before its site, and hands on between
        blocks the plain tensor :meth:`append` returns: an alias's own gradient (what tensor hooks
        and ``retain_grad`` on it see) lacks what the sink sums, the plain tensor's is complete."""
        if self._frozen or self.sink is None or torch.compiler.is_compiling() or self.sink.holds([stream]):
            tracked = stream  # (under torch.compile, a block compiled on its own, the sink is not traced)
        else:
            tracked = self._collect(stream)
        index = self.n_appended
        if self._replays():
            made = self._stream_next is not None and stream is self._stream_next[0] and stream._version == self._stream_next[1]
            if self._group_first(index) == index:
                if self._replay is None or not made or self._span_starts(index):
                    self._replay, self._earlier = (index, tracked, tracked._version), []
            elif not made:
                self._replay = None  # not the stream append() made, or changed in place since: no replay until the next group
            self._stream_site = (index, tracked, tracked._version)
        return tracked

    def _span_starts(self, index: int) -> bool:
        """Whether the stream replay starts afresh at ``index``, the first site of a group: in
        every group of full routing; in block routing where the span so far holds more than
        ``REPLAY_SPAN_MAX_OUTPUTS`` outputs (those the block's merges would add first)."""
        return self.block_size == 1 or len(self._earlier) > REPLAY_SPAN_MAX_OUTPUTS

    def append(self, output: Tensor, sublayer: int, stream: Optional[Tensor] = None) -> Optional[Tensor]:
        """Record the raw output ``[..., d]`` of sublayer ``sublayer`` (0-based, in order).

        With ``stream`` (the additive form's residual stream before that sublayer, as
        :meth:`track_stream` returned it), returns the stream after it, ``stream + output``, a
        plain tensor; where the stream is collected, its gradient and the output's are summed in
        one step (:meth:`GradientSink.advance`)."""
        if self._frozen:
            raise RuntimeError("DepthHistory.append: this is a snapshot(), which is read-only; append to the live history")
        if sublayer != self.n_appended:
            raise ValueError(f"DepthHistory: got sublayer {sublayer}, expected {self.n_appended} (sublayers run in order)")
        # the stream and the running sum advance in one step (GradientSink.advance) where the sink
        # collected them: each hands its gradient to its slot (each running sum is a source of its
        # own slot); the others go through autograd
        sunk_stream = stream is not None and self._sink_for([stream]) is not None
        sunk_partial = self.partial is not None and self._sink_for([self.partial]) is not None
        new_stream = partial = None
        if sunk_stream or sunk_partial:
            new_stream, partial = self.sink.advance(stream if sunk_stream else None, self.partial if sunk_partial else None, output)
        if stream is not None and not sunk_stream:
            new_stream = stream + output  # the addition merge_route_norm's stream_start replays
        if stream is not None and self._replays():
            site = self._stream_site
            if site is None or site[0] != sublayer or stream is not site[1] or stream._version != site[2]:
                self._replay = None  # the stream is not the one this site's routing read
            self._stream_next = (new_stream, new_stream._version)
            self._group_outputs.append((output, output._version))  # the stream's addends, and the running sum's
        else:
            self._replay = self._stream_next = None
        if not sunk_partial:
            partial = output if self.partial is None else self.partial + output
        self.partial = self._collect(partial)
        self.n_appended += 1
        if self._group_first(self.n_appended) == self.n_appended:
            self._earlier, self._group_outputs = [*self._earlier, *self._group_outputs], []  # (track_stream drops them at a span's start)
        if self.n_appended % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
        return new_stream

    def _replays(self) -> bool:
        """Whether the additive form's stream may be replayed here (``replay_stream``): two-phase
        routing in groups of one block (or full routing's groups), on the live history, in eager
        code (a block compiled on its own routes through the custom op, which saves the stream)."""
        return (
            self.replay_stream and self.two_phase and not self._frozen and (self.block_size == 1 or self.group_size == self.block_size)
            and not torch.compiler.is_compiling()
        )

    def _collect(self, source: Tensor) -> Tensor:
        """``source`` as a source of the depth history: its sink alias (eager code with a sink)."""
        if self.sink is None or torch.compiler.is_compiling():
            return source
        return self.sink.collect(source)

    def _sink_for(self, sources: Sequence[Tensor]) -> Optional[GradientSink]:
        """The sink for an op over ``sources``: None under torch.compile (a block compiled on its own
        inside an eager model) or where one of them was made there (not collected); their
        gradients then go through autograd, which the collected aliases add to their sums."""
        if self.sink is None or torch.compiler.is_compiling() or not self.sink.holds(sources):
            return None
        return self.sink

    def route(
        self, site: "RoutingSite", stream: Optional[Tensor] = None, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Routed input ``[..., d]`` of ``site``, the site about to run (index ``n_appended``).

        Plain per-site routing over :meth:`sources`, or the two-phase computation when enabled
        (not with ``return_weights``: probes take the plain path). ``stream`` is the residual
        stream of the additive form.
        """
        if not self.two_phase or return_weights or self._direct(site):
            return site(self, stream, return_weights=return_weights)
        prior_out, prior_lse, newer = self._phase_two_inputs()
        if not newer and site.gate is None:
            return prior_out  # first site of a group: phase one covered all it sees
        return merge_route(
            newer,
            site.query,
            site.key_gain,
            site.heads,
            prior_out,
            prior_lse,
            stream=stream if site.gate is not None else None,
            gate=site.gate,
            eps=site.eps,
            grad_sink=self._sink_for(newer),
        )

    def route_norm(self, site: "RoutingSite", norm: nn.Module, stream: Optional[Tensor] = None) -> Tensor:
        """``norm(route(site, stream))`` ``[..., d]``: the input of the sublayer after ``site``.

        With two-phase routing and ``norm`` an ``nn.RMSNorm`` with a weight, the second phase and
        the norm run as one op (:func:`lit_mhar.kernels.merge_route_norm`): the result, in the
        sources' dtype, is the norm of the unrounded site output, which is neither written nor saved.
        Otherwise the site's output goes through ``norm`` as a module call.
        """
        fused = self.two_phase and isinstance(norm, nn.RMSNorm) and norm.weight is not None
        if not fused:
            return norm(self.route(site, stream))
        if self._direct(site):  # the first block's sites: phase one would see the embedding alone
            sources = self.sources()
            eps = norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(sources[0].dtype, norm.weight.dtype)).eps
            return route_norm(sources, site.query, site.key_gain, site.heads, norm.weight, eps, eps=site.eps, grad_sink=self._sink_for(sources))
        prior_out, prior_lse, newer = self._phase_two_inputs()
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(prior_out.dtype, norm.weight.dtype)).eps
        additive = site.gate is not None
        return merge_route_norm(
            newer, site.query, site.key_gain, site.heads, prior_out, prior_lse, norm.weight, eps,
            stream=stream if additive else None, gate=site.gate, eps=site.eps, grad_sink=self._sink_for(newer),
            **(self._stream_replay(stream, newer) if additive else {}),
        )

    def _stream_replay(self, stream: Optional[Tensor], newer: Sequence[Tensor]) -> dict:
        """``merge_route_norm``'s ``stream_start`` (and in block routing ``block_outputs``, and
        inside a span of blocks, ``REPLAY_SPAN_MAX_OUTPUTS``, ``earlier_outputs``) for this site
        (``replay_stream``): the stream at the start of the site's group (or span), where ``stream`` is
        it plus the sublayer outputs :meth:`append` added since, none of them changed in place
        since, which in full routing are the sources ``newer`` and in block routing are the span's
        earlier blocks' outputs, then the outputs that add up to the one source, the running sum
        (of their dtype); else {}."""
        index = self.n_appended
        if not self._replays() or self._replay is None or self._stream_site is None or stream is None:
            return {}
        first, start, start_version = self._replay
        site, tracked, tracked_version = self._stream_site
        group_first = self._group_first(index)
        if site != index or stream is not tracked or first != group_first - len(self._earlier):
            return {}
        if stream._version != tracked_version or start._version != start_version:
            return {}
        if start.dtype != torch.float32 or stream.dtype != torch.float32:  # the kernel's additions are float32's
            return {}
        outputs, earlier = [o for o, _ in self._group_outputs], [o for o, _ in self._earlier]
        changed = any(o._version != v for o, v in (*self._earlier, *self._group_outputs))
        if len(outputs) != index - group_first or changed:
            return {}
        if self.block_size == 1:
            return dict(stream_start=start) if len(newer) == len(outputs) and not earlier else {}
        extra = dict(earlier_outputs=earlier) if earlier else {}
        if not outputs:
            return dict(stream_start=start, **extra) if not newer else {}
        like = newer[0] if len(newer) == 1 else None
        if like is None or any(o.dtype != like.dtype or o.shape != like.shape or o.device != like.device for o in (*earlier, *outputs)):
            return {}  # (an output of another dtype: the running sum is not their sum in one dtype)
        return dict(stream_start=start, block_outputs=outputs, **extra)

    def _direct(self, site: "RoutingSite") -> bool:
        """Whether ``site``, the site about to run, is routed directly over :meth:`sources`, without
        phase one: block routing's replacement form, in the first block, whose phase one would see
        the embedding alone (Delta keeps its pass: its stream replay spans the group; full routing
        keeps it: its first group's merges would each read one more source)."""
        return self.block_size > 1 and self.two_phase and site.gate is None and self._group_first(self.n_appended) < self.block_size

    def _phase_two_inputs(self) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Phase one's routed value and lse for the site about to run, and the sources added since."""
        index = self.n_appended
        if index not in self._inter:
            self._route_group(index)
        prior_out, prior_lse, covered = self._inter[index] if self._frozen else self._inter.pop(index)
        newer = self.blocks[covered:] + ([] if self.partial is None else [self.partial])
        return prior_out, prior_lse, newer

    def snapshot(self) -> "DepthHistory":
        """A read-only copy of the history as the site about to run sees it (activation checkpointing).

        A checkpointed sublayer routes its input again in the backward pass, when the live history
        has grown (more sublayers appended, the partial block moved on). The snapshot keeps the
        sources of this moment (references, no copies: the embedding, the completed block sums and
        the partial block, all of which later sites read anyway) and, with ``two_phase``, this
        site's phase-one result, which is computed here, outside the recomputed region: its
        ``route_sites`` pass serves every site of the block. :meth:`route` on the snapshot gives the
        same result every time; :meth:`append` on it raises RuntimeError.
        """
        view = DepthHistory.__new__(DepthHistory)
        view.__dict__.update(self.__dict__)
        view.blocks, view._inter, view._frozen = list(self.blocks), {}, True
        # a snapshot never replays the stream: it keeps no reference to the live history's streams
        # or outputs (the live list of outputs grows, and checkpointing holds snapshots until backward)
        view._replay = view._stream_next = view._stream_site = None
        view._group_outputs, view._earlier = [], []
        if self.two_phase and not self._direct(self.sites[self.n_appended]):
            index = self.n_appended
            if index not in self._inter:
                self._route_group(index)
            view._inter[index] = self._inter.pop(index)
        return view

    def _group_first(self, index: int) -> int:
        """The first site of site ``index``'s group: groups of ``group_size`` sites from site 0, the
        model's last site joining the group before it where it would be alone (up to
        ``JOIN_FINAL_SITE_MAX_SITES`` sites in the group)."""
        first = index - index % self.group_size
        if first == index > 0 and self.sites is not None and index == len(self.sites) - 1 and 1 < self.group_size < JOIN_FINAL_SITE_MAX_SITES:
            return index - self.group_size
        return first

    def _route_group(self, first: int) -> None:
        """Phase one for sites ``first`` .. end of their group: one pass over the complete sources."""
        start, n = self._group_first(first), len(self.sites)
        last = n if self._group_first(n - 1) == start else min(start + self.group_size, n)  # the model's last site in this group or not
        group = self.sites[first:last]
        queries = torch.stack([s.query for s in group])
        gains = torch.stack([s.key_gain for s in group])
        outs, lse = route_sites(self.blocks, queries, gains, group[0].heads, group[0].eps, grad_sink=self._sink_for(self.blocks))
        for j in range(len(group)):
            self._inter[first + j] = (outs[j], lse[j], len(self.blocks))

class DecodeHistory:
    """The depth history of tokens being decoded, in one buffer; each site routes and normalises in one op.

    Decoding needs no backward, so the sources can live in one preallocated buffer
    ``[slots, ..., d]`` (slot 0 the embedding, slot n the n-th block sum, the last used slot the
    partial block) and each routing site can be one fused op (:func:`lit_mhar.kernels.route_norm_decode`):
    it adds the output of the sublayer that just ran into its slot, routes over the slots and
    applies the next sublayer's RMSNorm. Same routing as :class:`DepthHistory` (plain per-site
    routing over the same block sums; the partial sums are stored in the buffer's dtype, as the
    training path's are), one kernel per site instead of an add, the routing op(s) and a norm.

    Full routing (S = 1) with ``sites`` given: the depth history grows by one slot per sublayer, so
    from ``prefix_min`` complete slots on, the ``group_size`` sites of a group are first routed
    together against the slots complete at the group's start (:func:`lit_mhar.kernels.route_sites_decode`,
    one pass), and each site's fused op then reads only the slots written since, merged with that
    prior (two-phase computation, AttnRes Sec. 4). Same result up to rounding.

    Args:
        embedding: ``[..., d]`` token embedding (source 0), in the dtype the history is kept in.
        block_size: S >= 1 sublayers per block.
        n_sublayers: sublayers in the model (2L), to size the buffer.
        sites: the model's routing sites in depth order (:meth:`lit_mhar.model.LM.routing_sites`,
            2L + 1 of them), for the grouped phase one of full routing; None routes site by site.
        group_size: sites per group (default ``DECODE_ROUTING_GROUP``); 1 routes site by site.
        prefix_min: complete slots from which a group takes the phase-one pass (default
            ``DECODE_PREFIX_MIN_SOURCES``).

    A group whose sites differ in heads or key-norm eps (possible only in an edited model) is routed
    site by site.

    Raises:
        ValueError: ``block_size``, ``group_size`` or ``prefix_min`` below 1 (or not integers), or
            ``sites`` not 2L + 1; from :meth:`route_norm`, a site out of order.
    """

    def __init__(
        self,
        embedding: Tensor,
        block_size: int,
        n_sublayers: int,
        sites: Optional[Sequence["RoutingSite"]] = None,
        group_size: Optional[int] = None,
        prefix_min: Optional[int] = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"DecodeHistory: block_size={block_size} must be >= 1")
        group_size = DECODE_ROUTING_GROUP if group_size is None else group_size
        prefix_min = DECODE_PREFIX_MIN_SOURCES if prefix_min is None else prefix_min
        for name, value in (("group_size", group_size), ("prefix_min", prefix_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeHistory: {name}={value!r} must be an integer >= 1")
        if sites is not None and len(sites) != n_sublayers + 1:
            raise ValueError(f"DecodeHistory: got {len(sites)} routing sites for {n_sublayers} sublayers; expected {n_sublayers + 1}")
        self.block_size = block_size
        self.buffer = embedding.new_empty((1 + -(-n_sublayers // block_size), *embedding.shape))
        self.buffer[0] = embedding
        self.n_blocks = 1  # completed slots 0 .. n_blocks - 1 (the embedding counts as block 0)
        self.has_partial = False
        self.pending: Optional[tuple[Tensor, int, bool]] = None  # (output, slot, add to the slot)
        self.n_appended = 0
        self.sites = list(sites) if sites is not None and block_size == 1 and group_size > 1 else None
        self.group_size, self.prefix_min = group_size, prefix_min
        self.n_routed = 0
        self._prior: Optional[tuple[Tensor, Tensor, int, int]] = None  # (out [G, ..., d], lse [G, ..., H], first site, slots)
        self._stacked: Optional[tuple[Tensor, Tensor]] = None

    def track_stream(self, stream: Tensor) -> Tensor:
        """``stream`` itself: decoding has no backward (see :meth:`DepthHistory.track_stream`)."""
        return stream

    def append(self, output: Tensor, sublayer: int, stream: Optional[Tensor] = None) -> Optional[Tensor]:
        """Record the raw output ``[..., d]`` of sublayer ``sublayer``; the next :meth:`route_norm` stores it.
        With ``stream`` (the additive form's residual stream), returns ``stream + output``."""
        if sublayer != self.n_appended:
            raise ValueError(f"DecodeHistory: got sublayer {sublayer}, expected {self.n_appended} (sublayers run in order)")
        if self.pending is not None:
            raise RuntimeError("DecodeHistory.append: the previous output was not routed yet (one route_norm per sublayer)")
        self.pending = (output, self.n_blocks, self.has_partial)
        self.n_appended += 1
        if self.n_appended % self.block_size == 0:
            self.n_blocks += 1
            self.has_partial = False
        else:
            self.has_partial = True
        return None if stream is None else stream + output

    def route_norm(self, site: "RoutingSite", norm: nn.RMSNorm, stream: Optional[Tensor] = None) -> Tensor:
        """``norm(route(site))`` ``[..., d]`` for the site about to run; ``stream`` for the additive form."""
        eps = norm.eps if norm.eps is not None else torch.finfo(self.buffer.dtype).eps
        index = self.n_routed
        if self.sites is not None:  # checked before any state changes: a refused call can be retried
            if index >= len(self.sites):
                raise ValueError(f"DecodeHistory.route_norm: all {len(self.sites)} routing sites have routed already")
            if self.sites[index] is not site:
                passed = next((i for i, s in enumerate(self.sites) if s is site), None)
                raise ValueError(
                    f"DecodeHistory.route_norm: expected routing site {index}, got "
                    f"{'one that is not among the model sites' if passed is None else f'site {passed}'} (sites route in order)"
                )
        if self.pending is None:
            output, n_sources, accumulate = None, self.n_blocks, False
        else:
            output, n_sources, accumulate = self.pending
            self.pending = None
        self.n_routed += 1
        prior: dict = {}
        if self.sites is not None:
            if index % self.group_size == 0:
                self._prior = self._phase_one(index, n_sources) if n_sources >= self.prefix_min else None
            if self._prior is not None and self._prior[2] <= index < self._prior[2] + self._prior[0].shape[0]:
                out, lse, first, n_prior = self._prior
                prior = dict(prior_out=out[index - first], prior_lse=lse[index - first], n_prior=n_prior)
        return route_norm_decode(
            self.buffer, n_sources, output, accumulate, site.query, site.key_gain, site.heads, norm.weight, eps,
            stream=stream if site.gate is not None else None, gate=site.gate, eps=site.eps, **prior,
        )

    def _phase_one(self, first: int, n_sources: int) -> Optional[tuple[Tensor, Tensor, int, int]]:
        """Sites ``first ..`` of a group routed against slots ``0 .. n_sources - 1`` in one pass;
        None (site-by-site routing) for a group whose sites differ in heads or eps."""
        last = min(first + self.group_size, len(self.sites))
        group = self.sites[first:last]
        if any(s.heads != group[0].heads or s.eps != group[0].eps for s in group):
            return None
        if self._stacked is None:  # once per step: every site's query and gain, [2L + 1, d]
            self._stacked = (torch.stack([s.query for s in self.sites]), torch.stack([s.key_gain for s in self.sites]))
        queries, gains = self._stacked
        out, lse = route_sites_decode(self.buffer, n_sources, queries[first:last], gains[first:last], group[0].heads, group[0].eps)
        return out, lse, first, n_sources


class RoutingSite(nn.Module):
    """One routing site: a pseudo-query, a key-RMSNorm gain and, for the Delta form, an output gate.

    Replacement form (AttnRes / MHAR): ``h_l = sum_i alpha_i v_i``.
    Additive form (Delta AttnRes): ``h_l = stream + gate * sum_i alpha_i v_i``.
    The query starts at zero (uniform weights at step 0, AttnRes Sec. 3); the gate starts at zero
    so a fresh Delta model computes exactly what the prenorm model with the same weights computes.

    Args:
        d_model: width d.
        heads: routing heads H (MHAR), dividing d.
        additive: True for the Delta form (adds the gate parameter).
        eps: key RMSNorm epsilon.
    """

    def __init__(self, d_model: int, heads: int, additive: bool, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(d_model))
        self.key_gain = nn.Parameter(torch.ones(d_model))
        self.gate = nn.Parameter(torch.zeros(d_model)) if additive else None

    def forward(
        self, history: DepthHistory, stream: Optional[Tensor] = None, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Routed input ``[..., d]`` for the next sublayer; with ``return_weights`` also ``[N, ..., H]`` float32."""
        return depth_route(
            history.sources(),
            self.query,
            self.key_gain,
            self.heads,
            stream=stream if self.gate is not None else None,
            gate=self.gate,
            eps=self.eps,
            return_weights=return_weights,
        )

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_gain)
        if self.gate is not None:
            nn.init.zeros_(self.gate)


class HyperConnection(nn.Module):
    """The hyper-connection around one sublayer (Hyper-Connections, Zhu et al., arXiv 2409.19606).

    The residual stream is the hyper hidden matrix ``H`` ``[..., n, d]``: n copies of width d
    (expansion rate n). Around sublayer ``T`` (attention or MLP, with its pre-norm), with the
    hyper-connection matrix ``HC = [[0, B], [A_m, A_r]]`` (``B`` ``1 x n``, ``A_m`` ``n x 1``,
    ``A_r`` ``n x n``)::

        x  = A_m^T H                    width connections: the sublayer's input, a mix of the copies
        H' = B^T T(x) + A_r^T H         depth connections write the output into every copy;
                                        A_r mixes the copies that are carried on

    Static (SHC): ``A_m``, ``A_r``, ``B`` are learned constants, stored as ``static_alpha`` =
    ``[A_m | A_r]`` ``[n, n + 1]`` and ``static_beta`` = ``B`` ``[n]``. Dynamic (DHC): each token
    adds input-dependent corrections computed from ``Hbar = RMSNorm(H)`` (the paper's ``norm``;
    this model normalises with RMSNorm)::

        [A_m | A_r](H) = s_alpha * tanh(Hbar W_alpha) + [A_m | A_r]     W_alpha = [W_m | W_r]  [d, n + 1]
        B(H)           = s_beta  * tanh(Hbar W_beta)^T + B              W_beta                 [d]

    Initialisation (the paper's, so that the network starts as a prenorm transformer): for
    sublayer ``l`` (counted over attention and MLP sublayers), ``A_m = e_{l mod n}``, ``A_r = I``,
    ``B = 1``, ``W_alpha = W_beta = 0`` and ``s_alpha = s_beta = 0.01``. Every copy then starts as
    the embedding and receives every sublayer output, so each copy *is* prenorm's stream and each
    sublayer reads prenorm's input; the model's final merge, the sum over copies, is n times
    prenorm's last hidden state, which the final RMSNorm maps to prenorm's up to its epsilon
    (exactly prenorm's with ``eps / n**2``). With n = 1, a fresh model is prenorm exactly.

    The connection weights and the mixing are computed with autocast off, in the stream's dtype
    (float32 under bf16 autocast, as prenorm's stream stays), so the n-copy stream is never
    rounded to bf16. Everything is per token: a KV-cached decode step needs nothing extra.

    Args:
        d_model: width d.
        rate: expansion rate n >= 1.
        sublayer: index l of the sublayer this connection wraps (0 .. 2L - 1); picks ``A_m``'s init.
        dynamic: dynamic (DHC) rather than static (SHC) connections.
        eps: epsilon of the RMSNorm of the dynamic form.
    """

    def __init__(self, d_model: int, rate: int, sublayer: int, dynamic: bool, eps: float) -> None:
        super().__init__()
        if rate < 1:
            raise ValueError(f"HyperConnection: rate={rate} must be >= 1")
        self.rate, self.sublayer = rate, sublayer
        self.static_alpha = nn.Parameter(torch.empty(rate, rate + 1))
        self.static_beta = nn.Parameter(torch.empty(rate))
        if dynamic:
            self.norm = nn.RMSNorm(d_model, eps=eps)
            self.dynamic_alpha = nn.Parameter(torch.empty(d_model, rate + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(d_model))
            self.alpha_scale = nn.Parameter(torch.empty(()))
            self.beta_scale = nn.Parameter(torch.empty(()))
        else:
            self.norm = self.dynamic_alpha = self.dynamic_beta = self.alpha_scale = self.beta_scale = None
        self.reset_parameters()

    @property
    def dynamic(self) -> bool:
        return self.dynamic_alpha is not None

    def reset_parameters(self) -> None:
        """The paper's prenorm-equivalent init: ``A_m = e_{l mod n}``, ``A_r = I``, ``B = 1``, dynamic part 0."""
        with torch.no_grad():
            self.static_alpha.zero_()
            self.static_alpha[self.sublayer % self.rate, 0] = 1.0
            self.static_alpha[:, 1:] = torch.eye(self.rate)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.norm.reset_parameters()
                self.dynamic_alpha.zero_()
                self.dynamic_beta.zero_()
                self.alpha_scale.fill_(0.01)
                self.beta_scale.fill_(0.01)

    def width(self, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Width connections of the hyper hidden matrix ``H`` ``[..., n, d]``.

        Returns:
            ``x`` ``[..., d]``: the sublayer's input ``A_m^T H``; ``carried`` ``[..., n, d]``: the
            copies carried on, ``A_r^T H``; ``beta`` (``B``): ``[..., n]`` (dynamic) or ``[n]``
            (static), for :meth:`depth`. All in ``H``'s dtype.
        """
        with torch.autocast(H.device.type, enabled=False):
            if self.dynamic:
                Hbar = self.norm(H)
                alpha = self.static_alpha + self.alpha_scale * torch.tanh(Hbar @ self.dynamic_alpha)  # [..., n, n+1]
                beta = self.static_beta + self.beta_scale * torch.tanh(Hbar @ self.dynamic_beta)  # [..., n]
                mixed = alpha.transpose(-1, -2) @ H  # [..., n+1, d]
            else:
                beta = self.static_beta
                mixed = torch.einsum("km,...kd->...md", self.static_alpha, H)
        return mixed[..., 0, :], mixed[..., 1:, :], beta

    def depth(self, out: Tensor, carried: Tensor, beta: Tensor) -> Tensor:
        """Depth connections: ``H' = B^T out + A_r^T H`` ``[..., n, d]`` from the sublayer output ``out`` ``[..., d]``."""
        return beta.unsqueeze(-1) * out.unsqueeze(-2) + carried


def routing_stats(weights: Tensor) -> tuple[Tensor, Tensor]:
    """Collapse diagnostics of one site's routing weights ``[N, ..., H]`` (float32).

    Returns (mean over tokens and heads of the max weight over sources, mean entropy in nats).
    """
    w = weights.float()
    max_weight = w.amax(0).mean()
    entropy = -(w * torch.log(w.clamp_min(1e-12))).sum(0).mean()
    return max_weight, entropy
