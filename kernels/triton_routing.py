"""Fused Triton depth routing: one pass over the sources forward, recomputing passes backward.

Same math as :mod:`lit_mhar.kernels.reference` (AttnRes eqs. 2-6, MHAR heads, Delta AttnRes's
additive form), extended in two ways that the model's Block AttnRes path uses:

* **several sites per pass** (``S`` queries against the same sources): the pseudo-queries do not
  depend on the input, so every site of a block (or of a group of full-routing sites) can be
  routed against the sources complete at its start while each is read once (the first phase of
  the two-phase computation);
* **a prior**: a routed value ``o`` with its log-sum-exp ``lse`` per head, merged as if it were one
  more source whose score is ``lse`` (the second, online-softmax phase, which adds the block in
  progress). Merging is exact: softmax over {completed blocks, partial} equals the lse-weighted mix
  of the softmax over the completed blocks and the partial;
* **the next RMSNorm fused into a merge** (``NORM``, :func:`merge_route_norm`): the merge writes
  ``RMSNorm(x) * weight`` of its output ``x`` (``r``, or ``stream + gate * r``) instead of ``x``,
  and its backward recomputes ``x`` from the prior and the sources (and the stream), applies the
  norm's backward and sums the weight's gradient per program, so neither ``x`` nor the norm's
  input is written or saved; except that an eager merge of the replacement form (the additive
  form too with ``SAVE_ROUTED_ADDITIVE``) over at least ``SAVE_ROUTED_MIN_SOURCES`` sources, with
  a backward to come, writes ``r`` in float32 and saves it in place of the prior
  (``SAVE_ROUTED``), so that its backward reads the sources once with scores.

Forward, per tile of ``BM`` tokens and a group of ``FWD_SITES`` sites (the groups of a pass are
programs side by side, so a source tile is read from HBM once and from L2 by the other groups), one
loop over the sources:
``rstd_i`` (key RMSNorm), the per-head score ``s_i = rstd_i * <q*g, v_i>_h`` and an online softmax
in float32; normalised keys are never written. Saved for backward: the log-sum-exp ``[S, M, H]``
float32 (4 bytes per token and head), nothing of size ``[N, M, d]``. Backward recomputes
``rstd``, ``s`` and ``alpha = exp(s - lse)`` from the sources in two passes (one where a fused
merge saved ``r``: ``D`` is then ``<dr, r>_h``): the first forms
``D = sum_i alpha_i <dr, v_i>_h`` (= ``<dr, r>_h``), the second writes every source gradient

    ds_i = alpha_i * (<dr, v_i>_h - D + dlse)
    dv_i = alpha_i * dr + rstd_i * (ds_i * w - rstd_i * v_i * sum_h ds_i s_i / d)
    dw  += sum_tokens ds_i * rstd_i * v_i        (w = q * g; dq = dw * g, dg = dw * q)

``dw`` (and the gate's gradient) are summed over tokens per persistent program in registers and
written as ``[programs, S, d]`` partials that a fixed-order ``sum`` reduces: no atomics, so two
runs give bit-identical gradients. Sources are addressed through a table of int64 element offsets
from the first source (no ``torch.stack``); every row offset is int64, so ``N * tokens * d`` may
exceed ``2**31``.

Two kernels run those passes. The two-pass kernel (``_route_bwd``, merges and short single sites)
keeps a token's gradients of all sites of the pass in registers and runs both passes per tile; a
merge fused with the norm whose forward saved its routed value r (``SAVE_ROUTED``) needs no first
pass: the norm's input and ``D = <dr, r>_h`` come from r. Over exactly one source (block routing's
merges, over the running sum) it keeps pass one's values for pass two (``ONE_SOURCE_MERGE``) and,
in the replacement form, loads each program's next tile while computing on this one
(``TILE_PREFETCH``).
The site-loop kernels (``_route_bwd_stats`` then ``_route_bwd_sources``: several sites, or one
site over many sources) hold one site's gradient at a time (``STATS_SITES``): the first runs one
program per (site, range of tiles) and also stores every ``s_i`` and ``<dr, v_i>_h``
(``[S, N, M, H, 2]`` float32), the second one program per (tile, source) with the sites in its
loop. Where the sources are bf16 with a head width of 128 or 160 and the key rstd saved, the first
of them is ``_route_bwd_stats_dot``: the same outputs, formed as ``tl.dot`` products on tensor
cores (rows (token, site) against rows (token, source) of a tile of tokens, per head, the head
width padded to a power of two; float32 factors as bf16x2 splits, hi + lo).
``_route_bwd_sources_dot`` does the same for the second (at head widths that need no padding), and
``_route_fwd_sites_dot`` for the forward of a phase-one pass; over at most eight sources at a head
width of one power-of-two tile (128) the forward is ``_route_fwd_sites_mix`` instead (the scores as
one dense product of the sites' weights against a tile's (token, source) rows, the weighted sum on
the vector units in float32). Eager calls run the autograd through
:class:`_RouteFunction`; ``torch.compile`` sees the custom ops.

Each token's width is held in registers as ``[heads, lanes]`` tiles; a head width that is a sum
of two powers of two (160 = 128 + 32 at 1b) is held as two tiles per head (``SPLIT_WIDTH``: every
lane tensor has a twin ``*_t`` over the head's last channels, and sums over a head add the two)
rather than one padded to the next power of two.

Decoding (no backward) has its own kernel, :func:`route_norm_decode`: one program per token loops
over the slots of one ``[slots, tokens, d]`` buffer in tiles of a few slots (all loads of a tile in
flight at once), adds the newest sublayer output into its slot, routes (online softmax per head)
and applies the next sublayer's RMSNorm, so a decode step runs one kernel per routing site. Full
routing's long histories take a phase one per group of sites (:func:`route_sites_decode`: one
program per token and site over the slots complete at the group's start), whose output and lse
each site's kernel then merges as a prior; without a prior, a history longer than
``DECODE_CHUNK`` slots is split over programs whose float32 partials a second launch merges.

On CPU tensors the kernels run in Triton's interpreter (for tests, through ``use_backend("triton")``);
on CUDA tensors they are compiled.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_mhar.kernels.reference import check_decode_args, check_merge_norm_args, check_route_args, check_route_norm_args, check_sites_decode_args
from lit_mhar.kernels.sink import GradientSink, SinkBinding

# Largest padded width (next power of two of d) one program keeps in registers.
MAX_BLOCK_D = 16384
# Tile of one program, by launch kind: sites x tokens x padded width fp32 elements of the
# accumulator (forward) or of the gradient tile (backward), spread over warps (4 to 16) at
# ``ELEMENTS_PER_THREAD`` each. Forward and site-loop sizes are the best, or within 2% of the
# best, of each kind tried alone at 350m shapes on an H200 (benchmarks/tune_tiles.py,
# BENCHMARKS.md): small tiles, 4 warps; at the widths in ``TUNED_TILES`` (below), 2 warps. The two-pass backward (the merges of two-phase routing)
# takes 2048 elements on 8 warps: 80 registers per thread instead of 169 for 4096 elements on 8
# (one program per SM, 8 resident warps, by Nsight Compute), which took block MHAR from 0.897 to
# 0.910 x prenorm at 350m (BENCHMARKS.md, fifth set). ``MAX_TILE_ELEMENTS``
# caps sites x width of the two-pass backward, which holds every site's gradient of a token (one
# token per program); it runs single sites only, unless ``SITE_LOOP_MIN_SITES`` is raised
# (benchmarks compare the two that way).
TILE_ELEMENTS = {"fwd": 4096, "merge_fwd": 4096, "bwd": 2048, "bwd_add": 2048, "bwd_stats": 2048, "bwd_sources": 2048}
ELEMENTS_PER_THREAD = {"fwd": 32, "merge_fwd": 32, "bwd": 8, "bwd_add": 8, "bwd_stats": 16, "bwd_sources": 16}
# Warps per program by launch kind where set (benchmarks/tune_tiles.py tries them); else from the tile.
WARPS: dict[str, int] = {}
# (elements, warps) of a launch kind at a padded width where measured better than the rule above
# (benchmarks/tune_tiles.py --shapes phase1 on an H200, phase one of 8 blocks at H = 8; BENCHMARKS.md,
# eighth set): at d = 512 (100m) and d = 1024 (350m) programs of 2 warps, 32 or 16 elements per
# thread, took the forward from 1.048 to 0.974 ms (100m) and 0.925 to 0.841 (350m), pass one of the
# site loop from 3.71 to 3.37 and 3.37 to 3.08, and pass two from 3.71 to 3.41 (2048 elements) and
# 3.37 to 2.88 (1024 elements). The merges' own kinds (``--shapes merge``, one merge fused with the
# norm, timed in a CUDA graph; BENCHMARKS.md, ninth set): the additive form's backward ("bwd_add")
# on 1024 elements and 2 warps took forward + backward from 0.498 to 0.353 ms at 350m and from
# 0.954 to 0.655 at 100m (Delta block in training 0.876 against 0.856 x prenorm at 350m, 0.813
# against 0.788 at 100m); the forward of a merge ("merge_fwd") moved its 201 MB at 2.9-3.4 TB/s
# on every tile tried (0.060-0.070 ms at 350m), so it keeps the forward's tile; the
# replacement form's backward measured within the spread of training ("bwd", 2048 on 8 warps kept).
# At 1280 lanes per token (d = 1280 at 1b; the key is lanes per token, so d = 960 with H = 6 takes
# them too, unmeasured; ``tune_tiles.py --scale 1b --shapes op,merge``, then ``--shapes phase1 --kinds
# bwd_sources``, BENCHMARKS.md, fourteenth set) programs of one or two tokens on one or two warps,
# where the rule gave one or two tokens on 4: at one site over
# 9 / 73 sources with H = 1 the forward took 0.254 / 1.641 ms against 0.397 / 2.772, the whole
# backward with pass one on one token and one warp 0.845 / 6.068 against 1.197 / 9.159, with pass two
# so 1.204 / 7.924 against 1.212 / 8.904; the merges' forward 0.079 / 0.127 / 0.207 ms (one newer
# source, additive form, four) against 0.090 / 0.123 / 0.227, their backward 0.402 / 0.920 (one,
# four) against 0.457 / 1.062. The additive form's backward took 0.625 ms against 0.739 alone, but in
# training (where the block's stream is rebuilt) Delta block ran at 0.802-0.806 x prenorm with it in
# three calls against 0.816-0.817 on the rule's tile (``untuned``, ``bwd-add-rule``), so it keeps the
# rule's (Delta full: 0.642-0.674 with it, 0.668 without, within its spread). A key with a third field
# holds for that head count only (measured at it: H = 1; pass two with H = 8 was best on the rule's
# tile, 6.832 ms against 7.073 on one warp). At H = 1 and d = 512 / 1024 (``tune_tiles.py --scale
# 100m|350m --shapes op``, BENCHMARKS.md, fifteenth set; ms for one site over 9 / 2L + 1 sources, the
# backward timed whole): at 100m the forward on one warp 0.384 / 0.954 against 0.450 / 1.115, pass
# one on tokens of one warp 1.253 / 3.288 against 1.411 / 3.731; at 350m pass one so 0.620 / 3.007
# against 0.853 / 3.364, pass two on 2 tokens of 2 warps 0.641 / 3.129 against 0.709 / 3.366. Phase
# one's passes at H = 1 (AttnRes) take them too: in training at 350m AttnRes in 8 blocks ran at 0.930
# x prenorm against 0.932 without them, full AttnRes 0.711 against 0.704; not measured at 100m.
# The replacement form's merge backward ("bwd") at d = 1024, H = 8, with the one-source merges'
# reuse of pass one and next-tile prefetch (``ONE_SOURCE_MERGE``, ``TILE_PREFETCH``): one token on 4
# warps (``tune_tiles.py --shapes merge --kinds bwd``, one merge's forward + backward: 0.198 ms
# against 0.253 on 2048 elements and 8 warps at one source, 0.507 / 0.789 against 0.546 / 0.839 at
# four / eight). In training at 350m, steps as CUDA graphs: block MHAR 192.3 against 194.0 ms a step
# (prenorm 181.05) in one call, 195.4-196.0 against 196.9 (prenorm 185.0) in another, where full
# MHAR took 222.6 against 225.8 ms (BENCHMARKS.md, twenty-eighth set). At d = 512 (100m) one token
# on 2 warps ran within the spread of two runs of the rule's tile, so that width keeps the rule.
# Not used where ``WARPS`` names the kind (tuning runs).
TUNED_TILES: dict[tuple, tuple[int, int]] = {
    ("fwd", 512): (2048, 2), ("fwd", 1024): (2048, 2), ("merge_fwd", 512): (2048, 2), ("merge_fwd", 1024): (2048, 2),
    ("bwd_add", 512): (1024, 2), ("bwd_add", 1024): (1024, 2),
    ("bwd_stats", 512): (2048, 2), ("bwd_stats", 1024): (2048, 2),
    ("bwd_sources", 512): (2048, 2), ("bwd_sources", 1024): (1024, 2),
    ("fwd", 1280, 1): (2560, 1), ("merge_fwd", 1280): (1280, 1), ("bwd", 1280): (1280, 2),
    ("bwd_stats", 1280, 1): (1280, 1), ("bwd_sources", 1280, 1): (1280, 1),
    ("fwd", 512, 1): (2048, 1), ("bwd_stats", 512, 1): (1024, 1),
    ("bwd_stats", 1024, 1): (1024, 1), ("bwd_sources", 1024, 1): (2048, 2),
    ("bwd", 1024, 8): (1024, 4),
}
MAX_TILE_ELEMENTS = 8192
# Backward passes over at least this many sites, or of one site over at least this many sources
# (either form, no prior), use the site-loop kernels (``_backward_site_loop``), which hold one
# site's gradient at a time and spread the sources over programs (BENCHMARKS.md, 350m shapes,
# replacement form: within 1% at 9 sources with H = 1, faster with H = 8 and at every larger N).
SITE_LOOP_MIN_SITES = 2
SITE_LOOP_MIN_SOURCES = 9
# Sites one forward program routes together (at most; a power of two dividing the pass's sites,
# so no site slot is padding): a source tile is then loaded, converted and normalised once per
# group instead of once per site (425 -> 362 warp instructions per token, site and source at 350m
# shapes, by ptxas; in training within run-to-run spread: block MHAR 0.910 against 0.909 with one,
# full MHAR 0.662 against 0.657, four per program 0.665; BENCHMARKS.md, fifth set).
FWD_SITES = 2
# With FWD_SITES_PADDED also where that many do not divide the pass's sites, the last group's spare
# slots masked (13 sites in 7 programs of 2, not 13 of 1). Measured on an H200 (BENCHMARKS.md,
# nineteenth set; ``tune_tiles.py --scale 100m --shapes padded-sites``, H = 8, bf16, the forward's
# ms): 13 sites over 13 sources 6.50 against 6.00 in groups of one (5.77 in padded groups of 4),
# 9 over 17 5.90 against 5.29, 3 over 5 0.87 against 0.69; in training at 100m within the spread
# (full MHAR 0.823 / 0.819 against 0.818 x prenorm, block MHAR 0.912 against 0.908). So off; a
# benchmark knob (``fwd-sites-padded``).
FWD_SITES_PADDED = False
# Sites one program of the site loop's pass one takes together (same rule): the source tile, its
# conversion and its norm are shared by the group, each site keeping its own gradient tile. Two
# per program cut the instructions per token, site and source from 512 to 444 (350m shapes, by
# ptxas), but measured no faster in training (350m on an H200: block MHAR 0.903 against 0.914 with
# one, full MHAR 0.669 against 0.670, full MHAR with four per program 0.618), so one it is; a
# benchmark knob.
STATS_SITES = 1
# Eager calls (not under torch.compile) run the op's autograd through a torch.autograd.Function
# calling the same kernels, which skips the custom op's per-call Python (argument flattening and
# checks): the host's time to enqueue a 350m block MHAR step fell from 159.5 to 145.3 ms (the step
# itself is GPU-bound: 213-214 ms either way). torch.compile traces the custom op.
EAGER_FUNCTION = True
# The forward of a pass whose backward runs the site loop saves each source's key rstd ([N, tokens]
# float32, 4 bytes per token and source) so that the backward kernels load it instead of reducing
# each source tile over the width again (in pass one: 512 -> 422 warp instructions per token and
# source, 7 -> 4 barriers per iteration at 350m shapes, by ptxas; in training at 350m on an H200
# block MHAR 0.916 against 0.910 recomputing, full MHAR 0.677 against 0.660). A benchmark knob.
SAVE_RSTD = True
# ... and, with SAVE_RSTD_MERGES, so does a merge (a prior or a fused norm: the two-pass backward,
# ``_route_bwd``), whose backward otherwise reduces each source tile over the width in both of its
# passes. Off by default: on an H200 at 350m it measured no gain (block MHAR 0.935 against 0.931,
# full MHAR 0.818 against 0.823, one run; BENCHMARKS.md, twenty-fourth set). A benchmark knob
# (``merge-rstd``).
SAVE_RSTD_MERGES = False
# A merge fused with the next RMSNorm (replacement form, at least SAVE_ROUTED_MIN_SOURCES sources:
# full routing's sites past a group's third; eager calls) writes its routed value r, the norm's
# input, in SAVED_ROUTED_DTYPE as well as the norm's output, and saves r instead of the prior: its
# backward then has the norm's input and D = <dr, r>_h without a first pass over the sources, so
# it reads them once instead of twice. The prior's lse gradient is D - sum_i alpha_i <dr, v_i>_h
# - p_alpha D (r = p_alpha o + sum_i alpha_i v_i). r in bf16 loses the cancellation in that
# difference (relative error 2.3e-2 against float64 at 7 sources, H = 8, where two passes give
# 1.8e-3), so r is float32: 2 more bytes per element than the prior it replaces. Measured in
# BENCHMARKS.md (sixteenth set). Benchmark knobs (SAVE_ROUTED False: the backward recomputes r
# from the prior and the sources in a first pass; SAVED_ROUTED_DTYPE None: r in the sources' dtype).
SAVE_ROUTED = True
SAVE_ROUTED_MIN_SOURCES = 3  # (at 2 sources the merge measured 2-9% faster: not worth 2 bytes per element)
# ... and in the additive form (Delta AttnRes, full routing: a fused merge of at least
# SAVE_ROUTED_MIN_SOURCES sources; not block routing's rebuilt running sums): r is stored before
# the stream and gate enter, the norm's input stream + gate * r is formed again in the backward,
# where the stream replayed from its group's start (REPLAY_STREAM) takes one pass that only adds
# the sources to it, without scores. Measured in training on an H200 (BENCHMARKS.md, nineteenth
# set; Delta full, tokens/s x prenorm, peak memory in brackets): 0.714 / 0.713 (1.070) against 0.714
# (1.022) two-pass at 100m, 0.792 / 0.781 (1.066) against 0.785 (1.020) at 350m: no faster, and r
# in float32 in place of the bf16 prior keeps 2 bytes per element more per merge that saves it
# (2.0 GiB at 100m, 1.9 at 350m), so off. A benchmark knob (``additive-saved-r``).
SAVE_ROUTED_ADDITIVE = False
# The two-pass backward over exactly one source (block routing's merges: the block's running sum)
# keeps pass one's source, rstd, scores and weights for pass two (``ONE``), where pass two would
# reload the source and reduce its squares and scores over the width again. Alone it measured no
# gain (350m block MHAR 194.2 / 194.7 ms a step against 194.3 / 194.6; BENCHMARKS.md, twenty-seventh
# set, call d); it is the one-tile structure the prefetch below needs. A benchmark knob
# (``one-source-loop``).
ONE_SOURCE_MERGE = True
# ... and, for the replacement form's fused-norm merge, loads each program's next tile while it
# computes on this one (``TILE_PF``): 350m block MHAR at 0.935 / 0.936 x prenorm against 0.929 /
# 0.933 without (call e). A benchmark knob (``no-tile-prefetch``).
TILE_PREFETCH = True
SAVED_ROUTED_DTYPE: Optional[torch.dtype] = torch.float32
# Head widths d/H that are a sum of two powers of two (96 = 64 + 32; 160 = 128 + 32 at 1b with
# H = 8) are held by the training kernels as two tiles per head instead of one padded to the next
# power of two (128, 256), where a quarter and three eighths of the lanes did no work. At 1b on an
# H200: block MHAR 0.898 against 0.886 x prenorm padded, full MHAR 0.578 against 0.536
# (BENCHMARKS.md, sixth set). A benchmark knob (False pads).
SPLIT_WIDTH = True
# At split head widths, pass two of the site loop loads the saved key rstd only with at most this
# many heads, else it reduces each source tile over the width again (pass one loads it either way).
# Measured on an H200 at 1b (d = 1280, 32768 tokens, 9 sources, one site; benchmarks/profile_op.py):
# pass two took 6.41 / 6.29 ms loading it against 0.70 / 0.69 recomputing with H = 8 / 4, and
# 0.51 / 0.47 against 0.66 / 0.62 ms with H = 2 / 1. Compiled for sm_90 offline, the slow case is
# Triton's specialisation of the kernel for one site (n_sites == 1, the loop over sites gone): with
# the saved rstd and H >= 4 it converts its tiles' layout through shared memory (320 128-bit
# stores, 19 barriers), which neither H <= 2 nor several sites do. A benchmark knob.
SPLIT_SOURCES_RSTD_HEADS = 2
# Sources in flight per program in the loops over sources (1 or 2), by launch kind: the loop loads
# source i + PREFETCH while it works on source i. A benchmark knob.
PREFETCH = {"fwd": 1, "bwd": 1, "bwd_stats": 1}
# Pass one of the site loop on tensor cores (``_route_bwd_stats_dot``) where it applies
# (``_stats_on_dots``): elements per tile (``_dot_tile``), warps (``DOT_WARPS_ONE_TOKEN`` where a
# tile holds one token's sources), at most ``DOT_PROGRAMS_PER_SM`` programs per SM in its one-wave
# grid (sized by registers like the merges'; not compared with other grids), and the sizes it
# takes. Measured on an H200 (BENCHMARKS.md, tenth set; ``tune_tiles.py --shapes dots``, the
# backward of one phase-one pass at 350m, both passes, bf16, H = 8): 6 sites over 8 blocks took
# 1.64 ms against 2.59 on the vector kernel, 8 sites over 9 sources 2.20 against 3.74, 8 sites over
# 41 sources 12.48 (4 warps) or 14.11 (2) against 15.86; in training at 350m block MHAR 0.971
# against 0.957 x prenorm, full MHAR 0.765 against 0.732. At head width 64 (100m) it was not faster
# in training (block MHAR 0.898 against 0.914, near the spread of about 0.015; full MHAR 0.771
# either way), hence ``DOT_MIN_HEAD_WIDTH``. A benchmark knob.
DOT_STATS = True
DOT_TILE_ELEMENTS = 4096
DOT_WARPS = 2
DOT_WARPS_ONE_TOKEN = {"fwd_sites_dot": 2, "bwd_stats_dot": 4, "bwd_sources_dot": 4}
# ... and where that one token's tile holds more than 64 sources (8 sites over 65 sources at 1b, H = 8,
# ``tune_tiles.py --shapes wide``, BENCHMARKS.md, fifteenth set): the forward took 7.71 ms on 4 warps
# against 13.93 on 2 and 10.29 on 8 (12.90 on the vector kernel), the backward 15.51 / 330.09 / 18.88.
DOT_WARPS_ONE_TOKEN_WIDE = 4
DOT_WIDE_SOURCES = 64  # a tile of more sources than this is "wide"
DOT_PROGRAMS_PER_SM = 16
# Software-pipelining stages (Triton's ``num_stages``) by tensor-core kernel where set; else
# Triton's default (3). Measured on an H200 (``tune_tiles.py --shapes dot-tune``, 350m, H = 8, bf16,
# the backward of one phase-one pass, ms; BENCHMARKS.md, twelfth set): pass two on one stage took
# 6 sites over 8 blocks 1.16 against 1.37, 8 sites over 9 sources 1.46 against 1.74, 8 sites over
# 41 sources 6.28 against 6.63 (4 warps); the forward of 8 sites over 41 sources (tiles of one
# token) 3.05 ms on 2 warps against 3.40 on 4 (``DOT_WARPS_ONE_TOKEN``). In training at 350m both
# were within the spread (full MHAR 0.820 against 0.817 with either former setting). Benchmark knobs.
DOT_STAGES: dict[str, int] = {"bwd_sources_dot": 1}
DOT_MAX_SITES = 16
# Sources of one tensor-core tile (all of a token's sources, padded to a power of two). At 64, full
# routing's last group at 1b (8 sites over 65 sources) ran on the vector kernels, 13.5 ms forward and
# 39.4 ms backward in a 580 ms step of full MHAR; on tiles of 128 sources its backward took 15.5 ms
# against 37.1 (``tune_tiles.py --shapes wide``, BENCHMARKS.md, fifteenth set). A single site takes
# tiles of at most ``DOT_MAX_SOURCES_ONE_SITE`` sources, none by default: its site padded to 16 rows
# of the tile, one site over 73 sources took 10.2 ms backward at 1b against 8.7 on the vector
# kernels (fifteenth set), over 49 sources at 350m 6.24 against 3.35 (eighteenth set; H = 8, bf16).
# In training at 350m, with full routing's final site alone in its group, full MHAR ran at 0.847
# against 0.839 / 0.841 x prenorm with tiles of up to 64 sources (the former value), Delta full 0.776
# against 0.766. A benchmark knob (``one-site-dots``).
DOT_MAX_SOURCES = 128
DOT_MAX_SOURCES_ONE_SITE = 0
# Pass two on tensor cores (``_route_bwd_sources_dot``) takes at most this many sources per launch:
# each source's gradient needs only its own scores and pass one's D and t. At 1b, in training, pass
# two of 8 sites over 65 sources in one tile of 128 took 24.6 ms against 7.9 for 57 sources in a tile
# of 64 (probably the gradient sink's sums it adds there, which the tuning shape lacks: 15.5 ms for
# the whole backward; not measured apart); with chunks of 64 full MHAR trained at 0.769 / 0.782 x
# prenorm against 0.753 in one launch (BENCHMARKS.md, fifteenth set).
DOT_SOURCES_CHUNK = 64
DOT_MIN_HEAD_WIDTH = 128
# ... and from DOT_MANY_SITES_MIN_HEAD_WIDTH (100m's 64) up for passes of at least DOT_MANY_SITES
# sites: full routing's groups, MHAR's of 12 (13 with the final site) and Delta's of 8 (9).
# Measured on an H200 in training at 100m (tokens/s x prenorm): full MHAR 0.821 / 0.813 with both
# passes on tensor cores at head width 64 against 0.775 / 0.775 on the vector kernels (one call),
# block MHAR 0.925 against 0.921 / 0.909 (another; earlier sets: 0.880 against 0.911, 0.898 against
# 0.914), so blocks of 3 or 4 sites keep the vector kernels (BENCHMARKS.md, eighteenth set); Delta
# full 0.750 with passes of 8 sites there against 0.713 / 0.714 (nineteenth set). A benchmark knob
# (``vector-at-64``; ``many-sites-12`` for the eighteenth set's threshold).
DOT_MANY_SITES_MIN_HEAD_WIDTH = 64
DOT_MANY_SITES = 8
# 1b's 160, padded to 256 (the eleventh set; two column tiles since the fourteenth, ``DOT_SPLIT_WIDTH``):
# pass one measured faster in training (full MHAR 0.643 against 0.610 x
# prenorm, block MHAR 0.928 against 0.921), pass two slower there (both passes: full 0.605 against
# 0.612, block 0.894 against 0.927), so pass two takes only widths that need no padding
# (``_sources_on_dots``; ``DOT_SOURCES_PADDED`` lets it take them, for benchmarks). BENCHMARKS.md,
# eleventh set.
DOT_MAX_HEAD_WIDTH = 160
DOT_SOURCES_PADDED = False
# Head widths that are a power of two plus a smaller one of at least 16 (160 = 128 + 32 at 1b with
# H = 8) are held by the tensor-core kernels as two column tiles per head (``_dot_lanes``), as
# ``SPLIT_WIDTH`` does for the vector kernels, instead of one padded to the next power of two:
# 3/8 of every product at 160 was padding. Pass two takes them too (``_sources_on_dots``). A benchmark
# knob (``pad-dots``: padded, pass two on the vector kernel, the code before the fourteenth set).
# In training at 1b on an H200 (BENCHMARKS.md, fourteenth set) full MHAR took 0.729 x prenorm with
# both this and the d = 1280 tiles against 0.649 with neither (one call), and 0.734 against 0.720
# without the tiles (another): about 0.07 is this. The backward of a single site there (one site over
# 9 sources, H = 8, its site padded to 16 rows of the tile) took 4.09 ms with pass two on tensor
# cores against 1.87 with it on the vector kernel (two calls), so at two column tiles pass two needs
# ``DOT_SPLIT_SOURCES_MIN_SITES`` sites.
DOT_SPLIT_WIDTH = True
DOT_SPLIT_SOURCES_MIN_SITES = 2
# Rows of either operand of a tile at most: the products [BM*BS, BM*BN] grow as the square of the
# tokens per tile, and at head width 16 pass two's tile of 256 rows asked an H200 for 299 KB of shared
# memory (232 KB there). From head width 64 up, DOT_TILE_ELEMENTS alone keeps tiles within it. A
# single token's sources are more rows where there are more than 64 of them (``DOT_MAX_SOURCES``).
DOT_MAX_ROWS = 64
# Pass two of the site loop on tensor cores too (``_route_bwd_sources_dot``) where pass one is.
# Measured on an H200 (BENCHMARKS.md, eleventh set; bf16, 350m, H = 8): the backward of 8 sites over
# 41 sources took 6.63 ms against 13.13 with pass two on the vector kernel (15.79 with both there);
# in training full MHAR 0.799 against 0.761 x prenorm and Delta full 0.743 against 0.712, block
# MHAR 0.965 against 0.968. A benchmark knob (``vector-sources``).
DOT_SOURCES = True
# Phase one's forward on tensor cores too (``_route_fwd_sites_dot``, where ``_fwd_on_dots`` holds),
# each source read for all the pass's sites at once, from head width DOT_FWD_MIN_HEAD_WIDTH up to
# DOT_MAX_HEAD_WIDTH. Measured in training on an H200 (BENCHMARKS.md, eleventh set; x prenorm,
# against the vector forward): full MHAR 0.804 / 0.789 and block MHAR 0.952 / 0.945 at 350m, full
# MHAR 0.647 / 0.633 at 1b; at head width 64 (100m) block MHAR was slower, 0.877 against 0.908.
# Benchmark knobs (``vector-fwd``, ``fwd-at-64``).
DOT_FWD = True
DOT_FWD_MIN_HEAD_WIDTH = 128
# ... with the weighted sum on the vector units (``_route_fwd_sites_mix``) for passes over at most
# DOT_MIX_MAX_SOURCES sources where a head's width is one power-of-two tile (350m's 128; 1b's 160
# keeps ``_route_fwd_sites_dot``): the scores W V^T as one dense product per tile (the weights not
# repeated per token: the block-diagonal products waste BM - 1 of every BM), then
# out = sum_i alpha_i v_i source by source in float32. Phase one's forward kernel was bound by
# latency, not by bytes or tensor cores (Nsight Compute, 350m, 6 sites over 8 sources: 2 warps a
# program, 255 registers a thread and spilling, 12.5% occupancy, issue slots 29% busy, DRAM 26% of
# its peak). Measured on an H200 (``tune_tiles.py --shapes mix``, 350m, H = 8, bf16, forward ms;
# BENCHMARKS.md, twenty-fifth set): block routing's 6 sites over 3 / 5 / 8 sources 0.429 / 0.643 /
# 0.807 against 0.498 / 0.774 / 0.809; full routing's 12 sites over 13 / 25 / 37 sources 2.5-3.5 /
# 5.7-6.7 / 9.7-13.4 against 1.57 / 1.86 / 3.03 (the source loop's cost grows with the sites), hence
# the cap. Its tiles: DOT_MIX_ROWS (token, source) rows, DOT_MIX_WARPS warps (the best of 16-128
# rows and 2-8 warps at every block-routing shape). Benchmark knobs (``fwd-block-diag``,
# ``mix-rows-<n>``, ``mix-w<n>``, ``mix-all-sources``).
DOT_FWD_MIX = True
DOT_MIX_MAX_SOURCES = 8
DOT_MIX_ROWS = 32
DOT_MIX_WARPS = 4
# Sites a pass needs for its forward to run there: phase-one passes (one site over many sources
# keeps the vector forward; not measured there).
DOT_FWD_MIN_SITES = 2
# Sources a phase-one pass needs for the tensor-core kernels (forward and both backward passes); a
# pass over fewer (full routing's first group, over the embedding alone; block routing's first two
# blocks) runs on the vector kernels, which hold a token's sources unpadded where a tensor-core tile
# pads them to 16 // BM rows per token (16 rows a tile) and its sites to a power of two. Measured on an
# H200 (``tune_tiles.py --shapes min-sources``, H = 8, bf16, forward + whole backward, ms;
# BENCHMARKS.md, seventeenth set): 12 sites over 1 / 2 sources 1.31 / 2.39 on the vector kernels
# against 2.12 / 2.98 at 350m, 1.67 / 3.48 against 4.80 / 5.64 at 1b; block routing's 6 sites at
# 350m over 1 / 2 / 4 sources 1.06 / 1.24 / 1.98 against 1.62 / 1.57 / 1.64 (not measured at 3; at
# 1b 9 sites over 4 sources 5.19 against 5.68). A benchmark knob (``dots-from-<n>``).
DOT_MIN_SOURCES = 3
# Tokens per program in the interpreter, where larger tiles only mean fewer, faster numpy calls.
INTERPRET_ROWS = 64
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Running sums the backward kernel rebuilds from a block's outputs (merge_route_norm's
# block_outputs): bf16, rounded to nearest even after each addition as torch's additions are, and
# float32; an fp16 running sum is saved.
REBUILD_DTYPES = (torch.float32, torch.bfloat16)
# Tests set this to fill every kernel output with NaN before the launch, so that an element the
# kernel fails to write cannot pass as a plausible value.
POISON_OUTPUTS = False
# Sums are written ``tl.reduce(x, axis, _ADD)`` and zeros ``tl.full``: ``tl.sum`` and ``tl.zeros``
# are themselves ``@triton.jit`` functions, which the interpreter cannot call unless
# TRITON_INTERPRET was set before Triton was imported; builtins and this combine function (which
# the interpreter maps to ``numpy.sum``) work either way, so CPU tests need no import order.
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _route_fwd(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    out_base, out_offs,
    lse_ptr,
    stream_ptr, gate_ptr,
    prior_ptr, prior_lse_ptr,
    scores_ptr, rstd_ptr,
    nw_ptr, routed_ptr,
    M, eps, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr, PF: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr, STORE_SCORES: tl.constexpr, STORE_RSTD: tl.constexpr, NORM: tl.constexpr,
    STORE_ROUTED: tl.constexpr,
):
    # Every tensor is 4-D (site, token, head, lane) and every sum keeps its axis, so that all of
    # them share one register layout: no tile is ever shuffled through shared memory.
    # One program per (token tile, group of BS sites), the group varying fastest: the programs of
    # one tile run together, so each source tile comes from HBM once and from L2 for the other
    # groups; within a group a source tile is loaded, converted and normalised once for BS sites.
    pid = tl.program_id(0)
    n_groups = (n_sites + BS - 1) // BS
    s_i = tl.arange(0, BS)[:, None, None, None] + (pid % n_groups) * BS
    rows = tl.cast(pid // n_groups, tl.int64) * BM + tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i  # [1, 1, BH, BDH] channel of (head, lane)
    cmask = (h_i < H) & (j_i < DH)
    smask = s_i < n_sites
    x_off = rows * D + col  # [1, BM, BH, BDH] int64
    xmask = (rows < M) & cmask
    hm_off = rows * H + h_i  # [1, BM, BH, 1]
    hmask = (rows < M) & (h_i < H)
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [BS, 1, BH, BDH] q * g
    if DT > 0:  # a second tile for each head's last DT channels (DH = BDH + DT): no padding lanes
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        x_off_t = rows * D + col_t
        xmask_t = hmask
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)  # [BS, 1, BH, DT]

    if HAS_PRIOR:  # the prior enters as a source with score lse_prior and value o (BS == 1)
        m_i = tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0)
        l_i = tl.full([BS, BM, BH, 1], 1.0, tl.float32)
        acc = tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
        if DT > 0:
            acc_t = tl.load(prior_ptr + x_off_t, mask=xmask_t, other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BS, BM, BH, 1], float("-inf"), tl.float32)
        l_i = tl.full([BS, BM, BH, 1], 0.0, tl.float32)
        acc = tl.full([BS, BM, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            acc_t = tl.full([BS, BM, BH, DT], 0.0, tl.float32)

    # Sources are loaded PF iterations ahead (PREFETCH), so that PF + 1 tiles are in flight per
    # program (the offset table has spare entries; a load past the last source is masked off by rows).
    off = tl.multiple_of(tl.load(src_offs), ALIGN)
    v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
    if DT > 0:
        v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
    if PF == 2:  # a second source in flight
        off = tl.multiple_of(tl.load(src_offs + 1), ALIGN)
        v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 1, M, 0)) & cmask, other=0.0)
        if DT > 0:
            v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 1, M, 0)) & (h_i < H), other=0.0)
    for i in range(n_src):
        v = v_next.to(tl.float32)  # [1, BM, BH, BDH]
        off = tl.multiple_of(tl.load(src_offs + i + PF), ALIGN)
        if PF == 2:
            v_next = v_next2
            v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & cmask, other=0.0)
        else:
            v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
        sq = tl.reduce(tl.reduce(v * v, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)  # [1, BM, 1, 1]
        s = tl.reduce(w * v, 3, _ADD, keep_dims=True)  # [BS, BM, BH, 1]
        if DT > 0:
            v_t = v_next_t.to(tl.float32)  # [1, BM, BH, DT]
            if PF == 2:
                v_next_t = v_next2_t
                v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & (h_i < H), other=0.0)
            else:
                v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
            sq += tl.reduce(tl.reduce(v_t * v_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            s += tl.reduce(w_t * v_t, 3, _ADD, keep_dims=True)
        rstd = 1.0 / tl.sqrt(sq / D + eps)
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward, written by the first group's programs
            tl.store(rstd_ptr + tl.cast(i, tl.int64) * M + rows, rstd, mask=rows < tl.where(pid % n_groups == 0, M, 0))
        s = s * rstd
        if STORE_SCORES:
            tl.store(scores_ptr + tl.cast(i, tl.int64) * M * H + hm_off, s, mask=hmask)
        m_new = tl.maximum(m_i, s)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * scale + p
        acc = acc * scale + p * v
        if DT > 0:
            acc_t = acc_t * scale + p * v_t
        m_i = m_new

    routed = acc / l_i
    if DT > 0:
        routed_t = acc_t / l_i
    tl.store(lse_ptr + s_i.to(tl.int64) * M * H + hm_off, m_i + tl.log(l_i), mask=smask & hmask)
    if STORE_ROUTED:  # the routed value r as well (fused norm, BS == 1; before the additive form's stream and gate): the backward's one pass (SAVE_ROUTED)
        tl.store(routed_ptr + x_off, routed.to(routed_ptr.dtype.element_ty), mask=xmask)
        if DT > 0:
            tl.store(routed_ptr + x_off_t, routed_t.to(routed_ptr.dtype.element_ty), mask=xmask_t)
    if ADDITIVE:  # Delta AttnRes: out = stream + gate * r (BS == 1)
        routed = (
            tl.load(stream_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            + tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32) * routed
        )
        if DT > 0:
            routed_t = (
                tl.load(stream_ptr + x_off_t, mask=xmask_t, other=0.0).to(tl.float32)
                + tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32) * routed_t
            )
    if NORM:  # the next sublayer's RMSNorm over the whole width (BS == 1): y = out * rstd(out) * weight
        sq_n = tl.reduce(tl.reduce(routed * routed, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
        if DT > 0:
            sq_n += tl.reduce(tl.reduce(routed_t * routed_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
        n_rstd = 1.0 / tl.sqrt(sq_n / D + norm_eps)  # [1, BM, 1, 1]
        routed = routed * n_rstd * tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if DT > 0:
            routed_t = routed_t * n_rstd * tl.load(nw_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
    o_off = tl.load(out_offs + s_i, mask=smask, other=0)  # [BS, 1, 1, 1]
    tl.store(out_base + o_off + x_off, routed.to(out_base.dtype.element_ty), mask=smask & xmask)
    if DT > 0:
        tl.store(out_base + o_off + x_off_t, routed_t.to(out_base.dtype.element_ty), mask=smask & xmask_t)


def _route_bwd(
    src_base, src_offs, n_src, n_rep, pre_offs,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    gate_ptr,
    prior_ptr, prior_lse_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc,
    dw_ptr, dgate_ptr, dprior_ptr, dprior_lse_ptr,
    nw_ptr, dnw_ptr, stream_ptr, dstream_ptr, dstream_acc_ptr, rstd_ptr,
    M, eps, num_tiles, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr, PF: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_DLSE: tl.constexpr, NORM: tl.constexpr, ACC: tl.constexpr,
    STREAM_ACC: tl.constexpr, REPLAY: tl.constexpr, REBUILD: tl.constexpr, SAVED_R: tl.constexpr, N_PRE: tl.constexpr,
    HAS_RSTD: tl.constexpr, ONE: tl.constexpr, TILE_PF: tl.constexpr,
):
    # Source i's gradient goes to dsrc_base + dsrc_offs[i]; with ACC, sources i < n_acc add to it
    # acc_base + acc_offs[i] (a gradient sink's sum so far, see _route_bwd_sources). With
    # STREAM_ACC the stream's gradient (fused norm, additive form) adds dstream_acc_ptr's likewise.
    # With REPLAY (fused norm, additive form, a float32 stream) stream_ptr holds the stream at the
    # group's start and the stream is that plus the sources, added in order in float32 as the
    # forward's torch additions did (bit-identical), while pass one reads the sources anyway;
    # N_PRE > 0 earlier outputs (src_base + pre_offs[k], the sublayers between that start and the
    # group's, in order) are added to it first (unrolled: their loads do not wait on each other).
    # With REBUILD too (block routing, n_src == 1) the table holds n_rep tensors, a block's outputs:
    # the one source is their running sum, rebuilt in both passes and rounded to the sources' dtype
    # after each addition as torch's additions round (bf16: to nearest even, on the bits, since
    # the interpreter's cast truncates), and the stream adds the outputs, not the running sum.
    # With SAVED_R (fused norm, BS == 1, not REBUILD) prior_ptr holds the routed value r the
    # forward stored (STORE_ROUTED), not the prior: the norm's backward and D = <dr, r>_h need no
    # pass over the sources with scores (with REPLAY, one that only adds them to the stream), so
    # one pass writes the source gradients, and the prior's lse gradient p_alpha (<dr, o>_h - D)
    # is formed as D - sum_i alpha_i <dr, v_i>_h - p_alpha D after it.
    # With HAS_RSTD each source's key rstd ([N, M] float32, the forward's, SAVE_RSTD_MERGES) is loaded
    # in both passes instead of reducing each source tile over the width (across warps) again.
    # With ONE (exactly one source, DT == 0, none of REBUILD, SAVED_R, HAS_RSTD: block routing's
    # merges) pass one keeps the source, its rstd, scores and weights in registers for pass two,
    # which then neither reloads the source nor reduces its squares and scores over the width again.
    # With TILE_PF too (the replacement form's fused-norm merge) each program loads its next tile's
    # inputs (output gradient, lse, prior and its lse, the source, the sink's addend) while it
    # computes on this one's.
    # Every lane tensor has a twin ``*_t`` over each head's last DT channels when DT > 0 (see
    # _route_fwd); sums over a head add the two.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s_i = tl.arange(0, BS)[:, None, None, None]
    m_i = tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    smask = s_i < n_sites
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [BS, 1, BH, BDH]
    s_1d = tl.arange(0, BS)
    g_off = tl.multiple_of(tl.load(g_offs + s_1d, mask=s_1d < n_sites, other=0), G_ALIGN)[:, None, None, None]
    dw_acc = tl.full([BS, 1, BH, BDH], 0.0, tl.float32)
    if DT > 0:
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)
        dw_acc_t = tl.full([BS, 1, BH, DT], 0.0, tl.float32)
    if ADDITIVE:
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dgate_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dgate_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)
    if NORM:  # the fused RMSNorm's weight (BS == 1, a prior; either form)
        nw = tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dnw_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            nw_t = tl.load(nw_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dnw_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)

    if TILE_PF:  # this program's first tile (the loop repeats these loads for each next tile: a
        # shared @triton.jit helper cannot be called from the interpreter-wrapped kernel CI runs)
        src1 = tl.multiple_of(tl.load(src_offs), ALIGN)
        if ACC:
            acc1 = tl.multiple_of(tl.load(acc_offs), ALIGN)
        rows_n = tl.cast(pid, tl.int64) * BM + m_i
        x_n = rows_n * D + col
        hm_n = rows_n * H + h_i
        hmask_n = (rows_n < M) & (h_i < H)
        dout_n = tl.load(g_base + g_off + x_n, mask=smask & (rows_n < M) & cmask, other=0.0)
        lse_n = tl.load(lse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)
        po_n = tl.load(prior_ptr + x_n, mask=(rows_n < M) & cmask, other=0.0)
        plse_n = tl.load(prior_lse_ptr + hm_n, mask=hmask_n, other=0.0)
        v1_n = tl.load(src_base + src1 + x_n, mask=(rows_n < M) & cmask, other=0.0)
        if ACC:
            acc_n = tl.load(acc_base + acc1 + x_n, mask=(rows_n < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
        if HAS_DLSE:
            dlse_n = tl.load(dlse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)

    # Persistent programs: tile pid, pid + nprog, ... so that dw is summed in registers over many
    # tiles and each program writes one partial; the order is fixed, hence deterministic.
    for tile in range(pid, num_tiles, nprog):
        rows = tl.cast(tile, tl.int64) * BM + m_i
        x_off = rows * D + col
        xmask = (rows < M) & cmask
        hm_off = rows * H + h_i
        hmask = (rows < M) & (h_i < H)
        sh_off = s_i.to(tl.int64) * M * H + hm_off  # [BS, BM, BH, 1]
        shmask = smask & hmask
        if TILE_PF:  # this tile's inputs, loaded during the last one; the next tile's issued now
            dout = dout_n.to(tl.float32)
            lse = lse_n
            po = po_n.to(tl.float32)
            p_alpha = tl.exp(plse_n - lse)
            v1 = v1_n.to(tl.float32)
            if ACC:
                acc = acc_n
            if HAS_DLSE:
                dlse = dlse_n
            rows_n = rows + tl.cast(nprog, tl.int64) * BM
            x_n = rows_n * D + col
            hm_n = rows_n * H + h_i
            hmask_n = (rows_n < M) & (h_i < H)
            dout_n = tl.load(g_base + g_off + x_n, mask=smask & (rows_n < M) & cmask, other=0.0)
            lse_n = tl.load(lse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)
            po_n = tl.load(prior_ptr + x_n, mask=(rows_n < M) & cmask, other=0.0)
            plse_n = tl.load(prior_lse_ptr + hm_n, mask=hmask_n, other=0.0)
            v1_n = tl.load(src_base + src1 + x_n, mask=(rows_n < M) & cmask, other=0.0)
            if ACC:
                acc_n = tl.load(acc_base + acc1 + x_n, mask=(rows_n < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
            if HAS_DLSE:
                dlse_n = tl.load(dlse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)
        else:
            dout = tl.load(g_base + g_off + x_off, mask=smask & xmask, other=0.0).to(tl.float32)  # [BS, BM, BH, BDH]
        if ADDITIVE:
            dr = dout * gate
        else:
            dr = dout
        if DT > 0:
            x_off_t = rows * D + col_t
            dout_t = tl.load(g_base + g_off + x_off_t, mask=shmask, other=0.0).to(tl.float32)  # [BS, BM, BH, DT]
            if ADDITIVE:
                dr_t = dout_t * gate_t
            else:
                dr_t = dout_t
        if not TILE_PF:
            lse = tl.load(lse_ptr + sh_off, mask=shmask, other=0.0)

        # pass 1: D = sum_i alpha_i <dr, v_i>_h (and r itself for the gate's gradient); with NORM
        # r itself, from which dr (the norm's backward) and then D = <dr, r>_h follow
        dsum = tl.full([BS, BM, BH, 1], 0.0, tl.float32)
        if ADDITIVE or NORM:
            racc = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
            if DT > 0:
                racc_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
        if NORM and ADDITIVE:  # the stream (REPLAY: at the group's start, the sources added below)
            hs = tl.load(stream_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            if DT > 0:
                hs_t = tl.load(stream_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if REPLAY:  # from an earlier group's start: the outputs in between first, in order
                for k in tl.static_range(N_PRE):
                    p_off = tl.multiple_of(tl.load(pre_offs + k), ALIGN)
                    hs = hs + tl.load(src_base + p_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    if DT > 0:
                        hs_t = hs_t + tl.load(src_base + p_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
        if SAVED_R:  # r itself: no pass over the sources with scores before the norm's backward
            p_alpha = tl.exp(tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0) - lse)
            racc += tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            if DT > 0:
                racc_t += tl.load(prior_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if REPLAY:  # the additive form's stream: its group's start plus the sources, in order, as pass one adds them
                for i in range(n_src):
                    r_off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
                    hs = hs + tl.load(src_base + r_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    if DT > 0:
                        hs_t = hs_t + tl.load(src_base + r_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
        elif HAS_PRIOR:
            if not TILE_PF:
                po = tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
                p_alpha = tl.exp(tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0) - lse)
            if DT > 0:
                po_t = tl.load(prior_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if not NORM:
                p_a = tl.reduce(dr * po, 3, _ADD, keep_dims=True)
                if DT > 0:
                    p_a += tl.reduce(dr_t * po_t, 3, _ADD, keep_dims=True)
                dsum += p_alpha * p_a
            if ADDITIVE or NORM:
                racc += tl.reduce(p_alpha * po, 0, _ADD, keep_dims=True)
                if DT > 0:
                    racc_t += tl.reduce(p_alpha * po_t, 0, _ADD, keep_dims=True)
        if ONE:  # pass one over the one source, whose values pass two reuses
            if not TILE_PF:
                off = tl.multiple_of(tl.load(src_offs), ALIGN)
                v1 = tl.load(src_base + off + x_off, mask=xmask, other=0.0).to(tl.float32)
            sq1 = tl.reduce(tl.reduce(v1 * v1, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            rstd1 = 1.0 / tl.sqrt(sq1 / D + eps)  # [1, BM, 1, 1]
            s1 = tl.reduce(w * v1, 3, _ADD, keep_dims=True) * rstd1  # [BS, BM, BH, 1]
            alpha1 = tl.where(shmask, tl.exp(s1 - lse), 0.0)
            if not NORM:
                dsum += alpha1 * tl.reduce(dr * v1, 3, _ADD, keep_dims=True)
            if ADDITIVE or NORM:
                racc += tl.reduce(alpha1 * v1, 0, _ADD, keep_dims=True)
            if REPLAY:
                hs = hs + v1
        elif not SAVED_R:  # pass one proper
            off = tl.multiple_of(tl.load(src_offs), ALIGN)
            v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
            if DT > 0:
                v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
            if REBUILD:  # source 0: the running sum of the table's n_rep outputs; the stream adds each
                hs = hs + v_next.to(tl.float32)
                if DT > 0:
                    hs_t = hs_t + v_next_t.to(tl.float32)
                for k in range(1, n_rep):
                    o_off = tl.multiple_of(tl.load(src_offs + k), ALIGN)
                    o = tl.load(src_base + o_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    hs = hs + o
                    run_s = v_next.to(tl.float32) + o
                    if src_base.dtype.element_ty == tl.bfloat16:  # round to nearest even on the bits
                        bits = run_s.to(tl.uint32, bitcast=True)
                        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                        run_s = tl.where(run_s == run_s, bits.to(tl.float32, bitcast=True), run_s)
                    v_next = run_s.to(src_base.dtype.element_ty)
                    if DT > 0:
                        o_t = tl.load(src_base + o_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                        hs_t = hs_t + o_t
                        run_t = v_next_t.to(tl.float32) + o_t
                        if src_base.dtype.element_ty == tl.bfloat16:
                            bits_t = run_t.to(tl.uint32, bitcast=True)
                            bits_t = ((bits_t + 0x7FFF + ((bits_t >> 16) & 1)) >> 16) << 16
                            run_t = tl.where(run_t == run_t, bits_t.to(tl.float32, bitcast=True), run_t)
                        v_next_t = run_t.to(src_base.dtype.element_ty)
            if PF == 2:  # a second source in flight
                off = tl.multiple_of(tl.load(src_offs + 1), ALIGN)
                v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 1, M, 0)) & cmask, other=0.0)
                if DT > 0:
                    v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 1, M, 0)) & (h_i < H), other=0.0)
            for i in range(n_src):
                v = v_next.to(tl.float32)
                off = tl.multiple_of(tl.load(src_offs + i + PF), ALIGN)
                if PF == 2:
                    v_next = v_next2
                    v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & cmask, other=0.0)
                else:
                    v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
                if not HAS_RSTD:
                    sq = tl.reduce(tl.reduce(v * v, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                sc = tl.reduce(w * v, 3, _ADD, keep_dims=True)
                if not NORM:
                    a = tl.reduce(dr * v, 3, _ADD, keep_dims=True)
                if DT > 0:
                    v_t = v_next_t.to(tl.float32)
                    if PF == 2:
                        v_next_t = v_next2_t
                        v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & (h_i < H), other=0.0)
                    else:
                        v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                    if not HAS_RSTD:
                        sq += tl.reduce(tl.reduce(v_t * v_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                    sc += tl.reduce(w_t * v_t, 3, _ADD, keep_dims=True)
                    if not NORM:
                        a += tl.reduce(dr_t * v_t, 3, _ADD, keep_dims=True)
                if HAS_RSTD:
                    rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
                else:
                    rstd = 1.0 / tl.sqrt(sq / D + eps)
                alpha = tl.exp(sc * rstd - lse)
                if not NORM:
                    dsum += alpha * a
                if ADDITIVE or NORM:
                    racc += tl.reduce(alpha * v, 0, _ADD, keep_dims=True)
                    if DT > 0:
                        racc_t += tl.reduce(alpha * v_t, 0, _ADD, keep_dims=True)
                if REPLAY:
                    if not REBUILD:  # (REBUILD: the stream added the outputs above)
                        hs = hs + v
                        if DT > 0:
                            hs_t = hs_t + v_t
        if NORM:
            # the norm's backward: dx = rstd_n * (weight * dy - x^ <weight * dy, x^> / d), x^ = rstd_n * x
            # over the whole width, x = r (or stream + gate * r); then dout = dx stands for the
            # gradient of the op's output before the norm, dr = dx (or gate * dx), D = <dr, r>_h
            # and the prior's <dr, o>_h
            if ADDITIVE:
                xn = hs + gate * racc
                if DT > 0:
                    xn_t = hs_t + gate_t * racc_t
            else:
                xn = racc
                if DT > 0:
                    xn_t = racc_t
            sq_n = tl.reduce(tl.reduce(xn * xn, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            if DT > 0:
                sq_n += tl.reduce(tl.reduce(xn_t * xn_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            n_rstd = 1.0 / tl.sqrt(sq_n / D + norm_eps)  # [1, BM, 1, 1]
            gy = dout * nw
            c_n = tl.reduce(tl.reduce(gy * xn, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            dnw_acc += tl.reduce(dout * (xn * n_rstd), 1, _ADD, keep_dims=True)
            if DT > 0:
                gy_t = dout_t * nw_t
                c_n += tl.reduce(tl.reduce(gy_t * xn_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                dnw_acc_t += tl.reduce(dout_t * (xn_t * n_rstd), 1, _ADD, keep_dims=True)
            c_n = c_n * (n_rstd * n_rstd / D)
            dout = n_rstd * (gy - xn * c_n)
            if DT > 0:
                dout_t = n_rstd * (gy_t - xn_t * c_n)
            if ADDITIVE:
                if STREAM_ACC:
                    ds_sum = dout + tl.load(dstream_acc_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
                    tl.store(dstream_ptr + x_off, ds_sum.to(dstream_ptr.dtype.element_ty), mask=xmask)
                else:
                    tl.store(dstream_ptr + x_off, dout.to(dstream_ptr.dtype.element_ty), mask=xmask)
                dr = dout * gate
                if DT > 0:
                    if STREAM_ACC:
                        ds_sum_t = dout_t + tl.load(dstream_acc_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                        tl.store(dstream_ptr + x_off_t, ds_sum_t.to(dstream_ptr.dtype.element_ty), mask=hmask)
                    else:
                        tl.store(dstream_ptr + x_off_t, dout_t.to(dstream_ptr.dtype.element_ty), mask=hmask)
                    dr_t = dout_t * gate_t
            else:
                dr = dout
                if DT > 0:
                    dr_t = dout_t
            dsum += tl.reduce(dr * racc, 3, _ADD, keep_dims=True)
            if DT > 0:
                dsum += tl.reduce(dr_t * racc_t, 3, _ADD, keep_dims=True)
            if SAVED_R:
                d_r = dsum  # D = <dr, r>_h, before the lse's gradient enters
                a_sum = tl.full([BS, BM, BH, 1], 0.0, tl.float32)  # sum_i alpha_i <dr, v_i>_h, from pass two
            elif HAS_PRIOR:  # (route_norm: a fused norm over sources alone)
                p_a = tl.reduce(dr * po, 3, _ADD, keep_dims=True)
                if DT > 0:
                    p_a += tl.reduce(dr_t * po_t, 3, _ADD, keep_dims=True)
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            if TILE_PF:
                dsum -= dlse
            else:
                dsum -= tl.load(dlse_ptr + sh_off, mask=shmask, other=0.0)
        if ADDITIVE:
            dgate_acc += tl.reduce(tl.reduce(dout, 0, _ADD, keep_dims=True) * racc, 1, _ADD, keep_dims=True)
            if DT > 0:
                dgate_acc_t += tl.reduce(tl.reduce(dout_t, 0, _ADD, keep_dims=True) * racc_t, 1, _ADD, keep_dims=True)
        if HAS_PRIOR:
            tl.store(dprior_ptr + x_off, (p_alpha * dr).to(dprior_ptr.dtype.element_ty), mask=xmask)
            if DT > 0:
                tl.store(dprior_ptr + x_off_t, (p_alpha * dr_t).to(dprior_ptr.dtype.element_ty), mask=hmask)
            if not SAVED_R:
                tl.store(dprior_lse_ptr + hm_off, p_alpha * (p_a - dsum), mask=hmask)

        # pass 2: every source gradient, and dw summed over this program's tokens
        if ONE:
            if ACC and not TILE_PF:
                a_off = tl.multiple_of(tl.load(acc_offs), ALIGN)
                acc = tl.load(acc_base + a_off + x_off, mask=(rows < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
            ds = alpha1 * (tl.reduce(dr * v1, 3, _ADD, keep_dims=True) - dsum)
            t = tl.reduce(tl.reduce(ds * s1, 2, _ADD, keep_dims=True), 0, _ADD, keep_dims=True) / D  # [1, BM, 1, 1]
            dv = tl.reduce(alpha1 * dr, 0, _ADD, keep_dims=True)  # through the weighted sum
            dv += rstd1 * tl.reduce(ds * w, 0, _ADD, keep_dims=True)  # through the score
            dv -= v1 * (rstd1 * rstd1 * t)  # through the key's rstd
            if ACC:
                dv += acc.to(tl.float32)
            d_off = tl.multiple_of(tl.load(dsrc_offs), ALIGN)
            tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
            dw_acc += tl.reduce(ds * (v1 * rstd1), 1, _ADD, keep_dims=True)
        n_two = n_src  # pass two's loop: none after ONE's
        if ONE:
            n_two = 0
        off = tl.multiple_of(tl.load(src_offs), ALIGN)
        v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_two > 0, M, 0)) & cmask, other=0.0)
        if DT > 0:
            v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_two > 0, M, 0)) & (h_i < H), other=0.0)
        if REBUILD:  # the running sum again, as in pass one
            for k in range(1, n_rep):
                o_off = tl.multiple_of(tl.load(src_offs + k), ALIGN)
                run_s = v_next.to(tl.float32) + tl.load(src_base + o_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                if src_base.dtype.element_ty == tl.bfloat16:
                    bits = run_s.to(tl.uint32, bitcast=True)
                    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                    run_s = tl.where(run_s == run_s, bits.to(tl.float32, bitcast=True), run_s)
                v_next = run_s.to(src_base.dtype.element_ty)
                if DT > 0:
                    run_t = v_next_t.to(tl.float32) + tl.load(src_base + o_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                    if src_base.dtype.element_ty == tl.bfloat16:
                        bits_t = run_t.to(tl.uint32, bitcast=True)
                        bits_t = ((bits_t + 0x7FFF + ((bits_t >> 16) & 1)) >> 16) << 16
                        run_t = tl.where(run_t == run_t, bits_t.to(tl.float32, bitcast=True), run_t)
                    v_next_t = run_t.to(src_base.dtype.element_ty)
        if PF == 2:  # a second source in flight
            off = tl.multiple_of(tl.load(src_offs + 1), ALIGN)
            v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 1, M, 0)) & cmask, other=0.0)
            if DT > 0:
                v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 1, M, 0)) & (h_i < H), other=0.0)
        for i in range(n_two):
            v = v_next.to(tl.float32)
            if ACC:  # the sink's addend, issued before the products: its latency overlaps them
                a_off = tl.multiple_of(tl.load(acc_offs + i), ALIGN)
                acc_rows = rows < tl.where(i < n_acc, M, 0)
                acc = tl.load(acc_base + a_off + x_off, mask=acc_rows & cmask, other=0.0)
                if DT > 0:
                    acc_t = tl.load(acc_base + a_off + x_off_t, mask=acc_rows & (h_i < H), other=0.0)
            off = tl.multiple_of(tl.load(src_offs + i + PF), ALIGN)
            if PF == 2:
                v_next = v_next2
                v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & cmask, other=0.0)
            else:
                v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
            if not HAS_RSTD:
                sq = tl.reduce(tl.reduce(v * v, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
            sc = tl.reduce(w * v, 3, _ADD, keep_dims=True)
            a = tl.reduce(dr * v, 3, _ADD, keep_dims=True)
            if DT > 0:
                v_t = v_next_t.to(tl.float32)
                if PF == 2:
                    v_next_t = v_next2_t
                    v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & (h_i < H), other=0.0)
                else:
                    v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                if not HAS_RSTD:
                    sq += tl.reduce(tl.reduce(v_t * v_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                sc += tl.reduce(w_t * v_t, 3, _ADD, keep_dims=True)
                a += tl.reduce(dr_t * v_t, 3, _ADD, keep_dims=True)
            if HAS_RSTD:
                rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
            else:
                rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
            s = sc * rstd  # [BS, BM, BH, 1]
            alpha = tl.where(shmask, tl.exp(s - lse), 0.0)
            ds = alpha * (a - dsum)
            if SAVED_R:
                a_sum += alpha * a
            t = tl.reduce(tl.reduce(ds * s, 2, _ADD, keep_dims=True), 0, _ADD, keep_dims=True) / D  # [1, BM, 1, 1]
            dv = tl.reduce(alpha * dr, 0, _ADD, keep_dims=True)  # through the weighted sum
            dv += rstd * tl.reduce(ds * w, 0, _ADD, keep_dims=True)  # through the score
            dv -= v * (rstd * rstd * t)  # through the key's rstd
            d_off = tl.multiple_of(tl.load(dsrc_offs + i), ALIGN)
            if ACC:
                dv += acc.to(tl.float32)
            tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
            dw_acc += tl.reduce(ds * (v * rstd), 1, _ADD, keep_dims=True)
            if DT > 0:
                dv_t = tl.reduce(alpha * dr_t, 0, _ADD, keep_dims=True)
                dv_t += rstd * tl.reduce(ds * w_t, 0, _ADD, keep_dims=True)
                dv_t -= v_t * (rstd * rstd * t)
                if ACC:
                    dv_t += acc_t.to(tl.float32)
                tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=hmask)
                dw_acc_t += tl.reduce(ds * (v_t * rstd), 1, _ADD, keep_dims=True)
        if SAVED_R:  # p_alpha <dr, o>_h = D - sum_i alpha_i <dr, v_i>_h, since r = p_alpha o + sum_i alpha_i v_i
            tl.store(dprior_lse_ptr + hm_off, d_r - a_sum - p_alpha * dsum, mask=hmask)

    tl.store(dw_ptr + (pid * n_sites + s_i).to(tl.int64) * D + col, dw_acc, mask=smask & cmask)
    if DT > 0:
        tl.store(dw_ptr + (pid * n_sites + s_i).to(tl.int64) * D + col_t, dw_acc_t, mask=smask & (h_i < H))
    if ADDITIVE:
        tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col, dgate_acc, mask=cmask)
        if DT > 0:
            tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col_t, dgate_acc_t, mask=h_i < H)
    if NORM:
        tl.store(dnw_ptr + tl.cast(pid, tl.int64) * D + col, dnw_acc, mask=cmask)
        if DT > 0:
            tl.store(dnw_ptr + tl.cast(pid, tl.int64) * D + col_t, dnw_acc_t, mask=h_i < H)


def _route_bwd_stats(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    gate_ptr, dgate_ptr,
    dsum_ptr, dw_ptr, sa_ptr, rstd_ptr,
    M, eps, num_tiles, progs_per_group,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr, PF: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, HAS_DLSE: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_RSTD: tl.constexpr,
):
    # Site-loop backward, pass one: per (site, token) D = sum_i alpha_i <dr, v_i>_h - dlse (and the
    # score s_i and a_i = <dr, v_i>_h of every source, stored for pass two: [S, N, M, H, 2]), and
    # this program's share of dw = sum_tokens sum_i ds_i rstd_i v_i, which one loop gives as
    # sum_tokens (X - D * Y) with X = sum_i alpha_i a_i rstd_i v_i, Y = sum_i alpha_i rstd_i v_i.
    # Program pid serves the group of BS sites pid % n_groups (a source tile is loaded, converted
    # and normalised once for the group; the groups of a tile run side by side and share its source
    # tiles through L2) and tiles pid // n_groups, + progs_per_group, ... (fixed order).
    # Additive form (one site, BS == 1): dr = gate * dout, and this program's share of
    # d gate = sum_tokens dout * r, with r = sum_i alpha_i v_i formed on the way.
    # Lane tensors have twins ``*_t`` over each head's last DT channels when DT > 0 (see _route_fwd).
    pid = tl.program_id(0)
    n_groups = (n_sites + BS - 1) // BS
    s_1d = (pid % n_groups) * BS + tl.arange(0, BS)
    s_i = s_1d[:, None, None, None]  # [BS, 1, 1, 1]
    smask = s_i < n_sites
    m_i = tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [BS, 1, BH, BDH]
    g_off = tl.multiple_of(tl.load(g_offs + s_1d, mask=s_1d < n_sites, other=0), G_ALIGN)[:, None, None, None]
    dw_acc = tl.full([BS, 1, BH, BDH], 0.0, tl.float32)
    if DT > 0:
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)
        dw_acc_t = tl.full([BS, 1, BH, DT], 0.0, tl.float32)
    if ADDITIVE:
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dgate_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dgate_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)
    for tile in range(pid // n_groups, num_tiles, progs_per_group):
        rows = tl.cast(tile, tl.int64) * BM + m_i
        x_off = rows * D + col
        xmask = (rows < M) & cmask
        hm_off = rows * H + h_i
        hmask = (rows < M) & (h_i < H)
        sh_off = s_i.to(tl.int64) * M * H + hm_off  # [BS, BM, BH, 1]
        shmask = smask & hmask
        dout = tl.load(g_base + g_off + x_off, mask=smask & xmask, other=0.0).to(tl.float32)  # [BS, BM, BH, BDH]
        if ADDITIVE:
            dr = dout * gate
            racc = tl.full([BS, BM, BH, BDH], 0.0, tl.float32)
        else:
            dr = dout
        if DT > 0:
            x_off_t = rows * D + col_t
            dout_t = tl.load(g_base + g_off + x_off_t, mask=shmask, other=0.0).to(tl.float32)  # [BS, BM, BH, DT]
            if ADDITIVE:
                dr_t = dout_t * gate_t
                racc_t = tl.full([BS, BM, BH, DT], 0.0, tl.float32)
            else:
                dr_t = dout_t
            xacc_t = tl.full([BS, BM, BH, DT], 0.0, tl.float32)
            yacc_t = tl.full([BS, BM, BH, DT], 0.0, tl.float32)
        lse = tl.load(lse_ptr + sh_off, mask=shmask, other=0.0)
        dsum = tl.full([BS, BM, BH, 1], 0.0, tl.float32)
        xacc = tl.full([BS, BM, BH, BDH], 0.0, tl.float32)
        yacc = tl.full([BS, BM, BH, BDH], 0.0, tl.float32)
        off = tl.multiple_of(tl.load(src_offs), ALIGN)
        v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
        if DT > 0:
            v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
        if PF == 2:  # a second source in flight
            off = tl.multiple_of(tl.load(src_offs + 1), ALIGN)
            v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 1, M, 0)) & cmask, other=0.0)
            if DT > 0:
                v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 1, M, 0)) & (h_i < H), other=0.0)
        for i in range(n_src):
            v = v_next.to(tl.float32)  # [1, BM, BH, BDH]
            off = tl.multiple_of(tl.load(src_offs + i + PF), ALIGN)
            if PF == 2:
                v_next = v_next2
                v_next2 = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & cmask, other=0.0)
            else:
                v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
            sc = tl.reduce(w * v, 3, _ADD, keep_dims=True)  # [BS, BM, BH, 1]
            a = tl.reduce(dr * v, 3, _ADD, keep_dims=True)
            if DT > 0:
                v_t = v_next_t.to(tl.float32)  # [1, BM, BH, DT]
                if PF == 2:
                    v_next_t = v_next2_t
                    v_next2_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 2 < n_src, M, 0)) & (h_i < H), other=0.0)
                else:
                    v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                sc += tl.reduce(w_t * v_t, 3, _ADD, keep_dims=True)
                a += tl.reduce(dr_t * v_t, 3, _ADD, keep_dims=True)
            if HAS_RSTD:  # saved by the forward: no reduction over the width (across warps) here
                rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
            else:
                sq = tl.reduce(tl.reduce(v * v, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                if DT > 0:
                    sq += tl.reduce(tl.reduce(v_t * v_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
                rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
            sc = sc * rstd
            alpha = tl.exp(sc - lse)
            sa_off = ((s_i.to(tl.int64) * n_src + i) * M * H + hm_off) * 2
            tl.store(sa_ptr + sa_off, sc, mask=shmask)
            tl.store(sa_ptr + sa_off + 1, a, mask=shmask)
            dsum += alpha * a
            ar = alpha * rstd
            xacc += (ar * a) * v
            yacc += ar * v
            if ADDITIVE:
                racc += alpha * v
            if DT > 0:
                xacc_t += (ar * a) * v_t
                yacc_t += ar * v_t
                if ADDITIVE:
                    racc_t += alpha * v_t
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            dsum -= tl.load(dlse_ptr + sh_off, mask=shmask, other=0.0)
        tl.store(dsum_ptr + sh_off, dsum, mask=shmask)
        dw_acc += tl.reduce(xacc - dsum * yacc, 1, _ADD, keep_dims=True)
        if ADDITIVE:
            dgate_acc += tl.reduce(tl.reduce(dout * racc, 0, _ADD, keep_dims=True), 1, _ADD, keep_dims=True)
        if DT > 0:
            dw_acc_t += tl.reduce(xacc_t - dsum * yacc_t, 1, _ADD, keep_dims=True)
            if ADDITIVE:
                dgate_acc_t += tl.reduce(tl.reduce(dout_t * racc_t, 0, _ADD, keep_dims=True), 1, _ADD, keep_dims=True)
    # partial row of (site, this program's share): [progs_per_group, n_sites, d], summed by the host
    part = tl.cast(pid // n_groups, tl.int64) * n_sites + s_i
    tl.store(dw_ptr + part * D + col, dw_acc, mask=smask & cmask)
    if DT > 0:
        tl.store(dw_ptr + part * D + col_t, dw_acc_t, mask=smask & (h_i < H))
    if ADDITIVE:
        tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col, dgate_acc, mask=cmask)
        if DT > 0:
            tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col_t, dgate_acc_t, mask=h_i < H)


def _route_fwd_sites_mix(
    src_base, src_offs, n_src, w_ptr, wlo_ptr, n_sites, out_base, out_offs, lse_ptr, rstd_ptr, M, eps, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, STORE_RSTD: tl.constexpr, DOT_F32: tl.constexpr,
):
    # What ``_route_fwd_sites_dot`` computes (DOT_FWD_MIX, a head width that is one power-of-two tile): the
    # scores on tensor cores without repeating the weights per token, the weighted sum on the vector
    # units. Per tile of BM tokens, after the key rstd (each (token, source) row's squares summed
    # over the width), per head h:
    #   sc = rstd * W V^T                          [BS, BM*BN]: W [BS, DH] (sites padded to BS >= 16
    #                                              rows, bf16x2 split), V [BM*BN, DH] rows (token, source)
    #   alpha = softmax over each token's BN columns  [BS, BM, BN], the padding sites zeroed, then
    #                                              folded to BSO = pow2(sites) rows and laid out [BM, BSO, BN]
    #   out[t, s] = sum_i alpha[t, s, i] v_i[t]    [BM, BSO, DH] float32, source by source
    # Every product of the score dot is used (the block-diagonal form wastes BM - 1 of every BM), the
    # weighted sum is float32 products and sums (alpha not split into bf16 halves) and mixes no
    # tokens, so a non-finite value stays in its token's outputs without masking. Each source tile
    # is read three times per tile (the rstd, the score dot, the weighted sum): once from memory,
    # then mostly from cache.
    pid = tl.program_id(0)
    q = tl.arange(0, BM * BN)  # rows (token, source) of the score dot
    j_q = q % BN
    m_q = q // BN
    jmask = j_q < n_src
    c = tl.arange(0, DH)
    s_w = tl.arange(0, BS)
    wmask = s_w[:, None] < n_sites
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    m_1 = tl.arange(0, BM)
    s_o = tl.arange(0, BSO)[None, :, None]  # [1, BSO, 1]
    o_off = tl.load(out_offs + s_o, mask=s_o < n_sites, other=0)  # [1, BSO, 1]
    j3 = tl.arange(0, BN)[None, None, :]  # [1, 1, BN]
    for tile in range(pid, num_tiles, progs):
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        qmask = jmask & (rows_q < M)
        rows_1 = tl.cast(tile, tl.int64) * BM + m_1  # [BM]
        tmask = rows_1 < M
        sq = tl.full([BM * BN], 0.0, tl.float32)
        for h in range(H):
            v = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
            sq += tl.reduce(v * v, 1, _ADD)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [BM*BN]
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward
            tl.store(rstd_ptr + j_q.to(tl.int64) * M + rows_q, rstd, mask=qmask)
        rstd3 = tl.reshape(rstd, [BM, BN])[None, :, :]  # [1, BM, BN]
        live = (j3 < n_src) & tmask[None, :, None]  # [1, BM, BN]
        for h in range(H):
            col = h * DH + c  # [DH]
            w = tl.load(w_ptr + s_w[:, None] * D + col[None, :], mask=wmask, other=0.0)  # [BS, DH] bf16: W's hi half
            w_lo = tl.load(wlo_ptr + s_w[:, None] * D + col[None, :], mask=wmask, other=0.0)
            v = tl.load(src_base + off + rows_q[:, None] * D + col[None, :], mask=qmask[:, None], other=0.0)  # [BM*BN, DH]
            if DOT_F32:
                w = w.to(tl.float32)
                w_lo = w_lo.to(tl.float32)
                v = v.to(tl.float32)
            vt = tl.trans(v)
            if DOT_F32:
                sc = tl.dot(w, vt, input_precision="ieee")
                sc = tl.dot(w_lo, vt, sc, input_precision="ieee")
            else:
                sc = tl.dot(w, vt)
                sc = tl.dot(w_lo, vt, sc)
            sc3 = tl.reshape(sc, [BS, BM, BN]) * rstd3
            mx = tl.reduce(tl.where(live, sc3, float("-inf")), 2, _MAX)  # [BS, BM]
            p = tl.where(live, tl.exp(sc3 - mx[:, :, None]), 0.0)
            l = tl.reduce(p, 2, _ADD)  # [BS, BM]
            tl.store(lse_ptr + (s_w[:, None].to(tl.int64) * M + rows_1[None, :]) * H + h, mx + tl.log(tl.where(l > 0, l, 1.0)),
                     mask=(s_w[:, None] < n_sites) & tmask[None, :])
            alpha = tl.where(s_w[:, None, None] < n_sites, p / tl.where(l > 0, l, 1.0)[:, :, None], 0.0)  # [BS, BM, BN]
            if BS > BSO:  # the padding rows are zero: fold them away
                alpha = tl.reduce(tl.reshape(alpha, [BS // BSO, BSO, BM, BN]), 0, _ADD)
            alpha = tl.permute(alpha, (1, 0, 2))  # [BM, BSO, BN]
            acc = tl.full([BM, BSO, DH], 0.0, tl.float32)
            for i in range(n_src):
                a_i = tl.reduce(tl.where(j3 == i, alpha, 0.0), 2, _ADD)  # [BM, BSO]
                i_off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
                v_i = tl.load(src_base + i_off + rows_1[:, None] * D + col[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)  # [BM, DH]
                acc += a_i[:, :, None] * v_i[:, None, :]
            tl.store(out_base + o_off + rows_1[:, None, None] * D + col[None, None, :], acc.to(out_base.dtype.element_ty),
                     mask=(s_o < n_sites) & tmask[:, None, None])


def _route_fwd_sites_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    out_base, out_offs,
    lse_ptr, rstd_ptr,
    M, eps, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, STORE_RSTD: tl.constexpr, DOT_F32: tl.constexpr,
):
    # Phase one forward on tensor cores (bf16 sources, replacement form, no prior): the outputs of
    # ``_route_fwd`` for all S <= BS sites of a pass, with every N <= BN source of a token in one
    # tile (``_dot_tile``'s tiles, as in ``_route_bwd_stats_dot``). Program p takes token tiles p,
    # p + progs, ... and, per tile, first sums each (token, source) row's squares over the whole
    # width (the key rstd), then per head h forms
    #   sc = rstd * W V^T,  alpha = softmax over the row's own token,  out = alpha V     [BM*BS, DHP]
    # with W = q * g and alpha as bf16x2 splits (hi + lo). Each source is read once per pass for all
    # sites (twice per tile: the second read, per head, mostly from L2), where the vector kernel
    # reads it once per FWD_SITES sites. Products across tokens are masked with where, and the
    # values enter alpha V with non-finite entries zeroed: alpha is 0 for other tokens' rows, and
    # 0 * inf would spread an inf to every token of the tile; a token whose own source holds one gets
    # a non-finite score, so its outputs are non-finite as on the vector kernel. With DT > 0 a head's
    # DH = DHP + DT columns are two tiles (``_dot_lanes``): every product gains its twin over the last
    # DT columns, and no column is padding.
    pid = tl.program_id(0)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # rows (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    if DT > 0:
        c_t = DHP + tl.arange(0, DT)[None, :]  # [1, DT] a head's last DT columns
    smask = s_r < n_sites
    jmask = j_q < n_src
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    o_off = tl.load(out_offs + s_r, mask=smask, other=0)[:, None]  # [BM*BS, 1]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        sq = tl.full([BM * BN], 0.0, tl.float32)
        for h in range(H):
            v = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c_1[None, :], mask=qmask[:, None] & cmask, other=0.0).to(tl.float32)
            sq += tl.reduce(v * v, 1, _ADD)
            if DT > 0:
                v_t = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c_t, mask=qmask[:, None], other=0.0).to(tl.float32)
                sq += tl.reduce(v_t * v_t, 1, _ADD)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [BM*BN]
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward
            tl.store(rstd_ptr + j_q.to(tl.int64) * M + rows_q, rstd, mask=qmask)
        live = same & rmask[:, None] & qmask[None, :]
        for h in range(H):
            col = h * DH + c_1[None, :]  # [1, DHP]
            w_off = s_r[:, None] * D + col
            w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16: W's hi half
            w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
            v = tl.load(src_base + off + rows_q[:, None] * D + col, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
            if DOT_F32:
                w = w.to(tl.float32)
                w_lo = w_lo.to(tl.float32)
                v = v.to(tl.float32)
            vt = tl.trans(v)
            if DOT_F32:
                sc = tl.dot(w, vt, input_precision="ieee")
                sc = tl.dot(w_lo, vt, sc, input_precision="ieee")
            else:
                sc = tl.dot(w, vt)
                sc = tl.dot(w_lo, vt, sc)
            if DT > 0:
                col_t = h * DH + c_t  # [1, DT]
                w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
                w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
                v_t = tl.load(src_base + off + rows_q[:, None] * D + col_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
                if DOT_F32:
                    w_t = w_t.to(tl.float32)
                    w_lo_t = w_lo_t.to(tl.float32)
                    v_t = v_t.to(tl.float32)
                vt_t = tl.trans(v_t)
                if DOT_F32:
                    sc = tl.dot(w_t, vt_t, sc, input_precision="ieee")
                    sc = tl.dot(w_lo_t, vt_t, sc, input_precision="ieee")
                else:
                    sc = tl.dot(w_t, vt_t, sc)
                    sc = tl.dot(w_lo_t, vt_t, sc)
            sc = sc * rstd[None, :]
            m = tl.reduce(tl.where(live, sc, float("-inf")), 1, _MAX)  # [BM*BS]
            p = tl.where(live, tl.exp(sc - m[:, None]), 0.0)
            l = tl.reduce(p, 1, _ADD)
            tl.store(lse_ptr + (s_r.to(tl.int64) * M + rows_r) * H + h, m + tl.log(l), mask=rmask)
            alpha = p / tl.where(l > 0, l, 1.0)[:, None]
            a_hi = alpha.to(tl.bfloat16)
            a_lo = (alpha - a_hi.to(tl.float32)).to(tl.bfloat16)
            v = tl.where(tl.abs(v) < float("inf"), v, 0.0)  # other tokens' rows meet alpha = 0
            if DOT_F32:
                out = tl.dot(a_hi.to(tl.float32), v, input_precision="ieee")
                out = tl.dot(a_lo.to(tl.float32), v, out, input_precision="ieee")
            else:
                out = tl.dot(a_hi, v)
                out = tl.dot(a_lo, v, out)
            tl.store(out_base + o_off + rows_r[:, None] * D + col, out.to(out_base.dtype.element_ty), mask=rmask[:, None] & cmask)
            if DT > 0:
                v_t = tl.where(tl.abs(v_t) < float("inf"), v_t, 0.0)
                if DOT_F32:
                    out_t = tl.dot(a_hi.to(tl.float32), v_t, input_precision="ieee")
                    out_t = tl.dot(a_lo.to(tl.float32), v_t, out_t, input_precision="ieee")
                else:
                    out_t = tl.dot(a_hi, v_t)
                    out_t = tl.dot(a_lo, v_t, out_t)
                tl.store(out_base + o_off + rows_r[:, None] * D + col_t, out_t.to(out_base.dtype.element_ty), mask=rmask[:, None])


def _route_bwd_stats_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    dsum_ptr, dw_ptr, sa_ptr, rstd_ptr, t_ptr,
    M, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, HAS_DLSE: tl.constexpr, DOT_F32: tl.constexpr,
    STORE_SA: tl.constexpr, STORE_T: tl.constexpr,
):
    # Site-loop backward, pass one, on tensor cores (bf16 sources and gradients): the outputs of
    # ``_route_bwd_stats`` (replacement form, saved key rstd, all N <= BN sources in one tile, head
    # width DH padded to DHP, a power of two >= 16, by masked columns). Program (p, h) serves head h
    # of token tiles p, p + progs, ... A tile of BM tokens is held as rows (token, site) [BM*BS, DHP]
    # (the sites' output gradients dR; the weights W = q * g repeated per token) and rows
    # (token, source) [BM*BN, DHP] (V), so
    #   sc = rstd * W V^T,  a = dR V^T                                        [BM*BS, BM*BN]
    # are plain products, of which only the blocks where both rows' tokens agree are used (the
    # rest, BM - 1 of every BM products, is masked off). With every source of a token in the
    # tile, D = sum_i alpha_i a_i - dlse is complete before the weight gradient's product
    #   dw += (ds * rstd) V,  ds = alpha * (a - D)                            [BM*BS, DHP]
    # (rows summed per site at the end): no second pass, no X - D * Y cancellation.
    # The float32 factors (W, the coefficients) enter as a bf16x2 split, hi + lo: each product is
    # exact to about 2^-17 relative, sums are float32; V and dR are bf16 already. The scores are
    # thus within about 2^-17 |<w, v>| rstd of float32 ones (an absolute error in the exponent:
    # harmless next to bf16 outputs, though the query gradient is less exact than the vector
    # kernel's at large score spreads). DOT_F32 (the interpreter, whose bf16 ``tl.dot`` is wrong)
    # multiplies the same bf16 values in float32. STORE_SA writes the scores and a for the vector
    # pass two; STORE_T instead writes this head's share of the key norm's term
    # t = sum_s ds_s * sc_s per (source, token) ([N, M, H] float32) for ``_route_bwd_sources_dot``.
    # DT > 0: a head's last DT columns are a second tile (``_route_fwd_sites_dot``).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # columns (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    col = h * DH + c_1[None, :]  # [1, DHP]
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    smask = s_r < n_sites
    jmask = j_q < n_src
    w_off = s_r[:, None] * D + col
    w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16: W's hi half
    w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
    if DOT_F32:
        w = w.to(tl.float32)
        w_lo = w_lo.to(tl.float32)
    g_off = tl.multiple_of(tl.load(g_offs + s_r, mask=smask, other=0), G_ALIGN)[:, None]  # [BM*BS, 1]
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    dw_acc = tl.full([BM * BS, DHP], 0.0, tl.float32)
    if DT > 0:
        col_t = h * DH + DHP + tl.arange(0, DT)[None, :]  # [1, DT]
        w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
        w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
        if DOT_F32:
            w_t = w_t.to(tl.float32)
            w_lo_t = w_lo_t.to(tl.float32)
        dw_acc_t = tl.full([BM * BS, DT], 0.0, tl.float32)
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r  # token of each row
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        dr = tl.load(g_base + g_off + rows_r[:, None] * D + col, mask=rmask[:, None] & cmask, other=0.0)  # [BM*BS, DHP]
        v = tl.load(src_base + off + rows_q[:, None] * D + col, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
        if DT > 0:
            dr_t = tl.load(g_base + g_off + rows_r[:, None] * D + col_t, mask=rmask[:, None], other=0.0)  # [BM*BS, DT]
            v_t = tl.load(src_base + off + rows_q[:, None] * D + col_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
        sh_r = (s_r.to(tl.int64) * M + rows_r) * H + h  # (site, token, head) of each row
        lse = tl.load(lse_ptr + sh_r, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + j_q.to(tl.int64) * M + rows_q, mask=qmask, other=1.0)[None, :]  # [1, BM*BN]
        if DOT_F32:
            dr = dr.to(tl.float32)
            v = v.to(tl.float32)
        vt = tl.trans(v)
        if DOT_F32:
            sc = tl.dot(w, vt, input_precision="ieee")
            sc = tl.dot(w_lo, vt, sc, input_precision="ieee")
            a = tl.dot(dr, vt, input_precision="ieee")
        else:
            sc = tl.dot(w, vt)
            sc = tl.dot(w_lo, vt, sc)
            a = tl.dot(dr, vt)
        if DT > 0:
            if DOT_F32:
                dr_t = dr_t.to(tl.float32)
                v_t = v_t.to(tl.float32)
            vt_t = tl.trans(v_t)
            if DOT_F32:
                sc = tl.dot(w_t, vt_t, sc, input_precision="ieee")
                sc = tl.dot(w_lo_t, vt_t, sc, input_precision="ieee")
                a = tl.dot(dr_t, vt_t, a, input_precision="ieee")
            else:
                sc = tl.dot(w_t, vt_t, sc)
                sc = tl.dot(w_lo_t, vt_t, sc)
                a = tl.dot(dr_t, vt_t, a)
        sc = sc * rstd
        # where, not a product with a zero weight: a non-finite value of one token stays in its rows
        live = same & rmask[:, None] & qmask[None, :]
        alpha = tl.where(live, tl.exp(sc - lse[:, None]), 0.0)
        if STORE_SA:
            sa_off = ((s_r[:, None].to(tl.int64) * n_src + j_q[None, :]) * M + rows_r[:, None]) * (H * 2) + h * 2
            tl.store(sa_ptr + sa_off, sc, mask=live)
            tl.store(sa_ptr + sa_off + 1, a, mask=live)
        dsum = tl.reduce(tl.where(live, alpha * a, 0.0), 1, _ADD)  # [BM*BS]
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            dsum -= tl.load(dlse_ptr + sh_r, mask=rmask, other=0.0)
        tl.store(dsum_ptr + sh_r, dsum, mask=rmask)
        ds = tl.where(live, alpha * (a - dsum[:, None]), 0.0)
        if STORE_T:
            t = tl.reduce(tl.where(live, ds * sc, 0.0), 0, _ADD)  # [BM*BN]: this head's share, summed over the sites
            tl.store(t_ptr + (j_q.to(tl.int64) * M + rows_q) * H + h, t, mask=qmask)
        coef = ds * rstd
        c_hi = coef.to(tl.bfloat16)
        c_lo = (coef - c_hi.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:
            dw_acc = tl.dot(c_hi.to(tl.float32), v, dw_acc, input_precision="ieee")
            dw_acc = tl.dot(c_lo.to(tl.float32), v, dw_acc, input_precision="ieee")
        else:
            dw_acc = tl.dot(c_hi, v, dw_acc)
            dw_acc = tl.dot(c_lo, v, dw_acc)
        if DT > 0:
            if DOT_F32:
                dw_acc_t = tl.dot(c_hi.to(tl.float32), v_t, dw_acc_t, input_precision="ieee")
                dw_acc_t = tl.dot(c_lo.to(tl.float32), v_t, dw_acc_t, input_precision="ieee")
            else:
                dw_acc_t = tl.dot(c_hi, v_t, dw_acc_t)
                dw_acc_t = tl.dot(c_lo, v_t, dw_acc_t)
    # rows (token, site) summed per site; partial row of (site, this program's share):
    # [progs, n_sites, d], summed by the host
    dw = tl.reduce(tl.reshape(dw_acc, [BM, BS, DHP]), 0, _ADD)  # [BS, DHP]
    s_1 = tl.arange(0, BS)[:, None]
    tl.store(dw_ptr + (tl.cast(pid, tl.int64) * n_sites + s_1) * D + col, dw, mask=(s_1 < n_sites) & cmask)
    if DT > 0:
        dw_t = tl.reduce(tl.reshape(dw_acc_t, [BM, BS, DT]), 0, _ADD)  # [BS, DT]
        tl.store(dw_ptr + (tl.cast(pid, tl.int64) * n_sites + s_1) * D + col_t, dw_t, mask=s_1 < n_sites)


def _route_bwd_sources_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dsum_ptr, rstd_ptr, t_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc,
    M, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, DOT_F32: tl.constexpr, ACC: tl.constexpr,
):
    # Site-loop backward, pass two, on tensor cores (bf16, after ``_route_bwd_stats_dot`` with
    # STORE_T): the source gradients of ``_route_bwd_sources``,
    #   dv = alpha^T dR + (ds * rstd)^T W - v rstd^2 t / d,      rows (token, source) [BM*BN, DHP]
    # on tiles laid out as ``_route_bwd_stats_dot``'s (program (p, h): head h of every progs-th tile
    # of BM tokens), recomputing the scores and a = <dr, v> as there (no [S, N, M, H, 2] round trip)
    # and summing t over the heads from the partials pass one stored. The host launches it once per
    # chunk of at most DOT_SOURCES_CHUNK sources, each with its own tile: n_src, n_acc, the offset
    # tables, rstd and t then count from the chunk's first source. The coefficients and W enter
    # as bf16x2 splits (hi * hi + hi * lo + lo * hi); dR and V are bf16 already. With ACC, source
    # i < n_acc adds acc_base + acc_offs[i] (a gradient sink's sum so far). DT > 0: a head's last DT
    # columns are a second tile (``_route_fwd_sites_dot``).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # rows (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    col = h * DH + c_1[None, :]  # [1, DHP]
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    smask = s_r < n_sites
    jmask = j_q < n_src
    w_off = s_r[:, None] * D + col
    w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16 hi
    w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
    if DOT_F32:
        w = w.to(tl.float32)
        w_lo = w_lo.to(tl.float32)
    g_off = tl.multiple_of(tl.load(g_offs + s_r, mask=smask, other=0), G_ALIGN)[:, None]  # [BM*BS, 1]
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    d_off = tl.multiple_of(tl.load(dsrc_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]
    if ACC:
        amask = j_q < n_acc
        a_off = tl.multiple_of(tl.load(acc_offs + j_q, mask=amask, other=0), ALIGN)[:, None]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    h_1 = tl.arange(0, BH)
    if DT > 0:
        col_t = h * DH + DHP + tl.arange(0, DT)[None, :]  # [1, DT]
        w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
        w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
        if DOT_F32:
            w_t = w_t.to(tl.float32)
            w_lo_t = w_lo_t.to(tl.float32)
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        dr = tl.load(g_base + g_off + rows_r[:, None] * D + col, mask=rmask[:, None] & cmask, other=0.0)  # [BM*BS, DHP]
        x_off = rows_q[:, None] * D + col
        v = tl.load(src_base + off + x_off, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
        if ACC:  # issued with the values: its latency overlaps theirs and the products
            acc = tl.load(acc_base + a_off + x_off, mask=(qmask & amask)[:, None] & cmask, other=0.0)
        if DT > 0:
            dr_t = tl.load(g_base + g_off + rows_r[:, None] * D + col_t, mask=rmask[:, None], other=0.0)  # [BM*BS, DT]
            x_off_t = rows_q[:, None] * D + col_t
            v_t = tl.load(src_base + off + x_off_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
            if ACC:
                acc_t = tl.load(acc_base + a_off + x_off_t, mask=(qmask & amask)[:, None], other=0.0)
        sh_r = (s_r.to(tl.int64) * M + rows_r) * H + h
        lse = tl.load(lse_ptr + sh_r, mask=rmask, other=0.0)
        dsum = tl.load(dsum_ptr + sh_r, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + j_q.to(tl.int64) * M + rows_q, mask=qmask, other=1.0)  # [BM*BN]
        t_off = ((j_q.to(tl.int64) * M + rows_q) * H)[:, None] + h_1[None, :]
        t = tl.reduce(tl.load(t_ptr + t_off, mask=qmask[:, None] & (h_1[None, :] < H), other=0.0), 1, _ADD)  # [BM*BN]
        if DOT_F32:
            dr = dr.to(tl.float32)
            v = v.to(tl.float32)
        vt = tl.trans(v)
        if DOT_F32:
            sc = tl.dot(w, vt, input_precision="ieee")
            sc = tl.dot(w_lo, vt, sc, input_precision="ieee")
            a = tl.dot(dr, vt, input_precision="ieee")
        else:
            sc = tl.dot(w, vt)
            sc = tl.dot(w_lo, vt, sc)
            a = tl.dot(dr, vt)
        if DT > 0:
            if DOT_F32:
                dr_t = dr_t.to(tl.float32)
                v_t = v_t.to(tl.float32)
            vt_t = tl.trans(v_t)
            if DOT_F32:
                sc = tl.dot(w_t, vt_t, sc, input_precision="ieee")
                sc = tl.dot(w_lo_t, vt_t, sc, input_precision="ieee")
                a = tl.dot(dr_t, vt_t, a, input_precision="ieee")
            else:
                sc = tl.dot(w_t, vt_t, sc)
                sc = tl.dot(w_lo_t, vt_t, sc)
                a = tl.dot(dr_t, vt_t, a)
        sc = sc * rstd[None, :]
        live = same & rmask[:, None] & qmask[None, :]
        alpha = tl.where(live, tl.exp(sc - lse[:, None]), 0.0)
        coef = tl.trans(tl.where(live, alpha * (a - dsum[:, None]), 0.0) * rstd[None, :])  # (ds * rstd)^T [BM*BN, BM*BS]
        alpha_t = tl.trans(alpha)
        p_hi = alpha_t.to(tl.bfloat16)
        p_lo = (alpha_t - p_hi.to(tl.float32)).to(tl.bfloat16)
        c_hi = coef.to(tl.bfloat16)
        c_lo = (coef - c_hi.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:
            dv = tl.dot(p_hi.to(tl.float32), dr, input_precision="ieee")
            dv = tl.dot(p_lo.to(tl.float32), dr, dv, input_precision="ieee")
            dv = tl.dot(c_hi.to(tl.float32), w, dv, input_precision="ieee")
            dv = tl.dot(c_hi.to(tl.float32), w_lo, dv, input_precision="ieee")
            dv = tl.dot(c_lo.to(tl.float32), w, dv, input_precision="ieee")
        else:
            dv = tl.dot(p_hi, dr)
            dv = tl.dot(p_lo, dr, dv)
            dv = tl.dot(c_hi, w, dv)
            dv = tl.dot(c_hi, w_lo, dv)
            dv = tl.dot(c_lo, w, dv)
        dv -= v.to(tl.float32) * (rstd * rstd * t / D)[:, None]
        if ACC:
            dv += acc.to(tl.float32)
        tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=qmask[:, None] & cmask)
        if DT > 0:
            if DOT_F32:
                dv_t = tl.dot(p_hi.to(tl.float32), dr_t, input_precision="ieee")
                dv_t = tl.dot(p_lo.to(tl.float32), dr_t, dv_t, input_precision="ieee")
                dv_t = tl.dot(c_hi.to(tl.float32), w_t, dv_t, input_precision="ieee")
                dv_t = tl.dot(c_hi.to(tl.float32), w_lo_t, dv_t, input_precision="ieee")
                dv_t = tl.dot(c_lo.to(tl.float32), w_t, dv_t, input_precision="ieee")
            else:
                dv_t = tl.dot(p_hi, dr_t)
                dv_t = tl.dot(p_lo, dr_t, dv_t)
                dv_t = tl.dot(c_hi, w_t, dv_t)
                dv_t = tl.dot(c_hi, w_lo_t, dv_t)
                dv_t = tl.dot(c_lo, w_t, dv_t)
            dv_t -= v_t.to(tl.float32) * (rstd * rstd * t / D)[:, None]
            if ACC:
                dv_t += acc_t.to(tl.float32)
            tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=qmask[:, None])


def _route_bwd_sources(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dsum_ptr, sa_ptr,
    gate_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc, rstd_ptr,
    M, eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr,
    BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, ADDITIVE: tl.constexpr, HAS_RSTD: tl.constexpr,
    ACC: tl.constexpr,
):
    # Site-loop backward, pass two: one program per (token tile, source), the source varying
    # fastest (the programs of a tile share the sites' gradient tiles through L2). The source tile
    # stays in registers while the sites go by:
    #   dv = sum_s alpha_s dr_s + rstd ds_s w_s - v rstd^2 sum_s sum_h ds_s s_s / d,
    # with the scores s_s and <dr_s, v>_h that pass one stored: no reduction over lanes per site.
    # Source i's gradient goes to dsrc_base + dsrc_offs[i]; with ACC, sources i < n_acc add to it
    # acc_base + acc_offs[i] (a gradient sink's sum so far; the same place to add in place).
    pid = tl.program_id(0)
    i = pid % n_src
    rows = tl.cast(pid // n_src, tl.int64) * BM + tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    x_off = rows * D + col
    xmask = (rows < M) & cmask
    hm_off = rows * H + h_i
    hmask = (rows < M) & (h_i < H)
    off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
    v = tl.load(src_base + off + x_off, mask=xmask, other=0.0).to(tl.float32)  # [1, BM, BH, BDH]
    if DT > 0:  # lane tensors have twins ``*_t`` over each head's last DT channels (see _route_fwd)
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        x_off_t = rows * D + col_t
        v_t = tl.load(src_base + off + x_off_t, mask=hmask, other=0.0).to(tl.float32)  # [1, BM, BH, DT]
        dv_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
    else:
        sq = tl.reduce(tl.reduce(v * v, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
        if DT > 0:
            sq += tl.reduce(tl.reduce(v_t * v_t, 3, _ADD, keep_dims=True), 2, _ADD, keep_dims=True)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
    dv = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
    t = tl.full([1, BM, BH, 1], 0.0, tl.float32)
    g_off = tl.multiple_of(tl.load(g_offs), G_ALIGN)
    dr_next = tl.load(g_base + g_off + x_off, mask=xmask, other=0.0)
    if DT > 0:
        dr_next_t = tl.load(g_base + g_off + x_off_t, mask=hmask, other=0.0)
    if ADDITIVE:  # one site: dr = gate * dout
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
    for s in range(n_sites):
        dr = dr_next.to(tl.float32)
        if ADDITIVE:
            dr = dr * gate
        g_off = tl.multiple_of(tl.load(g_offs + s + 1), G_ALIGN)
        dr_next = tl.load(g_base + g_off + x_off, mask=(rows < tl.where(s + 1 < n_sites, M, 0)) & cmask, other=0.0)
        if DT > 0:
            dr_t = dr_next_t.to(tl.float32)
            if ADDITIVE:
                dr_t = dr_t * gate_t
            dr_next_t = tl.load(g_base + g_off + x_off_t, mask=(rows < tl.where(s + 1 < n_sites, M, 0)) & (h_i < H), other=0.0)
        w = tl.load(w_ptr + s * D + col, mask=cmask, other=0.0)  # [1, 1, BH, BDH]
        sh_off = tl.cast(s, tl.int64) * M * H + hm_off
        sa_off = ((tl.cast(s, tl.int64) * n_src + i) * M * H + hm_off) * 2
        sc = tl.load(sa_ptr + sa_off, mask=hmask, other=0.0)  # [1, BM, BH, 1]
        alpha = tl.exp(sc - tl.load(lse_ptr + sh_off, mask=hmask, other=0.0))
        ds = alpha * (tl.load(sa_ptr + sa_off + 1, mask=hmask, other=0.0) - tl.load(dsum_ptr + sh_off, mask=hmask, other=0.0))
        dv += alpha * dr + (rstd * ds) * w
        if DT > 0:
            w_t = tl.load(w_ptr + s * D + col_t, mask=h_i < H, other=0.0)  # [1, 1, BH, DT]
            dv_t += alpha * dr_t + (rstd * ds) * w_t
        t += ds * sc
    t = tl.reduce(t, 2, _ADD, keep_dims=True)  # [1, BM, 1, 1]
    dv -= v * (rstd * rstd * t / D)
    d_off = tl.multiple_of(tl.load(dsrc_offs + i), ALIGN)
    if ACC:
        a_off = tl.multiple_of(tl.load(acc_offs + i), ALIGN)
        acc_rows = rows < tl.where(i < n_acc, M, 0)
        dv += tl.load(acc_base + a_off + x_off, mask=acc_rows & cmask, other=0.0).to(tl.float32)
    tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
    if DT > 0:
        dv_t -= v_t * (rstd * rstd * t / D)
        if ACC:
            dv_t += tl.load(acc_base + a_off + x_off_t, mask=acc_rows & (h_i < H), other=0.0).to(tl.float32)
        tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=hmask)


def _decode_route_norm(
    hist_ptr, n_buf, slot_stride, pend_ptr,
    q_ptr, g_ptr, nw_ptr, stream_ptr, gate_ptr, out_ptr,
    part_ptr, part_ml_ptr, M, n_split,
    prior_out_ptr, prior_lse_ptr, start,
    eps, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr,
    CH: tl.constexpr, NSP: tl.constexpr, PHASE: tl.constexpr,
    HAS_PENDING: tl.constexpr, ACCUMULATE: tl.constexpr, ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr,
):
    # PHASE 0: one program per token: CH slots per iteration ([CH, head, lane] tiles, all loads of
    # an iteration in flight at once), online softmax per head, then the pending sublayer output
    # as the newest source (added into its slot on the way), then finishing. With a prior (the
    # site's routing over slots 0 .. start - 1 from PHASE 3, as out and lse per head) the softmax
    # starts from it and the loop from slot start.
    # PHASE 3 (phase one of a group of sites): program (token, site) routes slots 0 .. n_buf - 1
    # with its site's query (row site of q_ptr, g_ptr) like PHASE 0, and writes out (float32) and
    # lse per head instead of finishing.
    # PHASE 1 (long histories): program (token, k) routes slots k*CH .. k*CH + CH - 1, the pending
    # output among them in the last tile, and writes its partial (acc, max, sum per head, float32);
    # PHASE 2: program (token) merges the n_split partials in order and finishes.
    # Finishing: the additive form, the next RMSNorm, the store. The pending output is routed as
    # stored, like the training path's partial sum.
    tok = tl.program_id(0)
    row = tl.cast(tok, tl.int64) * D
    h_i = tl.arange(0, BH)[None, :, None]
    j_i = tl.arange(0, BDH)[None, None, :]
    col = h_i * DH + j_i  # [1, BH, BDH]
    cmask = (h_i < H) & (j_i < DH)
    if PHASE == 0 or PHASE == 2:  # what finishing reads, loaded first so that its latency overlaps the routing
        nw = tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if ADDITIVE:
            x_stream = tl.load(stream_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
            x_gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    if PHASE == 2:
        k_i = tl.arange(0, NSP)[:, None, None]
        kmask = k_i < n_split
        pk = tl.cast(k_i * M + tok, tl.int64)
        acc_k = tl.load(part_ptr + pk * D + col, mask=kmask & cmask, other=0.0)  # [NSP, BH, BDH]
        ml_off = (pk * H + h_i) * 2
        m_k = tl.load(part_ml_ptr + ml_off, mask=kmask & (h_i < H), other=float("-inf"))  # [NSP, BH, 1]
        l_k = tl.load(part_ml_ptr + ml_off + 1, mask=kmask & (h_i < H), other=0.0)
        # padding heads (H not a power of two) merge as max 0, sum 1: their r is 0, not 0 / 0
        pad = kmask & (h_i >= H)
        m_k = tl.where(pad, 0.0, m_k)
        l_k = tl.where(pad, 1.0, l_k)
        m = tl.reduce(m_k, 0, _MAX, keep_dims=True)
        scale = tl.where(kmask, tl.exp(m_k - m), 0.0)
        r = tl.reduce(acc_k * scale, 0, _ADD, keep_dims=True) / tl.reduce(l_k * scale, 0, _ADD, keep_dims=True)
    elif PHASE == 0 or PHASE == 3:
        c_i = tl.arange(0, CH)[:, None, None]
        site = tl.program_id(1)  # 0 in PHASE 0 (one program per token)
        w = tl.load(q_ptr + site * D + col, mask=cmask, other=0.0).to(tl.float32)
        w *= tl.load(g_ptr + site * D + col, mask=cmask, other=0.0).to(tl.float32)
        if HAS_PRIOR:  # the prior enters as one more source whose score is its lse (padding heads: 0, sum 1)
            m_run = tl.load(prior_lse_ptr + tl.cast(tok, tl.int64) * H + h_i, mask=h_i < H, other=0.0)
            l_run = tl.full([1, BH, 1], 1.0, tl.float32)
            acc = tl.load(prior_out_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
        else:
            m_run = tl.full([1, BH, 1], float("-inf"), tl.float32)
            l_run = tl.full([1, BH, 1], 0.0, tl.float32)
            acc = tl.full([1, BH, BDH], 0.0, tl.float32)
        if HAS_PENDING:  # loaded before the loop (its latency overlaps it), stored after
            slot_ptr = hist_ptr + tl.cast(n_buf, tl.int64) * slot_stride + row + col
            o = tl.load(pend_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
            if ACCUMULATE:
                o += tl.load(slot_ptr, mask=cmask, other=0.0).to(tl.float32)
        for c0 in range(start, n_buf, CH):
            slot = c0 + c_i
            smask = slot < n_buf
            v = tl.load(hist_ptr + tl.cast(slot, tl.int64) * slot_stride + row + col, mask=smask & cmask, other=0.0).to(tl.float32)
            sq = tl.reduce(tl.reduce(v * v, 2, _ADD, keep_dims=True), 1, _ADD, keep_dims=True)  # [CH, 1, 1]
            sc = tl.reduce(w * v, 2, _ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [CH, BH, 1]
            sc = tl.where(smask, sc, float("-inf"))
            m_new = tl.maximum(m_run, tl.reduce(sc, 0, _MAX, keep_dims=True))
            p = tl.exp(sc - m_new)
            scale = tl.exp(m_run - m_new)
            l_run = l_run * scale + tl.reduce(p, 0, _ADD, keep_dims=True)
            acc = acc * scale + tl.reduce(p * v, 0, _ADD, keep_dims=True)
            m_run = m_new
        if HAS_PENDING:
            if ACCUMULATE:
                # threads holding copies of one element (narrow d) must all have read it before any writes
                tl.debug_barrier()
            o = o.to(hist_ptr.dtype.element_ty)
            tl.store(slot_ptr, o, mask=cmask)
            o = o.to(tl.float32)  # routed as stored, like the training path's partial sum
            sq = tl.reduce(tl.reduce(o * o, 2, _ADD, keep_dims=True), 1, _ADD, keep_dims=True)
            sc = tl.reduce(w * o, 2, _ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [1, BH, 1]
            m_new = tl.maximum(m_run, sc)
            p = tl.exp(sc - m_new)
            scale = tl.exp(m_run - m_new)
            l_run = l_run * scale + p
            acc = acc * scale + p * o
        r = acc / l_run
        if PHASE == 3:
            site_tok = tl.cast(site * M + tok, tl.int64)
            tl.store(part_ptr + site_tok * D + col, r, mask=cmask)
            tl.store(part_ml_ptr + site_tok * H + h_i, m_run + tl.log(l_run), mask=h_i < H)
    else:
        slot = tl.program_id(1) * CH + tl.arange(0, CH)[:, None, None]  # [CH, 1, 1]
        slot_off = tl.cast(slot, tl.int64) * slot_stride + row + col
        w = tl.load(q_ptr + col, mask=cmask, other=0.0).to(tl.float32) * tl.load(g_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        n_read = n_buf + 1 if ACCUMULATE else n_buf
        v = tl.load(hist_ptr + slot_off, mask=(slot < n_read) & cmask, other=0.0).to(tl.float32)
        if HAS_PENDING:
            is_new = slot == n_buf
            v += tl.load(pend_ptr + row + col + 0 * slot, mask=is_new & cmask, other=0.0).to(tl.float32)
            v = v.to(hist_ptr.dtype.element_ty)
            if ACCUMULATE:
                # threads holding copies of one element (narrow d) must all have read it before any writes
                tl.debug_barrier()
            tl.store(hist_ptr + slot_off, v, mask=is_new & cmask)
            v = v.to(tl.float32)
            valid = slot <= n_buf
        else:
            valid = slot < n_buf
        sq = tl.reduce(tl.reduce(v * v, 2, _ADD, keep_dims=True), 1, _ADD, keep_dims=True)  # [CH, 1, 1]
        sc = tl.reduce(w * v, 2, _ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [CH, BH, 1]
        sc = tl.where(valid, sc, float("-inf"))
        m = tl.reduce(sc, 0, _MAX, keep_dims=True)  # [1, BH, 1]
        p = tl.exp(sc - m)
        l = tl.reduce(p, 0, _ADD, keep_dims=True)
        acc = tl.reduce(p * v, 0, _ADD, keep_dims=True)  # [1, BH, BDH]
        pk = tl.cast(tl.program_id(1) * M + tok, tl.int64)
        tl.store(part_ptr + pk * D + col, acc, mask=cmask)
        ml_off = (pk * H + h_i) * 2
        tl.store(part_ml_ptr + ml_off, m, mask=h_i < H)
        tl.store(part_ml_ptr + ml_off + 1, l, mask=h_i < H)
    if PHASE == 0 or PHASE == 2:
        if ADDITIVE:
            x = (x_stream + x_gate * r).to(stream_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = r.to(hist_ptr.dtype.element_ty).to(tl.float32)
        ms = tl.reduce(tl.reduce(x * x, 2, _ADD, keep_dims=True), 1, _ADD, keep_dims=True) / D
        y = x / tl.sqrt(ms + norm_eps) * nw
        tl.store(out_ptr + row + col, y.to(out_ptr.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's launch arithmetic (``triton.cdiv`` goes through Triton's
    constexpr-function wrapper, about 1.5 us a call with triton 3.9: hundreds of calls a step)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def _kernel(name: str, interpret: bool):
    """The kernel ``name`` compiled for CUDA, or wrapped for Triton's interpreter (CPU tensors).

    Building the interpreted version explicitly (instead of through ``TRITON_INTERPRET``) lets
    one process run both, and does not depend on when the variable was set.
    """
    fn = {
        "fwd": _route_fwd, "bwd": _route_bwd, "bwd_stats": _route_bwd_stats, "bwd_sources": _route_bwd_sources,
        "fwd_sites_dot": _route_fwd_sites_dot, "fwd_sites_mix": _route_fwd_sites_mix, "bwd_stats_dot": _route_bwd_stats_dot, "bwd_sources_dot": _route_bwd_sources_dot,
        "decode": _decode_route_norm,
    }[name]
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_RESIDENT: dict = {}
_RESIDENT_FALLBACKS: dict = {}  # configurations whose registers could not be read, and why
# Backward kernels whose persistent grid is sized by the programs an SM holds (one wave); the others
# launch 32 warps' worth of programs per SM whatever the registers allow. Measured at 350m on an
# H200 (BENCHMARKS.md, fifth set): sizing the two-pass kernel's grid (the merges) took full MHAR's
# merge backward from 19.4 to 15.0 ms per step, while sizing pass one of the site loop made full
# routing's 8-site passes 1.6x slower (52.5 against 33.1 ms per step), so it stays off for that
# kernel. The tensor-core kernels of the site loop take one wave too (their programs stride over
# the token tiles; not compared with other grids). A benchmark knob.
OCCUPANCY_GRIDS = frozenset({"bwd", "fwd_sites_dot", "fwd_sites_mix", "bwd_stats_dot", "bwd_sources_dot"})


def _resident_programs(name: str, device: torch.device, args: tuple, kwargs: dict) -> int:
    """Programs of kernel ``name`` compiled for these arguments that one SM holds at once (its
    registers, shared memory and threads), so that a persistent grid is a whole number of waves.

    Compiles (or finds in Triton's cache) without launching, once per configuration: the answer,
    and so the grid and the fixed order of the partial sums, is the same at every call. Falls back
    to 32 warps' worth of programs where Triton does not report its registers.
    """
    warps = kwargs["num_warps"]
    if name not in OCCUPANCY_GRIDS:
        return max(1, 32 // warps)
    # the compiled kernel also depends on which integer arguments are 1 or multiples of 16 (Triton
    # specialises them), so those facts are part of the configuration
    ints = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int))
    key = (name, device.index or 0, tuple(sorted(kwargs.items())), tuple(a.dtype for a in args if isinstance(a, Tensor)), ints)
    if key not in _RESIDENT:
        fallback = max(1, 32 // warps)
        try:
            compiled = _kernel(name, False).warmup(*args, grid=(1,), **kwargs)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs_per_warp * warps)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
            shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // max(1, compiled.metadata.shared)
            _RESIDENT[key] = max(1, min(by_regs, by_threads, shared, 32))
        except Exception as e:  # noqa: BLE001 - an estimate for the grid only; the launch reports real errors
            _RESIDENT[key] = fallback
            _RESIDENT_FALLBACKS[key] = repr(e)
    return _RESIDENT[key]


def _geometry(d: int, heads: int) -> tuple[int, int, int]:
    """(BH, BDH, padded width) of the [heads, d/heads] register layout. Raises for too wide a d."""
    bh, bdh = _pow2(heads), _pow2(d // heads)
    if bh * bdh > MAX_BLOCK_D:
        raise ValueError(
            f"triton depth routing: width d={d} with heads={heads} pads to {bh * bdh} lanes per token, "
            f"more than the {MAX_BLOCK_D} one program holds; use the reference backend"
        )
    return bh, bdh, bh * bdh


def _lanes(d: int, heads: int) -> tuple[int, int, int, int]:
    """(BH, BDH, DT, lanes per token) of the training kernels' register layout. A head width
    ``d/heads`` that is a sum of two powers of two (96 = 64 + 32, 160 = 128 + 32) is held as two
    tiles of BDH and DT lanes (``SPLIT_WIDTH``), else padded to a power of two (DT = 0). Raises
    ValueError for too wide a d."""
    bh, bdh, bd = _geometry(d, heads)
    dh = d // heads
    if SPLIT_WIDTH and dh != bdh:
        head, rest = bdh // 2, dh - bdh // 2
        if rest & (rest - 1) == 0:  # rest < head, a power of two
            return bh, head, rest, bh * dh
    return bh, bdh, 0, bd


def _tile(kind: str, n_sites: int, d: int, heads: int, interpret: bool) -> tuple[int, int, int, int, int, int]:
    """(BS, BM, num_warps, BH, BDH, DT) for a launch of a training kernel (:func:`_lanes`); raises
    ValueError for an unsupported size."""
    bh, bdh, dt, bd = _lanes(d, heads)
    bs = _pow2(n_sites)
    if bs * bd > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"triton depth routing: {n_sites} sites at width d={d} (heads={heads}) in one pass need "
            f"{bs * bd} fp32 registers per token in the two-pass backward, more than {MAX_TILE_ELEMENTS}; "
            f"route at most {max(1, MAX_TILE_ELEMENTS // bd)} sites per pass with it"
        )
    tuned = None if interpret or kind in WARPS else TUNED_TILES.get((kind, bd, heads), TUNED_TILES.get((kind, bd)))
    if interpret:
        rows = max(1, min(INTERPRET_ROWS, 65536 // (bs * bd)))
    else:
        rows = max(1, (tuned[0] if tuned else TILE_ELEMENTS[kind]) // (bs * bd))
    rows = 1 << (rows.bit_length() - 1)  # a power of two, rounded down
    if interpret:
        return bs, rows, 4, bh, bdh, dt
    if tuned:
        return bs, rows, tuned[1], bh, bdh, dt
    # warps for about ELEMENTS_PER_THREAD elements each, rounded down to a power of two (split widths are not one)
    warps = max(1, bs * rows * bd // (32 * ELEMENTS_PER_THREAD[kind]))
    warps = WARPS.get(kind, max(4, min(16, 1 << (warps.bit_length() - 1))))
    return bs, rows, warps, bh, bdh, dt


def _group_sites(n_sites: int, most: int, d: int, heads: int, padded: bool = False) -> int:
    """Sites per program: the largest power of two <= ``most`` dividing ``n_sites`` (no padding
    sites; with ``padded``, at most ``n_sites``, the last group's spare slots masked) whose tile of
    one token per site fits ``MAX_TILE_ELEMENTS`` at width ``d`` (1 always fits)."""
    most = min(most, max(1, MAX_TILE_ELEMENTS // _lanes(d, heads)[3]))
    group = 1
    while group * 2 <= most and (n_sites % (group * 2) == 0 or (padded and group * 2 <= n_sites)):
        group *= 2
    return group


def _new(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous and 16-byte aligned (the kernels load 16-byte vectors through offset tables)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _offsets(tensors: Sequence[Tensor], base: Tensor) -> Tensor:
    """int64 element offsets of ``tensors`` from ``base`` (same dtype, 16-byte aligned), on its device,
    plus two spare 0s so that the kernels can read the entries ``PREFETCH`` ahead unconditionally."""
    size, start = base.element_size(), base.data_ptr()
    offs = tuple((t.data_ptr() - start) // size for t in tensors) + (0, 0)
    if base.device.type != "cuda":
        return torch.tensor(offs, dtype=torch.int64)
    # Training allocates the same buffers at the same addresses step after step, so a table is
    # usually one already on the device: reuse it (no host-to-device copy). Tables are read-only and
    # never freed (a captured CUDA graph may hold one), so the cache stops growing when full.
    key = (base.device.index, offs)
    table = _OFFSET_TABLES.get(key)
    if table is None:
        host = torch.tensor(offs, dtype=torch.int64, pin_memory=True)
        table = host.to(base.device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            # A CUDA graph captures the copy as a node that re-reads this pinned host memory at
            # every replay: keep it alive and unchanged as long as the process (the device table
            # itself belongs to the graph's memory pool, refilled by that node before each use).
            _CAPTURED_HOST_TABLES.append(host)
        elif len(_OFFSET_TABLES) < _OFFSET_TABLES_MAX:
            _OFFSET_TABLES[key] = table
    return table


_OFFSET_TABLES: dict[tuple, Tensor] = {}
_OFFSET_TABLES_MAX = 4096
_CAPTURED_HOST_TABLES: list[Tensor] = []  # host sides of tables uploaded during CUDA graph capture


def _check_dtypes(sources: Sequence[Tensor]) -> None:
    for i, s in enumerate(sources):
        if s.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton depth routing: sources[{i}] has dtype {s.dtype}; supported: {list(SUPPORTED_DTYPES)}")


def _forward(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    stream: Optional[Tensor], gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    store_scores: bool, save_rstd: bool = False, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
    save_routed: bool = False,
) -> list[Tensor]:
    like = sources[0] if sources else prior_out
    if norm_weight is not None and (queries.shape[0] != 1 or (prior_out is None and (stream is not None or not sources))):
        raise ValueError("triton depth routing: the fused RMSNorm (norm_weight) needs one site, with a prior or (replacement form) sources")
    if save_routed and (norm_weight is None or prior_out is None):
        raise ValueError("triton depth routing: save_routed is for the fused norm's merges (norm_weight and a prior)")
    shape, d = like.shape, like.shape[-1]
    n_sites, n_src, M = queries.shape[0], len(sources), like.numel() // d
    interpret = like.device.type != "cuda"
    if n_sites < SITE_LOOP_MIN_SITES and n_sites > 1:  # the two-pass backward's limit on sites per pass, checked before any work
        _tile("bwd", n_sites, d, heads, interpret)
    group = _group_sites(n_sites, FWD_SITES, d, heads, padded=FWD_SITES_PADDED)
    # a forward with a prior (a merge: one site, few sources) is a launch kind of its own
    _, bm, warps, bh, bdh, dt = _tile("fwd" if prior_out is None and norm_weight is None else "merge_fwd", group, d, heads, interpret)
    srcs = [_aligned(s) for s in sources]
    base = srcs[0] if srcs else _aligned(prior_out)
    w = (queries.float() * gains.float()).contiguous()
    if stream is not None:  # the norm's output in the sources' dtype, else the stream's
        outs = [_new(shape, like.dtype if norm_weight is not None else stream.dtype, like.device)]
    else:
        outs = [_new(shape, like.dtype, like.device) for _ in range(n_sites)]
    lse = _new((n_sites, *shape[:-1], heads), torch.float32, like.device)
    scores = _new((n_src, *shape[:-1], heads) if store_scores else (0,), torch.float32, like.device)
    store_rstd = bool(save_rstd) and n_src > 0
    rstd = _new((n_src, M) if store_rstd else (0,), torch.float32, like.device)
    routed = [_new(shape, SAVED_ROUTED_DTYPE or like.dtype, like.device)] if save_routed else []  # the norm's input r (SAVE_ROUTED)
    dummy = w
    if _fwd_on_dots(n_sites, n_src, d, heads, stream, prior_out, store_scores, norm_weight, like.dtype):
        # phase one on tensor cores: program p takes every progs-th tile of tokens, all heads
        w_hi = w.to(torch.bfloat16)
        w_lo = (w - w_hi.float()).to(torch.bfloat16)
        dhp, dt_dot = _dot_lanes(d // heads)
        src_offs, out_offs = _offsets(srcs, base), _offsets(outs, outs[0])
        if DOT_FWD_MIX and dt_dot == 0 and dhp == d // heads and n_src <= DOT_MIX_MAX_SOURCES:
            bs_mix, bso_mix, bn_mix, bm_mix = _mix_tile(n_sites, n_src)
            tiles = _cdiv(M, bm_mix)
            mix_flags = dict(
                D=d, H=heads, DH=d // heads, BS=bs_mix, BSO=bso_mix, BN=bn_mix, BM=bm_mix, ALIGN=16 // base.element_size(),
                STORE_RSTD=store_rstd, DOT_F32=interpret, num_warps=WARPS.get("fwd_sites_mix", DOT_MIX_WARPS),
            )

            def mix_args(progs: int) -> tuple:
                return (base, src_offs, n_src, w_hi, w_lo, n_sites, outs[0], out_offs, lse, rstd if store_rstd else dummy, M, eps, tiles, progs)

            progs = _dot_programs("fwd_sites_mix", like.device, tiles, 1, mix_args, mix_flags)
            _kernel("fwd_sites_mix", interpret)[(progs,)](*mix_args(progs), **mix_flags)
            return [*outs, lse, scores, rstd]
        bs_dot, bn_dot, bm_dot = _dot_tile(n_sites, n_src, d // heads)
        tiles = _cdiv(M, bm_dot)
        flags = dict(
            D=d, H=heads, DH=d // heads, DHP=dhp, DT=dt_dot, BS=bs_dot, BN=bn_dot, BM=bm_dot,
            ALIGN=16 // base.element_size(),
            STORE_RSTD=store_rstd, DOT_F32=interpret, **_dot_launch("fwd_sites_dot", bm_dot, bn_dot),
        )

        def args(progs: int) -> tuple:
            return (base, src_offs, n_src, w_hi, w_lo, n_sites, outs[0], out_offs, lse, rstd if store_rstd else dummy, M, eps, tiles, progs)

        progs = _dot_programs("fwd_sites_dot", like.device, tiles, 1, args, flags)
        _kernel("fwd_sites_dot", interpret)[(progs,)](*args(progs), **flags)
        return [*outs, lse, scores, rstd]
    _kernel("fwd", interpret)[(_cdiv(M, bm) * _cdiv(n_sites, group),)](
        base, _offsets(srcs, base), n_src,
        w, n_sites,
        outs[0], _offsets(outs, outs[0]),
        lse,
        _aligned(stream) if stream is not None else dummy, gate.contiguous() if gate is not None else dummy,
        _aligned(prior_out) if prior_out is not None else dummy, prior_lse.contiguous() if prior_lse is not None else dummy,
        scores if store_scores else dummy, rstd if store_rstd else dummy,
        norm_weight.contiguous() if norm_weight is not None else dummy, routed[0] if routed else dummy,
        M, eps, float(norm_eps),
        D=d, H=heads, DH=d // heads, BH=bh, BDH=bdh, DT=dt, PF=PREFETCH["fwd"], BS=group, BM=bm, ALIGN=16 // base.element_size(),
        ADDITIVE=stream is not None, HAS_PRIOR=prior_out is not None, STORE_SCORES=store_scores, STORE_RSTD=store_rstd,
        NORM=norm_weight is not None, STORE_ROUTED=save_routed, num_warps=warps,
    )
    return [*outs, lse, scores, rstd, *routed]


def _source_grad_targets(sink: Optional[SinkBinding], n_src: int, like: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor], int]:
    """``(dsrc, targets, addends, n_acc)`` for a backward kernel: without a sink a new ``[N, ..., d]``
    gradient (``targets`` its slices, nothing to add); with one, an empty ``dsrc`` and the sink's
    slot buffers (the kernel adds ``addends[k]`` for ``k < n_acc``; see ``GradientSink.targets``)."""
    if sink is None:
        dsrc = _new((n_src, *like.shape), like.dtype, like.device)
        targets = list(dsrc.unbind(0))
        return dsrc, targets, targets, 0
    targets, addends, n_acc = sink.targets(like, _new)
    return _new((0,), like.dtype, like.device), targets, addends, n_acc


def _uses_site_loop(n_sites: int, n_src: int, has_prior: bool, norm: bool = False) -> bool:
    """Whether the backward of such a pass runs the site-loop kernels (else the two-pass kernel,
    which alone has the fused norm's backward)."""
    return not has_prior and not norm and n_src > 0 and (n_sites >= SITE_LOOP_MIN_SITES or n_src >= SITE_LOOP_MIN_SOURCES)


def _saves_rstd(sources: Sequence[Tensor], queries: Tensor, gains: Tensor, has_prior: bool, norm: bool = False) -> bool:
    """Whether the forward of such a pass writes each source's key rstd ``[N, tokens]`` for its
    backward: a backward that will run (gradients on) and runs the site loop (``SAVE_RSTD``), or a
    merge (a prior or a fused norm: the two-pass kernel, ``SAVE_RSTD_MERGES``)."""
    site_loop = _uses_site_loop(queries.shape[0], len(sources), has_prior, norm)
    return (
        len(sources) > 0
        and ((SAVE_RSTD and site_loop) or (SAVE_RSTD_MERGES and not site_loop and (has_prior or norm)))
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (queries, gains, *sources))
    )


def _saves_routed(
    sources: Sequence[Tensor], queries: Tensor, gains: Tensor, stream: Optional[Tensor], prior_out: Optional[Tensor],
    prior_lse: Optional[Tensor], norm_weight: Optional[Tensor], block_outputs: Optional[Sequence[Tensor]] = None,
) -> bool:
    """Whether an eager call's forward writes and saves the routed value r for a one-pass backward
    (``SAVE_ROUTED``): a merge fused with the norm over at least ``SAVE_ROUTED_MIN_SOURCES`` sources
    of the prior's dtype (the additive form with ``SAVE_ROUTED_ADDITIVE``, not where its running
    sum is rebuilt from ``block_outputs``), and a backward that will run (gradients on, an input
    that requires one), so that inference writes no r."""
    return (
        SAVE_ROUTED and norm_weight is not None and prior_out is not None
        and (stream is None or (SAVE_ROUTED_ADDITIVE and block_outputs is None))
        and len(sources) >= max(1, SAVE_ROUTED_MIN_SOURCES) and prior_out.dtype == sources[0].dtype
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (queries, gains, prior_out, prior_lse, norm_weight, *sources))
    )


def _backward(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    lse: Tensor, grad_outs: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor] = None,
    norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0, stream: Optional[Tensor] = None,
    sink: Optional[SinkBinding] = None, stream_replay: bool = False, rebuild: bool = False, saved_routed: bool = False,
    earlier_outputs: Sequence[Tensor] = (),
) -> list[Tensor]:
    """The fused backward (:func:`route_bwd`); with ``sink`` the source gradients are added into
    the sink's slots inside the kernels and the first returned gradient is an empty tensor. With
    ``stream_replay`` (fused norm, additive form) ``stream`` is the stream at the group's start,
    and the site's stream is that plus the sources in order (``merge_route_norm``'s ``stream_start``);
    with ``rebuild`` too, ``sources`` are a block's outputs, whose running sum is the one source and
    which the stream adds instead (``block_outputs``). With ``saved_routed`` (fused norm, not
    ``rebuild``) ``prior_out`` is the routed value r the forward stored (``save_routed``): the
    kernel runs one pass with scores over the sources instead of two (with ``stream_replay``, and
    one that only adds them to the stream), and ``dprior`` has the sources' dtype (the prior's,
    which r's float32 need not be). ``earlier_outputs`` (with ``stream_replay``; the sources'
    dtype): ``stream`` is the stream at an earlier group's start, to which these are added first
    (``merge_route_norm``'s ``earlier_outputs``)."""
    like = sources[0] if sources else prior_out
    shape, d = like.shape, like.shape[-1]
    n_sites, n_src, M = queries.shape[0], (1 if rebuild else len(sources)), like.numel() // d
    device = like.device
    interpret = device.type != "cuda"
    if _uses_site_loop(n_sites, n_src, prior_out is not None, norm_weight is not None):
        empty = [_new((0,), torch.float32, device) for _ in range(2)]  # no norm: d_norm_weight, d_stream
        return [*_backward_site_loop(sources, queries, gains, heads, eps, gate, lse, grad_outs, grad_lse, rstd, sink), *empty]
    # the additive form (its stream and gate) is a tile kind of its own: it holds more per token
    bs, bm, warps, bh, bdh, dt = _tile("bwd" if gate is None else "bwd_add", n_sites, d, heads, interpret)
    num_tiles = _cdiv(M, bm)
    srcs = [_aligned(s) for s in sources]
    earlier = [_aligned(o) for o in earlier_outputs]
    base = srcs[0] if srcs else earlier[0] if earlier else _aligned(prior_out)
    if earlier and (not stream_replay or any(o.dtype != base.dtype for o in earlier)):
        raise ValueError(
            f"triton depth routing: earlier outputs (dtypes {sorted({str(o.dtype) for o in earlier})}) need a replayed stream "
            f"(stream_replay={stream_replay}) and the dtype of the sources' table, {base.dtype}"
        )
    grads = [_aligned(g) for g in grad_outs]
    if any(g.dtype != grads[0].dtype for g in grads):
        grads = [_aligned(g.to(grads[0].dtype)) for g in grads]
    w = (queries.float() * gains.float()).contiguous()
    dsrc, targets, addends, n_acc = _source_grad_targets(sink, n_src, like) if n_src else (_new((0,), like.dtype, device), [w], [w], 0)
    prior_dtype = like.dtype if saved_routed else prior_out.dtype if prior_out is not None else torch.float32  # (r's may differ)
    dprior = _new(shape if prior_out is not None else (0,), prior_dtype, device)
    dprior_lse = _new(prior_lse.shape if prior_lse is not None else (0,), torch.float32, device)
    dummy = w
    flags = dict(
        D=d, H=heads, DH=d // heads, BH=bh, BDH=bdh, DT=dt, PF=1 if rebuild else PREFETCH["bwd"], BS=bs, BM=bm,
        ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size(),
        ADDITIVE=gate is not None, HAS_PRIOR=prior_out is not None, HAS_DLSE=grad_lse is not None,
        NORM=norm_weight is not None, ACC=n_acc > 0, num_warps=warps,
    )

    head = (
        base, _offsets(srcs, base), n_src, len(srcs), _offsets(earlier, base),
        w, n_sites,
        grads[0], _offsets(grads, grads[0]),
        lse.contiguous(), grad_lse.contiguous() if grad_lse is not None else dummy,
        gate.contiguous() if gate is not None else dummy,
        _aligned(prior_out) if prior_out is not None else dummy, prior_lse.contiguous() if prior_lse is not None else dummy,
        targets[0], _offsets(targets, targets[0]), addends[0], _offsets(addends, addends[0]), n_acc,
    )
    nw = norm_weight.contiguous() if norm_weight is not None else dummy
    norm_stream = norm_weight is not None and gate is not None  # the additive form's stream enters the norm
    if norm_stream and stream is None:
        raise ValueError("triton depth routing: the additive form's fused norm needs the stream in its backward")
    if norm_stream and sink is not None and sink.stream_slot is not None:  # the stream's gradient into its slot
        (dstream,), (dstream_acc,), stream_acc = sink.sink.targets([sink.stream_slot], stream, _new)
    else:
        dstream = _new(shape if norm_stream else (0,), stream.dtype if norm_stream else torch.float32, device)
        dstream_acc, stream_acc = dstream, 0
    flags["STREAM_ACC"] = stream_acc > 0
    flags["REPLAY"] = norm_stream and stream_replay
    flags["REBUILD"] = flags["REPLAY"] and rebuild
    if rebuild and not flags["REBUILD"]:
        raise ValueError("triton depth routing: rebuilding a block's running sum needs the fused norm's replayed stream")
    flags["SAVED_R"] = saved_routed
    flags["N_PRE"] = len(earlier)
    has_rstd = rstd is not None and rstd.numel() > 0
    if has_rstd and tuple(rstd.shape) != (n_src, M):
        raise ValueError(f"triton depth routing: saved rstd has shape {tuple(rstd.shape)}, expected {(n_src, M)}")
    flags["HAS_RSTD"] = has_rstd
    flags["ONE"] = ONE_SOURCE_MERGE and n_src == 1 and dt == 0 and not flags["REBUILD"] and not saved_routed and not has_rstd
    flags["TILE_PF"] = TILE_PREFETCH and flags["ONE"] and norm_weight is not None and prior_out is not None and gate is None
    rstd_arg = rstd.contiguous() if has_rstd else dummy
    if saved_routed and (norm_weight is None or prior_out is None or flags["REBUILD"]):
        raise ValueError("triton depth routing: a saved routed value stands for the prior of a fused norm's merge (not a rebuilt block's)")

    def args(dw: Tensor, dgate: Tensor, dnw: Tensor) -> tuple:
        return (
            *head, dw, dgate, dprior if prior_out is not None else dummy, dprior_lse if prior_lse is not None else dummy,
            nw, dnw, _aligned(stream) if norm_stream else dummy, dstream if norm_stream else dummy, dstream_acc if norm_stream else dummy,
            rstd_arg, M, eps, num_tiles, float(norm_eps),
        )

    # persistent programs: as many as the SMs hold at once (one wave), each over a fixed range of tiles
    if interpret:
        programs = min(num_tiles, 2)
    else:
        programs = min(num_tiles, _sm_count(device.index or 0) * _resident_programs("bwd", device, args(dummy, dummy, dummy), flags))
    dw = _new((programs, n_sites, d), torch.float32, device)
    dgate = _new((programs, d) if gate is not None else (0,), torch.float32, device)
    dnw = _new((programs, d) if norm_weight is not None else (0,), torch.float32, device)
    _kernel("bwd", interpret)[(programs,)](
        *args(dw, dgate if gate is not None else dummy, dnw if norm_weight is not None else dummy), **flags
    )
    dw = dw.sum(0)  # fixed-order reduction over programs: deterministic
    q, g = queries.float(), gains.float()
    return [
        dsrc,
        (dw * g).to(queries.dtype),
        (dw * q).to(gains.dtype),
        dgate.sum(0).to(gate.dtype) if gate is not None else dgate,
        dprior,
        dprior_lse,
        dnw.sum(0).to(norm_weight.dtype) if norm_weight is not None else dnw,  # fixed order, like dw
        dstream,
    ]



def _stats_on_dots(n_sites: int, n_src: int, d: int, heads: int, gate: Optional[Tensor], has_rstd: bool, dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
    """Whether pass one of the site loop runs on tensor cores (``_route_bwd_stats_dot``): ``DOT_STATS``,
    the replacement form with the key rstd saved, at most ``DOT_MAX_SITES`` sites and
    ``DOT_MIN_SOURCES`` to ``DOT_MAX_SOURCES`` sources (one tile; at most ``DOT_MAX_SOURCES_ONE_SITE``, none by default, for one site), a head width from ``DOT_MIN_HEAD_WIDTH`` to
    ``DOT_MAX_HEAD_WIDTH`` (from ``DOT_MANY_SITES_MIN_HEAD_WIDTH`` with at least ``DOT_MANY_SITES``
    sites; the kernels hold it as one or two column tiles, ``_dot_lanes``), bf16 sources and
    gradients (float32 would multiply on the vector units anyway)."""
    dh = d // heads
    min_width = DOT_MIN_HEAD_WIDTH if n_sites < DOT_MANY_SITES else min(DOT_MIN_HEAD_WIDTH, DOT_MANY_SITES_MIN_HEAD_WIDTH)
    return (
        DOT_STATS and gate is None and has_rstd and n_sites <= DOT_MAX_SITES
        and max(1, DOT_MIN_SOURCES) <= n_src <= (DOT_MAX_SOURCES if n_sites > 1 else DOT_MAX_SOURCES_ONE_SITE)
        and min_width <= dh <= DOT_MAX_HEAD_WIDTH and dtype == torch.bfloat16 and grad_dtype == dtype
    )


def _fwd_on_dots(
    n_sites: int, n_src: int, d: int, heads: int, stream: Optional[Tensor], prior_out: Optional[Tensor], store_scores: bool,
    norm_weight: Optional[Tensor], dtype: torch.dtype,
) -> bool:
    """Whether a forward runs on tensor cores (``_route_fwd_sites_dot``): ``DOT_FWD``, a phase-one
    pass (at least ``DOT_FWD_MIN_SITES`` sites, the replacement form, no prior, no fused norm, no
    stored scores) over at most ``DOT_MAX_SITES`` sites and ``DOT_MIN_SOURCES`` to ``DOT_MAX_SOURCES`` sources, bf16
    sources, and a head width from ``DOT_FWD_MIN_HEAD_WIDTH`` to ``DOT_MAX_HEAD_WIDTH``."""
    dh = d // heads
    return (
        DOT_FWD and DOT_FWD_MIN_SITES <= n_sites <= DOT_MAX_SITES and max(1, DOT_MIN_SOURCES) <= n_src <= DOT_MAX_SOURCES
        and stream is None and prior_out is None and not store_scores and norm_weight is None
        and DOT_FWD_MIN_HEAD_WIDTH <= dh <= DOT_MAX_HEAD_WIDTH and dtype == torch.bfloat16
    )


def _sources_on_dots(d: int, heads: int, n_sites: int) -> bool:
    """Whether pass two of the site loop runs on tensor cores where pass one does: ``DOT_SOURCES``
    and a head width held without padding (a power of two, or two column tiles from at least
    ``DOT_SPLIT_SOURCES_MIN_SITES`` sites on), or any with ``DOT_SOURCES_PADDED``."""
    dh = d // heads
    if DOT_SOURCES_PADDED:
        return DOT_SOURCES
    return DOT_SOURCES and (_dot_width(dh) == dh or (sum(_dot_lanes(dh)) == dh and n_sites >= DOT_SPLIT_SOURCES_MIN_SITES))


def _dot_programs(name: str, device: torch.device, tiles: int, heads: int, args, flags: dict) -> int:
    """Programs per head of a tensor-core kernel's grid: one wave (at most ``DOT_PROGRAMS_PER_SM``
    per SM), each striding over the token tiles; two in the interpreter. ``args(programs)`` gives the
    launch arguments; the registers are read from a compile for as many programs as SMs (Triton
    specialises a count of 1)."""
    if device.type != "cuda":
        return min(tiles, 2)
    sms = _sm_count(device.index or 0)
    resident = min(DOT_PROGRAMS_PER_SM, _resident_programs(name, device, args(sms), flags))
    return min(tiles, max(1, sms * resident // heads))


def _dot_launch(name: str, bm: int, bn: int) -> dict:
    """Launch options of tensor-core kernel ``name`` on tiles of ``bm`` tokens and ``bn`` sources: its
    warps (``WARPS`` where set, else ``DOT_WARPS``, or for tiles of one token the kernel's
    ``DOT_WARPS_ONE_TOKEN``, ``DOT_WARPS_ONE_TOKEN_WIDE`` over ``DOT_WIDE_SOURCES``) and its pipelining stages
    where ``DOT_STAGES`` sets them."""
    one_token = DOT_WARPS_ONE_TOKEN_WIDE if bn > DOT_WIDE_SOURCES else DOT_WARPS_ONE_TOKEN[name]
    opts = dict(num_warps=WARPS.get(name, DOT_WARPS if bm > 1 else one_token))
    if name in DOT_STAGES:
        opts["num_stages"] = DOT_STAGES[name]
    return opts


def _dot_width(head_width: int) -> int:
    """The head width the tensor-core kernels compute on: the next power of two, at least 16 (the
    smallest ``tl.dot`` operand); the padding columns are masked off."""
    return max(16, _pow2(head_width))


def _dot_lanes(head_width: int) -> tuple[int, int]:
    """(DHP, DT): the tensor-core kernels' column tiles per head. A head width that is a power of two
    plus a smaller one of at least 16 (160 = 128 + 32 at 1b) is two tiles, DHP + DT, with
    ``DOT_SPLIT_WIDTH``; any other is one tile padded to ``_dot_width`` (DT = 0)."""
    padded = _dot_width(head_width)
    rest = head_width - padded // 2
    if DOT_SPLIT_WIDTH and padded != head_width and rest >= 16 and rest & (rest - 1) == 0:
        return padded // 2, rest
    return padded, 0


def _dot_tile(n_sites: int, n_src: int, head_width: int) -> tuple[int, int, int]:
    """(BS, BN, BM) of the tensor-core kernels' tiles: sites and sources padded to powers of two, tokens
    per tile so that a tile holds about ``DOT_TILE_ELEMENTS`` elements of (token, source) or
    (token, site) rows of the padded head width, at most ``DOT_MAX_ROWS`` rows unless one token's
    sources or sites alone are more (up to ``DOT_MAX_SOURCES``: a tile of one token), and sites or
    sources padded further where a token's rows alone are fewer than 16 (the smallest ``tl.dot``
    operand)."""
    bs, bn = _pow2(n_sites), _pow2(n_src)
    rows = min(DOT_TILE_ELEMENTS // _dot_width(head_width), DOT_MAX_ROWS)
    bm = max(1, rows // max(bs, bn))
    return max(bs, 16 // bm), max(bn, 16 // bm), bm


def _mix_tile(n_sites: int, n_src: int) -> tuple[int, int, int, int]:
    """(BS, BSO, BN, BM) of ``_route_fwd_sites_mix``'s tiles: the score dot's weight rows (sites
    padded to a power of two, at least 16, the smallest ``tl.dot`` operand), the output's sites (a
    power of two), the sources (a power of two) and the tokens, ``DOT_MIX_ROWS`` (token, source) rows
    a tile and at least 16."""
    bso, bn = _pow2(n_sites), _pow2(n_src)
    return max(16, bso), bso, bn, max(1, DOT_MIX_ROWS // bn, 16 // bn)


def _backward_site_loop(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float, gate: Optional[Tensor],
    lse: Tensor, grad_outs: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor] = None,
    sink: Optional[SinkBinding] = None,
) -> list[Tensor]:
    """Backward of several sites (phase one of Block AttnRes), or of one site over many sources
    (with ``gate``: the additive form), without a prior, in two kernels.

    ``_route_bwd_stats`` (one program per site and range of token tiles) forms each site's ``D``,
    its scores and ``<dr, v_i>_h``, and query-gradient (and gate-gradient) partials;
    ``_route_bwd_sources`` (one program per token tile and source) then writes each source's
    gradient, looping over the sites. No tile holds more than one site's gradient, so programs
    take several tokens whatever the number of sites, and the sources are spread over programs.
    ``rstd`` ``[N, tokens]`` float32, each source's key rstd as the forward computed it, spares both
    kernels the reduction over the width; an empty tensor or None recomputes it. With ``sink`` the
    source gradients are added into its slots ``0 .. N - 1`` inside pass two (the returned source
    gradient is then an empty tensor).

    Where ``_stats_on_dots`` holds (bf16, the replacement form, ``rstd`` given, head width 128 to
    160 or from 64 with ``DOT_MANY_SITES`` sites, ``DOT_MIN_SOURCES`` to ``DOT_MAX_SOURCES`` sources, two sites or more), pass one is ``_route_bwd_stats_dot`` (tensor cores; one program per head and range of
    tiles of ``_dot_tile`` tokens), and where ``_sources_on_dots`` holds too (an unpadded head width)
    pass two is ``_route_bwd_sources_dot``, which
    recomputes the scores and takes the key norm's term as per-head shares pass one wrote
    (``[N, tokens, H]`` float32) instead of the ``[S, N, tokens, H, 2]`` scores; it runs on
    ``DOT_SOURCES_CHUNK`` sources per launch (each source's gradient needs only its own scores
    once pass one has D and t).
    """
    like = sources[0]
    shape, d = like.shape, like.shape[-1]
    n_sites, n_src, M = queries.shape[0], len(sources), like.numel() // d
    device = like.device
    interpret = device.type != "cuda"
    group = _group_sites(n_sites, STATS_SITES, d, heads)
    n_groups = n_sites // group
    _, bm, warps, bh, bdh, dt = _tile("bwd_stats", group, d, heads, interpret)
    _, bm_src, warps_src, _, _, _ = _tile("bwd_sources", 1, d, heads, interpret)
    num_tiles = _cdiv(M, bm)
    srcs = [_aligned(s) for s in sources]
    base = srcs[0]
    grads = [_aligned(g) for g in grad_outs]
    if any(g.dtype != grads[0].dtype for g in grads):
        grads = [_aligned(g.to(grads[0].dtype)) for g in grads]
    w = (queries.float() * gains.float()).contiguous()
    src_offs, g_offs = _offsets(srcs, base), _offsets(grads, grads[0])
    dsum = _new(lse.shape, torch.float32, device)
    has_rstd = rstd is not None and rstd.numel() > 0
    if has_rstd and tuple(rstd.shape) != (n_src, M):
        raise ValueError(f"triton depth routing: saved rstd has shape {tuple(rstd.shape)}, expected {(n_src, M)}")
    on_dots = _stats_on_dots(n_sites, n_src, d, heads, gate, has_rstd, like.dtype, grads[0].dtype)
    both_on_dots = on_dots and _sources_on_dots(d, heads, n_sites)  # pass two too: no scores round trip, t's head shares instead
    # s_i and <dr, v_i>_h per site and source, for the vector pass two
    score_a = _new((0,) if both_on_dots else (n_sites, n_src, *lse.shape[1:], 2), torch.float32, device)
    t_part = _new((n_src, M, heads) if both_on_dots else (0,), torch.float32, device)
    dsrc, targets, addends, n_acc = _source_grad_targets(sink, n_src, like)
    gate_c = gate.contiguous() if gate is not None else w
    geometry = dict(D=d, H=heads, DH=d // heads, BH=bh, BDH=bdh, DT=dt, ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size())
    lse = lse.contiguous()
    rstd = rstd.contiguous() if has_rstd else w
    flags = dict(**geometry, PF=PREFETCH["bwd_stats"], BS=group, BM=bm, HAS_DLSE=grad_lse is not None, ADDITIVE=gate is not None, HAS_RSTD=has_rstd, num_warps=warps)

    def stats_args(dw: Tensor, dgate: Tensor, per_group: int) -> tuple:
        return (
            base, src_offs, n_src, w, n_sites, grads[0], g_offs,
            lse, grad_lse.contiguous() if grad_lse is not None else w,
            gate_c, dgate, dsum, dw, score_a, rstd,
            M, eps, num_tiles, per_group,
        )

    # persistent programs for pass one, spread over the groups of sites
    if interpret:
        per_group = min(num_tiles, 2)
    else:
        resident = _resident_programs("bwd_stats", device, stats_args(w, w, max(1, 32 // warps)), flags)
        per_group = min(num_tiles, _cdiv(_sm_count(device.index or 0) * resident, n_groups))
    if on_dots:
        # pass one on tensor cores: program (p, h) takes head h of every progs-th tile of tokens
        bs_dot, bn_dot, bm_dot = _dot_tile(n_sites, n_src, d // heads)
        w_hi = w.to(torch.bfloat16)
        w_lo = (w - w_hi.float()).to(torch.bfloat16)
        tiles_dot = _cdiv(M, bm_dot)
        dhp, dt_dot = _dot_lanes(d // heads)  # pass two's too
        dot_flags = dict(
            D=d, H=heads, DH=d // heads, DHP=dhp, DT=dt_dot, BS=bs_dot, BN=bn_dot, BM=bm_dot,
            ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size(), HAS_DLSE=grad_lse is not None,
            DOT_F32=interpret, STORE_SA=not both_on_dots, STORE_T=both_on_dots,
            **_dot_launch("bwd_stats_dot", bm_dot, bn_dot),
        )

        def dot_args(dw: Tensor, progs: int) -> tuple:
            return (
                base, src_offs, n_src, w_hi, w_lo, n_sites, grads[0], g_offs, lse, grad_lse.contiguous() if grad_lse is not None else w,
                dsum, dw, score_a, rstd, t_part, M, tiles_dot, progs,
            )

        progs = _dot_programs("bwd_stats_dot", device, tiles_dot, heads, lambda p: dot_args(w, p), dot_flags)
        dw = _new((progs * n_sites, d), torch.float32, device)
        dgate = _new((0,), torch.float32, device)
        per_group = progs
        _kernel("bwd_stats_dot", interpret)[(progs, heads)](*dot_args(dw, progs), **dot_flags)
    else:
        dw = _new((per_group * n_sites, d), torch.float32, device)
        dgate = _new((per_group, d) if gate is not None else (0,), torch.float32, device)
        _kernel("bwd_stats", interpret)[(per_group * n_groups,)](*stats_args(dw, dgate if gate is not None else w, per_group), **flags)
    if both_on_dots:
        target_offs, addend_offs = _offsets(targets, targets[0]), _offsets(addends, addends[0])
        # pass two needs no source but its own (pass one finished D and t), so it takes the sources
        # DOT_SOURCES_CHUNK at a time, each launch on its own tiles
        for c0 in range(0, n_src, DOT_SOURCES_CHUNK):
            c1 = min(n_src, c0 + DOT_SOURCES_CHUNK)
            acc_c = min(max(n_acc - c0, 0), c1 - c0)
            bs2, bn2, bm2 = _dot_tile(n_sites, c1 - c0, d // heads)
            tiles2 = _cdiv(M, bm2)
            src_flags = dict(
                D=d, H=heads, BH=_pow2(heads), DH=d // heads, DHP=dhp, DT=dt_dot, BS=bs2, BN=bn2, BM=bm2,
                ALIGN=16 // base.element_size(), G_ALIGN=16 // grads[0].element_size(), DOT_F32=interpret, ACC=acc_c > 0,
                **_dot_launch("bwd_sources_dot", bm2, bn2),
            )

            def src_args(progs: int, c0=c0, c1=c1, acc_c=acc_c, tiles2=tiles2) -> tuple:
                return (
                    base, src_offs[c0:], c1 - c0, w_hi, w_lo, n_sites, grads[0], g_offs, lse, dsum, rstd[c0:c1], t_part[c0:c1],
                    targets[0], target_offs[c0:], addends[0], addend_offs[c0:], acc_c, M, tiles2, progs,
                )

            progs2 = _dot_programs("bwd_sources_dot", device, tiles2, heads, src_args, src_flags)
            _kernel("bwd_sources_dot", interpret)[(progs2, heads)](*src_args(progs2), **src_flags)
    else:
        _kernel("bwd_sources", interpret)[(_cdiv(M, bm_src) * n_src,)](
            base, src_offs, n_src, w, n_sites, grads[0], g_offs,
            lse, dsum, score_a, gate_c, targets[0], _offsets(targets, targets[0]), addends[0], _offsets(addends, addends[0]), n_acc, rstd,
            M, eps,
            **geometry, BM=bm_src, ADDITIVE=gate is not None, HAS_RSTD=has_rstd and (dt == 0 or heads <= SPLIT_SOURCES_RSTD_HEADS),
            ACC=n_acc > 0, num_warps=warps_src,
        )
    dw = dw.view(per_group, n_sites, d).sum(0)  # fixed-order reduction over programs: deterministic
    q, g = queries.float(), gains.float()
    empty = [torch.empty(0, dtype=torch.float32, device=device) for _ in range(2)]  # outputs may not alias
    dgate = dgate.sum(0).to(gate.dtype) if gate is not None else dgate  # fixed order, like dw
    return [dsrc, (dw * g).to(queries.dtype), (dw * q).to(gains.dtype), dgate, *empty]


# ----------------------------------------------------------------------------------------------
# torch.library ops (opaque to torch.compile) and their autograd
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("lit_mhar::route_fwd", mutates_args=())
def route_fwd(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    stream: Optional[Tensor], gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    store_scores: bool, save_rstd: bool, norm_weight: Optional[Tensor], norm_eps: float,
) -> list[Tensor]:
    """Fused forward of ``S = queries.shape[0]`` routing sites over the same sources.

    Args: sources N tensors ``[..., d]`` of one dtype (N may be 0 with a prior); queries, gains
    ``[S, d]``; ``stream``/``gate`` the additive form (S = 1); ``prior_out`` ``[..., d]`` and
    ``prior_lse`` ``[..., H]`` float32 a routed value merged as one more source (S = 1);
    ``store_scores`` also returns each source's scores; ``save_rstd`` also returns each source's key
    rstd (for the site loop's backward); ``norm_weight`` ``[d]`` (with a prior, S = 1, replacement
    form) returns ``RMSNorm(out) * norm_weight`` (epsilon ``norm_eps``) in place of ``out``.

    Returns ``[out_0 .. out_{S-1}, lse [S, ..., H] float32, scores [N, ..., H] float32 or empty,
    rstd [N, tokens] float32 (each source's key rstd, for the backward) or empty]``.
    """
    return _forward(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps)


@route_fwd.register_fake
def _(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps):
    like = sources[0] if sources else prior_out
    lead = like.shape[:-1]
    if stream is not None:  # as _forward: the fused norm's output in the sources' dtype, else the stream's
        outs = [like.new_empty(like.shape) if norm_weight is not None else stream.new_empty(like.shape)]
    else:
        outs = [like.new_empty(like.shape) for _ in range(queries.shape[0])]
    lse = like.new_empty((queries.shape[0], *lead, heads), dtype=torch.float32)
    scores = like.new_empty((len(sources), *lead, heads) if store_scores else (0,), dtype=torch.float32)
    saves = bool(save_rstd) and len(sources) > 0
    rstd = like.new_empty((len(sources), like.numel() // like.shape[-1]) if saves else (0,), dtype=torch.float32)
    return [*outs, lse, scores, rstd]


@torch.library.custom_op("lit_mhar::route_bwd", mutates_args=())
def route_bwd(
    sources: list[Tensor], queries: Tensor, gains: Tensor, heads: int, eps: float,
    gate: Optional[Tensor], prior_out: Optional[Tensor], prior_lse: Optional[Tensor],
    lse: Tensor, grad_outs: list[Tensor], grad_lse: Optional[Tensor], rstd: Optional[Tensor],
    norm_weight: Optional[Tensor], norm_eps: float, stream: Optional[Tensor],
) -> list[Tensor]:
    """Fused backward of :func:`route_fwd` (``rstd``: its saved key rstd, or None / empty;
    ``stream``: the additive form's stream where the norm is fused, else None). Returns
    ``[d_sources [N, ..., d], d_queries [S, d], d_gains [S, d], d_gate [d] or empty, d_prior_out or
    empty, d_prior_lse or empty, d_norm_weight [d] or empty, d_stream (fused norm, additive) or empty]``."""
    return _backward(
        sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, norm_eps, stream
    )


@route_bwd.register_fake
def _(sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, norm_eps, stream):
    like = sources[0] if sources else prior_out

    def empty():  # one per output: outputs may not alias each other
        return queries.new_empty(0, dtype=torch.float32)

    return [
        like.new_empty((len(sources), *like.shape)),
        queries.new_empty(queries.shape),
        gains.new_empty(gains.shape),
        gate.new_empty(gate.shape) if gate is not None else empty(),
        prior_out.new_empty(prior_out.shape) if prior_out is not None else empty(),
        prior_lse.new_empty(prior_lse.shape) if prior_lse is not None else empty(),
        norm_weight.new_empty(norm_weight.shape) if norm_weight is not None else empty(),
        stream.new_empty(stream.shape) if norm_weight is not None and gate is not None else empty(),
    ]


def _setup_context(ctx, inputs, output):
    sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps = inputs
    n_out = 1 if stream is not None else queries.shape[0]
    kept_stream = stream if norm_weight is not None else None  # the fused norm's backward needs the stream
    ctx.save_for_backward(queries, gains, gate, prior_out, prior_lse, norm_weight, kept_stream, output[n_out], output[n_out + 2], *sources)
    ctx.heads, ctx.eps, ctx.n_out, ctx.additive, ctx.norm_eps = heads, eps, n_out, stream is not None, norm_eps
    ctx.set_materialize_grads(False)


def _gradients(ctx, grads, backward) -> Optional[tuple]:
    """The backward both autograd paths share: ``(d_sources [N, ..., d], d_queries, d_gains,
    d_stream, d_gate, d_prior_out, d_prior_lse, d_norm_weight)`` (None where an input has no gradient) through
    ``backward`` (the custom op :func:`route_bwd` or :func:`_backward`), or None when no output has
    a gradient. Missing output gradients are zeros."""
    queries, gains, gate, prior_out, prior_lse, norm_weight, stream, lse, rstd, *sources = ctx.saved_tensors
    grad_outs, grad_lse = list(grads[: ctx.n_out]), grads[ctx.n_out]
    if all(g is None for g in grad_outs) and grad_lse is None:
        return None
    like = sources[0] if sources else prior_out
    dtype = next((g.dtype for g in grad_outs if g is not None), like.dtype)
    grad_outs = [torch.zeros(like.shape, dtype=dtype, device=like.device) if g is None else g for g in grad_outs]
    d_src, d_q, d_g, d_gate, d_prior, d_prior_lse, d_nw, d_stream = backward(
        sources, queries, gains, ctx.heads, ctx.eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, ctx.norm_eps,
        stream,
    )
    if ctx.additive and norm_weight is None:
        d_stream = grad_outs[0]  # out = stream + gate * r: d stream = d out
    return (
        d_src, d_q, d_g,
        d_stream if ctx.additive else None,
        d_gate if gate is not None else None,
        d_prior if prior_out is not None else None,
        d_prior_lse if prior_lse is not None else None,
        d_nw if norm_weight is not None else None,
    )


def _backward_rule(ctx, grads):
    res = _gradients(ctx, grads, route_bwd)
    if res is None:
        return (None,) * 13
    d_src, d_q, d_g, d_stream, d_gate, d_prior, d_prior_lse, d_nw = res
    return list(d_src.unbind(0)), d_q, d_g, None, None, d_stream, d_gate, d_prior, d_prior_lse, None, None, d_nw, None


route_fwd.register_autograd(_backward_rule, setup_context=_setup_context)


class _RouteFunction(torch.autograd.Function):
    """Eager autograd of :func:`route_fwd`: the same kernels and gradients as the custom op's
    registered autograd, without the custom op's per-call argument handling (``EAGER_FUNCTION``).

    ``apply(heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse,
    norm_weight, stream_start, block_outputs, earlier_outputs, *sources)`` returns the custom op's outputs as a tuple. With
    ``save_routed`` (:func:`_saves_routed`) a fused norm's merge saves its routed value r in place of
    the prior and its backward runs one pass with scores over the sources, where the custom op runs
    two (the same gradients up to float32 rounding; a replayed stream takes a pass that only adds
    the sources). With
    ``sink`` (a :class:`SinkBinding` of the sources) the sources' gradients are added into the sink
    inside the backward kernels and autograd gets none for them. With ``stream_start`` (fused
    norm, additive form: ``stream`` equals it plus the sources added in order) that is saved
    instead of ``stream`` and the backward kernel adds the sources to it again; with
    ``block_outputs`` too (a tuple: the one source is their running sum, ``stream`` the start plus
    them) the outputs are saved instead of the source, and the kernel rebuilds both from them.
    ``earlier_outputs`` (a tuple, or None; with ``stream_start``): the outputs between an earlier
    group's start, which ``stream_start`` then is, and this group's, saved and added first.
    """

    @staticmethod
    def forward(
        ctx, heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse,
        norm_weight, stream_start, block_outputs, earlier_outputs, *sources,
    ):
        ctx.saved_routed = save_routed  # r saved in place of the prior (SAVE_ROUTED)
        outs = _forward(
            list(sources), queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps,
            save_routed=ctx.saved_routed,
        )
        if ctx.saved_routed:
            prior_out = outs.pop()  # r: what the backward reads where it read the prior
        n_out = 1 if stream is not None else queries.shape[0]
        # the fused norm's backward needs the stream: saved, or replayed from the group's start
        ctx.stream_replay = norm_weight is not None and stream is not None and stream_start is not None
        ctx.rebuild = ctx.stream_replay and block_outputs is not None and len(sources) == 1
        kept_stream = (stream_start if ctx.stream_replay else stream) if norm_weight is not None else None
        kept = block_outputs if ctx.rebuild else sources  # the block's outputs rebuild its running sum
        earlier = tuple(earlier_outputs or ()) if ctx.stream_replay else ()
        ctx.n_earlier = len(earlier)  # saved before the sources; the stream adds them first
        kept = (*earlier, *kept)
        ctx.save_for_backward(queries, gains, gate, prior_out, prior_lse, norm_weight, kept_stream, outs[n_out], outs[n_out + 2], *kept)
        ctx.heads, ctx.eps, ctx.n_out, ctx.additive, ctx.n_src = heads, eps, n_out, stream is not None, len(sources)
        ctx.norm_eps, ctx.sink, ctx.norm_weight_given = norm_eps, sink, norm_weight is not None
        ctx.mark_non_differentiable(outs[n_out + 1], outs[n_out + 2])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again (as with the custom op)
    def backward(ctx, *grads):
        sink, k = ctx.sink, ctx.n_earlier

        def backward(sources, *args):
            return _backward(
                sources[k:], *args, sink=sink, stream_replay=ctx.stream_replay, rebuild=ctx.rebuild, saved_routed=ctx.saved_routed,
                earlier_outputs=sources[:k],
            )

        res = _gradients(ctx, grads, backward)
        if res is None:
            return (None,) * (17 + ctx.n_src)
        d_src, *rest = res
        if sink is not None and sink.stream_slot is not None and ctx.norm_weight_given:
            rest[2] = None  # the stream's gradient went into its slot (the fused norm's backward kernel)
        return (None,) * 7 + (*rest, None, None, None, *(d_src.unbind(0) if sink is None else (None,) * ctx.n_src))


def _route(
    sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, norm_weight=None, norm_eps=0.0, sink=None,
    stream_start=None, block_outputs=None, earlier_outputs=None,
):
    """:func:`route_fwd` with autograd: the custom op under ``torch.compile``, else (with
    ``EAGER_FUNCTION``) :class:`_RouteFunction`, which runs the same kernels. Whether the forward
    saves the key rstd is decided here, outside the op, so that the op's output shapes follow from
    its arguments (torch.compile guards on the module settings read here). ``sink``: the
    :class:`SinkBinding` of the sources (the callers bind it, and drop it where they cast the
    sources: the copies' gradients go back through autograd); used on the eager path only: the
    custom op returns the gradients through autograd, also correct for the aliases.
    ``stream_start``, ``block_outputs``, ``earlier_outputs``: see :func:`merge_route_norm`; used on
    the eager path only (the custom op saves the stream and the sources)."""
    save_rstd = _saves_rstd(sources, queries, gains, prior_out is not None, norm_weight is not None)
    if EAGER_FUNCTION and not torch.compiler.is_compiling():
        save_routed = _saves_routed(sources, queries, gains, stream, prior_out, prior_lse, norm_weight, block_outputs)
        return _RouteFunction.apply(
            heads, eps, store_scores, save_rstd, save_routed, norm_eps, sink, queries, gains, stream, gate, prior_out, prior_lse, norm_weight,
            stream_start, None if block_outputs is None else tuple(block_outputs),
            None if earlier_outputs is None else tuple(earlier_outputs), *sources,
        )
    return torch.ops.lit_mhar.route_fwd(
        sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, float(norm_eps)
    )


# ----------------------------------------------------------------------------------------------
# Public functions: the same signatures as lit_mhar.kernels.reference
# ----------------------------------------------------------------------------------------------


def _bind(sink: Optional[GradientSink], sources: Sequence[Tensor], name: str) -> Optional[SinkBinding]:
    """``sink``'s binding to ``sources`` (ValueError before any work for sources it did not collect), or None."""
    return None if sink is None else sink.bind(sources, name)


def _uncast(binding: Optional[SinkBinding], srcs: Sequence[Tensor], sources: Sequence[Tensor]) -> Optional[SinkBinding]:
    """``binding`` where the kernels read the collected ``sources`` themselves, None where they read cast copies."""
    return binding if binding is not None and all(a is b for a, b in zip(srcs, sources)) else None


def _common_dtype(sources: Sequence[Tensor]) -> list[Tensor]:
    """Sources in their promoted dtype (one element type for the offset table); a cast is a copy."""
    _check_dtypes(sources)
    dtype = sources[0].dtype
    for s in sources[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return [s if s.dtype == dtype else s.to(dtype) for s in sources]


def depth_route(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int = 1,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused depth routing at one site; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.depth_route` (AttnRes eqs. 2-6, MHAR, Delta AttnRes).

    Args:
        sources: N >= 1 tensors ``[..., d]``, float32 / bfloat16 / float16 (mixed dtypes are cast
            to the promoted one, a copy).
        query, gain: ``[d]``. heads: H dividing d. stream, gate: the additive form, or None.
        eps: key RMSNorm epsilon. return_weights: also return ``[N, ..., H]`` float32 weights.

    Returns:
        ``out`` ``[..., d]`` in the promoted source dtype (replacement) or the stream's dtype
        (additive); with ``return_weights`` also the weights, which carry no gradient here.

    Raises:
        ValueError: the reference's argument errors, float64 sources, a width over the kernel's
            register budget.
    """
    check_route_args(sources, query, gain, heads, stream, gate, eps)
    srcs = _common_dtype(sources)
    res = _route(srcs, query[None], gain[None], heads, eps, stream, gate, None, None, return_weights)
    if not return_weights:
        return res[0]
    lse, scores = res[1], res[2]
    return res[0], torch.exp(scores - lse).detach()


def route_sites(
    sources: Sequence[Tensor], queries: Tensor, gains: Tensor, heads: int = 1, eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> tuple[list[Tensor], Tensor]:
    """First phase of two-phase Block AttnRes: S sites routed against the same sources in one pass.

    Same contract as :func:`lit_mhar.kernels.reference.route_sites`: ``queries``/``gains``
    ``[S, d]``; returns S routed values ``[..., d]`` (source dtype) and their log-sum-exp
    ``[S, ..., H]`` float32. Any number of sites: the backward loops over them. With
    ``grad_sink`` the backward kernels add each source's gradient into the sink's buffer (no
    separate addition kernel).
    """
    if queries.dim() != 2 or gains.shape != queries.shape:
        raise ValueError(f"route_sites: queries {tuple(queries.shape)} and gains {tuple(gains.shape)} must both be [S, d]")
    check_route_args(sources, queries[0], gains[0], heads, None, None, eps, "route_sites")
    binding = _bind(grad_sink, sources, "route_sites")
    srcs = _common_dtype(sources)
    res = _route(srcs, queries, gains, heads, eps, None, None, None, None, False, sink=_uncast(binding, srcs, sources))
    S = queries.shape[0]
    return list(res[:S]), res[S]


def merge_route(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    prior_out: Tensor,
    prior_lse: Tensor,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> Tensor:
    """Second phase: merge a routed value ``prior_out`` (log-sum-exp ``prior_lse``) with more sources.

    Same contract as :func:`lit_mhar.kernels.reference.merge_route`; ``sources`` may be empty.
    With ``grad_sink`` the backward kernel adds the sources' gradients into the sink.
    """
    if sources:
        check_route_args(sources, query, gain, heads, stream, gate, eps, "merge_route")
    binding = _bind(grad_sink, sources, "merge_route")
    srcs = _common_dtype(sources) if sources else []
    sink = _uncast(binding, srcs, sources)
    return _route(srcs, query[None], gain[None], heads, eps, stream, gate, prior_out, prior_lse.float(), False, sink=sink)[0]


def merge_route_norm(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    prior_out: Tensor,
    prior_lse: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
    stream_start: Optional[Tensor] = None,
    block_outputs: Optional[Sequence[Tensor]] = None,
    earlier_outputs: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """Second phase fused with the next sublayer's RMSNorm: one kernel forward, one backward.

    Same contract as :func:`lit_mhar.kernels.reference.merge_route_norm` (``y = RMSNorm(x) *
    norm_weight``, ``x = r`` or ``stream + gate * r``, never rounded). The backward
    recomputes ``r`` from the prior and the sources, so the forward saves what the merge saves (the
    prior, its lse, the sources; where a backward will run, the replacement form (the additive
    form too with ``SAVE_ROUTED_ADDITIVE``) over at least ``SAVE_ROUTED_MIN_SOURCES`` sources writes
    ``r`` in float32 and saves it instead of the prior, and the backward reads the sources once
    with scores (``SAVE_ROUTED``); in the additive form the stream, or ``stream_start`` where given
    and float32, from which the backward kernel recomputes the stream by adding the sources it
    reads anyway; with ``block_outputs`` too, block routing, the block's outputs so far instead of
    its running sum and the stream: the backward kernel rebuilds the running sum, rounding after
    each addition as torch does, and the stream from them, where the running sum is bf16 or
    float32 and read uncast; with ``earlier_outputs`` too, of the prior's and the sources' dtype,
    ``stream_start`` is an earlier group's start and these outputs, saved, are added to it first),
    not the norm's input; the
    weight's gradient is summed per persistent program and reduced in a fixed order (deterministic).
    With ``grad_sink`` the backward kernel adds the sources' gradients into the sink, and in the
    additive form the stream's where the sink collected the stream (:meth:`GradientSink.collect`);
    where the sources are cast to a common dtype first, the gradients go through autograd instead
    (the collected aliases add them to their sums: the same totals).
    """
    check_merge_norm_args(
        sources, query, gain, heads, prior_out, prior_lse, norm_weight, norm_eps, eps, stream, gate, stream_start, block_outputs,
        earlier_outputs,
    )
    _check_dtypes([prior_out])
    if stream_start is not None and stream_start.dtype != torch.float32:
        stream_start = None  # the kernel adds in float32; a bf16 / fp16 stream rounds after each addition: saved instead
    binding = None if grad_sink is None else grad_sink.bind(sources, "merge_route_norm", stream=stream if gate is not None else None)
    srcs = _common_dtype(sources) if sources else []
    if srcs and srcs[0].dtype != prior_out.dtype:
        dtype = torch.promote_types(srcs[0].dtype, prior_out.dtype)
        srcs, prior_out = [s.to(dtype) for s in srcs], prior_out.to(dtype)
    if block_outputs is not None and (stream_start is None or srcs[0] is not sources[0] or srcs[0].dtype not in REBUILD_DTYPES):
        # the kernel rounds the rebuilt running sum as torch does for bf16 (and float32: no rounding
        # beyond the sum's); a cast source, another dtype, or a stream that is not replayed: saved
        stream_start = block_outputs = None
    if earlier_outputs and (
        stream_start is None or (srcs and srcs[0] is not sources[0])
        or any(o.dtype not in SUPPORTED_DTYPES or o.dtype != prior_out.dtype for o in earlier_outputs)
    ):
        # the kernel reads them off the sources' base pointer: the sources' dtype, uncast, and the
        # prior's (on the GPU a float32 prior with bf16 outputs gave gradients off the saved
        # stream's by float32 rounding, 7.5e-9 of 0.22, cause not established: BENCHMARKS.md,
        # twentieth set); else the stream is saved
        stream_start = block_outputs = earlier_outputs = None
    return _route(
        srcs, query[None], gain[None], heads, eps, stream, gate, prior_out, prior_lse.float(), False, norm_weight, float(norm_eps),
        sink=_uncast(binding, srcs, sources), stream_start=stream_start, block_outputs=block_outputs,
        earlier_outputs=earlier_outputs or None,
    )[0]


def route_norm(
    sources: Sequence[Tensor],
    query: Tensor,
    gain: Tensor,
    heads: int,
    norm_weight: Tensor,
    norm_eps: float,
    eps: float = 1e-6,
    grad_sink: Optional[GradientSink] = None,
) -> Tensor:
    """One routing site fused with the next RMSNorm, without a prior: one kernel forward, one backward.

    Same contract as :func:`lit_mhar.kernels.reference.route_norm`. The forward reads each source
    once (online softmax) and writes only the norm's output; the backward (the two-pass kernel of
    the merges, without a prior) recomputes the routed value from the sources. With ``grad_sink``
    the backward kernel adds the sources' gradients into the sink; where the sources are cast to a
    common dtype first, they go through autograd instead (the same totals).
    """
    check_route_norm_args(sources, query, gain, heads, norm_weight, norm_eps, eps)
    binding = _bind(grad_sink, sources, "route_norm")
    srcs = _common_dtype(sources)
    return _route(
        srcs, query[None], gain[None], heads, eps, None, None, None, None, False, norm_weight, float(norm_eps), sink=_uncast(binding, srcs, sources),
    )[0]

# ----------------------------------------------------------------------------------------------
# Decode: routing fused with the next RMSNorm (inference only)
# ----------------------------------------------------------------------------------------------

# Decode kernel geometry (``benchmarks/tune_decode.py``; per launch inside a CUDA graph, 350m, bf16,
# H = 8, batch 1 and 32; BENCHMARKS.md). A site's program loops over its slots in tiles of
# DECODE_TILE_ELEMENTS fp32 elements (2 slots at d = 1024) on DECODE_WARPS warps: a block site over
# 9 slots and the pending output measured 4.9 us in 2-slot tiles, 8.3 in 4-slot ones, 14.0 in
# 8-slot ones, 10.8 in one 16-slot tile on 4 warps (the former geometry, whose 255 registers per
# thread spilled, by Nsight Compute) and 15.4 on 8. A history longer than
# DECODE_CHUNK slots (at d <= 2048) without a prior is split over programs of that many slots and
# merged by a second launch (8 warps). Phase one of a group of sites (route_sites_decode): tiles
# of DECODE_SITES_TILE_ELEMENTS on DECODE_SITES_WARPS warps.
# All are module-level so that the benchmarks can vary them.
DECODE_TILE_ELEMENTS = 2048
DECODE_WARPS = 8
DECODE_CHUNK = 16
DECODE_SITES_TILE_ELEMENTS = 8192
DECODE_SITES_WARPS = 2


def _decode_slots(n: int, elements: int, bd: int) -> int:
    """Slots per tile: a power of two, at most ``elements // bd`` (at least 1) and no more than ``n`` needs."""
    cap = max(1, elements // bd)
    cap = 1 << (cap.bit_length() - 1)
    return min(_pow2(max(1, n)), cap)


@torch.library.custom_op("lit_mhar::route_norm_decode", mutates_args=("history",))
def _route_norm_decode_op(
    history: Tensor, n_sources: int, pending: Optional[Tensor], accumulate: bool, query: Tensor, gain: Tensor,
    heads: int, norm_weight: Tensor, norm_eps: float, stream: Optional[Tensor], gate: Optional[Tensor], eps: float,
    prior_out: Optional[Tensor], prior_lse: Optional[Tensor], n_prior: int,
) -> Tensor:
    d = history.shape[-1]
    routed_dtype = stream.dtype if stream is not None else history.dtype
    out = _new(history.shape[1:], torch.promote_types(routed_dtype, norm_weight.dtype), history.device)
    M = out.numel() // d
    if M == 0:
        return out
    interpret = history.device.type != "cuda"
    bh, bdh, bd = _geometry(d, heads)
    # one program looping over the slots (after the prior, if any) in tiles, or, for a history
    # longer than DECODE_CHUNK slots without a prior, split over programs of that many slots
    cap = max(1, DECODE_CHUNK * 2048 // max(bd, 2048))
    has_prior = prior_out is not None
    n_split = 1 if has_prior else _cdiv(n_sources + (pending is not None), cap)
    if n_split == 1:
        chunk, warps = _decode_slots(n_sources - n_prior, DECODE_TILE_ELEMENTS, bd), DECODE_WARPS
    else:
        chunk, warps = cap, 8
    dummy = query
    if n_split > 1:
        part = torch.empty((n_split, M, d), dtype=torch.float32, device=history.device)
        part_ml = torch.empty((n_split, M, heads, 2), dtype=torch.float32, device=history.device)
    else:
        part = part_ml = dummy
    args = (
        history, n_sources, history[0].numel(), pending.contiguous() if pending is not None else dummy,
        query.contiguous(), gain.contiguous(), norm_weight.contiguous(), stream.contiguous() if stream is not None else dummy,
        gate.contiguous() if gate is not None else dummy, out,
        part, part_ml, M, n_split,
        prior_out.contiguous() if has_prior else dummy, prior_lse.contiguous() if has_prior else dummy, n_prior if has_prior else 0,
        eps, norm_eps,
    )
    flags = dict(
        D=d, H=heads, DH=d // heads, BH=bh, BDH=bdh, CH=chunk, NSP=_pow2(n_split),
        HAS_PENDING=pending is not None, ACCUMULATE=bool(accumulate) and pending is not None, ADDITIVE=stream is not None,
        HAS_PRIOR=has_prior,
    )
    warps = 4 if interpret else warps
    kernel = _kernel("decode", interpret)
    kernel[(M, n_split)](*args, **flags, PHASE=0 if n_split == 1 else 1, num_warps=warps)
    if n_split > 1:
        kernel[(M,)](*args, **flags, PHASE=2, num_warps=4)
    return out


@_route_norm_decode_op.register_fake
def _(history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream, gate, eps, prior_out, prior_lse, n_prior):
    routed_dtype = stream.dtype if stream is not None else history.dtype
    return history.new_empty(history.shape[1:], dtype=torch.promote_types(routed_dtype, norm_weight.dtype))


@torch.library.custom_op("lit_mhar::route_sites_decode", mutates_args=())
def _route_sites_decode_op(history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float) -> tuple[Tensor, Tensor]:
    G, d = queries.shape
    out = _new((G, *history.shape[1:]), torch.float32, history.device)
    lse = _new((G, *history.shape[1:-1], heads), torch.float32, history.device)
    M = history[0].numel() // d
    if M == 0:
        return out, lse
    interpret = history.device.type != "cuda"
    bh, bdh, bd = _geometry(d, heads)
    chunk = _decode_slots(n_sources, DECODE_SITES_TILE_ELEMENTS, bd)
    q, g = queries.contiguous(), gains.contiguous()
    _kernel("decode", interpret)[(M, G)](
        history, n_sources, history[0].numel(), q,
        q, g, q, q, q, q,
        out, lse, M, 1,
        q, q, 0,
        eps, 0.0,
        D=d, H=heads, DH=d // heads, BH=bh, BDH=bdh, CH=chunk, NSP=1, PHASE=3,
        HAS_PENDING=False, ACCUMULATE=False, ADDITIVE=False, HAS_PRIOR=False,
        num_warps=4 if interpret else DECODE_SITES_WARPS,
    )
    return out, lse


@_route_sites_decode_op.register_fake
def _(history, n_sources, queries, gains, heads, eps):
    G = queries.shape[0]
    return (
        history.new_empty((G, *history.shape[1:]), dtype=torch.float32),
        history.new_empty((G, *history.shape[1:-1], heads), dtype=torch.float32),
    )


def route_norm_decode(
    history: Tensor,
    n_sources: int,
    pending: Optional[Tensor],
    accumulate: bool,
    query: Tensor,
    gain: Tensor,
    heads: int,
    norm_weight: Tensor,
    norm_eps: float,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    prior_out: Optional[Tensor] = None,
    prior_lse: Optional[Tensor] = None,
    n_prior: int = 0,
) -> Tensor:
    """Fused decode-time routing + RMSNorm; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.route_norm_decode` (one kernel per routing site).

    ``history`` float32 / bfloat16 / float16; a prior is float32. Raises ValueError for the
    reference's argument errors, another dtype or too wide a d, before anything is written.
    """
    check_decode_args(
        history, n_sources, pending, accumulate, norm_weight, norm_eps, query, gain, heads, stream, gate, eps,
        prior_out, prior_lse, n_prior,
    )
    _check_dtypes([history])
    if pending is not None and pending.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"route_norm_decode: pending has dtype {pending.dtype}; supported: {list(SUPPORTED_DTYPES)}")
    if prior_out is not None and (prior_out.dtype != torch.float32 or prior_lse.dtype != torch.float32):
        raise ValueError(
            f"route_norm_decode: prior_out / prior_lse have dtypes {prior_out.dtype} / {prior_lse.dtype}; "
            "the Triton kernel takes float32 (as route_sites_decode returns them)"
        )
    return torch.ops.lit_mhar.route_norm_decode(
        history, n_sources, pending, accumulate, query, gain, heads, norm_weight, float(norm_eps), stream, gate, eps,
        prior_out, prior_lse, int(n_prior),
    )


def route_sites_decode(
    history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Phase one of a group of decode-time routing sites; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.route_sites_decode` (one kernel, one program per token and site).

    ``history`` float32 / bfloat16 / float16; returns float32. Raises ValueError for the
    reference's argument errors, another dtype or too wide a d, before any work.
    """
    check_sites_decode_args(history, n_sources, queries, gains, heads, eps)
    _check_dtypes([history])
    return torch.ops.lit_mhar.route_sites_decode(history, n_sources, queries, gains, heads, float(eps))
