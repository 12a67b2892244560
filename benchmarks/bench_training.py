"""Training throughput and peak memory of every residual variant against prenorm, in one process.

A plain loop over :class:`lit_mhar.model.LM`: bf16 autocast, fused AdamW (0.9, 0.95, wd 0.1),
random tokens, the presets' tokens per step unless ``--batch`` says otherwise. Compiled as
``LitLM(compile=True)`` compiles (``LM.compile_for_training("auto")``): prenorm as one graph, the
routed variants' attention, MLP and pre-norms module by module (one compilation shared by all
layers; knobs ``compile-model`` and ``compile-sublayers`` choose one layout); routing runs through the fused Triton op (two-phase for block routing), which
``torch.compile`` treats as opaque.

MFU = tokens/s x ``LM.flops_per_token(seq_len)`` / peak, with the datasheet's dense bf16 peak
(989 TFLOP/s, H100/H200 SXM) and the bf16 matmul rate measured in the same run.

    python benchmarks/bench_training.py --scale 350m --out results/   # appends CSV rows
    python benchmarks/bench_training.py --scale 350m --variants prenorm,mhar-block8-H8,mhar-block8-H8:fwd1

A variant ``name:knob`` runs with a setting of :data:`KNOBS` (how the step is compiled or captured)
changed, beside the defaults.
``host_ms`` is the host's time to enqueue one step onto an idle GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import importlib
import json
import os
import sys
import time
from unittest import mock

import torch
from triton.testing import do_bench

from lit_mhar import LM, ModelConfig
from lit_mhar.module import graph_training_loss, next_token_loss

DATASHEET_TFLOPS = 989.0
SCALES = {"20m": (64, 1024, 8), "100m": (64, 2048, 12), "350m": (32, 1024, 24), "1b": (32, 1024, 36), "debug": (2, 64, 4)}  # batch, seq, layers
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": a dry run of this script (debug scale, --no-compile)
VARIANTS = {  # name -> ModelConfig overrides (block size from 8 blocks of 2L sublayers)
    "prenorm": dict(residual="prenorm"),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "delta-full-H8": dict(residual="delta", heads=8, block_size=1),
    "delta-block8-H8": dict(residual="delta", heads=8, block_size="8blocks"),
    "hyper-dhc-n4": dict(residual="hyper", hc_rate=4, hc_dynamic=True),  # compiled as one graph, as prenorm (nothing routed)
    # AttnRes (H = 1)
    "attnres-block8": dict(residual="attnres", heads=1, block_size="8blocks"),
    "attnres-full": dict(residual="attnres", heads=1, block_size=1),
}
# How the step runs, against the defaults, same model, side by side: "<variant>:<knob>" (several
# joined by ":"). Each knob is {(module, attribute): value}, set while the variant runs.
# What is compiled, as LitLM(compile=True) does (LM.compile_for_training's "auto"): the whole model
# where nothing is routed, the sublayers module by module where routing is (routing eager).
COMPILE_LAYOUT = "auto"
# With True, the whole training step (forward, backward, clipping, AdamW with capturable=True) is
# captured once as a CUDA graph after the warm-up steps and replayed: the host enqueues one graph
# per step instead of every kernel (knob "cuda-graph"; prenorm needs it too for a fair ratio).
CUDA_GRAPH = False
# With True, forward and backward run as LitLM(cuda_graph=True) runs them: captured as two CUDA
# graphs by lit_mhar.module.graph_training_loss on the first step (autocast without its cache, as
# Lightning's), the clipping and AdamW eager (knob "graphed-loss").
GRAPHED_LOSS = False
KNOBS = {
    "cuda-graph": {(__name__, "CUDA_GRAPH"): True},  # the step captured as one CUDA graph and replayed
    "graphed-loss": {(__name__, "GRAPHED_LOSS"): True},  # forward and backward captured, as LitLM(cuda_graph=True)
    "compile-model": {(__name__, "COMPILE_LAYOUT"): "model"},  # the whole model compiled (LitLM(compile="model")), routing through the custom op
    "compile-sublayers": {(__name__, "COMPILE_LAYOUT"): "sublayers"},  # attention, MLP and norms module by module (LitLM(compile="sublayers"))
}
FIELDS = ["scale", "variant", "batch", "seq", "steps", "tokens_per_s", "ratio_vs_prenorm", "step_ms", "host_ms", "mfu_datasheet", "mfu_measured",
          "peak_mem_GiB", "mem_ratio_vs_prenorm", "loss", "compile_s", "matmul_TFLOPs", "status", "note"]


def split_variant(name: str) -> tuple[dict, list[str]]:
    """``(config overrides, knob names)`` of ``"<variant>[:<knob>...]"``; ValueError names an unknown part."""
    base, *knob_names = name.split(":")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}; valid: {list(VARIANTS)}")
    for k in knob_names:
        if k not in KNOBS:
            raise ValueError(f"unknown knob {k!r} in {name!r}; valid: {list(KNOBS)}")
    if {"cuda-graph", "graphed-loss"} <= set(knob_names):
        raise ValueError(f"{name!r}: cuda-graph (the whole step captured) and graphed-loss (forward and backward captured) exclude each other")
    return VARIANTS[base], knob_names


@contextlib.contextmanager
def settings(values: dict):
    """Set ``{(module, attribute[, key]): value}`` for the duration (a dict entry where a key is
    given), then restore them; the patching is :mod:`unittest.mock`'s (the dispatch table's entries
    through :func:`lit_mhar.kernels.dispatch.overrides`, which also clears the plan's cache)."""
    with contextlib.ExitStack() as stack:
        table = {attr: value for (module, attr, *key), value in values.items() if module == "lit_mhar.kernels.dispatch" and not key}
        if table:
            from lit_mhar.kernels import dispatch

            stack.enter_context(dispatch.overrides(**table))
        for (module, attr, *key), value in values.items():
            if module == "lit_mhar.kernels.dispatch" and not key:
                continue
            mod = importlib.import_module(module)
            if key:
                stack.enter_context(mock.patch.dict(getattr(mod, attr), {key[0]: value}))
            else:
                stack.enter_context(mock.patch.object(mod, attr, value))
        yield


def knobs(names: list[str]):
    """Set the named :data:`KNOBS` for the duration, then restore the defaults."""
    return settings({k: v for name in names for k, v in KNOBS[name].items()})


def matmul_tflops() -> float:
    if DEVICE != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def variant_config(scale, overrides, **fields) -> ModelConfig:
    """The preset ``scale``'s config with a variant's ``overrides`` (``block_size="8blocks"``: 8 blocks
    of the 2L sublayers) and any other ``fields``."""
    kw = dict(overrides)
    if kw.get("block_size") == "8blocks":
        kw["block_size"] = 2 * SCALES[scale][2] // 8
    return ModelConfig.from_name(scale, **kw, **fields)


def training_parts(scale, overrides, batch, seq, compile_):
    """``(model, forward, update)`` of a variant: the LM on the device (with ``compile_``, compiled
    as :data:`COMPILE_LAYOUT` says); ``forward()`` returns the loss (bf16 autocast, cross-entropy on fixed random
    tokens ``[batch, seq]``); ``update()`` clips the gradients and takes a fused AdamW step."""
    cfg = variant_config(scale, overrides)
    torch.manual_seed(0)
    with torch.device(DEVICE):  # initialise on the device: seconds instead of a minute at 1b
        model = LM(cfg)
    if compile_:
        model.compile_for_training(COMPILE_LAYOUT)
    opt = torch.optim.AdamW(
        model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=DEVICE == "cuda", capturable=CUDA_GRAPH and DEVICE == "cuda"
    )
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=DEVICE, generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    captured = []  # graphed-loss: the captured training loss, once the first step came

    def forward():
        if GRAPHED_LOSS and DEVICE == "cuda":
            with torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=False):
                if not captured:
                    captured.append(graph_training_loss(model, x, y))
                return captured[0](x, y)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = model(x)
        return next_token_loss(logits, y)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, forward, update


def training_step(scale, overrides, batch, seq, compile_):
    """``(model, step)``: the variant's LM on the device and a closure running one optimiser step
    (:func:`training_parts`' forward, backward, update) that returns the loss."""
    model, forward, update = training_parts(scale, overrides, batch, seq, compile_)

    def step():
        loss = forward()
        loss.backward()
        update()
        return loss

    if CUDA_GRAPH and DEVICE == "cuda":
        return model, graphed(step)
    return model, step


def graphed(step, warmup: int = 3):
    """``step`` (no arguments, returns a tensor) run ``warmup`` times on a side stream (compilation,
    Triton's autotuning, the optimiser's state), then captured as one CUDA graph; the returned
    closure replays it and returns the captured output tensor (overwritten by each replay). The
    peak memory statistics are reset before the capture, so ``max_memory_allocated`` afterwards is
    the captured step's peak (its activations live in the graph's private pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay():
        graph.replay()
        return out

    replay.graph = graph
    return replay


def run_variant(scale, name, overrides, batch, seq, steps, warmup, compile_):
    if DEVICE == "cuda":  # (not an earlier variant's peak, where the peak is read from the warm-up: graphed-loss)
        torch.cuda.reset_peak_memory_stats()
    model, step = training_step(scale, overrides, batch, seq, compile_)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    t0 = time.time()
    for _ in range(warmup):
        loss = step()
    sync()
    compile_s = time.time() - t0
    # (a captured step's activations live in its graph's pool, allocated once at the capture: a
    # graph's step resets before its capture; with graphed-loss the peak is that of the warm-up
    # steps and the capture, all in the warm-up)
    if DEVICE == "cuda" and not hasattr(step, "graph") and not GRAPHED_LOSS:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
    # host time: one step enqueued onto an idle GPU (synchronised before and after), so the host
    # never waits for the GPU; a host_ms close to step_ms means the step is bound by the host
    host = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - t0)
        sync()
    result = dict(
        step_ms=ms, host_ms=min(host) * 1e3, tokens_per_s=batch * seq / ms * 1e3, peak=peak, loss=loss.item(),
        flops_per_token=model.flops_per_token(seq), compile_s=compile_s,
    )
    del model, step, loss
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # one entry per module class and shape; never fall back to eager
    for name in args.variants.split(","):
        split_variant(name)  # an unknown variant or knob stops here, before any work
    batch, seq, _ = SCALES[args.scale]
    batch = args.batch or batch
    peak_measured = matmul_tflops()
    print(f"bf16 matmul {peak_measured:.0f} TFLOP/s", flush=True)
    path = os.path.join(args.out, "train_bench.csv")
    new = not os.path.exists(path)
    base = None
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        if new:
            writer.writeheader()
        for name in args.variants.split(","):
            row = dict(scale=args.scale, variant=name, batch=batch, seq=seq, steps=args.steps, matmul_TFLOPs=f"{peak_measured:.0f}")
            try:
                overrides, knob_names = split_variant(name)
                with knobs(knob_names):
                    r = run_variant(args.scale, name, overrides, batch, seq, args.steps, args.warmup, not args.no_compile)
                if name == "prenorm":
                    base = r
                flops = r["tokens_per_s"] * r["flops_per_token"]
                row.update(
                    status="ok", tokens_per_s=f"{r['tokens_per_s']:.0f}", step_ms=f"{r['step_ms']:.1f}", host_ms=f"{r['host_ms']:.1f}",
                    mfu_datasheet=f"{flops / DATASHEET_TFLOPS / 1e12:.3f}", mfu_measured=f"{flops / peak_measured / 1e12:.3f}",
                    peak_mem_GiB=f"{r['peak'] / 2**30:.2f}", loss=f"{r['loss']:.4f}", compile_s=f"{r['compile_s']:.0f}",
                )
                if base is not None:
                    row.update(ratio_vs_prenorm=f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}", mem_ratio_vs_prenorm=f"{r['peak'] / max(base['peak'], 1):.3f}")
            except torch.cuda.OutOfMemoryError:
                row.update(status="OOM")
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - record and go on with the next variant
                row.update(status="error", note=repr(e)[:300])
                import traceback

                traceback.print_exc()
            writer.writerow(row)
            fh.flush()
            print(json.dumps(row), flush=True)
    if DEVICE == "cuda":  # the backward kernels' persistent grids, as sized (programs per SM)
        from lit_mhar.kernels import launch

        for key, programs in getattr(launch, "_RESIDENT", {}).items():
            print(f"resident programs per SM: {programs} for {key[0]} {dict(key[2])}", flush=True)
        for key, why in getattr(launch, "_RESIDENT_FALLBACKS", {}).items():
            print(f"resident programs not read for {key[0]}: {why}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
