"""The GPU benchmark scripts' own helpers, on the CPU (the scripts themselves run on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lit_mhar.kernels import triton_routing as tr

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def tune_tiles(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # tune_tiles imports bench_routing_op from its folder
    import tune_tiles

    yield tune_tiles
    sys.modules.pop("tune_tiles", None)


def test_tune_tiles_kernel_settings_sets_restores_and_takes_none(tune_tiles):
    """``kernel_settings`` sets the kernels module's attributes for its block and restores them,
    and with no settings (a family's "package-defaults" row) leaves the package's own in place."""
    before = (tr.DOT_MIN_SOURCES, dict(tr.WARPS))
    with tune_tiles.kernel_settings(dict(DOT_MIN_SOURCES=before[0] + 5, WARPS={"bwd": 2})):
        assert tr.DOT_MIN_SOURCES == before[0] + 5 and tr.WARPS == {"bwd": 2}
    assert (tr.DOT_MIN_SOURCES, tr.WARPS) == before
    with tune_tiles.kernel_settings({}):
        assert (tr.DOT_MIN_SOURCES, tr.WARPS) == before
    assert (tr.DOT_MIN_SOURCES, tr.WARPS) == before
