"""How much memory a training step needs, estimated before any work, against what the device has free."""

from __future__ import annotations

import os
from typing import Optional

import torch

from lit_mhar.config import ModelConfig

# Elements saved for the backward pass per token, measured on the eager CPU path (float32) with
# torch.autograd.graph.saved_tensors_hooks over the variants and shapes of the debug preset:
# per layer 8 d + 4 ffn + 2 (q + k + v widths); the logits and their gradient, 2 V; every routing
# site about 3 d per source it reads; Hyper-Connections about 9 d per stream copy and layer.
_PER_LAYER_D, _PER_LAYER_FFN, _PER_QKV = 8, 4, 2
_PER_SOURCE, _PER_HYPER_COPY = 3.1, 9
_OPTIMIZER_BYTES_PER_PARAM = 16  # float32 weight, gradient and AdamW's two moments


def activation_elements_per_token(cfg: ModelConfig, activation_checkpointing: bool = False) -> float:
    """Elements the training step keeps per token for its backward pass (eager PyTorch), at its peak.

    With ``activation_checkpointing`` only each layer's input and the depth history stay, plus one
    layer recomputed at a time.
    """
    d, L = cfg.d_model, cfg.n_layer
    layer = _PER_LAYER_D * d + _PER_LAYER_FFN * cfg.ffn_dim + _PER_QKV * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    routing = _PER_SOURCE * d * sum(cfg.n_sources(site) for site in range(2 * L + 1)) if cfg.routed else 0.0
    hyper = _PER_HYPER_COPY * cfg.hc_rate * d * L if cfg.residual == "hyper" else 0.0
    layers = (2 * d * L + layer) if activation_checkpointing else layer * L
    return 2 * cfg.vocab_size + layers + routing + hyper


def training_bytes(cfg: ModelConfig, batch_size: int, mixed_precision: bool = False, activation_checkpointing: bool = False) -> int:
    """Estimated peak bytes of one training step of ``batch_size`` sequences of ``cfg.seq_len`` tokens
    on one device: the activations (:func:`activation_elements_per_token`; 2 bytes each under 16-bit
    mixed precision, else 4) and float32 weights, gradients and AdamW state. It is the eager path's;
    the fused GPU kernels and compiled models keep less, so on a GPU it is an upper bound."""
    params = _count_parameters(cfg)
    per_token = activation_elements_per_token(cfg, activation_checkpointing) * (2 if mixed_precision else 4)
    return int(batch_size * cfg.seq_len * per_token + params * _OPTIMIZER_BYTES_PER_PARAM)


def _count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the LM of ``cfg``, counted without building it."""
    from lit_mhar.model import LM

    with torch.device("meta"):
        return sum(p.numel() for p in LM(cfg).parameters())


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory free for a new run on ``device``: a CUDA device's free memory, or the host's available
    RAM (``MemAvailable``, Linux) for the CPU; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
