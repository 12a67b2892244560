"""Activation checkpointing: memory and step time of every residual variant with and without it.

For each variant, one process, the same weights and batch: a training step (bf16 autocast on a
GPU, float32 on CPU) without checkpointing, then with ``LM.activation_checkpointing = True``.
Reported per variant and mode:

- ``activations_GiB``: memory the forward leaves allocated for the backward (allocated after the
  forward minus before it; on CPU, the bytes of the tensors created by the forward still alive,
  counted by a dispatch mode, as tests/test_activation_checkpointing.py does);
- ``peak_GiB``: ``torch.cuda.max_memory_allocated`` over forward + backward (GPU only), weights,
  gradients and the batch included;
- ``step_ms``: median forward + backward time over ``--steps`` steps (no optimizer);
- the check: loss with checkpointing equal to the loss without, and the relative difference of
  the gradient norms; a mode whose check fails is reported as ``status=mismatch`` with no numbers.

    python benchmarks/bench_checkpointing.py --scale 350m --batch 16 --out results/    # one GPU
    python benchmarks/bench_checkpointing.py --device cpu --scale debug --batch 2 --seq 64 --steps 1   # a dry run
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lit_mhar import LM, ModelConfig

VARIANTS = {  # name -> ModelConfig overrides; "8blocks": S = 2L / 8
    "prenorm": dict(residual="prenorm"),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "delta-full-H8": dict(residual="delta", heads=8, block_size=1),
    "delta-block8-H8": dict(residual="delta", heads=8, block_size="8blocks"),
}
FIELDS = ["scale", "variant", "checkpointing", "batch", "seq", "activations_GiB", "peak_GiB", "step_ms", "activation_ratio",
          "time_ratio", "loss", "grad_norm_rel_diff", "status"]


def live_bytes_counter(exclude):
    """A dispatch mode counting the bytes of storages created under it that are still alive (CPU measure)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.skip = {t.untyped_storage()._cdata for t in exclude}
            self.created = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.skip:
                    s = t.untyped_storage()
                    self.created.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
            return out

        def live(self):
            return sum(n for ref, n in self.created.values() if not ref.expired())

    return Counter()


def measure(model: LM, x: torch.Tensor, y: torch.Tensor, device: str, steps: int) -> dict:
    cuda = device == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def forward():
        with autocast:
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    model.zero_grad(set_to_none=True)
    loss = forward()  # warm-up (and compilation of the Triton kernels)
    loss.backward()
    first_loss = loss.item()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])).item()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = forward()
        torch.cuda.synchronize()
        activations = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        counter = live_bytes_counter([*model.parameters(), *model.buffers(), x, y])
        with counter:
            loss = forward()
        activations, peak = counter.live(), float("nan")
        loss.backward()
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        forward().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(loss=first_loss, grad_norm=grad_norm, activations_GiB=activations / 2**30, peak_GiB=peak / 2**30,
                step_ms=1e3 * statistics.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", default="350m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=None, help="default: the preset's seq_len")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="folder for checkpointing.csv (rows appended)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.variants:
        kw = dict(VARIANTS[name])
        base = ModelConfig.from_name(args.scale)
        if kw.get("block_size") == "8blocks":
            kw["block_size"] = max(1, base.n_sublayers // 8)
        seq = args.seq or base.seq_len
        cfg = ModelConfig.from_name(args.scale, seq_len=seq, **kw)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = LM(cfg)
        gen = torch.Generator(device=args.device).manual_seed(0)
        idx = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), device=args.device, generator=gen)
        x, y = idx[:, :-1], idx[:, 1:]
        results = {}
        for checkpointing in (False, True):
            model.activation_checkpointing = checkpointing
            try:
                results[checkpointing] = measure(model, x, y, args.device, args.steps)
            except torch.cuda.OutOfMemoryError as e:
                results[checkpointing] = dict(status=f"OOM: {str(e)[:80]}")
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        plain, ckpt = results[False], results[True]
        ok = "loss" in plain and "loss" in ckpt
        diff = abs(ckpt["grad_norm"] - plain["grad_norm"]) / plain["grad_norm"] if ok else float("nan")
        # recomputation repeats the same kernels on the same inputs: the loss is identical
        match = ok and ckpt["loss"] == plain["loss"] and diff < 1e-3
        for checkpointing, r in results.items():
            row = dict(scale=args.scale, variant=name, checkpointing=checkpointing, batch=args.batch, seq=seq)
            if "loss" not in r:
                row["status"] = r["status"]
            elif not match:
                row.update(status="mismatch", loss=r["loss"], grad_norm_rel_diff=diff)
            else:
                row.update({k: r[k] for k in ("activations_GiB", "peak_GiB", "step_ms", "loss")}, grad_norm_rel_diff=diff, status="ok")
                row["activation_ratio"] = r["activations_GiB"] / plain["activations_GiB"]
                row["time_ratio"] = r["step_ms"] / plain["step_ms"]
            rows.append(row)
            print(" ".join(f"{k}={row.get(k, '')!s:.12}" for k in FIELDS), flush=True)
        del model
        gc.collect()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "checkpointing.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
