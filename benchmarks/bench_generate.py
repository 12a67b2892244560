"""Inference speed of depth routing: prefill and KV-cached decode of block / full MHAR against prenorm.

One process, one GPU, random weights in bf16 (no autocast), random prompts of ``--prompt-len``
tokens at batch 1 and 32 (``--batches``). Per variant and batch:

- prefill: one forward over the prompts into an empty :class:`lit_mhar.model.KVCache` (the
  training computation: causal attention, the fused routing op, two-phase for blocks; Kimi
  AttnRes, Sec. 4), timed with ``triton.testing.do_bench`` (median); tokens/s = B * P / time;
- decode: greedy, one token per step (``argmax`` inside the step), ``--decode-steps`` steps from
  the prefilled cache. ``eager``: Python launches every kernel; ``graph``: the step captured once
  as a CUDA graph (static shapes: the position is a device tensor, the cache is written in place)
  and replayed, the median of ``GRAPH_PASSES`` passes from the same prefilled cache. Latency = ms
  per step; tokens/s = B / latency;
- with ``--compile``, the same again after ``nn.Module.compile`` of every attention, MLP and
  RMSNorm (as benchmarks/bench_training.py; routing stays the opaque fused op).

Ratios are against prenorm in the same run, same batch and mode: ``decode_latency_ratio`` =
variant ms / prenorm ms (the issue's target: <= 1.05 block MHAR, <= 1.15 full MHAR, CUDA graph),
``prefill_speed_ratio`` = variant tokens/s / prenorm tokens/s.

Correctness, checked in the same run before any speed is reported for a variant: prefill + cached
decode logits against one full forward over the same tokens (float32, same device and kernels,
before the cast to bf16), and graph-replayed logits against eager ones (bf16, same kernels). A
failed check leaves the speed columns empty and says why in ``status``. (The compiled backbone's
graph is checked against its own eager step; the float32 check runs before compilation.)

Rows go to ``$OUT/generate_bench.csv`` as they are measured (every variant uncompiled first), so a
run cut short keeps what it measured; the markdown table is printed and written at the end.

    python benchmarks/bench_generate.py                 # 350m on CUDA, markdown table, CSV to $OUT
    python benchmarks/bench_generate.py --smoke         # tiny model on CPU: checks the script works

Imports torch, triton and lit_mhar's model only.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from lit_mhar.config import ModelConfig
from lit_mhar.model import LM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import settings  # noqa: E402

VARIANTS = {  # name -> ModelConfig overrides; "8blocks": S = 2L / 8
    "prenorm": dict(residual="prenorm"),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    # the same models with the decode path's table entries set otherwise, for side-by-side comparison
    "mhar-full-H8-split": dict(residual="attnres", heads=8, block_size=1),
    "mhar-block8-H8-t1024": dict(residual="attnres", heads=8, block_size="8blocks"),
    "mhar-full-H8-t1024": dict(residual="attnres", heads=8, block_size=1),
}
# variant -> {(module, attribute): value} set while the variant is measured:
# -split: no grouped phase one, every site over its whole depth history (long ones split over programs);
# -t1024: decode tiles of 1024 elements (one slot at d = 1024; the default is 2048).
KNOBS = {
    "mhar-full-H8-split": {("lit_mhar.routing", "DECODE_PREFIX_MIN_SOURCES"): 1 << 30},
    "mhar-block8-H8-t1024": {("lit_mhar.kernels.dispatch", "DECODE_TILE_ELEMENTS"): 1024},
    "mhar-full-H8-t1024": {("lit_mhar.kernels.dispatch", "DECODE_TILE_ELEMENTS"): 1024},
}


def knobs(name: str):
    """Set the variant's :data:`KNOBS` for the duration, then restore them."""
    return settings(KNOBS.get(name, {}))


SMOKE = dict(d_model=64, n_layer=8, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=512, seq_len=128)
FIELDS = [
    "scale", "variant", "heads", "block_size", "backbone", "batch", "prompt_len", "decode_steps", "cache_len",
    "prefill_ms", "prefill_tok_s", "prefill_speed_ratio",
    "decode_eager_ms", "decode_eager_tok_s", "decode_eager_latency_ratio",
    "decode_graph_ms", "decode_graph_tok_s", "decode_latency_ratio",
    "check_vs_full_forward", "check_graph_vs_eager", "status", "note",
]
FULL_TOL = 1e-4  # float32 relative error of cached vs full-forward logits (a position off by one: ~1e-1)
GRAPH_PASSES = 5  # timed passes of --decode-steps graph replays; their median is reported
GRAPH_TOL = 1e-3  # graph replay runs the eager step's kernels: equal up to nondeterminism


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA, wall clock over ``reps`` calls on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        fn()  # compile / autotune outside the timing
        torch.cuda.synchronize(device)
        return do_bench(fn, warmup=5, rep=max(50, 10 * reps), return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(scale: str, overrides: dict, smoke: bool, device: torch.device) -> LM:
    """The variant's model on ``device`` in float32, random weights, random non-zero pseudo-queries."""
    kw = dict(overrides)
    base = ModelConfig.from_name(scale, **(SMOKE if smoke else {}))
    if kw.get("block_size") == "8blocks":
        kw["block_size"] = max(1, base.n_sublayers // 8)
    cfg = ModelConfig.from_name(scale, **(SMOKE if smoke else {}), **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = LM(cfg)
    g = torch.Generator().manual_seed(1)
    for site in model.routing_sites():  # routing away from uniform, so the checks mean something
        site.query.data = (torch.randn(site.query.shape, generator=g) * 2 * (cfg.heads / cfg.d_model) ** 0.5).to(device)
    return model.eval().requires_grad_(False)


class Decoder:
    """Greedy decode steps from a prefilled cache: ``step()`` feeds ``tok`` at ``pos``, writes the
    argmax into ``tok`` and advances ``pos``; every tensor it touches has a fixed address, so the
    step can be captured as a CUDA graph (``capture()``) and replayed (``replay()``)."""

    def __init__(self, model: LM, prompts: torch.Tensor, cache_len: int) -> None:
        self.model = model
        B, P = prompts.shape
        self.cache = model.new_cache(B, max_len=cache_len)
        logits = model(prompts, cache=self.cache, pos=0)[:, -1]
        self.tok = logits.argmax(-1, keepdim=True)
        self.pos = torch.tensor(P, device=prompts.device)
        self.logits = torch.empty_like(logits)
        self.snapshot = ([k.clone() for k in self.cache.k], [v.clone() for v in self.cache.v], self.tok.clone(), self.pos.clone())
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    def step(self) -> torch.Tensor:
        self.logits.copy_(self.model(self.tok, cache=self.cache, pos=self.pos)[:, -1])
        self.tok.copy_(self.logits.argmax(-1, keepdim=True))
        self.pos.add_(1)
        return self.logits

    def reset(self) -> None:
        ks, vs, tok, pos = self.snapshot
        for dst, src in zip(self.cache.k + self.cache.v, ks + vs):
            dst.copy_(src)
        self.tok.copy_(tok)
        self.pos.copy_(pos)

    def capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (Triton compiles, allocator settles) off the capture stream
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        # (the routing ops' offset tables made during the capture keep their pinned host memory,
        # which the captured copies re-read at every replay: lit_mhar.kernels.launch.offsets)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        self.reset()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


def check_against_full_forward(model: LM, vocab: int, device: torch.device, steps: int = 6) -> float:
    """Relative error of prefill + ``steps`` cached decode steps against one full forward (2 rows)."""
    g = torch.Generator(device=device).manual_seed(2)
    idx = torch.randint(0, vocab, (2, 24 + steps), device=device, generator=g)
    cache = model.new_cache(2, max_len=idx.shape[1])
    pieces = [model(idx[:, :24], cache=cache, pos=0)]
    for t in range(24, idx.shape[1]):
        pieces.append(model(idx[:, t : t + 1], cache=cache, pos=torch.tensor(t, device=device)))
    return rel_err(torch.cat(pieces, 1), model(idx))


def measure(model: LM, batches: list[int], P: int, steps: int, device: torch.device, reps: int, graphs: bool, full_err: float) -> list[dict]:
    """Prefill and decode timings of ``model`` at every batch size (see the module docstring);
    ``full_err`` is the variant's :func:`check_against_full_forward` result."""
    cfg = model.cfg
    cache_len = min(cfg.seq_len, math.ceil((P + steps + 8) / 64) * 64)
    rows = []
    for B in batches:
        row = dict(batch=B, prompt_len=P, decode_steps=steps, cache_len=cache_len, check_vs_full_forward=f"{full_err:.2e}")
        rows.append(row)
        if not full_err <= FULL_TOL:
            row.update(status=f"check failed: cached vs full forward {full_err:.2e} > {FULL_TOL}")
            continue
        g = torch.Generator(device=device).manual_seed(3)
        prompts = torch.randint(0, cfg.vocab_size, (B, P), device=device, generator=g)
        cache = model.new_cache(B, max_len=cache_len)
        ms = time_ms(lambda: model(prompts, cache=cache, pos=0), device, reps)
        row.update(prefill_ms=ms, prefill_tok_s=B * P / ms * 1e3)
        del cache

        dec = Decoder(model, prompts, cache_len)
        n_check = 4
        eager_logits = [dec.step().clone() for _ in range(n_check)]
        dec.reset()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step()
        sync(device)
        eager_ms = (time.perf_counter() - t0) * 1e3 / steps
        row.update(decode_eager_ms=eager_ms, decode_eager_tok_s=B / eager_ms * 1e3)
        dec.reset()
        if not graphs:
            row.update(status="ok", note="no CUDA graph on this device")
            del dec
            continue
        try:
            dec.capture()
            graph_logits = [dec.replay().clone() for _ in range(n_check)]
        except Exception as e:  # noqa: BLE001 - capture is what may fail here; report it and keep the eager numbers
            traceback.print_exc()
            row.update(status="graph capture failed", note=repr(e)[:300])
            del dec
            continue
        graph_err = max(rel_err(a, b) for a, b in zip(graph_logits, eager_logits))
        row.update(check_graph_vs_eager=f"{graph_err:.2e}")
        if not graph_err <= GRAPH_TOL:
            row.update(status=f"check failed: graph vs eager {graph_err:.2e} > {GRAPH_TOL}")
            del dec
            continue
        passes = []
        for _ in range(GRAPH_PASSES):  # the median of several passes: a single one moved by up to 2% between runs
            dec.reset()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                dec.graph.replay()
            sync(device)
            passes.append((time.perf_counter() - t0) * 1e3 / steps)
        graph_ms = statistics.median(passes)
        row.update(decode_graph_ms=graph_ms, decode_graph_tok_s=B / graph_ms * 1e3, status="ok")
        del dec
        gc.collect()
    return rows


def fmt(x: object, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else ("" if x is None else str(x))


def markdown(rows: list[dict]) -> str:
    head = ("| variant | backbone | B | prefill tok/s | ×prenorm | decode eager ms/step | ×prenorm | "
            "decode graph ms/step | tok/s | ×prenorm (latency) | check full / graph | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['backbone']} | {r.get('batch', '')} | {fmt(r.get('prefill_tok_s'), ',.0f')} | "
            f"{fmt(r.get('prefill_speed_ratio'), '.3f')} | {fmt(r.get('decode_eager_ms'), '.3f')} | "
            f"{fmt(r.get('decode_eager_latency_ratio'), '.3f')} | {fmt(r.get('decode_graph_ms'), '.3f')} | "
            f"{fmt(r.get('decode_graph_tok_s'), ',.0f')} | {fmt(r.get('decode_latency_ratio'), '.3f')} | "
            f"{r.get('check_vs_full_forward', '')} / {r.get('check_graph_vs_eager', '-')} | {r.get('status', '')} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="350m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10, help="timed prefill repetitions on CPU (CUDA: do_bench)")
    ap.add_argument("--compile", action="store_true", help="also measure with attention/MLP/norms compiled (nn.Module.compile)")
    ap.add_argument("--compile-variants", default=None, help="with --compile: the variants measured compiled too (default: all of --variants)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (8 layers, d=64), short prompts: checks the script runs, on CPU by default")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for generate_bench.csv / .md (default: $OUT; none: print only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if args.smoke:
        args.prompt_len, args.decode_steps, args.reps = min(args.prompt_len, 32), min(args.decode_steps, 8), min(args.reps, 3)
        args.batches = "1,4" if args.batches == "1,32" else args.batches
    seq_len = ModelConfig.from_name(args.scale, **(SMOKE if args.smoke else {})).seq_len
    if args.prompt_len < 1 or args.decode_steps < 1 or args.prompt_len + args.decode_steps + 8 > seq_len:
        print(f"--prompt-len {args.prompt_len} + --decode-steps {args.decode_steps} + 8 must fit the context ({seq_len}), both >= 1", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    graphs = device.type == "cuda"
    torch._dynamo.config.cache_size_limit = 64
    info = f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, dtype {str(dtype).removeprefix('torch.')}"
    print(f"# bench_generate: scale {args.scale}{' (smoke)' if args.smoke else ''}, {info}", flush=True)

    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; valid: {list(VARIANTS)}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    csv_file = writer = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        csv_file = open(os.path.join(args.out, "generate_bench.csv"), "w", newline="")
        writer = csv.DictWriter(csv_file, FIELDS, extrasaction="ignore")
        writer.writeheader()

    def record(row: dict) -> None:
        base = next((r for r in rows if r["variant"] == "prenorm" and r.get("backbone") == row.get("backbone") and r.get("batch") == row.get("batch")), None)
        if base is not None or row["variant"] == "prenorm":
            for value, key in (("prefill_tok_s", "prefill_speed_ratio"), ("decode_eager_ms", "decode_eager_latency_ratio"), ("decode_graph_ms", "decode_latency_ratio")):
                b = row if base is None else base
                if isinstance(row.get(value), float) and isinstance(b.get(value), float):
                    row[key] = row[value] / b[value]
        rows.append(row)
        print({k: fmt(v, ".4g") for k, v in row.items()}, flush=True)
        if writer is not None:  # row by row, so a run cut short still leaves its results
            writer.writerow({k: fmt(v, ".6g") for k, v in row.items()})
            csv_file.flush()

    # every variant without compilation first (eager and CUDA graph), then compiled
    compiled_names = names if args.compile_variants is None else [n for n in names if n in args.compile_variants.split(",")]
    for backbone in ["eager"] + (["compiled"] if args.compile else []):
        for name in (names if backbone == "eager" else compiled_names):
            common = dict(scale=args.scale + ("-smoke" if args.smoke else ""), variant=name, backbone=backbone)
            model = None
            try:
                model = build(args.scale, VARIANTS[name], args.smoke, device)
                common.update(heads=model.cfg.heads, block_size=model.cfg.block_size)
                with torch.no_grad(), knobs(name):
                    full_err = check_against_full_forward(model, model.cfg.vocab_size, device)
                model.to(dtype)
                if backbone == "compiled":
                    model.compile_sublayers()  # the same compilation as the training benchmark
                with torch.no_grad(), knobs(name):
                    for r in measure(model, batches, args.prompt_len, args.decode_steps, device, args.reps, graphs, full_err):
                        record({**common, **r})
            except torch.cuda.OutOfMemoryError:
                record({**common, "status": "OOM"})
            except Exception as e:  # noqa: BLE001 - record and go on with the next variant
                traceback.print_exc()
                record({**common, "status": "error", "note": repr(e)[:300]})
            finally:
                del model
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    table = markdown(rows)
    print("\n" + table)
    if args.out:
        csv_file.close()
        with open(os.path.join(args.out, "generate_bench.md"), "w") as fh:
            fh.write(f"bench_generate: scale {args.scale}, {info}, prompt {args.prompt_len} tokens, {args.decode_steps} decode steps\n\n{table}\n")
        print(f"wrote {args.out}/generate_bench.csv and generate_bench.md")
    bad = [r for r in rows if r.get("status") != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
