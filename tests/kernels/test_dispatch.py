"""The dispatch plan (:func:`lit_mhar.kernels.dispatch.plan`), a pure function of a call's shape.

Proves: for every routing call the models make at 20m, 100m, 350m and 1b (widths 384 / 512 / 1024 /
1280, H = 1, 4, 8, 16, full and block routing, MHAR and Delta, bf16 and float32, eager and compiled,
decoding, single sites), the plan names the kernel family and tile the code at 85cbf51 (tag
``kernel-knobs-final``) launched, recorded in ``data/dispatch_85cbf51.txt.gz``; the one flag it adds
(``LONE_SOURCE``: a softmax over one source, whose weight is exactly 1) is set exactly there; tuned
tiles hold at their width and head count only; the host's launch arithmetic equals Triton's;
unsupported sizes raise clear errors; table overrides are checked and undone.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest
import torch
import triton

from lit_mhar.kernels import dispatch, use_backend
from lit_mhar.kernels import triton_routing as tr
from lit_mhar.kernels.dispatch import Call, plan

RECORDED = Path(__file__).parent / "data" / "dispatch_85cbf51.txt.gz"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def recorded_calls() -> list[tuple[Call, list, list]]:
    """``(call, forward launches, backward launches)`` of the recorded table; a launch is ``(kernel,
    {name: value})``, None where that side was not recorded for the call."""

    def launches(text: str):
        if text == "-":
            return None
        found = re.findall(r"(\w+)\(([^)]*)\)", text)
        return [(k, {a: int(v) for a, v in (kv.split("=") for kv in args.split(","))}) for k, args in found]

    rows = []
    for line in gzip.decompress(RECORDED.read_bytes()).decode().splitlines():
        if line.startswith("#"):
            continue
        head, fwd, bwd = (part.strip() for part in line.split("|"))
        form, n, s, d, h, dtype, grad, eager, rebuild, rstd, pending = head.split()
        call = Call(
            form, int(n), int(s), int(d), int(h), DTYPES[dtype], DTYPES[grad], eager=bool(int(eager)), rebuild=bool(int(rebuild)),
            rstd_saved=bool(int(rstd)), pending=bool(int(pending)),
        )
        rows.append((call, launches(fwd), launches(bwd)))
    return rows


def test_plan_launches_what_85cbf51_launched_for_every_model_call():
    """Each recorded call's forward and backward: the same kernels in the same order, every recorded
    constexpr and launch option equal; the plan's only other flag is LONE_SOURCE on the vector
    backward kernels, set where the call routes one source without a prior."""
    rows = recorded_calls()
    assert len(rows) > 4000 and {c.width for c, _, _ in rows} == {384, 512, 1024, 1280} and {c.heads for c, _, _ in rows} == {1, 4, 8, 16}
    checked = lone = 0
    for call, fwd, bwd in rows:
        decided = plan(call)
        for recorded, planned in ((fwd, decided.forward), (bwd, decided.backward)):
            if recorded is None:
                continue
            assert [k for k, _ in recorded] == [launch.kernel for launch in planned], call
            for (kernel, meta), launch in zip(recorded, planned):
                assert {k: int(v) for k, v in launch.meta.items() if k in meta} == meta, (call, kernel)
                extra = set(launch.meta) - set(meta)
                assert extra == ({"LONE_SOURCE"} if kernel in ("bwd", "bwd_stats", "bwd_sources") else set()), (call, kernel, extra)
                if extra:
                    assert launch.meta["LONE_SOURCE"] == (call.sources == 1 and not call.form.startswith("merge")), call
                    lone += launch.meta["LONE_SOURCE"]
                checked += 1
    assert checked > 5000 and lone > 0


def test_interpreter_tiles_take_up_to_64_tokens_on_4_warps():
    """In Triton's interpreter (CPU tensors) the vector kernels take up to INTERPRET_ROWS tokens a
    program on 4 warps, decoding 4 warps; the tensor-core tiles are the GPU's."""
    p = plan(Call("route", 9, 1, 1280, 8, torch.float32), interpret=True)
    assert [(launch.meta["BM"], launch.meta["num_warps"]) for launch in (*p.forward, *p.backward)] == [(32, 4), (32, 4), (32, 4)]
    assert plan(Call("merge-norm", 1, 1, 64, 2, torch.float32), interpret=True).backward[0].meta["BM"] == dispatch.INTERPRET_ROWS
    decode = plan(Call("decode", 9, 1, 1024, 8, torch.bfloat16), interpret=True).forward
    assert [launch.meta["num_warps"] for launch in decode] == [4]
    dots = Call("route", 41, 8, 1024, 8, torch.bfloat16)
    assert plan(dots, interpret=True).backward == plan(dots).backward


def test_tuned_tiles_hold_at_their_width_and_head_count_only():
    """A tuned tile keyed by (kind, width) holds for every head count, one keyed by (kind, width,
    heads) for that count only; other counts and widths take the general rule, the interpreter its
    own rows."""
    def tokens(kind, d, heads):  # (tokens, warps)
        tile = dispatch.vector_tile(kind, 1, d, heads)
        return tile["BM"], tile["num_warps"]

    assert tokens("bwd_sources", 1280, 1) == (1, 1) and tokens("fwd", 1280, 1) == (2, 1)
    assert tokens("bwd_sources", 1280, 8) == (1, 4) and tokens("fwd", 1280, 8) == (2, 4)  # the rule: 2048 / 4096 elements, 4 warps at least
    assert tokens("bwd", 1280, 1) == tokens("bwd", 1280, 8) == (1, 2) and tokens("bwd_add", 1280, 8) == (1, 4)
    assert tokens("bwd_sources", 1024, 8) == (1, 2) and tokens("bwd_sources", 768, 8) == (2, 4)
    assert tokens("bwd_stats", 1024, 1) == (1, 1) and tokens("bwd_stats", 1024, 8) == (2, 2)  # (kind, 1024, 1) over (kind, 1024)
    assert tokens("fwd", 512, 1) == (4, 1) and tokens("fwd", 512, 8) == (4, 2)
    assert tokens("bwd_stats", 512, 1) == (2, 1) and tokens("bwd_sources", 1024, 1) == (2, 2) and tokens("bwd_sources", 512, 1) == (4, 2)
    interpreted = [dispatch.vector_tile("bwd_sources", 1, 1280, h, True) for h in (1, 8)]
    assert [(t["BM"], t["num_warps"]) for t in interpreted] == [(32, 4), (32, 4)]


def test_host_launch_arithmetic_equals_tritons():
    """The plan's plain-Python ``cdiv`` and ``pow2`` give what ``triton.cdiv`` and
    ``triton.next_power_of_2`` give (grids, tiles and padded widths depend on them)."""
    assert [dispatch.pow2(n) for n in range(0, 5000)] == [triton.next_power_of_2(n) for n in range(0, 5000)]
    assert [dispatch.pow2(n) for n in (2**31 - 1, 2**31, 2**31 + 1)] == [2**31, 2**31, 2**32]
    pairs = [(a, b) for a in (0, 1, 2, 15, 16, 17, 1000, 131071, 131072, 2**40 + 3) for b in (1, 2, 3, 16, 64, 127, 4096)]
    assert [dispatch.cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


def test_unsupported_sizes_raise_clear_errors():
    with use_backend("triton"):
        v = [torch.randn(3, 1024)]
        with dispatch.overrides(SITE_LOOP_MIN_SITES=100):  # the two-pass backward, which holds every site's gradient
            with pytest.raises(ValueError, match="route at most 8 sites per pass"):
                tr.route_sites(v, torch.randn(9, 1024), torch.ones(9, 1024))
        with pytest.raises(ValueError, match="more than the 16384"):
            tr.depth_route([torch.randn(2, 16385)], torch.randn(16385), torch.ones(16385))
        with pytest.raises(ValueError, match="dtype torch.float64"):
            tr.depth_route([torch.randn(2, 8, dtype=torch.float64)], torch.randn(8), torch.ones(8))
        with pytest.raises(ValueError, match="heads=3"):
            tr.depth_route([torch.randn(2, 8)], torch.randn(8), torch.ones(8), heads=3)
    with pytest.raises(ValueError, match="form 'routes'"):
        plan(Call("routes", 1, 1, 8, 1, torch.float32))
    with pytest.raises(ValueError, match="heads=3 must divide"):
        plan(Call("route", 1, 1, 8, 3, torch.float32))


def test_overrides_take_table_entries_only_and_are_undone():
    call = Call("route", 3, 6, 1024, 8, torch.bfloat16)
    assert plan(call).forward[0].kernel == "fwd_sites_mix"
    with dispatch.overrides(DOT_MIX_MAX_SOURCES=0):
        assert plan(call).forward[0].kernel == "fwd_sites_dot"
    assert plan(call).forward[0].kernel == "fwd_sites_mix" and dispatch.DOT_MIX_MAX_SOURCES == 8
    for bad in ("plan", "dot_tile", "NOT_AN_ENTRY"):
        with pytest.raises(ValueError, match="not entries of the dispatch table"):
            with dispatch.overrides(**{bad: 1}):
                pass
