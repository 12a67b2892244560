"""A Qwen3-style decoder whose sublayers are wired across depth by one of the residual variants.

Token embedding, RoPE, grouped-query attention with QK-RMSNorm through
``scaled_dot_product_attention`` (causal), SwiGLU MLP, RMSNorm, untied LM head.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_mhar.config import ModelConfig
from lit_mhar.kernels import resolve_backend
from lit_mhar.routing import DecodeHistory, DepthHistory, HyperConnection, RoutingSite


def rope_cache(seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape ``[seq_len, head_dim]`` float32 (rotate-half convention)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by position; cos/sin ``[T, head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that normalises an input narrower than its weight in the weight's dtype.

    Under bf16 autocast the routed input of a sublayer is bf16 while the gain is float32; torch's
    fused RMSNorm kernel needs one dtype and otherwise falls back to a chain of float32 elementwise
    kernels (pow, mean, rsqrt, two multiplies, and as many again backward), which cost a 350m block
    MHAR training step more time than its routing (docs/benchmarks/history, second set). Casting the input
    up first (one kernel) keeps the fused path; the result is the same float32 computation.
    ``[..., d] -> [..., d]`` in the promoted dtype (``nn.RMSNorm``'s fallback rounds its result to
    the input's dtype; under autocast the next linear layer rounds either to bf16 the same way).
    """

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w is not None and x.dtype != w.dtype:
            x = x.to(torch.promote_types(x.dtype, w.dtype))
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class LayerCache(NamedTuple):
    """One attention layer's view of a :class:`KVCache` for one forward call.

    Attributes:
        k, v: ``[B, n_kv_head, L, head_dim]`` key / value buffers of this layer, written in place.
        positions: ``[T]`` int64 positions of the T tokens of this call, or None for a prefill from
            position 0 (keys and values go to ``[:T]`` and attention is the training's causal one).
        mask: ``[G * T, L]`` additive attention mask in the cache's dtype, G = n_head / n_kv_head
            query heads per KV head: row ``g * T + t`` is 0 where token t may attend to cached
            position j (``j <= positions[t]``) and -inf elsewhere; None with ``positions`` None.
    """

    k: Tensor
    v: Tensor
    positions: Optional[Tensor]
    mask: Optional[Tensor]


class KVCache:
    """Keys and values of every attention layer for incremental decoding (one step = T new tokens).

    Buffers are allocated once, ``[B, n_kv_head, max_len, head_dim]`` per layer (zeros), and written in
    place, so a decode step has static shapes (CUDA graphs can capture it). Depth routing needs no
    cache: it mixes each token's own depth history (its embedding and sublayer outputs), which a
    decode step computes for the new token anyway; only attention looks at earlier positions.

    Args:
        cfg: the model's config.
        batch_size: rows B (a prefill of one row fills every row: one prompt, B samples).
        max_len: positions L the cache holds, at most ``cfg.seq_len``.
        device, dtype: of the buffers; the model's (or its autocast dtype) for no conversion.

    Raises:
        ValueError: ``batch_size`` < 1 or ``max_len`` outside ``[1, cfg.seq_len]``.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"KVCache: batch_size={batch_size!r} must be an integer >= 1")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= cfg.seq_len:
            raise ValueError(f"KVCache: max_len={max_len!r} must be an integer in [1, {cfg.seq_len}] (ModelConfig.seq_len)")
        shape = (batch_size, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.batch_size, self.max_len = batch_size, max_len


class Attention(nn.Module):
    """Causal grouped-query self-attention with QK-RMSNorm (unless ``cfg.qk_norm`` is False) and RoPE. ``[B, T, d] -> [B, T, d]``.

    With a :class:`LayerCache`, the new keys and values are written into the cache first; a prefill
    from position 0 then attends causally over its own tokens (the training computation), any other
    step attends over the whole cache under ``cache.mask``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # QK-RMSNorm (Qwen3); Llama-style attention has none (cfg.qk_norm = False). RMSNorm, not
        # nn.RMSNorm: under bf16 autocast the projections are bf16 and the gains float32, which
        # nn.RMSNorm can only compute on its slow unfused path (with a warning at every call).
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Optional[LayerCache] = None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None and cache.positions is not None:
            y = self._cached_attention(q, k, v, cache)
        else:
            if cache is not None:  # prefill from position 0 (one row may fill every row of the cache)
                cache.k[:, :, :T] = k
                cache.v[:, :, :T] = v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_head != self.n_kv_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _cached_attention(self, q: Tensor, k: Tensor, v: Tensor, cache: LayerCache) -> Tensor:
        """Write ``k, v`` at ``cache.positions``; attend ``q`` ``[B, n_head, T, hd]`` over the cache under its mask.

        The query heads sharing a KV head are folded into the query length (``[B, n_kv, group * T, hd]``),
        so grouped-query attention reads each cached key once and needs no ``enable_gqa`` support
        from the masked SDPA backends.
        """
        B, _, T, hd = q.shape
        cache.k.index_copy_(2, cache.positions, k.to(cache.k.dtype))
        cache.v.index_copy_(2, cache.positions, v.to(cache.v.dtype))
        q = q.reshape(B, self.n_kv_head, -1, hd)  # rows in (group, T) order, like cache.mask
        y = F.scaled_dot_product_attention(q.to(cache.k.dtype), cache.k, cache.v, attn_mask=cache.mask)
        return y.reshape(B, self.n_head, T, hd).to(v.dtype)  # the CUDA backends may return another layout


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. ``[B, T, d] -> [B, T, d]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One transformer layer: two sublayers (attention, MLP), each with its own pre-norm.

    How each residual variant feeds sublayer ``l`` (f = attention or MLP, v = depth history)::

        prenorm:  h ──► norm ──► f ──► (+) ──► h          h_{l+1} = h_l + f(norm(h_l))
                  └──────────────────────┘
        attnres:  v_0..v_l ──► route(q_l) ──► norm ──► f ──► v_{l+1}
                  input = sum_i alpha_i v_i, alpha = softmax_i q_l . RMSNorm(v_i); H heads split
                  the channels (MHAR); with S > 1 the v are block sums + the partial block
        delta:    h ──► (+ gate_l * route(q_l)(v_0..v_l)) ──► norm ──► f ──► (+) ──► h
                  └───────────────────────────────────────────────────────────┘
                  the residual stream is kept; the routed deltas are added to each input only
        hyper:    H ──► A_m^T H ──► norm ──► f ──► B^T f ──► (+) ──► H        H: n copies [.., n, d]
                  └──────► A_r^T H (copies mixed) ────────────┘
                  x = A_m^T H: width connections read the copies; H' = B^T f(norm(x)) + A_r^T H:
                  depth connections write the output into every copy (HyperConnection); A_m, A_r, B
                  learned, + s * tanh(norm(H) W) per token if dynamic; init A_m = e_{l mod n},
                  A_r = I, B = 1: every copy is prenorm's h. The LM head reads the sum of the copies.
    """

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.residual = cfg.residual
        self.activation_checkpointing = False  # set by LM (see its docstring)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        if cfg.routed:
            additive = cfg.residual == "delta"
            self.attn_site = RoutingSite(cfg.d_model, cfg.heads, additive, cfg.norm_eps)
            self.mlp_site = RoutingSite(cfg.d_model, cfg.heads, additive, cfg.norm_eps)
        else:
            self.attn_site = self.mlp_site = None
        if cfg.residual == "hyper":  # one hyper-connection per sublayer, initialised by sublayer index
            self.attn_hc = HyperConnection(cfg.d_model, cfg.hc_rate, 2 * index, cfg.hc_dynamic, cfg.norm_eps)
            self.mlp_hc = HyperConnection(cfg.d_model, cfg.hc_rate, 2 * index + 1, cfg.hc_dynamic, cfg.norm_eps)
        else:
            self.attn_hc = self.mlp_hc = None

    def forward(
        self,
        h: Optional[Tensor],
        history: Optional[DepthHistory],
        cos: Tensor,
        sin: Tensor,
        weights: Optional[list[Tensor]] = None,
        cache: Optional[LayerCache] = None,
    ) -> Optional[Tensor]:
        """Run both sublayers. ``h`` is the residual stream ``[B, T, d]`` (None for attnres, which
        has none; for hyper, the n copies ``[B, T, n, d]``); ``history`` collects sublayer outputs;
        routing weights are appended to ``weights`` when it is a list; ``cache`` is this layer's
        KV cache (decoding)."""
        attn = (lambda x: self.attn(x, cos, sin)) if cache is None else (lambda x: self.attn(x, cos, sin, cache))
        sublayers = ((self.attn_norm, self.attn_site, attn), (self.mlp_norm, self.mlp_site, self.mlp))
        for j, (norm, site, fn) in enumerate(sublayers):
            if h is not None and history is not None:  # Delta: the stream as the site reads it (DepthHistory.track_stream)
                h = history.track_stream(h)
            hc = (self.attn_hc, self.mlp_hc)[j]
            if hc is not None:  # Hyper-Connections: read the copies, write the output back into them
                if self.activation_checkpointing and cache is None and torch.is_grad_enabled():
                    # the whole hyper-connected sublayer is recomputed; saved is its input, the n copies
                    h = checkpoint(_hyper_sublayer, hc, norm, fn, h, use_reentrant=False)
                else:
                    h = _hyper_sublayer(hc, norm, fn, h)
                continue
            if self.activation_checkpointing and weights is None and cache is None and torch.is_grad_enabled():
                # route + norm + sublayer are recomputed in the backward pass; what stays saved is
                # their input: the stream and a snapshot of the sources (kept for later sites anyway)
                view = None if site is None else history.snapshot()
                out = checkpoint(_routed_sublayer, norm, site, fn, h, view, use_reentrant=False)
            elif site is not None and weights is None:
                # decoding: route + norm in one op; training and prefill: the two-phase second phase
                # and the norm in one op where the form allows (DepthHistory.route_norm)
                out = fn(history.route_norm(site, norm, h))
            else:
                x = h if site is None else route(site, history, h, weights)
                out = fn(norm(x))
            if h is not None and history is not None:  # Delta: the stream and the depth history advance together
                h = history.append(out, 2 * self.index + j, stream=h)
            elif h is not None:
                h = h + out
            elif history is not None:
                history.append(out, 2 * self.index + j)
        return h


def _routed_sublayer(norm: nn.Module, site: Optional[RoutingSite], fn, stream: Optional[Tensor], history: Optional[DepthHistory]) -> Tensor:
    """``fn(norm(x))``, x routed from ``history`` (a :meth:`DepthHistory.snapshot`) or the stream: the checkpointed region."""
    return fn(norm(stream) if site is None else history.route_norm(site, norm, stream))


def _hyper_sublayer(hc: HyperConnection, norm: nn.Module, fn, H: Tensor) -> Tensor:
    """``H' = B^T fn(norm(A_m^T H)) + A_r^T H`` ``[..., n, d]``: one sublayer inside its hyper-connection."""
    x, carried, beta = hc.width(H)
    return hc.depth(fn(norm(x)), carried, beta)


def route(site: RoutingSite, history: DepthHistory, stream: Optional[Tensor], weights: Optional[list[Tensor]]) -> Tensor:
    """Route ``history`` into ``site`` and keep its routing weights when ``weights`` is a list."""
    if weights is None:
        return history.route(site, stream)
    out, w = history.route(site, stream, return_weights=True)
    weights.append(w)
    return out


# LM.compile_for_training's layouts.
COMPILE_LAYOUTS = ("auto", "sublayers", "model")


class LM(nn.Module):
    """Decoder-only language model over token ids ``[B, T]`` (int64) giving logits ``[B, T, V]``.

    Args:
        cfg: the validated :class:`ModelConfig`.
        activation_checkpointing: in training (gradients enabled, no cache, no routing weights
            asked for), run each sublayer's routing, pre-norm and attention / MLP under
            ``torch.utils.checkpoint`` (non-reentrant) and recompute them in the backward pass.
            Saved between forward and backward are then only each sublayer's inputs: the residual
            stream (prenorm, delta) and the depth history's sources (the embedding, sublayer
            outputs or block sums and partial blocks; with two-phase routing also each
            site's phase-one result), about one or two ``[B, T, d]`` tensors per sublayer instead of
            every intermediate of attention, the MLP and the routing op. With Hyper-Connections the
            whole hyper-connected sublayer is recomputed and its input, the n copies ``[B, T, n, d]``,
            is what stays. Costs one more forward of every sublayer. Gradients are those without it (recomputation is deterministic, the
            fused routing kernels included). A training-time setting: not part of ``cfg``.
    """

    def __init__(self, cfg: ModelConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.activation_checkpointing = activation_checkpointing
        self.final_site = RoutingSite(cfg.d_model, cfg.heads, cfg.residual == "delta", cfg.norm_eps) if cfg.routed else None
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; output projections scaled by 1/sqrt(2L); norms at 1; routing at its
        zero init; hyper-connections at the paper's prenorm-equivalent init."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=std)
        for m in self.modules():
            if isinstance(m, (nn.RMSNorm, RoutingSite, HyperConnection)):
                m.reset_parameters()

    def forward(
        self, idx: Tensor, return_routing: bool = False, cache: Optional[KVCache] = None, pos: int | Tensor = 0
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits ``[B, T, V]`` for token ids ``idx`` ``[B, T]``.

        With ``return_routing``, also the routing weights of every site in depth order (2L + 1
        sites, the last before the LM head), each ``[N_l, B, T, H]`` float32.

        With ``cache`` (a :class:`KVCache`, see :meth:`new_cache`), ``idx`` are the tokens at positions
        ``pos .. pos + T - 1``: their keys and values are written into the cache and they attend to
        every cached position before them, so a prompt can be prefilled in one call (``pos=0``) and
        then decoded one token per call. Depth routing is per token, over the token's own
        sublayer outputs: the prefill uses the training's routing op (two-phase routing on the
        fused kernels, AttnRes Sec. 4); later steps without gradients keep the depth history in
        one buffer (:class:`DecodeHistory`) and route each site together with the next RMSNorm in
        one op (:func:`lit_mhar.kernels.route_norm_decode`; full routing's long histories in
        groups of sites routed against the slots complete at the group's start in one pass first).
        ``pos`` is an int, or a 0-d int64 tensor on
        the model's device for decode steps a CUDA graph replays (then it is not range-checked).
        ``pos=0`` as an int is the prefill path: the training's causal attention over ``idx``, one
        row of ``idx`` filling every row of the cache.

        Raises:
            ValueError: T larger than ``cfg.seq_len``; with a cache, an int ``pos`` with ``pos + T``
                beyond the cache, or a batch other than the cache's (or 1 at ``pos=0``); a non-zero
                ``pos`` without a cache.
        """
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than ModelConfig.seq_len={self.cfg.seq_len}")
        if cache is None:
            if not (isinstance(pos, int) and pos == 0):
                raise ValueError(f"LM.forward: pos={pos!r} needs a cache (positions are offsets into a KVCache)")
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
            layer_caches: list[Optional[LayerCache]] = [None] * len(self.blocks)
        else:
            cos, sin, layer_caches = self._cache_step(idx, cache, pos)
        weights: Optional[list[Tensor]] = [] if return_routing else None
        x = self.embed(idx)
        history = None
        decoding = cache is not None and not (isinstance(pos, int) and pos == 0) and not return_routing and not torch.is_grad_enabled()
        if self.cfg.routed:
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            if decoding:  # one buffer for the depth history, one fused route + norm op per site
                history = DecodeHistory(x.to(dtype), self.cfg.block_size, 2 * self.cfg.n_layer, self.routing_sites())
            else:
                # On the fused kernels routing takes the two-phase path (one pass over the complete
                # sources per block, or per group of sites in full routing); the reference path
                # and probes route site by site.
                two_phase = not return_routing and resolve_backend(x) == "triton"
                history = DepthHistory(x.to(dtype), self.cfg.block_size, self.routing_sites(), two_phase)
        h = None if self.cfg.residual == "attnres" else x
        if self.cfg.residual == "hyper":  # the hyper hidden matrix H^0: n copies of the embedding [B, T, n, d]
            h = x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.hc_rate, x.shape[-1])
        for block, layer_cache in zip(self.blocks, layer_caches):
            h = block(h, history, cos, sin, weights) if layer_cache is None else block(h, history, cos, sin, weights, layer_cache)
        if self.final_site is not None and weights is None:
            if h is not None:
                h = history.track_stream(h)
            if self.activation_checkpointing and cache is None and torch.is_grad_enabled():
                return self.lm_head(checkpoint(history.snapshot().route_norm, self.final_site, self.norm, h, use_reentrant=False))
            return self.lm_head(history.route_norm(self.final_site, self.norm, h))
        if self.final_site is not None:
            h = route(self.final_site, history, h, weights)
        if self.cfg.residual == "hyper":  # Hyper-Connections merge the copies by their sum
            h = h.sum(-2)
        logits = self.lm_head(self.norm(h))
        return (logits, weights) if return_routing else logits

    @property
    def activation_checkpointing(self) -> bool:
        """Whether training forwards recompute every sublayer in the backward pass (see the class docstring); settable."""
        return self.blocks[0].activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"LM.activation_checkpointing={enabled!r} must be true or false")
        for block in self.blocks:
            block.activation_checkpointing = enabled

    def compile_for_training(self, layout: str = "auto", **compile_kwargs) -> str:
        """``torch.compile`` the model in place for training and return the layout used.

        ``layout``: ``"sublayers"`` (:meth:`compile_sublayers`), ``"model"`` (the whole model as one
        graph, ``nn.Module.compile``; routing through the kernels' ``torch.library`` custom op), or
        ``"auto"``: the whole model where nothing is routed (prenorm, Hyper-Connections), the
        sublayers where depth routing is, so that routing runs eagerly on the fused kernels with
        their eager-only savings (compiled whole, Delta block saves the float32 stream of every
        sublayer through the custom op; docs/benchmarks/history, twenty-second set, has the
        measurements). State-dict keys are unchanged.

        Raises:
            ValueError: an unknown ``layout`` (valid: ``COMPILE_LAYOUTS``).
        """
        if layout not in COMPILE_LAYOUTS:
            raise ValueError(f"LM.compile_for_training: layout={layout!r}; valid: {list(COMPILE_LAYOUTS)}")
        if layout == "auto":
            layout = "sublayers" if self.cfg.routed else "model"
        if layout == "model":
            self.compile(**compile_kwargs)
        else:
            self.compile_sublayers(**compile_kwargs)
        return layout

    def compile_sublayers(self, **compile_kwargs) -> None:
        """``torch.compile`` every sublayer and norm module by module, in place (``nn.Module.compile``).

        Attention, MLP and their pre-norms of every block and the final norm are compiled; layers
        of one shape share one compilation. Depth routing, the depth history and the residual
        stream's additions stay eager, so the routing runs on the fused Triton kernels with the
        eager-only savings (:class:`lit_mhar.kernels.GradientSink`, the Delta form's replayed
        stream, the merges' saved routed value) that a compile of the whole model, which routes
        through the ``torch.library`` custom op, leaves out.
        State-dict keys are unchanged. ``compile_kwargs`` go to ``nn.Module.compile``.
        """
        for block in self.blocks:
            for m in (block.attn_norm, block.attn, block.mlp_norm, block.mlp):
                m.compile(**compile_kwargs)
        self.norm.compile(**compile_kwargs)

    def new_cache(self, batch_size: int, max_len: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> KVCache:
        """An empty :class:`KVCache` on the model's device: ``max_len`` positions (default ``seq_len``),
        in ``dtype`` (default the model's parameter dtype)."""
        p = self.embed.weight
        return KVCache(self.cfg, batch_size, self.cfg.seq_len if max_len is None else max_len, p.device, dtype or p.dtype)

    def _cache_step(self, idx: Tensor, cache: KVCache, pos: int | Tensor) -> tuple[Tensor, Tensor, list[LayerCache]]:
        """RoPE angles and per-layer cache views for tokens ``idx`` at positions ``pos .. pos + T - 1``."""
        B, T = idx.shape
        if isinstance(pos, Tensor):
            positions = pos.reshape(()) + torch.arange(T, device=idx.device)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0 or pos + T > cache.max_len:
                raise ValueError(f"LM.forward: pos={pos!r} with {T} tokens must satisfy 0 <= pos and pos + T <= {cache.max_len} (the cache's max_len)")
            positions = None if pos == 0 else torch.arange(pos, pos + T, device=idx.device)
            cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        if B != cache.batch_size and not (positions is None and B == 1):
            raise ValueError(f"LM.forward: batch of {B} rows, the cache has {cache.batch_size} (a prefill at pos=0 may also have 1)")
        mask = None
        if positions is not None:  # [G * T, L], additive: built once per call, shared by every layer
            visible = torch.arange(cache.max_len, device=idx.device) <= positions[:, None]
            mask = torch.zeros(visible.shape, dtype=cache.k[0].dtype, device=idx.device).masked_fill_(~visible, -math.inf)
            mask = mask.repeat(self.cfg.n_head // self.cfg.n_kv_head, 1)
        return cos, sin, [LayerCache(k, v, positions, mask) for k, v in zip(cache.k, cache.v)]

    def routing_sites(self) -> list[RoutingSite]:
        """Routing sites in depth order: site ``l`` before sublayer ``l`` (attention 2i, MLP 2i+1), then the final one."""
        if not self.cfg.routed:
            return []
        return [s for b in self.blocks for s in (b.attn_site, b.mlp_site)] + [self.final_site]

    def routing_parameters(self) -> list[nn.Parameter]:
        """The depth-wiring parameters: pseudo-queries, key-norm gains and output gates of every routing
        site, and every hyper-connection's weights (LitLM trains them without weight decay, which
        would pull ``A_r = I`` and ``B = 1`` towards zero)."""
        return [p for m in self.modules() if isinstance(m, (RoutingSite, HyperConnection)) for p in m.parameters()]

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameter count; the embedding table (a lookup, no matmul FLOPs) excluded by default."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for MFU.

        ``6 * N + 6 * L * n_head * head_dim * T``: 6 FLOPs per matmul parameter (N without the
        embedding, with the LM head), plus causal attention scores and values (forward
        ``2 * 2 * d_attn * T/2`` per layer per token, times 3 for backward). Routing and
        elementwise work are not counted as model FLOPs.
        """
        cfg = self.cfg
        return 6.0 * self.num_params() + 6.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
