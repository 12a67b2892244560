"""The GPU benchmark scripts' own helpers, on the CPU (the scripts themselves run on the GPU machine)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from lit_mhar.kernels import dispatch, launch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark_script(monkeypatch, name: str):
    """The benchmark script ``name`` imported as a module, its folder on ``sys.path`` for the test
    (the scripts import their siblings); yielded, then dropped from ``sys.modules``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


@pytest.fixture
def tune_tiles(monkeypatch):
    yield from _benchmark_script(monkeypatch, "tune_tiles")


def test_tune_tiles_sets_one_tile_and_reads_table_entries(tune_tiles):
    """``tile_table`` sets one launch kind's tile at one width and head count and keeps the package's
    others (its own table untouched); ``--try`` takes NAME=VALUE with a Python literal."""
    before = dict(dispatch.TUNED_TILES)
    table = tune_tiles.tile_table("bwd_stats", 1024, 1, 4096, 8)
    assert table[("bwd_stats", 1024, 1)] == (4096, 8) and {k: v for k, v in table.items() if k != ("bwd_stats", 1024, 1)} == {
        k: v for k, v in before.items() if k != ("bwd_stats", 1024, 1)
    }
    assert dispatch.TUNED_TILES == before
    with dispatch.overrides(TUNED_TILES=table):
        assert dispatch.vector_tile("bwd_stats", 1, 1024, 1)["num_warps"] == 8
    assert tune_tiles.parse_try('DOT_STAGES={"bwd_sources_dot": 2}') == {"DOT_STAGES": {"bwd_sources_dot": 2}}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        tune_tiles.parse_try("4")


@pytest.fixture
def memory_phases(monkeypatch):
    yield from _benchmark_script(monkeypatch, "memory_phases")


def test_memory_peak_takes_the_blocks_alive_at_the_largest_sum(memory_phases):
    """``live_at_peak`` replays an allocator trace: the peak is the largest sum of live blocks,
    blocks freed before it and blocks from before the trace do not count, the phase is the
    forward's up to ``forward_events``, and the live blocks are grouped by the project line that
    allocated them."""
    here = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "rms_norm"},
            {"filename": "/tmp/site/lit_mhar/model.py", "line": 7, "name": "forward"}]
    there = [{"filename": "/home/lit_mhar/.venv/lib/python3.12/site-packages/torch/autograd/function.py", "line": 5, "name": "apply"},
             {"filename": "/usr/lib/python3/dist-packages/lit_mhar/kernels/sink.py", "line": 3, "name": "advance"}]
    events = [
        dict(action="alloc", addr=1, size=100, frames=here),
        dict(action="alloc", addr=2, size=50, frames=there),
        dict(action="free_completed", addr=99, size=500, frames=[]),  # allocated before the trace
        dict(action="alloc", addr=3, size=30, frames=here),  # peak: 180
        dict(action="free_completed", addr=1, size=100, frames=here),
        dict(action="alloc", addr=4, size=120, frames=[]),  # 50 + 30 + 120 = 200
        dict(action="free_completed", addr=4, size=120, frames=[]),
        dict(action="alloc", addr=5, size=170, frames=[]),  # 50 + 30 + 170 = 250, the peak
        dict(action="free_completed", addr=2, size=50, frames=there),
    ]
    best, phase, groups = memory_phases.live_at_peak(events, forward_events=4)
    assert best == 250 and phase == "backward"
    assert groups == [("(autograd engine)", 170, 1), ("lit_mhar/kernels/sink.py:3 (advance)", 50, 1), ("lit_mhar/model.py:7 (forward)", 30, 1)]
    best, phase, groups = memory_phases.live_at_peak(events[:4], forward_events=4)
    assert best == 180 and phase == "forward" and groups[0] == ("lit_mhar/model.py:7 (forward)", 130, 2)
    # a free counts where it is requested (memory_allocated drops there), not where it completes
    repo_frame = [{"filename": f"{memory_phases.REPO}/kernels/triton_routing.py", "line": 4, "name": "_new"}]
    deferred = [
        dict(action="alloc", addr=1, size=100, frames=repo_frame),
        dict(action="free_requested", addr=1, size=100, frames=repo_frame),
        dict(action="alloc", addr=2, size=60, frames=here),
        dict(action="free_completed", addr=1, size=100, frames=repo_frame),
        dict(action="free_requested", addr=2, size=60, frames=here),
        dict(action="free_completed", addr=2, size=60, frames=here),
    ]
    assert memory_phases.live_at_peak(deferred, forward_events=6) == (100, "forward", [("kernels/triton_routing.py:4 (_new)", 100, 1)])
    assert memory_phases._label([{"filename": "/a/b/torch/nn/functional.py", "line": 1, "name": "f"}]) == "nn/functional.py:1 (f)"


@pytest.fixture
def host_profile(monkeypatch):
    yield from _benchmark_script(monkeypatch, "host_profile")


def test_host_profile_names_the_innermost_frame_of_the_project(host_profile):
    """A synchronisation is attributed to the innermost frame of the project's code (installed or
    checkout), not to torch's or the script's frames below or above it; with none, the innermost
    frame outside the warnings module."""
    import traceback

    def frame(path, line, name):
        return traceback.FrameSummary(path, line, name, lookup_line=False)

    stack = [
        frame("/work/benchmarks/host_profile.py", 90, "step"),
        frame("/tmp/site/lit_mhar/model.py", 207, "forward"),
        frame("/tmp/site/lit_mhar/kernels/triton_routing.py", 1861, "_forward"),
        frame("/usr/lib/python3/site-packages/torch/cuda/__init__.py", 12, "synchronize"),
    ]
    assert host_profile._project_frame(stack) == "kernels/triton_routing.py:1861 (_forward)"
    assert host_profile._project_frame(stack[:2]) == "model.py:207 (forward)"
    warned = [stack[0], stack[3], frame("/usr/lib/python3.12/warnings.py", 110, "_showwarnmsg")]
    assert host_profile._project_frame(warned).endswith("torch/cuda/__init__.py:12 (synchronize)")
    # a checkout (editable install): lit_mhar.kernels lives in kernels/ beside lit_mhar/
    checkout = [stack[0], frame("/src/repo/lit_mhar/routing.py", 320, "route_norm"), frame("/src/repo/kernels/triton_routing.py", 2022, "_backward"), stack[3]]
    assert host_profile._project_frame(checkout, root="/src/repo") == "kernels/triton_routing.py:2022 (_backward)"
    assert host_profile._project_frame(checkout[:2], root="/src/repo") == "routing.py:320 (route_norm)"
    assert host_profile._project_frame([stack[0], stack[3]], root="/work").endswith("(synchronize)")  # benchmarks/ is not the package


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--top", "0"], ["--warmup", "-1"]])
def test_host_profile_refuses_bad_counts_before_any_work(host_profile, argv, capsys):
    with pytest.raises(SystemExit) as e:
        host_profile.main(["--scale", "debug", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{argv[0]} {argv[1]}: must be" in err


@pytest.fixture
def host_overhead_cpu(monkeypatch):
    yield from _benchmark_script(monkeypatch, "host_overhead_cpu")


def test_host_overhead_runs_the_triton_path_with_every_launch_stubbed(host_overhead_cpu):
    """A routed step goes through the Triton wrappers (their launches counted, none run), prenorm's
    through none of them; the kernels' launch module is left as it was."""
    kernel = launch.kernel
    ms, launches, table = host_overhead_cpu.measure("100m", "mhar-block8-H8", steps=1, warmup=0, profile=5)
    assert ms > 0 and launches > 0 and "kernels" in table
    assert host_overhead_cpu.measure("100m", "prenorm", steps=1, warmup=0, profile=0)[1:] == (0, "")
    assert host_overhead_cpu.measure("100m", "mhar-block8-H8:cuda-graph", steps=1, warmup=0, profile=0)[1] == launches  # (a no-op on the CPU)
    assert launch.kernel is kernel


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--warmup", "-1"], ["--profile", "-1"], ["--rounds", "0"], ["--variants", "prenorm,mhar-block9"],
                                  ["--variants", "mhar-block8-H8:no-such-knob"]])
def test_host_overhead_refuses_bad_arguments_before_any_work(host_overhead_cpu, argv, capsys):
    with pytest.raises(SystemExit) as e:
        host_overhead_cpu.main(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.fixture
def bench_training(monkeypatch):
    yield from _benchmark_script(monkeypatch, "bench_training")


@pytest.mark.parametrize("variant, layout", [("prenorm", "model"), ("mhar-block8-H8", "sublayers"), ("prenorm:compile-sublayers", "sublayers"),
                                             ("delta-block8-H8:compile-model", "model")])
def test_training_benchmark_compiles_as_litlm_does_unless_a_knob_says(bench_training, monkeypatch, variant, layout):
    """The benchmark's layout is LitLM(compile=True)'s (the whole model unless it routes), or the knob's."""
    from lit_mhar import LM

    monkeypatch.setattr(bench_training, "DEVICE", "cpu")
    used = []
    real = LM.compile_for_training
    monkeypatch.setattr(LM, "compile_for_training", lambda self, layout="auto", **kw: used.append(real(self, layout, backend="eager")))
    overrides, knob_names = bench_training.split_variant(variant)
    with bench_training.knobs(knob_names):
        bench_training.training_parts("debug", overrides, 1, 8, compile_=True)
    assert used == [layout] and bench_training.COMPILE_LAYOUT == "auto"  # (the knob restored)


def test_training_benchmark_refuses_both_graph_knobs_at_once_by_name(bench_training):
    with pytest.raises(ValueError, match="'prenorm:cuda-graph:graphed-loss': cuda-graph .* exclude each other"):
        bench_training.split_variant("prenorm:cuda-graph:graphed-loss")
    assert bench_training.split_variant("prenorm:graphed-loss")[1] == ["graphed-loss"]


@pytest.fixture
def bench_fit(monkeypatch):
    yield from _benchmark_script(monkeypatch, "bench_fit")


def test_fit_benchmark_reads_throughput_windows_in_step_order(bench_fit, tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,perf/tokens_per_s,step,train/loss\n,300.5,19,\n0,,19,2.5\n,100,9,\n,,0,\n")
    assert bench_fit.read_windows(str(path), "perf/tokens_per_s") == [100.0, 300.5]
    assert bench_fit.read_windows(str(path), "perf/mfu") == []


@pytest.mark.parametrize("argv, message", [
    (["--configs", "configs/no_such.yaml"], "no such file"),
    (["--configs", "configs/debug.yaml", "--steps", "0"], "--steps 0 and"),
    (["--configs", "configs/debug.yaml", "--steps", "20", "--log-every", "10", "--skip", "2"], "gives no window after the 2 skipped"),
    (["--configs", "configs/debug.yaml+model.cuda_graph"], "setting 'model.cuda_graph' is not key=value"),
    (["--configs", "configs/debug.yaml+=true"], "setting '=true' is not key=value"),
])
def test_fit_benchmark_refuses_bad_arguments_before_any_work(bench_fit, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench_fit.main([argv[0], str(BENCHMARKS.parent / argv[1]), *argv[2:], "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fit_benchmark_refuses_an_out_folder_with_earlier_logs_before_any_fit(bench_fit, tmp_path, capsys, monkeypatch):
    (tmp_path / "fit_logs_1").mkdir()
    monkeypatch.setattr(bench_fit, "run_config", lambda *a, **k: pytest.fail("a fit started"))
    config = str(BENCHMARKS.parent / "configs" / "debug.yaml")
    with pytest.raises(SystemExit) as e:
        bench_fit.main(["--configs", f"{config},{config}", "--steps", "30", "--out", str(tmp_path)])
    assert e.value.code == 2 and "fit_logs_1" in capsys.readouterr().err


def test_fit_benchmark_times_a_real_fit_and_never_overwrites_its_logs(bench_fit, small_corpus, tmp_path):
    """One real ``lit-mhar fit`` on the CPU: a row with the median throughput of the windows after
    the skipped one; a second run into the same folder refuses before starting."""
    extra = ["--data.data_dir", str(small_corpus), "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.accelerator", "cpu",
             "--data.val_tokens", "64"]
    config = str(BENCHMARKS.parent / "configs" / "debug" / "block_mhar.yaml")
    row = bench_fit.run_config(config + "+model.routing_log_every_n_steps=0", steps=6, log_every=2, skip=1, extra=extra, out=str(tmp_path), index=0)
    assert row["status"] == "ok", row
    assert row["config"].endswith("block_mhar.yaml+model.routing_log_every_n_steps=0") and row["args"].endswith("--model.routing_log_every_n_steps 0")
    assert row["windows"] == 2 and float(row["tokens_per_s"]) > 0
    assert not list(tmp_path.rglob("*.ckpt"))  # checkpoints removed, logs kept
    assert list(tmp_path.rglob("metrics.csv")) and (tmp_path / "fit_0.log").is_file()
    with pytest.raises(FileExistsError, match="fit_logs_0 exists"):
        bench_fit.run_config(config, steps=6, log_every=2, skip=1, extra=extra, out=str(tmp_path), index=0)


@pytest.fixture
def step_bytes(monkeypatch):
    yield from _benchmark_script(monkeypatch, "step_bytes")


NCU_RAW = """==PROF== Connected to process 123 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","","","","","byte","byte","nsecond"
"0","123","python3","h","_route_bwd","1","7","(256, 1, 1)","(528, 1, 1)","0","9.0","300,000,000","100,000,000","200,000"
"1","123","python3","h","_route_bwd","1","7","(256, 1, 1)","(528, 1, 1)","0","9.0","200000000","200000000","100000"
"2","123","python3","h","void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>","1","7","(128, 1, 1)","(999, 1, 1)","0","9.0","128000000","64000000","48000"
==PROF== Disconnected from process 123
"""


def test_step_bytes_reads_ncu_raw_csv_and_sums_bytes_and_time_by_category(step_bytes, tmp_path):
    """Bytes are read plus written, in base units (ns to ms); each category and the total get
    GB, ms, GB/s, the fraction of the copy bandwidth and the time at it."""
    path = tmp_path / "ncu_bytes_350m_mhar-block8-H8.csv"
    path.write_text(NCU_RAW)
    kernels = step_bytes.read_ncu_csv(str(path))
    assert [k[0] for k in kernels] == ["_route_bwd", "_route_bwd", kernels[2][0]]
    assert kernels[0][1:] == pytest.approx((0.2, 4e8)) and kernels[2][1:] == pytest.approx((0.048, 1.92e8))
    rows = {r["category"]: r for r in step_bytes.summarise(kernels, copy_gbs=4000.0)}
    bwd = rows["routing bwd"]
    assert (bwd["kernels"], bwd["GB"], bwd["ms"]) == (2, pytest.approx(0.8), pytest.approx(0.3))
    assert bwd["GB_per_s"] == pytest.approx(0.8e9 / 0.3e-3 / 1e9) and bwd["frac_copy"] == pytest.approx(bwd["GB_per_s"] / 4000)
    assert bwd["ms_at_copy"] == pytest.approx(0.2)
    assert rows["all profiled"]["GB"] == pytest.approx(0.992) and rows["elementwise"]["kernels"] == 1


def test_step_bytes_report_names_a_failed_ncu_file_and_refuses_the_graph_knobs(step_bytes, tmp_path):
    (tmp_path / "copy_bandwidth.json").write_text('{"GB_per_s": 4000.0}')
    (tmp_path / "ncu_bytes_350m_prenorm.csv").write_text("==ERROR== profiling is not supported\n")
    (tmp_path / "ncu_bytes_350m_mhar-block8-H8.csv").write_text(NCU_RAW)
    assert step_bytes.main(["report", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "step_bytes.md").read_text()
    assert "350m prenorm: " in md and "no ncu CSV header" in md and "### 350m mhar-block8-H8" in md
    with pytest.raises(ValueError, match="cuda-graph"):
        step_bytes.profile_one_step("debug", "prenorm:cuda-graph", 0)


@pytest.fixture
def head_counts(monkeypatch):
    yield from _benchmark_script(monkeypatch, "head_counts")


def test_head_counts_measures_each_checkout_in_its_own_process(head_counts, tmp_path):
    """A dry run on the CPU (debug scale, the reference path): this checkout and a second one (here
    the same files, as ``--before`` takes an extracted archive) each measured against its own
    prenorm, written as CSV and markdown; a folder that is not a checkout is refused."""
    before = tmp_path / "before"
    before.mkdir()
    for name in ("lit_mhar", "kernels"):
        (before / name).symlink_to(BENCHMARKS.parent / name)
    assert head_counts.main(["--scales", "debug", "--variants", "attnres-block8-H1", "--steps", "1", "--warmup", "1",
                             "--before", str(before), "--out", str(tmp_path)]) == 0
    rows = (tmp_path / "head_counts.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and all(",ok," in row for row in rows[1:])
    assert "| attnres-block8-H1 |" in (tmp_path / "head_counts.md").read_text()
    with pytest.raises(SystemExit):
        head_counts.main(["--before", str(tmp_path), "--out", str(tmp_path)])
