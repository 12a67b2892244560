"""Model configuration: one dataclass, named presets, validation that names the bad field."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Optional

Residual = Literal["prenorm", "attnres", "delta", "hyper"]
RESIDUALS: tuple[str, ...] = ("prenorm", "attnres", "delta", "hyper")

# Geometry of the named scales. 100m / 350m / 1b are the shapes of the MHAR paper (Qwen3-style);
# `debug` trains on a CPU in seconds and `20m` is for small GPU runs.
PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(d_model=128, n_layer=4, n_head=4, n_kv_head=2, ffn_dim=384, seq_len=256),
    "20m": dict(d_model=384, n_layer=8, n_head=6, n_kv_head=2, ffn_dim=1024, seq_len=1024),
    "100m": dict(d_model=512, n_layer=12, n_head=8, n_kv_head=4, ffn_dim=1536, seq_len=2048),
    "350m": dict(d_model=1024, n_layer=24, n_head=16, n_kv_head=8, ffn_dim=4096, seq_len=1024),
    "1b": dict(d_model=1280, n_layer=36, n_head=16, n_kv_head=8, ffn_dim=5120, seq_len=1024),
}


@dataclass
class ModelConfig:
    """Shape of a Qwen3-style decoder and how its sublayers are wired across depth.

    Geometry fields left as ``None`` take the value of the preset ``name``; any of them can be
    overridden. ``ModelConfig.from_name("100m", residual="attnres", heads=8)`` is MHAR at 100M.

    Attributes:
        name: Preset the unset geometry fields come from: debug, 20m, 100m, 350m or 1b.
        residual: How sublayers are wired across depth. ``prenorm``: the additive residual
            stream. ``attnres``: each sublayer input is a softmax-weighted sum over the depth
            history (Attention Residuals; MHAR when heads > 1). ``delta``: the residual stream is
            kept and a gated, routed sum of sublayer (or block) deltas is added to it. ``hyper``:
            Hyper-Connections (Zhu et al., arXiv 2409.19606): the residual stream is widened to
            ``hc_rate`` copies, mixed into each sublayer's input and written back by learned width
            and depth connections; a fresh model computes what prenorm computes.
        heads: Routing heads H (MHAR): the pseudo-query is split into H contiguous d/H channel
            slices, each with its own softmax over depth. Must divide d_model. 1 is AttnRes.
        block_size: Sublayers per block S for Block AttnRes / Delta Block. 1 routes over every
            sublayer output (full routing).
        hc_rate: Expansion rate n of ``residual='hyper'``: copies of the residual stream (the
            paper's default is 4; n = 1 with static connections is prenorm with learnable scalars).
        hc_dynamic: ``residual='hyper'`` only: dynamic hyper-connections (DHC, input-dependent,
            tanh-scaled, zero-initialised corrections to the connection weights), else static (SHC).
        vocab_size: Vocabulary size (set from the data by the CLI).
        seq_len: Longest sequence in tokens (set from the data by the CLI).
        d_model: Width d of the residual stream.
        n_layer: Transformer layers L; the model has 2L sublayers (attention, MLP).
        n_head: Attention heads.
        n_kv_head: Key/value heads for grouped-query attention; must divide n_head.
        head_dim: Width of each attention head (even, for RoPE). None: d_model / n_head. Set it
            for models whose heads are not d_model / n_head wide, such as Qwen3-0.6B (d_model
            1024, 16 heads of 128).
        qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3). False for
            Llama-style attention, which has none.
        ffn_dim: Hidden width of the SwiGLU MLP.
        rope_base: RoPE base frequency.
        norm_eps: Epsilon of every RMSNorm, the routing key norm included.
        init_std: Standard deviation of the normal weight initialisation.
    """

    name: str = "debug"
    residual: Residual = "prenorm"
    heads: int = 1
    block_size: int = 1
    hc_rate: int = 4
    hc_dynamic: bool = True
    vocab_size: int = 8192
    seq_len: Optional[int] = None
    d_model: Optional[int] = None
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_kv_head: Optional[int] = None
    head_dim: Optional[int] = None
    ffn_dim: Optional[int] = None
    qk_norm: bool = True
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ValueError(f"ModelConfig.name={self.name!r} is not a preset; valid: {sorted(PRESETS)}")
        for key, value in PRESETS[self.name].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.residual not in RESIDUALS:
            raise ValueError(f"ModelConfig.residual={self.residual!r} is unknown; valid: {list(RESIDUALS)}")
        for key in ("heads", "block_size", "hc_rate", "vocab_size", "seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{key}={value!r} must be an integer >= 1")
        if self.d_model % self.heads:
            raise ValueError(
                f"ModelConfig.heads={self.heads} must divide d_model={self.d_model}; "
                f"valid: {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 64]}"
            )
        derived = self.head_dim is None
        if derived:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"ModelConfig.n_head={self.n_head} must divide d_model={self.d_model} (or set head_dim)"
                )
            self.head_dim = self.d_model // self.n_head
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            source = f" (d_model={self.d_model} / n_head={self.n_head}; change either, or set head_dim)" if derived else ""
            raise ValueError(f"ModelConfig.head_dim={self.head_dim!r}{source} must be an even integer >= 2 (RoPE rotates pairs)")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"ModelConfig.qk_norm={self.qk_norm!r} must be true or false")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.residual in ("prenorm", "hyper") and (self.heads != 1 or self.block_size != 1):
            bad = ", ".join(f"{k}={v}" for k, v in (("heads", self.heads), ("block_size", self.block_size)) if v != 1)
            raise ValueError(
                f"ModelConfig.residual={self.residual!r} has no depth routing, so heads and block_size must be left "
                f"at 1 (got {bad}); use residual='attnres' or 'delta' to route"
            )
        if self.block_size > 2 * self.n_layer:
            raise ValueError(
                f"ModelConfig.block_size={self.block_size} is more than the model's {2 * self.n_layer} sublayers "
                f"(2 x n_layer={self.n_layer}); valid: 1 to {2 * self.n_layer}"
            )
        if not isinstance(self.hc_dynamic, bool):
            raise ValueError(f"ModelConfig.hc_dynamic={self.hc_dynamic!r} must be true or false")
        if self.residual != "hyper":
            for key in ("hc_rate", "hc_dynamic"):
                if getattr(self, key) != _DEFAULTS[key]:
                    raise ValueError(
                        f"ModelConfig.{key}={getattr(self, key)!r} applies to residual='hyper' only; leave it at "
                        f"{_DEFAULTS[key]!r} for residual={self.residual!r}"
                    )
        if self.rope_base <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("ModelConfig.rope_base, norm_eps and init_std must be > 0")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        """The preset ``name`` with ``overrides`` applied (any field). Raises ValueError if invalid."""
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}; valid: {[f.name for f in fields(cls)]}")
        return cls(name=name, **overrides)

    @property
    def n_sublayers(self) -> int:
        """Sublayers (attention and MLP each count one): 2L."""
        return 2 * self.n_layer

    @property
    def routed(self) -> bool:
        """Whether the model has routing sites (attnres, delta); prenorm and hyper have none."""
        return self.residual in ("attnres", "delta")

    def n_sources(self, site: int) -> int:
        """Sources seen by routing site ``site`` (0..2L; 2L is the final site before the LM head).

        The embedding, one per completed block of S sublayers, and the in-progress block's
        partial sum when that block has started. With S = 1 this is ``site + 1``.
        """
        return 1 + site // self.block_size + (1 if site % self.block_size else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ModelConfig)}
