"""Whether Delta block routing's stream replay (``DepthHistory(replay_stream=True)``, the default)
gives gradients bit-identical to the saved stream on the GPU, by head-width layout.

A Delta MHAR model (5 layers, blocks of 3, H = 4) on the Triton path: per-parameter gradients with
the replay twice (run to run) and without it, at d = 48 (head width 12: two column tiles of 8 and 4
lanes) under bf16 autocast and in float32, and at d = 32 (head width 8); and at d = 32 with a float32 output at sublayer 3 (a float32 block sum:
phase one's prior is float32 in the blocks after it), with the stream replayed per block
(``REPLAY_SPAN_MAX_OUTPUTS = 0``) and over spans of two (3). Prints, per case, how many gradients differ and
the largest differences (absolute, with the gradient's largest magnitude). Needs CUDA. Run from
outside the repository root with the package installed:

    python benchmarks/replay_rounding.py
"""
from __future__ import annotations

import functools
import sys
from unittest import mock

import torch

from lit_mhar import LM, ModelConfig, routing
from lit_mhar import model as model_module
from lit_mhar.kernels import use_backend


def model_of(d_model: int, block_size: int = 3) -> LM:
    """The tests' Delta model: random pseudo-queries, key gains and gates (routing not uniform)."""
    cfg = ModelConfig.from_name("debug", residual="delta", heads=4, block_size=block_size, d_model=d_model, n_layer=5,
                                n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=16)
    torch.manual_seed(0)
    model = LM(cfg)
    g = torch.Generator().manual_seed(0)
    for site in model.routing_sites():
        site.query.data = torch.randn(site.query.shape, generator=g)
        site.key_gain.data = 1 + 0.5 * torch.randn(site.key_gain.shape, generator=g)
        site.gate.data = torch.randn(site.gate.shape, generator=g)
    return model.cuda()


def loss_and_grads(model: LM, idx: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    with use_backend("triton"), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    if not torch.cuda.is_available():
        print("replay_rounding.py needs CUDA", file=sys.stderr)
        return 2
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(8)).cuda()
    cases = [(48, True, 3, False), (32, True, 3, False), (48, False, 3, False), (32, True, 0, True), (32, True, 3, True)]
    for d_model, autocast, span, float32_output in cases:
        routing.REPLAY_SPAN_MAX_OUTPUTS = span
        model = model_of(d_model)
        if float32_output:
            model.blocks[1].mlp.register_forward_hook(lambda module, args, out: out.float())
        runs = {}
        for key, replay in (("on", True), ("on2", True), ("off", False)):
            with mock.patch.object(model_module, "DepthHistory", functools.partial(routing.DepthHistory, replay_stream=replay)):
                runs[key] = loss_and_grads(model, idx, autocast)
        for a, b in (("on", "on2"), ("on", "off")):
            diffs = [(n, (runs[a][1][n] - runs[b][1][n]).abs().max().item(), runs[b][1][n].abs().max().item()) for n in runs[b][1]]
            bad = [x for x in diffs if x[1] > 0]
            print(f"d={d_model} autocast={autocast} span_max_outputs={span} float32_output={float32_output} {a} vs {b}: "
                  f"loss equal {torch.equal(runs[a][0], runs[b][0])}; "
                  f"{len(bad)} of {len(diffs)} grads differ", bad[:6])
    routing.REPLAY_SPAN_MAX_OUTPUTS = 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
