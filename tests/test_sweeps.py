"""``lit-mhar sweep``: search-space parsing, budgets, bad input, and real sweeps of real fits on tiny data.

The sweeps here are the shipped ``sweeps/debug.yaml`` with a tiny model (d=32, one layer) on a
corpus of a few stdlib modules prepared once per session (tests/conftest.py), so each trial is a real ``lit-mhar fit``
subprocess of a few seconds plus its start-up (importing Lightning and MLflow: ~15 s on two cores).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from lit_mhar.cli import main
from lit_mhar.sweeps.runner import open_storage, run
from lit_mhar.sweeps.space import Objective, SearchSpace, budget_overrides, compose_trial_config, token_budget

ROOT = Path(__file__).resolve().parents[1]
S = optuna.trial.TrialState


def write_sweep(tmp: Path, stdlib_corpus: Path, study: str, space, **fields) -> Path:
    """sweeps/debug.yaml with a tiny model, the corpus, and every store inside ``tmp``."""
    sweep = yaml.safe_load((ROOT / "sweeps" / "debug.yaml").read_text())
    sweep["study"] = study
    sweep["space"] = space
    sweep["base"]["model"]["config"].update(d_model=32, n_layer=1, n_head=2, n_kv_head=1, ffn_dim=64)
    sweep["base"]["model"]["warmup_steps"] = 2
    sweep["base"]["data"].update(data_dir=str(stdlib_corpus), seq_len=32, batch_size=4, val_tokens=256)
    sweep["base"]["trainer"].update(log_every_n_steps=2)
    sweep["objective"] = {"tokens": 1024, "evals": 2}  # 8 steps of 4 x 32 tokens
    sweep["storage"] = f"sqlite:///{tmp / 'sweeps.db'}"
    sweep["mlflow"] = {"experiment": "sweeps-test", "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "artifact_location": str(tmp / "artifacts")}
    sweep["output_dir"] = str(tmp / "runs")
    sweep.update(fields)
    path = tmp / f"{study}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def load(tmp: Path, study: str) -> optuna.Study:
    return optuna.load_study(study_name=study, storage=open_storage(f"sqlite:///{tmp / 'sweeps.db'}"))


def cli(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lit_mhar.cli", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ----------------------------------------------------------------------------- the space, no training


def test_union_of_grids_runs_the_baseline_once_and_each_routed_point_once():
    space = SearchSpace.parse([{"residual": ["prenorm"], "scale": ["20m"]}, {"residual": ["delta", "prenorm"], "heads": [1, 4], "scale": ["20m"]},
                               {"residual": ["prenorm"], "scale": ["20m"]}])
    points = space.grid()
    assert points[0] == {"residual": "prenorm", "scale": "20m"}
    assert [p for p in points if "heads" in p] == [
        {"residual": r, "heads": h, "scale": "20m"} for r in ("delta", "prenorm") for h in (1, 4)
    ]
    assert len(points) == 5  # the third sub-grid repeats the first and adds nothing
    assert space.choices("residual") == ("prenorm", "delta")


@pytest.mark.parametrize(
    "space, message",
    [
        ({"headz": [1, 2]}, "unknown parameter 'headz'"),
        ({"heads": []}, "space.heads is an empty list"),
        ({}, "non-empty mapping"),
        ([], "space is an empty list"),
        ({"trainer.max_steps": [10]}, "set from objective.tokens"),
        ({"model.config.heads": [2]}, "short name 'heads'"),
        ({"residual": ["mhar"]}, "valid: ['prenorm', 'attnres', 'delta', 'hyper']"),
        ({"heads": [0, 2]}, "integer >= 1"),
        ({"scale": ["7b"]}, "valid presets"),
        ({"lr": {"low": 1e-2, "high": 1e-4, "log": True}}, "must be below high"),
        ({"lr": {"low": 0.0, "high": 1e-2, "log": True}}, "log range needs low > 0"),
        ({"lr": {"low": 1e-4}}, "low and high are required"),
        ({"heads": [2, 2]}, "lists a value twice"),
    ],
    ids=["unknown-name", "empty-list", "empty-mapping", "empty-union", "reserved", "long-form-of-short-name", "bad-residual",
         "zero-heads", "unknown-scale", "inverted-range", "log-from-zero", "half-range", "duplicate-value"],
)
def test_bad_space_names_the_parameter(space, message):
    with pytest.raises(ValueError) as error:
        SearchSpace.parse(space)
    assert message in str(error.value)


def test_ranges_are_for_tpe_and_random_not_grids():
    space = SearchSpace.parse({"lr": {"low": "1e-4", "high": 1e-2, "log": True}, "model.warmup_steps": {"low": 1, "high": 9}})
    assert space.subspaces[0]["lr"].low == 1e-4 and not space.subspaces[0]["model.warmup_steps"].log
    assert space.subspaces[0]["model.warmup_steps"].integer
    from lit_mhar.sweeps.space import Sampler

    with pytest.raises(ValueError, match="space.lr is a range, which a grid cannot enumerate"):
        space.check_sampler(Sampler(name="grid"))
    space.check_sampler(Sampler(name="tpe", n_trials=4))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = space.suggest(study.ask())
        assert 1e-4 <= params["lr"] <= 1e-2 and params["model.warmup_steps"] in range(1, 10)


def test_token_budget_gives_whole_validations_and_needs_a_fixed_device_count():
    resolved = {"data": {"batch_size": 4, "seq_len": 32}, "trainer": {"devices": 1, "accumulate_grad_batches": 1, "num_nodes": 1}}
    budget = token_budget(Objective(tokens=10_000, evals=4), resolved)
    assert (budget.tokens_per_step, budget.val_every, budget.max_steps) == (128, 20, 80)  # 79 steps rounded up to 4 x 20
    assert budget.tokens == 80 * 128 >= 10_000
    assert token_budget(Objective(tokens=10_000, evals=4), {**resolved, "trainer": {"devices": "2", "accumulate_grad_batches": 2}}).tokens_per_step == 512
    with pytest.raises(ValueError, match="trainer.devices='auto'"):
        token_budget(Objective(), {**resolved, "trainer": {"devices": "auto"}})
    with pytest.raises(ValueError, match="fewer than objective.evals=4"):
        token_budget(Objective(tokens=200, evals=4), resolved)


def test_budget_overrides_keep_throughput_windows_inside_a_validation_interval():
    resolved = {"data": {"batch_size": 32, "seq_len": 1024}, "trainer": {"devices": 1, "accumulate_grad_batches": 2, "log_every_n_steps": 25}}
    budget = token_budget(Objective(tokens=4_000_000, evals=4), resolved)  # 62 steps -> 64, validate every 16
    overrides = budget_overrides(budget, resolved)
    assert overrides["trainer.max_steps"] == 64 and overrides["trainer.val_check_interval"] == 32  # batches: 16 steps x 2
    assert overrides["trainer.log_every_n_steps"] == 8  # 25 would never complete between two validations
    long = token_budget(Objective(tokens=400_000_000, evals=4), resolved)
    assert budget_overrides(long, resolved)["trainer.log_every_n_steps"] == 25  # left alone when it fits


def test_trial_config_is_base_then_scale_then_point():
    base = {"model": {"config": {"name": "20m"}, "lr": 1e-3}, "data": {"seq_len": 1024}}
    per_scale = {"100m": {"model": {"lr": 5e-4}, "data": {"batch_size": 16}}}
    config = compose_trial_config(base, per_scale, {"scale": "100m", "heads": 4, "seed": 7, "model.warmup_steps": 10})
    assert config["model"] == {"config": {"name": "100m", "heads": 4}, "lr": 5e-4, "warmup_steps": 10}
    assert config["data"] == {"seq_len": 1024, "batch_size": 16, "seed": 7} and config["seed_everything"] == 7
    assert base["model"]["config"] == {"name": "20m"}  # not modified


def test_pruning_callback_reports_the_kth_validation_and_stops_the_fit(tmp_path):
    from types import SimpleNamespace

    import torch

    from lit_mhar.sweeps.space import Pruner
    from lit_mhar.sweeps.trial import OptunaPruning

    url = f"sqlite:///{tmp_path / 'p.db'}"
    study = optuna.create_study(study_name="p", storage=open_storage(url), pruner=Pruner(name="median", n_startup_trials=1).build(2))
    done = study.ask()
    done.report(1.0, 1)
    done.report(0.5, 2)
    study.tell(done, 0.5)
    running = study.ask()
    callback = OptunaPruning(url, "p", running._trial_id, {"name": "median", "n_startup_trials": 1}, evals=2, max_steps=8)
    trainer = SimpleNamespace(sanity_checking=False, global_step=4, callback_metrics={"val/loss": torch.tensor(0.9)}, should_stop=False)
    callback.on_validation_end(trainer, None)  # better than the median at validation 1: goes on
    assert not trainer.should_stop and callback.pruned_at is None
    trainer.global_step, trainer.callback_metrics = 8, {"val/loss": torch.tensor(0.7)}
    callback.on_validation_end(trainer, None)  # worse than the median (0.5) at validation 2: stops
    assert trainer.should_stop and callback.pruned_at == 2
    frozen = study.trials[1]
    assert frozen.intermediate_values == {1: pytest.approx(0.9), 2: pytest.approx(0.7)}
    assert frozen.user_attrs["lit_mhar.pruned_at"] == 2
    trainer.callback_metrics = {}
    callback.pruned_at = None
    with pytest.raises(RuntimeError, match="metric 'val/loss' was not logged"):
        callback.on_validation_end(trainer, None)


def test_journal_storage_opens_and_locks_beside_its_file(tmp_path):
    from lit_mhar.sweeps.storage import StorageLock

    storage = open_storage(f"journal:{tmp_path / 'sweeps.journal'}")
    optuna.create_study(study_name="j", storage=storage).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="j", storage=open_storage(f"journal:{tmp_path / 'sweeps.journal'}")).trials) == 2
    lock = StorageLock(f"journal:{tmp_path / 'sweeps.journal'}")
    lock.acquire()
    assert (tmp_path / "sweeps.journal.sweep-lock").exists()
    lock.release()
    lock.release()  # twice is harmless
    with pytest.raises(ValueError, match="folder .*nowhere does not exist"):
        open_storage(f"journal:{tmp_path / 'nowhere' / 'x.journal'}")


# ----------------------------------------------------------------------------- bad input before any trial


@pytest.mark.parametrize(
    "storage, message",
    [("sqlite:////no/such/folder/sweeps.db", "folder /no/such/folder does not exist"),
     ("postgresql://sweeper:secret@127.0.0.1:1/optuna", "unreachable"),
     ("sweeps.db", "not a URL"),
     ("sqlite://", "in-memory")],
    ids=["sqlite-missing-folder", "postgres-unreachable", "no-scheme", "in-memory"],
)
def test_unusable_storage_fails_before_anything_is_created(tmp_path, stdlib_corpus, storage, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        run(study="s", space={"heads": [1]}, base={"model": {"config": {"name": "debug", "residual": "attnres"}}}, storage=storage,
            output_dir=str(tmp_path / "runs"))
    assert message in str(error.value)
    assert "secret" not in str(error.value)  # the password is not printed
    assert "\n" not in str(error.value)  # one line (drivers' messages span several)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_unknown_fit_argument_in_the_space_fails_before_the_study_exists(tmp_path, stdlib_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, stdlib_corpus, "typo", [{"residual": ["prenorm"], "model.warmup_stepz": [5]}])
    with pytest.raises(ValueError, match="warmup_stepz"):
        main(["sweep", "run", "--config", str(path)])
    assert "typo" not in optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path / 'sweeps.db'}"))
    assert not (tmp_path / "mlflow.db").exists()


def test_refused_sweep_leaves_no_new_journal_file_and_keeps_an_existing_one(tmp_path, stdlib_corpus, monkeypatch):
    """A sweep refused before its study exists (a bad fit argument in the space) removes the empty
    journal file that opening a new ``journal:PATH`` storage created; an existing journal is kept."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, stdlib_corpus, "typo", [{"residual": ["prenorm"], "model.warmup_stepz": [5]}])
    journal = tmp_path / "sweeps.journal"
    with pytest.raises(ValueError, match="warmup_stepz"):
        main(["sweep", "run", "--config", str(path), "--storage", f"journal:{journal}"])
    assert not journal.exists()
    optuna.create_study(study_name="other", storage=open_storage(f"journal:{journal}"))
    before = journal.read_bytes()
    with pytest.raises(ValueError, match="warmup_stepz"):
        main(["sweep", "run", "--config", str(path), "--storage", f"journal:{journal}"])
    assert journal.read_bytes() == before


def test_sweep_help_lists_run_and_report(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "run" in out and "report" in out


@pytest.mark.parametrize("name", ["debug.yaml", "h_sweep.yaml", "compare.yaml"])
def test_shipped_sweeps_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "run", "--config", str(ROOT / "sweeps" / name), "--print_config"])
    assert exit_.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    space = SearchSpace.parse(printed["space"])
    assert space.grid()
    if name == "h_sweep.yaml":
        points = space.grid()
        assert {p["heads"] for p in points if "heads" in p} == {1, 2, 4, 8, 16}
        assert {p["scale"] for p in points} == {"20m", "100m"} and len(points) == 84  # two seeds


def test_compare_sweep_runs_every_published_method_at_both_scales_with_two_seeds_on_one_budget():
    """sweeps/compare.yaml: every point is a valid model, 20m points come first, all share data, budget and optimiser."""
    from lit_mhar.config import ModelConfig
    from lit_mhar.sweeps.fitconfig import model_fields, resolve_fit_config
    from lit_mhar.sweeps.space import get_dotted

    sweep = yaml.safe_load((ROOT / "sweeps" / "compare.yaml").read_text())
    grid = SearchSpace.parse(sweep["space"]).grid()
    assert len(grid) == 36 and [p["scale"] for p in grid] == ["20m"] * 18 + ["100m"] * 18
    methods: dict[tuple, set] = {}
    for point in grid:
        config = compose_trial_config(sweep["base"], sweep["per_scale"], point)
        model = ModelConfig(**get_dotted(config, "model.config"))  # raises for an invalid point
        blocks = "full" if model.block_size == 1 else ("8 blocks" if model.n_sublayers == 8 * model.block_size else model.block_size)
        methods.setdefault((model.residual, model.heads, blocks), set()).add((model.name, point["seed"]))
        assert config["data"] == {**sweep["base"]["data"], "seed": point["seed"]} and config["trainer"] == sweep["base"]["trainer"]
        assert config["model"]["lr"] == {"20m": 1e-3, "100m": 5e-4}[model.name]
    expected = {("prenorm", 1, "full"), ("hyper", 1, "full"), ("attnres", 1, "full"), ("attnres", 8, "full"), ("attnres", 16, "full"),
                ("delta", 1, "full"), ("attnres", 1, "8 blocks"), ("attnres", 8, "8 blocks"), ("delta", 8, "8 blocks")}
    assert set(methods) == expected
    assert all(runs == {(s, seed) for s in ("20m", "100m") for seed in (0, 1)} for runs in methods.values())
    hyper = next(p for p in grid if p["residual"] == "hyper" and p["scale"] == "100m")
    resolved = resolve_fit_config(compose_trial_config(sweep["base"], sweep["per_scale"], hyper))  # the fit CLI takes it
    assert model_fields(resolved)["residual"] == "hyper" and resolved["model"]["config"]["hc_rate"] == 4
    assert token_budget(Objective(**sweep["objective"]), resolved).max_steps == 2000


# ----------------------------------------------------------------------------- real sweeps


@pytest.mark.slow
def test_debug_sweep_end_to_end(tmp_path, stdlib_corpus, monkeypatch):
    """Optuna study, MLflow parent and children, a trial that raises, an invalid model, resume, report."""
    monkeypatch.chdir(tmp_path)
    space = [
        {"residual": ["prenorm"]},
        # raises inside the trial process (no checkpoint to start from), after its config passed every check
        {"residual": ["attnres"], "heads": [1], "model.init_from": [str(tmp_path / "missing.ckpt")]},
        {"residual": ["attnres"], "heads": [2, 3]},  # H=3 does not divide d=32: FAIL before it starts
    ]
    path = write_sweep(tmp_path, stdlib_corpus, "e2e", space)
    assert main(["sweep", "run", "--config", str(path)]) == 0

    study = load(tmp_path, "e2e")
    trials = study.get_trials()
    assert [t.state for t in trials] == [S.COMPLETE, S.FAIL, S.COMPLETE, S.FAIL]
    assert "missing.ckpt" in trials[1].user_attrs["lit_mhar.fail_reason"]
    assert "ModelConfig.heads=3 must divide d_model=32" in trials[3].user_attrs["lit_mhar.fail_reason"]
    assert trials[2].datetime_start > trials[1].datetime_complete  # the sweep went on after the crash
    for t in (trials[0], trials[2]):
        assert sorted(t.intermediate_values) == [1, 2] and t.value == t.intermediate_values[2]
        assert t.user_attrs["lit_mhar.max_steps"] == 8 and t.user_attrs["lit_mhar.tokens"] == 1024
        assert t.user_attrs["lit_mhar.tokens_per_s"] > 0
    assert trials[2].params == {"residual": "attnres", "heads": 2}

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sweeps-test")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("lit_mhar.sweep") == "parent"]
    assert parent.info.run_name == "e2e" and parent.info.status == "FINISHED"
    children = {int(r.data.tags["optuna.trial_number"]): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == [0, 1, 2, 3]
    assert [children[i].data.tags["optuna.trial_state"] for i in range(4)] == ["COMPLETE", "FAIL", "COMPLETE", "FAIL"]
    assert [children[i].info.status for i in range(4)] == ["FINISHED", "FAILED", "FINISHED", "FAILED"]
    complete = children[2]
    assert complete.data.metrics["sweep/val_loss"] == pytest.approx(trials[2].value)
    assert complete.data.metrics["val/loss"] == pytest.approx(trials[2].value)
    assert complete.data.params["sweep.heads"] == "2" and "perf/tokens_per_s" in complete.data.metrics
    artifacts = {a.path for a in client.list_artifacts(complete.info.run_id)}
    assert {"config.yaml", "trial.yaml", "trial.log"} <= artifacts  # the fit's resolved config, the sweep's input, the log
    assert "lit_mhar.git_commit" in complete.data.tags

    # The same command again resumes: nothing is left, nothing runs twice.
    assert main(["sweep", "run", "--config", str(path)]) == 0
    assert len(load(tmp_path, "e2e").trials) == 4
    # A changed sweep under the same study name is refused, and nothing is added.
    with pytest.raises(ValueError, match="made by a different sweep .*objective"):
        main(["sweep", "run", "--config", str(path), "--objective.tokens", "2048"])
    assert len(load(tmp_path, "e2e").trials) == 4

    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    assert main(["sweep", "report", "--study", "e2e", "--storage", storage, "--output_dir", str(tmp_path / "report")]) == 0
    out = tmp_path / "report"
    for png in ("val_loss_vs_heads.png", "val_loss_vs_block_size.png", "prenorm_fit.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # on a CPU: no throughput or memory plots, and the report says why
    assert not (out / "tokens_per_s_vs_heads.png").exists() and not (out / "peak_memory_vs_heads.png").exists()
    summary = (out / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and summary[1].startswith("debug,prenorm,1,1") and summary[2].startswith("debug,attnres,1,2")
    report_md = (out / "report.md").read_text()
    assert "missing.ckpt" in report_md and "heads=3 must divide" in report_md and "1,024 training tokens" in report_md
    assert "Throughput ratios, adjusted speedups and their plots are left out: trials ran on a CPU" in report_md
    assert "no fit (L = E + A*C^-alpha has 3 parameters and 1 distinct compute value" in report_md
    with (out / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["state"] for r in rows] == ["COMPLETE", "FAIL", "COMPLETE", "FAIL"] and "missing.ckpt" in rows[1]["fail_reason"]
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/val_loss_vs_heads.png" in logged and "report/summary.md" in logged
    with pytest.raises(ValueError, match="not empty; pass --overwrite true"):
        main(["sweep", "report", "--study", "e2e", "--storage", storage, "--output_dir", str(out)])
    with pytest.raises(ValueError, match=r"no study 'nope' .* studies there: \['e2e'\]"):
        main(["sweep", "report", "--study", "nope", "--storage", storage])

    # --retry_failed runs the two failed points once more (they fail again, and are not retried in a loop).
    assert main(["sweep", "run", "--config", str(path), "--retry_failed", "true"]) == 0
    trials = load(tmp_path, "e2e").get_trials()
    assert [t.state for t in trials] == [S.COMPLETE, S.FAIL, S.COMPLETE, S.FAIL, S.FAIL, S.FAIL]
    assert [t.params for t in trials[4:]] == [trials[1].params, trials[3].params]


@pytest.mark.slow
def test_two_commands_and_two_workers_share_a_grid_each_point_exactly_once(tmp_path, stdlib_corpus):
    """`sweep run --workers 2` and a second `sweep run` started at the same moment on one sqlite study."""
    # 5 points for 3 workers: the single worker of the second command, up first, is unlikely to take
    # them all while the first command still starts its two workers (it took all of 3 points once on
    # two cores loaded by other work; 5 were shared in two runs under that load)
    space = [{"residual": ["prenorm"]}, {"residual": ["attnres", "delta"], "heads": [1, 2]}]
    path = write_sweep(tmp_path, stdlib_corpus, "shared", space)
    procs = [cli("sweep", "run", "--config", str(path), "--workers", "2", cwd=tmp_path), cli("sweep", "run", "--config", str(path), cwd=tmp_path)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    trials = load(tmp_path, "shared").get_trials()
    assert len(trials) == 5 and all(t.state == S.COMPLETE for t in trials), [(t.number, t.state, t.user_attrs) for t in trials]
    points = [json.dumps(t.params, sort_keys=True) for t in trials]
    assert len(set(points)) == 5
    assert len({t.user_attrs["lit_mhar.pid"] for t in trials}) >= 2  # the work was shared
    created = sum("created study" in o for o in outputs)
    assert created == 1  # one creator; the other command resumed the same study and parent run
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sweeps-test").experiment_id])
    assert sum(r.data.tags.get("lit_mhar.sweep") == "parent" for r in runs) == 1 and len(runs) == 6


@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_trials(tmp_path, stdlib_corpus):
    # 8192 tokens: trial 0 (batch 16) is 16 steps; trial 1 (batch 4) 64 steps, seconds of time to kill it while it trains
    space = [{"residual": ["prenorm"], "data.batch_size": [16]}, {"residual": ["attnres"], "heads": [2]}]
    path = write_sweep(tmp_path, stdlib_corpus, "killed", space, objective={"tokens": 8192, "evals": 2})
    proc = cli("sweep", "run", "--config", str(path), cwd=tmp_path)
    log_1 = tmp_path / "runs" / "killed" / "trial-0001" / "trial.log"
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it while trial 1 trains, after trial 0 finished
        try:
            trials = load(tmp_path, "killed").get_trials()
        except KeyError:
            trials = []
        if len(trials) > 1 and trials[1].state == S.RUNNING and log_1.is_file() and "Trainable params" in log_1.read_text():
            break
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    else:
        pytest.fail("trial 1 never started")
    assert trials[0].state == S.COMPLETE
    first_value = trials[0].value
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup at all
    proc.wait()
    assert load(tmp_path, "killed").trials[1].state == S.RUNNING  # left behind

    assert main(["sweep", "run", "--config", str(path)]) == 0
    trials = load(tmp_path, "killed").get_trials()
    complete = [t for t in trials if t.state == S.COMPLETE]
    assert [t.params for t in complete] == [{"residual": "prenorm", "data.batch_size": 16}, {"residual": "attnres", "heads": 2}]
    assert [t.user_attrs["lit_mhar.max_steps"] for t in complete] == [16, 64]
    assert complete[0].number == 0 and complete[0].value == first_value  # not run again
    assert trials[1].state == S.FAIL and "lit_mhar.fail_reason" not in trials[1].user_attrs  # interrupted, then re-run
    assert len(trials) == 3 and complete[1].number == 2
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_1 = client.get_run(trials[1].user_attrs["lit_mhar.mlflow_run_id"])
    result = tmp_path / "runs" / "killed" / "trial-0001" / "result.json"
    deadline = time.time() + 60  # the orphaned trial process stops at its next batch and closes its run as KILLED
    while not (result.is_file() and run_1.info.status == "KILLED") and time.time() < deadline:
        time.sleep(0.2)
        run_1 = client.get_run(run_1.info.run_id)
    assert run_1.info.status == "KILLED"
    assert result.is_file(), (result.parent / "trial.log").read_text()[-3000:]
    orphan = json.loads(result.read_text())
    assert orphan["status"] == "error" and "runner that started this trial died" in orphan["error"]


def test_base_config_is_read_relative_to_the_sweep_file(tmp_path, monkeypatch):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"config": {"name": "debug"}}}))
    (tmp_path / "sub").mkdir()
    sweep = {"study": "rel", "base_config": "../base.yaml", "space": {"residual": ["attnres"]}, "storage": "sqlite:////no/such/folder/s.db"}
    (tmp_path / "sub" / "rel.yaml").write_text(yaml.safe_dump(sweep))
    monkeypatch.chdir(tmp_path / "sub")
    with pytest.raises(ValueError, match="folder /no/such/folder does not exist"):  # got past reading the base config
        main(["sweep", "run", "--config", "rel.yaml"])
    monkeypatch.chdir(tmp_path)  # cwd does not matter: the path is the sweep file's
    with pytest.raises(ValueError, match="folder /no/such/folder does not exist"):
        main(["sweep", "run", "--config", "sub/rel.yaml"])
    (tmp_path / "base.yaml").write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="is not a readable fit config"):
        main(["sweep", "run", "--config", "sub/rel.yaml"])
    (tmp_path / "base.yaml").write_text("model:\n  config: {name: debug\n")  # a syntax error
    with pytest.raises(ValueError, match=r"base_config='../base.yaml' \(.*base.yaml\): not valid YAML: .* at line 3"):
        main(["sweep", "run", "--config", "sub/rel.yaml"])


@pytest.mark.slow
def test_random_sampler_with_median_pruner_prunes_a_trial_that_does_not_learn(tmp_path, stdlib_corpus):
    """Random sampling until n_trials, and a real pruned trial: lr 1e-7 is worse than the median at validation 1."""
    path = write_sweep(tmp_path, stdlib_corpus, "pruned", {"residual": ["attnres"], "lr": [0.003, 1e-7]},
                       sampler={"name": "random", "n_trials": 2, "seed": 10},  # seed 10 draws 0.003, then 1e-7
                       pruner={"name": "median", "n_startup_trials": 1})
    assert main(["sweep", "run", "--config", str(path)]) == 0
    trials = load(tmp_path, "pruned").get_trials()
    assert [t.params["lr"] for t in trials] == [0.003, 1e-7]
    assert [t.state for t in trials] == [S.COMPLETE, S.PRUNED]
    assert trials[1].user_attrs["lit_mhar.pruned_at"] == 1 and list(trials[1].intermediate_values) == [1]
    assert trials[1].intermediate_values[1] > trials[0].intermediate_values[1]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(trials[1].user_attrs["lit_mhar.mlflow_run_id"]).data.tags["optuna.trial_state"] == "PRUNED"
    assert main(["sweep", "run", "--config", str(path)]) == 0  # n_trials is reached: nothing more runs
    assert len(load(tmp_path, "pruned").trials) == 2


def test_report_summary_pairs_seeds_and_gives_throughput_and_memory_against_prenorm():
    from lit_mhar.sweeps.report import markdown_table, summarise

    def row(residual, seed, loss, speed, mem, heads=1):
        return {"trial": seed, "state": "COMPLETE", "scale": "20m", "residual": residual, "block_size": 1, "heads": heads, "seed": seed,
                "budget": 1.0, "val_loss": loss, "tokens_per_s": speed, "mfu": None, "peak_memory_gb": mem, "tokens": 100,
                "flops_per_token": 1e6, "passes": 0.5, "startup_s": 10.0, "trials_per_gpu": 1}

    rows = [row("prenorm", 0, 3.0, 1000.0, 10.0), row("prenorm", 1, 3.2, 1000.0, 10.0),
            row("hyper", 0, 2.9, 800.0, 13.0), row("hyper", 1, 2.95, 800.0, 13.0)]
    hyper = next(r for r in summarise(rows) if r["residual"] == "hyper")
    assert hyper["n"] == hyper["pairs"] == 2 and abs(hyper["val_loss"] - 2.925) < 1e-12 and abs(hyper["delta"] + 0.175) < 1e-12
    assert abs(hyper["val_loss_std"] - 0.0353553) < 1e-6 and hyper["throughput_vs_prenorm"] == 0.8 and hyper["memory_vs_prenorm"] == 1.3
    assert hyper["multiplier"] is None  # one budget: no loss-vs-compute fit
    table = markdown_table(summarise(rows))
    assert "peak GiB × prenorm" in table and "| **1.300** |" in table  # hyper, the best row, in bold


# ----------------------------------------------------------------------------- exit status


def test_sweep_whose_every_trial_fails_exits_1_with_a_summary(tmp_path, stdlib_corpus, monkeypatch, capsys):
    """No trial completes (H = 3, 5 do not divide d = 32: FAIL before any fit starts): exit 1 and why, also on resume."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, stdlib_corpus, "allfail", {"residual": ["attnres"], "heads": [3, 5]})
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "sweep", "run", "--config", str(path)])
    assert main() == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("lit-mhar sweep run: error: no trial of study 'allfail' has completed (2 FAIL); trial 1 failed with: ")
    assert "ModelConfig.heads=5 must divide d_model=32" in line and str(tmp_path / "runs" / "allfail") in line and "--retry_failed true" in line
    assert [t.state for t in load(tmp_path, "allfail").get_trials()] == [S.FAIL, S.FAIL]
    assert main(["sweep", "run", "--config", str(path)]) == 1  # resumed: nothing left to run, still no result
    assert "no trial of study 'allfail' has completed (2 FAIL)" in capsys.readouterr().err


def test_sweep_exit_status_is_0_once_any_trial_completed(tmp_path, capsys):
    """Optuna's view: a study succeeded when it has a best trial; FAIL and PRUNED trials beside it do not matter."""
    from types import SimpleNamespace

    from lit_mhar.sweeps.runner import _exit_status

    ctx = SimpleNamespace(study="s", output_dir=str(tmp_path), is_grid=False)
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(state=S.FAIL, user_attrs={"lit_mhar.fail_reason": "RuntimeError: boom"}))
    study.add_trial(optuna.trial.create_trial(state=S.PRUNED, intermediate_values={1: 5.0}))
    assert _exit_status(study, ctx) == 1
    assert "no trial of study 's' has completed (1 FAIL, 1 PRUNED); trial 0 failed with: RuntimeError: boom." in capsys.readouterr().err
    study.add_trial(optuna.trial.create_trial(state=S.COMPLETE, value=3.0))
    assert _exit_status(study, ctx) == 0
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- GPU configs without a GPU, the parent run's end


def test_gpu_config_without_cuda_stops_the_sweep_before_the_study_exists(tmp_path, stdlib_corpus, monkeypatch):
    """The fit CLI refuses trainer.accelerator: gpu without CUDA; so does the sweep's check of its points, not each trial."""
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = write_sweep(tmp_path, stdlib_corpus, "nogpu", {"residual": ["prenorm", "attnres"]})
    sweep = yaml.safe_load(path.read_text())
    sweep["base"]["trainer"]["accelerator"] = "gpu"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    with pytest.raises(ValueError, match=r"point .*trainer.accelerator='gpu' but no CUDA GPU is available.*--trainer.accelerator cpu"):
        main(["sweep", "run", "--config", str(path)])
    assert "nogpu" not in optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path / 'sweeps.db'}"))
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_cuda_graph_on_a_cpu_sweep_stops_it_before_the_study_exists(tmp_path, stdlib_corpus, monkeypatch):
    """A base config with model.cuda_graph on a CPU trainer is refused by the sweep's check of its points, not by each trial."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, stdlib_corpus, "graphed", {"residual": ["prenorm", "attnres"]})
    sweep = yaml.safe_load(path.read_text())
    sweep["base"].setdefault("model", {})["cuda_graph"] = True
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    with pytest.raises(ValueError, match=r"point .*model.cuda_graph=True needs one CUDA GPU.*got trainer.accelerator="):
        main(["sweep", "run", "--config", str(path)])
    assert "graphed" not in optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path / 'sweeps.db'}"))
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_parent_run_gets_an_end_time_and_fails_when_no_trial_completed(tmp_path, stdlib_corpus, monkeypatch, capsys):
    """Every trial FAILs (H = 3 does not divide d = 32, before any fit starts): exit 1 and the parent run FAILED, ended."""
    from lit_mhar.sweeps.mlflow_runs import _close_parent

    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, stdlib_corpus, "ended", {"residual": ["attnres"], "heads": [3]})
    before = int(time.time() * 1000)
    assert main(["sweep", "run", "--config", str(path)]) == 1
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sweeps-test").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("lit_mhar.sweep") == "parent"]
    assert parent.info.status == "FAILED" and parent.info.end_time is not None and parent.info.end_time >= before

    # a study with a COMPLETE trial ends FINISHED; KILLED stays KILLED; RUNNING (other workers) has no end time yet
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(state=S.FAIL))
    study.add_trial(optuna.trial.create_trial(state=S.COMPLETE, value=1.0))
    for status in ("FINISHED", "KILLED", "RUNNING"):
        run_id = client.create_run(parent.info.experiment_id).info.run_id
        assert _close_parent(client, run_id, status, study) == status
        info = client.get_run(run_id).info
        assert info.status == status and (info.end_time is None) == (status == "RUNNING")


class _FakeStudy:
    def __init__(self, attrs: dict, trials: int = 0) -> None:
        self.user_attrs, self._trials = attrs, trials

    def get_trials(self, deepcopy: bool = True) -> list:
        return [object()] * self._trials


def test_a_study_another_sweep_just_created_is_waited_for_until_it_is_marked(monkeypatch):
    """Two ``sweep run`` commands creating one study: the second may load it before the first has
    marked it "initialising"; an empty unmarked study is waited for (STUDY_MARK_GRACE_S), one with
    trials and no mark is refused at once, and one that stays unmarked past the grace too."""
    from lit_mhar.sweeps import runner

    clock = [0.0]
    monkeypatch.setattr(runner.time, "time", lambda: clock[0])
    monkeypatch.setattr(runner.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    later = iter([_FakeStudy({}), _FakeStudy({runner.ATTR + "initialising": "host:1"}), _FakeStudy({runner.ATTR + "spec": {"a": 1}})])
    done = runner._await_sweep_study(_FakeStudy({}), lambda: next(later), "s", "sqlite:///x.db")
    assert done.user_attrs == {runner.ATTR + "spec": {"a": 1}} and clock[0] == 3.0
    with pytest.raises(ValueError, match="'s' exists in sqlite:///x.db but was not made by lit-mhar sweep"):
        runner._await_sweep_study(_FakeStudy({}, trials=2), lambda: pytest.fail("reloaded"), "s", "sqlite:///x.db")
    clock[0] = 0.0
    with pytest.raises(ValueError, match="not made by lit-mhar sweep"):
        runner._await_sweep_study(_FakeStudy({}), lambda: _FakeStudy({}), "s", "sqlite:///x.db")
    assert runner.STUDY_MARK_GRACE_S < clock[0] <= runner.STUDY_MARK_GRACE_S + 1
