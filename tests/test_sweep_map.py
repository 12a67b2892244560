"""The map a sweep draws and what keeps it true: paired intervals and compute multipliers on a
synthetic study with known answers, the loss-vs-compute fit, the pass budget, worker placement,
and a study carried to a fresh folder."""

from __future__ import annotations

import math
import shutil
import statistics

import optuna
import pytest
import yaml

from lit_mhar.cli import main
from lit_mhar.sweeps import report as report_module
from lit_mhar.sweeps.report import PowerLaw, fit_power_law, pareto_front, summarise, t_interval
from lit_mhar.sweeps.runner import _gpus, passes
from lit_mhar.sweeps.storage import ATTR, open_storage

from test_sweeps import ROOT, cli, load, write_sweep

T_975_DF1 = 12.706204736174707  # Student t, 97.5% quantile, one degree of freedom
T_975_DF2 = 4.302652729911275


# ----------------------------------------------------------------------------- statistics


def test_t_interval_is_the_student_t_interval_of_the_mean():
    mean, low, high = t_interval([0.1, 0.3])
    half = T_975_DF1 * statistics.stdev([0.1, 0.3]) / math.sqrt(2)
    assert (mean, low, high) == pytest.approx((0.2, 0.2 - half, 0.2 + half))
    assert t_interval([0.5]) == (0.5, None, None)


def test_power_law_fit_recovers_known_parameters():
    compute = [1e15, 2e15, 4e15, 8e15, 1.6e16]
    law = PowerLaw(E=1.7, A=3.0e6, alpha=0.45, points=5, rms=0.0)
    fitted = fit_power_law(compute, [law.loss(c) for c in compute])
    assert fitted.E == pytest.approx(1.7, abs=2e-3) and fitted.alpha == pytest.approx(0.45, rel=2e-2) and fitted.rms < 1e-4
    assert fitted.compute_for(law.loss(3e15)) == pytest.approx(3e15, rel=1e-2)
    assert fitted.compute_for(1.0) == math.inf  # below the floor: no compute reaches it


def test_power_law_fit_of_two_points_is_refused_as_underdetermined():
    with pytest.raises(ValueError, match=r"3 parameters and 2 distinct compute value\(s\).*underdetermined"):
        fit_power_law([1e15, 2e15, 2e15], [3.0, 2.9, 2.91])
    with pytest.raises(ValueError, match="compute must be > 0"):
        fit_power_law([0.0, 1e15, 2e15], [3.0, 2.9, 2.8])


def test_pareto_front_keeps_points_no_other_beats_on_both():
    # (tokens/s, loss): the second is slower and worse than the first; the rest trade off
    assert pareto_front([(100, 3.0), (90, 3.1), (80, 2.9), (120, 3.2)]) == [0, 2, 3]


# ----------------------------------------------------------------------------- a synthetic study with known answers

LAW = PowerLaw(E=2.0, A=4.0e5, alpha=0.4, points=0, rms=0.0)
FLOPS = 1.0e8  # FLOPs per token of every point here
TOKENS = 1.0e7
PRENORM = {0: LAW.loss(TOKENS * FLOPS) + 0.01, 1: LAW.loss(TOKENS * FLOPS) - 0.01}  # seed -> val loss at budget 1
DELTAS = {  # (residual, H, S) -> seed -> val loss minus prenorm's of the same seed
    ("attnres", 1, 1): {0: -0.100, 1: -0.101},  # best, and sure of it
    ("attnres", 8, 1): {0: -0.080, 1: -0.110},  # a close mean with a wide interval: indistinguishable
    ("attnres", 16, 1): {0: +0.020, 1: +0.021},  # worse than prenorm, and sure of it
}


def _trial(study: optuna.Study, residual: str, heads: int, block: int, seed: int, budget: float, value: float, tokens_per_s: float,
           trials_per_gpu: int = 1) -> None:
    params = {"residual": residual, "heads": heads, "block_size": block, "seed": seed, "budget": budget}
    choices = {"residual": ["prenorm", "attnres"], "heads": [1, 8, 16], "block_size": [1], "seed": [0, 1], "budget": [0.25, 0.5, 1.0]}
    dists = {k: optuna.distributions.CategoricalDistribution(choices[k]) for k in params}
    attrs = {
        ATTR + "point": str(params), ATTR + "model": {"name": "20m", "residual": residual, "heads": heads, "block_size": block},
        ATTR + "seed": seed, ATTR + "tokens": int(TOKENS * budget), ATTR + "flops_per_token": FLOPS, ATTR + "passes": 0.1 * budget,
        ATTR + "tokens_per_s": tokens_per_s, ATTR + "peak_memory_gb": 10.0, ATTR + "mfu": 0.1, ATTR + "trials_per_gpu": trials_per_gpu,
        ATTR + "startup_s": 12.0,
    }
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value, user_attrs=attrs))


def _synthetic(tmp_path, trials_per_gpu: int = 1) -> tuple[str, optuna.Study]:
    storage = f"sqlite:///{tmp_path / f'syn{trials_per_gpu}.db'}"
    study = optuna.create_study(study_name="syn", storage=open_storage(storage))
    study.set_user_attr(ATTR + "spec", {"sampler": "grid", "objective": {"metric": "val/loss", "tokens": int(TOKENS), "evals": 4}})
    study.set_user_attr(ATTR + "output_dir", str(tmp_path / "runs"))
    for seed in (0, 1):
        for budget in (0.25, 0.5):  # exactly on the law: the fit is exact
            _trial(study, "prenorm", 1, 1, seed, budget, LAW.loss(TOKENS * budget * FLOPS), 1000.0, trials_per_gpu)
        _trial(study, "prenorm", 1, 1, seed, 1.0, PRENORM[seed], 1000.0, trials_per_gpu)
        for (residual, heads, block), by_seed in DELTAS.items():
            _trial(study, residual, heads, block, seed, 1.0, PRENORM[seed] + by_seed[seed], 500.0, trials_per_gpu)
    return storage, study


@pytest.fixture
def synthetic(tmp_path):
    return _synthetic(tmp_path)


def test_report_pairs_by_seed_and_gives_known_intervals_and_multipliers(synthetic):
    _, study = synthetic
    rows = report_module._rows(study)
    summary = {(r["residual"], r["heads"], r["block_size"]): r for r in summarise(rows)}
    assert len(summary) == 4  # prenorm's 0.25 / 0.5 budgets only feed the fit
    for key, by_seed in DELTAS.items():
        r = summary[key]
        diffs = [by_seed[0], by_seed[1]]
        half = T_975_DF1 * statistics.stdev(diffs) / math.sqrt(2)
        assert r["pairs"] == 2 and r["delta"] == pytest.approx(statistics.fmean(diffs))
        assert (r["delta_low"], r["delta_high"]) == pytest.approx((r["delta"] - half, r["delta"] + half))
    assert summary[("attnres", 1, 1)]["best"] and summary[("attnres", 8, 1)]["indistinguishable"] is True
    assert summary[("attnres", 16, 1)]["indistinguishable"] is False and summary[("prenorm", 1, 1)]["indistinguishable"] is False
    assert (summary[("prenorm", 1, 1)]["delta_low"], summary[("prenorm", 1, 1)]["delta_high"]) == (0.0, 0.0)
    # the fit: prenorm's six points (three budgets x two seeds, the budget-1 pair straddling the law)
    law = report_module.fits(rows)["20m"]
    assert law.E == pytest.approx(LAW.E, abs=0.02) and law.alpha == pytest.approx(LAW.alpha, rel=0.1)
    h1 = summary[("attnres", 1, 1)]
    expected = law.compute_for(h1["val_loss"]) / (TOKENS * FLOPS)
    assert h1["multiplier"] == pytest.approx(expected) and h1["multiplier"] > 1
    assert h1["multiplier_low"] <= h1["multiplier"] <= h1["multiplier_high"]
    assert summary[("prenorm", 1, 1)]["multiplier"] == pytest.approx(1.0, abs=0.05)  # the fit passes through the baseline
    # throughput: half of prenorm's; the adjusted speedup is the multiplier times that
    assert h1["throughput_vs_prenorm"] == pytest.approx(0.5) and h1["adjusted_speedup"] == pytest.approx(0.5 * h1["multiplier"])


def test_report_files_of_a_gpu_study(synthetic, tmp_path):
    storage, _ = synthetic
    out = tmp_path / "report"
    assert main(["sweep", "report", "--study", "syn", "--storage", storage, "--output_dir", str(out), "--log_to_mlflow", "false"]) == 0
    for png in ("val_loss_vs_heads.png", "prenorm_fit.png", "multiplier_vs_heads.png", "pareto.png", "speedup_vs_heads.png", "peak_memory_vs_heads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    text = (out / "report.md").read_text()
    assert "L(C) = 2.0" in text and "passes over the training split per trial: 0.025 to 0.100" in text
    assert "median 12.0 s" in text and "left out" not in text


def test_report_leaves_throughput_out_when_trials_shared_a_gpu(tmp_path):
    storage, study = _synthetic(tmp_path, trials_per_gpu=4)
    rows = report_module._rows(study)
    note = report_module.throughput_note(rows)
    assert note and "4 trials trained at once on each GPU" in note
    assert all(r["adjusted_speedup"] is None and r["throughput_vs_prenorm"] is None for r in summarise(rows, throughput=False))
    out = tmp_path / "shared"
    main(["sweep", "report", "--study", "syn", "--storage", storage, "--output_dir", str(out), "--log_to_mlflow", "false"])
    assert not (out / "pareto.png").exists() and "left out: 4 trials trained at once" in (out / "report.md").read_text()


# ----------------------------------------------------------------------------- the runner


def test_workers_and_trials_per_gpu_place_processes_on_gpus():
    assert _gpus(1, 3) == [None, None, None]  # one GPU (or none): the default device, three trials at once
    assert passes(1000, 9, 1100) == pytest.approx(1000 * 10 / 9 / 1100)


@pytest.mark.parametrize("value, message", [(-1, r"max_passes=-1(\.0)? must be a number >= 0")])
def test_bad_max_passes_is_refused(tmp_path, stdlib_corpus, value, message):
    path = write_sweep(tmp_path, stdlib_corpus, "bad", [{"residual": ["prenorm"]}])
    with pytest.raises(ValueError, match=message):
        main(["sweep", "run", "--config", str(path), "--max_passes", str(value).lower()])
    assert not (tmp_path / "sweeps.db").exists() or "bad" not in optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path / 'sweeps.db'}"))


@pytest.mark.slow
def test_a_sweep_over_the_pass_budget_is_refused_before_any_trial(tmp_path, stdlib_corpus):
    path = write_sweep(tmp_path, stdlib_corpus, "over", [{"residual": ["prenorm"]}], objective={"tokens": 10_000_000, "evals": 2})
    proc = cli("sweep", "run", "--config", str(path), cwd=tmp_path)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, output
    assert "would pass over the training split of" in output and "more than --max_passes 1" in output
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "sweeps.db").exists() or not optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path / 'sweeps.db'}"))


@pytest.mark.slow
def test_a_study_carried_to_a_fresh_folder_resumes_there(tmp_path, stdlib_corpus, monkeypatch):
    """Only the storage file travels (no MLflow store, no trial folders); the corpus is rebuilt at the same
    relative path. A changed corpus is refused; the identical one resumes, under a new MLflow parent run."""
    first, fresh = tmp_path / "first", tmp_path / "fresh"
    for folder in (first, fresh):
        folder.mkdir()
    shutil.copytree(stdlib_corpus, first / "data")

    def sweep_file(folder, n_trials):
        path = write_sweep(folder, stdlib_corpus, "moving", {"residual": ["prenorm", "attnres"]},
                           sampler={"name": "random", "n_trials": n_trials, "seed": 0})
        sweep = yaml.safe_load(path.read_text())
        sweep["base"]["data"]["data_dir"] = "data"  # relative: the corpus is rebuilt where the study resumes
        sweep["storage"], sweep["output_dir"] = "sqlite:///sweeps.db", "runs"
        sweep["mlflow"] = {"experiment": "sweeps-test"}  # the default store: sqlite:///mlflow.db of the folder
        path.write_text(yaml.safe_dump(sweep, sort_keys=False))
        return path

    monkeypatch.chdir(first)
    assert main(["sweep", "run", "--config", str(sweep_file(first, 1))]) == 0
    study = load(first, "moving")
    assert study.user_attrs[ATTR + "output_dir"] == "runs" and study.user_attrs[ATTR + "mlflow"]["tracking_uri"] == "sqlite:///mlflow.db"
    assert list(study.user_attrs[ATTR + "corpora"]) == ["data"]

    shutil.copy(first / "sweeps.db", fresh / "sweeps.db")
    monkeypatch.chdir(fresh)
    path = sweep_file(fresh, 2)
    from lit_mhar.data import prepare

    prepare(str(fresh / "data"), source="files", files=[str(p) for p in sorted((ROOT / "lit_mhar").glob("*.py"))], vocab_size=300)
    with pytest.raises(ValueError, match=r"trained on data with data digest .* but the dataset there now has digest"):
        main(["sweep", "run", "--config", str(path)])
    shutil.rmtree(fresh / "data")
    shutil.copytree(stdlib_corpus, fresh / "data")  # rebuilt identically
    assert main(["sweep", "run", "--config", str(path)]) == 0
    trials = load(fresh, "moving").get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    parent = load(fresh, "moving").user_attrs[ATTR + "mlflow"]["parent_run_id"]
    assert parent != study.user_attrs[ATTR + "mlflow"]["parent_run_id"]
    from mlflow import MlflowClient

    assert MlflowClient(f"sqlite:///{fresh / 'mlflow.db'}").get_run(parent).info.run_name == "moving"
