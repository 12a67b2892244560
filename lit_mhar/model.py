"""A Qwen3-style decoder whose sublayers are wired across depth by one of the residual variants.

Token embedding, RoPE, grouped-query attention with QK-RMSNorm through
``scaled_dot_product_attention`` (causal), SwiGLU MLP, RMSNorm, untied LM head.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_mhar.config import ModelConfig
from lit_mhar.kernels import resolve_backend
from lit_mhar.routing import DepthHistory, RoutingSite


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


class Attention(nn.Module):
    """Causal grouped-query self-attention with QK-RMSNorm (unless ``cfg.qk_norm`` is False) and RoPE. ``[B, T, d] -> [B, T, d]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # QK-RMSNorm (Qwen3); Llama-style attention has none (cfg.qk_norm = False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_head != self.n_kv_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


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
    """

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.residual = cfg.residual
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        if cfg.routed:
            additive = cfg.residual == "delta"
            self.attn_site = RoutingSite(cfg.d_model, cfg.heads, additive, cfg.norm_eps)
            self.mlp_site = RoutingSite(cfg.d_model, cfg.heads, additive, cfg.norm_eps)
        else:
            self.attn_site = self.mlp_site = None

    def forward(
        self,
        h: Optional[Tensor],
        history: Optional[DepthHistory],
        cos: Tensor,
        sin: Tensor,
        weights: Optional[list[Tensor]] = None,
    ) -> Optional[Tensor]:
        """Run both sublayers. ``h`` is the residual stream ``[B, T, d]`` (None for attnres, which
        has none); ``history`` collects sublayer outputs; routing weights are appended to
        ``weights`` when it is a list."""
        sublayers = ((self.attn_norm, self.attn_site, lambda x: self.attn(x, cos, sin)), (self.mlp_norm, self.mlp_site, self.mlp))
        for j, (norm, site, fn) in enumerate(sublayers):
            x = h if site is None else route(site, history, h, weights)
            out = fn(norm(x))
            if h is not None:
                h = h + out
            if history is not None:
                history.append(out, 2 * self.index + j)
        return h


def route(site: RoutingSite, history: DepthHistory, stream: Optional[Tensor], weights: Optional[list[Tensor]]) -> Tensor:
    """Route ``history`` into ``site`` and keep its routing weights when ``weights`` is a list."""
    if weights is None:
        return history.route(site, stream)
    out, w = history.route(site, stream, return_weights=True)
    weights.append(w)
    return out


class LM(nn.Module):
    """Decoder-only language model over token ids ``[B, T]`` (int64) giving logits ``[B, T, V]``.

    Args:
        cfg: the validated :class:`ModelConfig`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.final_site = RoutingSite(cfg.d_model, cfg.heads, cfg.residual == "delta", cfg.norm_eps) if cfg.routed else None
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; output projections scaled by 1/sqrt(2L); norms at 1; routing at its zero init."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=std)
        for m in self.modules():
            if isinstance(m, (nn.RMSNorm, RoutingSite)):
                m.reset_parameters()

    def forward(self, idx: Tensor, return_routing: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits ``[B, T, V]`` for token ids ``idx`` ``[B, T]``.

        With ``return_routing``, also the routing weights of every site in depth order (2L + 1
        sites, the last before the LM head), each ``[N_l, B, T, H]`` float32.

        Raises:
            ValueError: T larger than ``cfg.seq_len``.
        """
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than ModelConfig.seq_len={self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        weights: Optional[list[Tensor]] = [] if return_routing else None
        x = self.embed(idx)
        history = None
        if self.cfg.routed:
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            # Block routing on the fused kernels takes the two-phase path (one pass over the
            # completed blocks per block); the reference path and probes route site by site.
            two_phase = self.cfg.block_size > 1 and not return_routing and resolve_backend(x) == "triton"
            history = DepthHistory(x.to(dtype), self.cfg.block_size, self.routing_sites(), two_phase)
        h = None if self.cfg.residual == "attnres" else x
        for block in self.blocks:
            h = block(h, history, cos, sin, weights)
        if self.final_site is not None:
            h = route(self.final_site, history, h, weights)
        logits = self.lm_head(self.norm(h))
        return (logits, weights) if return_routing else logits

    def routing_sites(self) -> list[RoutingSite]:
        """Routing sites in depth order: site ``l`` before sublayer ``l`` (attention 2i, MLP 2i+1), then the final one."""
        if not self.cfg.routed:
            return []
        return [s for b in self.blocks for s in (b.attn_site, b.mlp_site)] + [self.final_site]

    def routing_parameters(self) -> list[nn.Parameter]:
        """Pseudo-queries, key-norm gains and output gates of every routing site."""
        return [p for m in self.modules() if isinstance(m, RoutingSite) for p in m.parameters()]

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
