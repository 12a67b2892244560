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

A variant ``name:knob`` runs with a kernel setting of :data:`KNOBS` changed, beside the defaults.
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
import triton
from triton.testing import do_bench

from lit_mhar import LM, ModelConfig, routing
from lit_mhar.module import graph_training_loss, next_token_loss

FULL_ROUTING_GROUPS = (routing.FULL_ROUTING_GROUP, routing.FULL_ROUTING_GROUP_ADDITIVE)  # the package's (replacement, additive)

DATASHEET_TFLOPS = 989.0
SCALES = {"100m": (64, 2048, 12), "350m": (32, 1024, 24), "1b": (32, 1024, 36), "debug": (2, 64, 4)}  # batch, seq, layers
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": a dry run of this script (debug scale, --no-compile)
VARIANTS = {  # name -> ModelConfig overrides (block size from 8 blocks of 2L sublayers)
    "prenorm": dict(residual="prenorm"),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "delta-full-H8": dict(residual="delta", heads=8, block_size=1),
    "delta-block8-H8": dict(residual="delta", heads=8, block_size="8blocks"),
    # full routing site by site (no two-phase groups): what full routing ran before the groups
    "mhar-full-H8-persite": dict(residual="attnres", heads=8, block_size=1, full_routing_group=1),
    # full routing's phase one in groups of 4, 6, 8, 12 or 16 sites (the package: 12 for MHAR, 8 for Delta)
    "mhar-full-H8-g4": dict(residual="attnres", heads=8, block_size=1, full_routing_group=4),
    "mhar-full-H8-g6": dict(residual="attnres", heads=8, block_size=1, full_routing_group=6),
    "mhar-full-H8-g8": dict(residual="attnres", heads=8, block_size=1, full_routing_group=8),
    "mhar-full-H8-g12": dict(residual="attnres", heads=8, block_size=1, full_routing_group=12),
    "mhar-full-H8-g16": dict(residual="attnres", heads=8, block_size=1, full_routing_group=16),
    "delta-full-H8-persite": dict(residual="delta", heads=8, block_size=1, full_routing_group=1),
    "delta-full-H8-g8": dict(residual="delta", heads=8, block_size=1, full_routing_group=8),
    "delta-full-H8-g12": dict(residual="delta", heads=8, block_size=1, full_routing_group=12),
    "hyper-dhc-n4": dict(residual="hyper", hc_rate=4, hc_dynamic=True),  # compiled as one graph, as prenorm (nothing routed)
    # AttnRes (H = 1)
    "attnres-block8": dict(residual="attnres", heads=1, block_size="8blocks"),
    "attnres-full": dict(residual="attnres", heads=1, block_size=1),
}
# Kernel settings against the defaults, same model, side by side: "<variant>:<knob>" (several
# knobs joined by ":"). Each knob is {(module, attribute[, key]): value}, set while the variant runs.
# Site groups are powers of two dividing a pass's sites (S = 3 / 6 / 9 for block MHAR at 100m /
# 350m / 1b; full routing's groups of 12 for MHAR, 8 for Delta, one more where the final site joins),
# so fwd4, fwd8 and stats4 change nothing where S has no such factor (unless fwd-sites-padded).
TR = "lit_mhar.kernels.triton_routing"
# What is compiled, as LitLM(compile=True) does (LM.compile_for_training's "auto"): the whole model
# where nothing is routed, the sublayers module by module where routing is (routing eager). Before
# the twenty-second set every variant, prenorm included, had its sublayers compiled, which made
# prenorm 4.4% / 5.6% / 8.1-9.1% slower at 1b / 350m / 100m than compiled whole (BENCHMARKS.md).
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
    "compile-sublayers": {(__name__, "COMPILE_LAYOUT"): "sublayers"},  # attention, MLP and norms module by module (LitLM(compile="sublayers"); every variant's before the twenty-second set)
    "custom-op": {(TR, "EAGER_FUNCTION"): False},  # eager calls through the custom op's autograd
    "fwd1": {(TR, "FWD_SITES"): 1},  # one site per forward program
    "fwd4": {(TR, "FWD_SITES"): 4},
    "fwd8": {(TR, "FWD_SITES"): 8},
    "rstd0": {(TR, "SAVE_RSTD"): False},
    "one-source-loop": {(TR, "ONE_SOURCE_MERGE"): False},  # merges over one source run pass two's general loop (reload the source, reduce again; before the twenty-seventh set)
    "no-tile-prefetch": {(TR, "TILE_PREFETCH"): False},  # the replacement form's one-source merges load each tile's inputs when they reach it
    "merge-rstd": {(TR, "SAVE_RSTD_MERGES"): True},  # the merges save each source's key rstd for their backward (not the default: not yet measured)  # the site loop's backward recomputes each source's key rstd
    "stats2": {(TR, "STATS_SITES"): 2},  # two sites per program of the site loop's pass one
    "stats4": {(TR, "STATS_SITES"): 4},
    "bwd4096": {(TR, "TILE_ELEMENTS", "bwd"): 4096, (TR, "ELEMENTS_PER_THREAD", "bwd"): 16},  # the former two-pass tiles (replacement form; the additive form's kind is "bwd_add")
    "bwd1024": {(TR, "TILE_ELEMENTS", "bwd"): 1024},  # two-pass tiles of half the tokens (8 elements per thread: 4 warps; replacement form)
    "bwd1024-8w": {(TR, "TILE_ELEMENTS", "bwd"): 1024, (TR, "WARPS", "bwd"): 8},  # ... one token on 8 warps (4 elements per thread)
    "bwd-2048-8w": {(TR, "TUNED_TILES", ("bwd", 1024, 8)): (2048, 8)},  # the replacement form's merge backward at d = 1024, H = 8 on two tokens of 8 warps (before the twenty-eighth set; the package: one token, 4 warps)
    **{f"bwd512-{e}-{w}w": {(TR, "TUNED_TILES", ("bwd", 512, 8)): (e, w)} for e, w in ((512, 2), (512, 4), (1024, 4), (1024, 2))},  # ... at d = 512 (100m), H = 8 (the package: the rule's 2048 elements on 8 warps)
    "grid32": {(TR, "OCCUPANCY_GRIDS"): frozenset()},  # persistent backward grids of 32 warps per SM, not sized by registers
    "occ-stats": {(TR, "OCCUPANCY_GRIDS"): frozenset({"bwd", "bwd_stats", "fwd_sites_dot", "bwd_stats_dot", "bwd_sources_dot"})},  # the vector pass one sized too
    "vector-stats": {(TR, "DOT_STATS"): False},  # pass one of the site loop on the vector kernel, not tensor cores
    "dot-w4": {(TR, "DOT_WARPS"): 4},  # pass one on tensor cores: 4 warps per program (default 2)
    "dot-w2-one-token": {(TR, "DOT_WARPS_ONE_TOKEN"): {"fwd_sites_dot": 2, "bwd_stats_dot": 2, "bwd_sources_dot": 2}},  # 2 warps where a tile holds one token (of at most 64 sources: wider ones take DOT_WARPS_ONE_TOKEN_WIDE)
    "fwd-w4-one-token": {(TR, "DOT_WARPS_ONE_TOKEN"): {"fwd_sites_dot": 4, "bwd_stats_dot": 4, "bwd_sources_dot": 4}},  # the forward's one-token tiles on 4 warps (before the twelfth set)
    "sources-stages3": {(TR, "DOT_STAGES"): {}},  # pass two on tensor cores with Triton's default 3 stages (before the twelfth set)
    "vector-at-64": {(TR, "DOT_MANY_SITES_MIN_HEAD_WIDTH"): 128},  # the site loop on the vector kernels at head width 64 (100m) whatever the sites (before the eighteenth set)
    "dots-at-64": {(TR, "DOT_MIN_HEAD_WIDTH"): 64},  # the site loop (both passes since the eleventh set) on tensor cores at head width 64 too (100m), whatever the sites (the package: passes of DOT_MANY_SITES sites or more)
    "dot-sources": {(TR, "DOT_SOURCES"): True},  # pass two on tensor cores too: the default since the eleventh set (BENCHMARKS.md)
    "fwd-block-diag": {(TR, "DOT_FWD_MIX"): False},  # phase one's forward as block-diagonal products of (token, site) and (token, source) rows (before the twenty-fifth set)
    **{f"mix-rows-{n}": {(TR, "DOT_MIX_ROWS"): n} for n in (16, 64, 128)},  # the mixed forward's (token, source) rows per tile (the package: 32)
    **{f"mix-w{n}": {(TR, "DOT_MIX_WARPS"): n} for n in (2, 8)},  # ... its warps (the package: 4)
    "mix-all-sources": {(TR, "DOT_MIX_MAX_SOURCES"): 1 << 30},  # ... over any number of sources (the package: at most 8; the twenty-fifth set's call b)
    "vector-fwd": {(TR, "DOT_FWD"): False},  # phase one's forward on the vector kernel, not tensor cores
    "fwd-at-64": {(TR, "DOT_FWD_MIN_HEAD_WIDTH"): 64},  # phase one's forward on tensor cores at head width 64 too (100m)
    "vector-sources": {(TR, "DOT_SOURCES"): False},  # pass two of the site loop on the vector kernel (pass one on tensor cores)
    "dots-at-160": {(TR, "DOT_MAX_HEAD_WIDTH"): 160},  # tensor cores at head width 160 (1b, padded to 256): the default since the eleventh set
    "vector-at-160": {(TR, "DOT_MAX_HEAD_WIDTH"): 128},  # 1b's head width 160 on the vector kernels (the tenth set's code)
    "dot-tile8192": {(TR, "DOT_TILE_ELEMENTS"): 8192},  # tiles of twice the (token, source) rows
    "pad": {(TR, "SPLIT_WIDTH"): False},  # head widths padded to a power of two, not split in two tiles
    "bwd8w": {(TR, "WARPS", "bwd"): 8},  # the replacement form's two-pass backward on 8 warps whatever its tile
    "bwd-add-8w": {(TR, "WARPS", "bwd_add"): 8},  # the additive form's merges on the former tiles (2048 elements, 8 warps)
    "pf2": {(TR, "PREFETCH", k): 2 for k in ("fwd", "bwd", "bwd_stats")},  # two sources in flight per program
    "pf2-fwd": {(TR, "PREFETCH", "fwd"): 2},
    "pf2-stats": {(TR, "PREFETCH", "bwd_stats"): 2},
    "src-rstd-all": {(TR, "SPLIT_SOURCES_RSTD_HEADS"): 1 << 30},  # pass two loads the saved key rstd at split widths whatever H
    "src-rstd0": {(TR, "SPLIT_SOURCES_RSTD_HEADS"): 0},  # pass two recomputes the key rstd at split widths
    "first-group-pass": {("lit_mhar.routing", "FIRST_GROUP_DIRECT"): False},  # block routing's first block through a phase-one pass over the embedding alone (before the twenty-fourth set)
    "first-group-direct-full": {("lit_mhar.routing", "FIRST_GROUP_DIRECT_FULL"): True},  # full routing's first group routed site by site too
    "unfused-norm": {("lit_mhar.routing", "FUSED_NORM"): False},  # the merge, then the RMSNorm module (two ops)
    "fused-norm-all": {("lit_mhar.routing", "FUSED_NORM_ADDITIVE_FULL"): True},  # Delta full routing fused too (the default now)
    "unfused-additive-full": {("lit_mhar.routing", "FUSED_NORM_ADDITIVE_FULL"): False},  # Delta full routing: merge, then the norm module
    "no-sink": {("lit_mhar.routing", "SINK_SOURCE_GRADIENTS"): False},  # autograd sums the source gradients (addition kernels)
    "no-stream-sink": {("lit_mhar.routing", "SINK_STREAM"): False},  # Delta: autograd sums the stream's gradients
    "save-stream": {("lit_mhar.routing", "REPLAY_STREAM"): False},  # Delta: each fused norm saves its float32 stream (full routing before the twelfth set, block before the thirteenth)
    # Delta block: the stream replayed over spans of blocks while the earlier outputs number at most n (the package: 3, spans of
    # two blocks at S = 2, 3; none from S = 4). The twentieth set measured spans of blocks (REPLAY_SPAN_BLOCKS, since replaced):
    # its "replay-span-1" / "-4" are "replay-max-0" / "-9" at S = 3, its spans of two at S = 6 (350m) "replay-max-6"
    **{f"replay-max-{n}": {("lit_mhar.routing", "REPLAY_SPAN_MAX_OUTPUTS"): n} for n in (0, 3, 6, 9)},
    "untuned": {(TR, "TUNED_TILES"): {}},  # tiles and warps by the general rule at every width (at 1b: the tiles before the fourteenth set)
    "bwd-add-rule": {(TR, "TUNED_TILES", ("bwd_add", 1280)): (2048, 4)},  # the additive merges' backward at 1b on the general rule's tile (one token, 4 warps): the default since the fourteenth set
    "dots-64": {(TR, "DOT_MAX_SOURCES"): 64},  # tensor-core tiles of at most 64 sources (before the fifteenth set: 1b full routing's last group on the vector kernels)
    "one-chunk": {(TR, "DOT_SOURCES_CHUNK"): 128},  # pass two on tensor cores over up to 128 sources in one launch (tiles of 128 sources)
    "h1-rule": {(TR, "TUNED_TILES", ("fwd", 512, 1)): (2048, 2), (TR, "TUNED_TILES", ("bwd_stats", 512, 1)): (2048, 2),
                (TR, "TUNED_TILES", ("bwd_stats", 1024, 1)): (2048, 2), (TR, "TUNED_TILES", ("bwd_sources", 1024, 1)): (1024, 2)},  # H = 1 at 100m / 350m on the (kind, width) tiles (before the fifteenth set)
    "two-pass-merges": {(TR, "SAVE_ROUTED"): False},  # fused-norm merges recompute r in a first pass over the sources (before the sixteenth set)
    "routed-bf16": {(TR, "SAVED_ROUTED_DTYPE"): None},  # ... save r in the sources' dtype (bf16), not float32
    "routed-from-2": {(TR, "SAVE_ROUTED_MIN_SOURCES"): 2},  # ... from 2 sources (the sixteenth set's calls 1-5)
    "routed-all": {(TR, "SAVE_ROUTED_MIN_SOURCES"): 1},  # ... save r at merges of one source too (block routing, a full-routing group's second site)
    "bwd-2w": {(TR, "TUNED_TILES", ("bwd", 1024, 8)): (2048, 2)},  # the replacement form's merge backward at d = 1024, H = 8 on 2 warps (tune_tiles' best at 8 sources, within 1% at 4; at one source (512, 1) was faster; slower in training, seventeenth set)
    "bwd-4w": {(TR, "TUNED_TILES", ("bwd", 512, 8)): (1024, 4)},  # ... at d = 512, H = 8 on tiles of 1024 elements, 4 warps (tune_tiles' best at 100m at 4 and 8 sources; at one source (512, 1) was faster)
    "one-site-dots": {(TR, "DOT_MAX_SOURCES_ONE_SITE"): 64},  # a single site's backward on tensor cores up to 64 sources (before the eighteenth set; the package: vector kernels)
    "additive-saved-r": {(TR, "SAVE_ROUTED_ADDITIVE"): True},  # Delta full's fused merges of 3 sources or more save r (float32) for a one-pass backward (the package: the prior, two passes)
    "additive-two-pass": {(TR, "SAVE_ROUTED_ADDITIVE"): False},  # ... the package's two passes (the nineteenth set's call 1 had r saved by default)
    "mhar-group-8": {("lit_mhar.routing", "FULL_ROUTING_GROUP"): 8},  # full MHAR in groups of 8 sites (before the sixteenth set; the package: 12)
    "additive-group-12": {("lit_mhar.routing", "FULL_ROUTING_GROUP_ADDITIVE"): 12},  # Delta full routing in groups of 12 sites (the package: 8)
    "many-sites-8": {(TR, "DOT_MANY_SITES"): 8},  # the site loop on tensor cores at head width 64 (100m) from passes of 8 sites: the package's since the nineteenth set
    "fwd-sites-padded": {(TR, "FWD_SITES_PADDED"): True},  # the vector forward in groups of FWD_SITES sites where they do not divide the pass's (spare slots masked; the package: groups dividing them)
    "fwd-sites-divide": {(TR, "FWD_SITES_PADDED"): False},  # ... groups dividing them, the package's (the nineteenth set's call 3 had padded groups by default)
    "many-sites-12": {(TR, "DOT_MANY_SITES"): 12},  # ... from passes of 12 sites (the eighteenth set: Delta full's groups of 8 on the vector kernels)
    "lone-final-site": {("lit_mhar.routing", "JOIN_FINAL_SITE"): False},  # the last routing site in a group of its own, a phase-one pass over every source (before the eighteenth set)
    **{f"dots-from-{n}": {(TR, "DOT_MIN_SOURCES"): n} for n in (1, 2, 4)},  # phase-one passes over fewer than n sources on the vector kernels (the package: 3)
    "triton-arith": {(TR, "_cdiv"): triton.cdiv, (TR, "_pow2"): triton.next_power_of_2},  # the host's launch arithmetic through Triton's functions (before the twenty-first set; host_overhead_cpu.py)
    "pad-dots": {(TR, "DOT_SPLIT_WIDTH"): False},  # tensor-core kernels pad 1b's head width 160 to 256, pass two on the vector kernel (before the fourteenth set)
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
    given), then restore them; the patching is :mod:`unittest.mock`'s."""
    with contextlib.ExitStack() as stack:
        for (module, attr, *key), value in values.items():
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
    of the 2L sublayers) and any other ``fields``; sets full routing's group size, a module setting
    (either form's; the package's own where the variant names none)."""
    kw = dict(overrides)
    group = kw.pop("full_routing_group", None)
    routing.FULL_ROUTING_GROUP, routing.FULL_ROUTING_GROUP_ADDITIVE = (group, group) if group else FULL_ROUTING_GROUPS
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
        from lit_mhar.kernels import triton_routing as tr

        for key, programs in getattr(tr, "_RESIDENT", {}).items():
            print(f"resident programs per SM: {programs} for {key[0]} {dict(key[2])}", flush=True)
        for key, why in getattr(tr, "_RESIDENT_FALLBACKS", {}).items():
            print(f"resident programs not read for {key[0]}: {why}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
