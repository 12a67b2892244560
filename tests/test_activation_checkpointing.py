"""Activation checkpointing (``LM(cfg, activation_checkpointing=True)``): same gradients, fewer saved bytes.

Gradients are compared in float64 on the reference routing op and, for the fused kernels, in float32
in Triton's interpreter (recomputation must be deterministic there too). Memory is measured by
what a training forward leaves alive for the backward pass: every tensor storage an operator
created during the forward (a ``TorchDispatchMode`` records it) that has not been freed when the
loss is returned, whoever holds it (autograd's saved tensors, the checkpoint's inputs, the depth
history). Without a GPU this is the measure of activation memory; on a GPU,
``benchmarks/bench_checkpointing.py`` measures peak memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lit_mhar import LM
from lit_mhar.kernels import use_backend
from lit_mhar.module import LitLM

from test_model import randomize_routing, tiny, tokens

VARIANTS = [  # (residual, heads H, block size S)
    ("prenorm", 1, 1),
    ("attnres", 1, 1),  # full AttnRes
    ("attnres", 4, 1),  # full MHAR
    ("attnres", 1, 2),  # Block AttnRes
    ("attnres", 4, 3),  # Block MHAR, blocks that straddle layers, a shorter last block
    ("delta", 1, 1),  # full Delta
    ("delta", 2, 2),  # Delta block
    ("hyper", 1, 1),  # Hyper-Connections (n = 4, dynamic)
]
IDS = [f"{r}-H{h}-S{s}" for r, h, s in VARIANTS]


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the ``with`` block that are still alive (``live()``).

    Storages of ``exclude`` (parameters, buffers, inputs) do not count, nor do views of them.
    """

    def __init__(self, exclude=()) -> None:
        super().__init__()
        self._exclude = {t.untyped_storage()._cdata for t in exclude}
        self._created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self._exclude:
                    self._created.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def live(self) -> int:
        return sum(n for ref, n in self._created.values() if not ref.expired())


def model_and_batch(residual, heads, block_size, checkpointing, dtype=torch.float64, **shape):
    cfg = tiny(residual, heads=heads, block_size=block_size, **shape)
    torch.manual_seed(0)
    model = LM(cfg, activation_checkpointing=checkpointing).to(dtype)
    randomize_routing(model)
    return model, tokens(cfg)


def loss_of(model, idx):
    return F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def loss_and_grads(model, idx):
    loss = loss_of(model, idx)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("residual,heads,block_size", VARIANTS, ids=IDS)
def test_checkpointing_gives_the_gradients_of_the_plain_backward(residual, heads, block_size):
    loss, grads = loss_and_grads(*model_and_batch(residual, heads, block_size, False))
    loss_ckpt, grads_ckpt = loss_and_grads(*model_and_batch(residual, heads, block_size, True))
    assert loss_ckpt == loss
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-12, atol=1e-14, msg=name)
    routing = [n for n in grads if n.endswith((".query", ".key_gain", ".gate")) and grads[n].abs().sum() > 0]
    assert bool(routing) == (residual in ("attnres", "delta"))  # the routing parameters' gradients were compared too
    assert all(grads[n].abs().sum() > 0 for n in grads if "_hc." in n) and (residual == "hyper") == any("_hc." in n for n in grads)


@pytest.mark.parametrize(
    "residual,heads,block_size,n_layer",
    [("attnres", 2, 3, 3), ("delta", 2, 1, 3), ("delta", 2, 3, 3), ("attnres", 2, 1, 6), ("delta", 2, 1, 4)],
    ids=["block-mhar-two-phase", "delta-full", "delta-block-fused-norm", "full-mhar-13-sites", "delta-full-9-sites"],
)
def test_checkpointing_on_the_fused_kernels_recomputes_them_exactly(residual, heads, block_size, n_layer):
    """Two-phase routing's phase one runs outside the recomputed region; everything matches bit for
    bit. The final site joins the group before it (JOIN_FINAL_SITE_MAX_SITES) in blocks of 3 over 6
    sublayers and in full routing over 13 (groups of 12) and 9 sites (Delta's groups of 8)."""
    with use_backend("triton"):  # Triton's interpreter on CPU, the compiled kernels on a GPU
        loss, grads = loss_and_grads(*model_and_batch(residual, heads, block_size, False, torch.float32, n_layer=n_layer))
        loss_ckpt, grads_ckpt = loss_and_grads(*model_and_batch(residual, heads, block_size, True, torch.float32, n_layer=n_layer))
    assert loss_ckpt == loss and grads_ckpt.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_ckpt[name], grads[name]), name


@pytest.mark.parametrize("residual,heads,block_size", [VARIANTS[i] for i in (0, 2, 4, 6)], ids=[IDS[i] for i in (0, 2, 4, 6)])
def test_checkpointing_keeps_only_the_streams_and_the_depth_history(residual, heads, block_size):
    shape = dict(n_layer=6, d_model=64, ffn_dim=256, n_head=4, n_kv_head=2)
    live = {}
    for checkpointing in (False, True):
        model, idx = model_and_batch(residual, heads, block_size, checkpointing, **shape)
        with LiveBytes([*model.parameters(), *model.buffers(), idx]) as counter:
            loss = loss_of(model, idx)
        live[checkpointing] = counter.live()
        loss.backward()  # the recomputation works after the counter is gone
    cfg = model.cfg
    B, T = idx.shape
    stream = B * T * cfg.d_model * 8  # one [B, T, d] float64 tensor
    sublayers = cfg.n_sublayers
    # what must stay: the embedding and one source per sublayer (raw outputs; with blocks, the
    # partial block and the block sums) and, with a residual stream, the stream before each sublayer
    kept = {"prenorm": 1 + sublayers, "attnres": 1 + sublayers, "delta": 1 + 2 * sublayers}[residual]
    head = 2 * B * T * cfg.vocab_size * 8 + 3 * stream  # logits, log-softmax, final norm in and out
    assert kept * stream <= live[True] <= kept * stream + head + stream, (live, kept * stream)
    assert live[True] < 0.2 * live[False], live  # without checkpointing: every intermediate of every sublayer


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_checkpointing_hyper_connections_keeps_only_the_n_copies_before_each_sublayer(dynamic):
    shape = dict(n_layer=6, d_model=64, ffn_dim=256, n_head=4, n_kv_head=2, hc_rate=3, hc_dynamic=dynamic)
    live = {}
    for checkpointing in (False, True):
        model, idx = model_and_batch("hyper", 1, 1, checkpointing, **shape)
        with LiveBytes([*model.parameters(), *model.buffers(), idx]) as counter:
            loss = loss_of(model, idx)
        live[checkpointing] = counter.live()
        loss.backward()
    cfg = model.cfg
    B, T = idx.shape
    stream = B * T * cfg.d_model * 8
    kept = 1 + cfg.hc_rate * cfg.n_sublayers  # the embedding and the n copies before each sublayer
    head = 2 * B * T * cfg.vocab_size * 8 + 3 * stream
    assert kept * stream <= live[True] <= kept * stream + head + cfg.hc_rate * stream, (live, kept * stream)
    assert live[True] < 0.3 * live[False], live


def test_no_grad_and_routing_weights_take_the_plain_path_with_the_same_result():
    model, idx = model_and_batch("attnres", 4, 3, True)
    plain, _ = model_and_batch("attnres", 4, 3, False)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), plain(idx), rtol=0, atol=0)
        logits, weights = model(idx, return_routing=True)
    assert len(weights) == model.cfg.n_sublayers + 1
    torch.testing.assert_close(logits, plain(idx), rtol=0, atol=0)


def test_litlm_switch_reaches_the_model_and_checkpoints_load_without_it():
    from lit_mhar import ModelConfig

    cfg = ModelConfig.from_name("debug", residual="delta", heads=2, vocab_size=64, seq_len=16)
    lit = LitLM(cfg, activation_checkpointing=True)
    assert lit.model.activation_checkpointing and all(b.activation_checkpointing for b in lit.model.blocks)
    assert list(lit.state_dict()) == list(LitLM(cfg).state_dict())  # a training setting, no weights
    with pytest.raises(ValueError, match="activation_checkpointing='yes' must be true or false"):
        lit.model.activation_checkpointing = "yes"
