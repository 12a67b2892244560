"""Numerics of the routing kernels' bf16 paths against float32, on one GPU.

For each variant, from the same weights and tokens, one forward and backward (no optimiser step):
bf16 autocast with the defaults (each site's merge fused with the next RMSNorm, a gradient sink),
bf16 autocast with the merge and the norm module as two ops (unfused: the norms made plain
modules, which the depth history does not fuse), bf16 autocast with autograd summing the source
gradients (``DepthHistory(sink=False)``), and float32 without autocast (the defaults; the kernels' float32
arithmetic). Prints, for each bf16 path, the loss difference from float32 and the relative L2
error of all parameter gradients concatenated (and of the routing parameters' alone) against
float32. The defaults should be no further from float32 than the alternatives; ``prenorm`` gives
the baseline's own bf16 error.

    python benchmarks/check_fused_norm.py --scale 350m --variants mhar-block8-H8,delta-block8-H8 --batch 4

``BENCH_DEVICE=cpu`` runs it on the debug scale in Triton's interpreter (a dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import DEVICE, SCALES, VARIANTS  # noqa: E402  (one table of scales and variants)

from lit_mhar import LM, ModelConfig, routing  # noqa: E402
from lit_mhar import model as model_module  # noqa: E402
from lit_mhar.kernels import use_backend  # noqa: E402


class PlainRMSNorm(torch.nn.Module):
    """``nn.RMSNorm``'s forward in a module that is not an ``nn.RMSNorm``: the depth history then
    runs each site's merge and this norm as two ops."""

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)


@contextlib.contextmanager
def routed(model: LM, fused: bool, sink: bool):
    """``model`` with its routing sites' merges fused with the next RMSNorm or not, its depth
    histories summing source gradients in a sink or not, for the duration."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm) and m.weight is not None]
    history = functools.partial(routing.DepthHistory, sink=sink)
    try:
        for norm in norms:
            norm.__class__ = torch.nn.RMSNorm if fused else PlainRMSNorm
        with mock.patch.object(model_module, "DepthHistory", history):
            yield
    finally:
        for norm in norms:
            norm.__class__ = torch.nn.RMSNorm


def gradients(model: LM, x: torch.Tensor, y: torch.Tensor, autocast: bool, fused: bool, sink: bool = True) -> tuple[float, dict]:
    """``(loss, {name: float64 gradient})`` of one forward and backward."""
    with routed(model, fused, sink):
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
    return loss.item(), {n: p.grad.double().flatten() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: dict, b: dict, names) -> float:
    if not names:
        return float("nan")  # (prenorm: no routing parameters)
    x, r = torch.cat([a[n] for n in names]), torch.cat([b[n] for n in names])
    return ((x - r).norm() / r.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="350m", choices=[s for s in SCALES if s != "debug"])
    ap.add_argument("--variants", default="mhar-block8-H8,delta-block8-H8", help=f"comma-separated, from {sorted(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; valid: {sorted(VARIANTS)}")
    scale = args.scale if DEVICE == "cuda" else "debug"
    seq, layers = SCALES[scale][1], SCALES[scale][2]
    batch = args.batch if DEVICE == "cuda" else 1
    for name in names:
        kw = dict(VARIANTS[name])
        if kw.get("block_size") == "8blocks":
            kw["block_size"] = 2 * layers // 8
        cfg = ModelConfig.from_name(scale, **kw)
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = LM(cfg)
        g = torch.Generator().manual_seed(0)
        for site in model.routing_sites():  # non-uniform routing (scores of about unit spread per head), open gates
            site.query.data.copy_(torch.randn(site.query.shape, generator=g) * (site.heads / cfg.d_model) ** 0.5)
            if site.gate is not None:
                site.gate.data.copy_(torch.randn(site.gate.shape, generator=g) * 0.5)
        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(DEVICE)
        x, y = idx[:, :-1], idx[:, 1:]
        with use_backend("triton"):
            loss32, g32 = gradients(model, x, y, autocast=False, fused=True)
            loss_f, g_f = gradients(model, x, y, autocast=True, fused=True)
            loss_u, g_u = gradients(model, x, y, autocast=True, fused=False)
            loss_n, g_n = gradients(model, x, y, autocast=True, fused=True, sink=False)
        routed = [n for n in g32 if "site" in n]
        print(
            f"{scale} {name}: loss float32 {loss32:.6f}; bf16 default {loss_f - loss32:+.2e}, unfused {loss_u - loss32:+.2e}, "
            f"no sink {loss_n - loss32:+.2e}; gradients vs float32: default {rel(g_f, g32, g32):.3e}, unfused {rel(g_u, g32, g32):.3e}, "
            f"no sink {rel(g_n, g32, g32):.3e}; routing parameters: default {rel(g_f, g32, routed):.3e}, "
            f"unfused {rel(g_u, g32, routed):.3e}, no sink {rel(g_n, g32, routed):.3e}",
            flush=True,
        )
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
