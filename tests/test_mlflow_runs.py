"""What a run shows in MLflow: an experiment of model training, the data it trained on, system metrics when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_mhar.cli import main

ROOT = Path(__file__).resolve().parents[1]


def args(data: Path, tmp: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", str(data), "--data.seq_len", "32", "--data.batch_size", "4",
            "--model.config.d_model", "32", "--model.config.n_layer", "1", "--model.config.ffn_dim", "32", "--trainer.limit_val_batches", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp / "runs"),
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp / 'mlflow.db'}", *extra]  # fmt: skip


def test_runs_record_their_dataset_and_their_experiment_opens_on_training_runs(small_corpus, tmp_path):
    """The UI (MLflow 3.17) opened the experiment on its GenAI overview, and the runs table's Dataset column was empty."""
    import mlflow

    assert main(["fit", *args(small_corpus, tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")]) == 0
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    assert main(["validate", *args(small_corpus, tmp_path, "--ckpt_path", str(ckpt))]) == 0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lit-mhar")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = {r.info.run_name.split("-")[0]: r for r in client.search_runs([experiment.experiment_id])}
    manifest = json.loads((small_corpus / "manifest.json").read_text())
    for command, splits in (("debug", {"train": "training", "val": "evaluation"}), ("validate", {"val": "evaluation"})):
        inputs = runs[command].inputs.dataset_inputs
        assert {i.dataset.name: i.tags[0].value for i in inputs} == {f"{small_corpus.name}/{s}": c for s, c in splits.items()}
        assert len({i.dataset.digest for i in inputs}) == 1 and json.loads(inputs[0].dataset.source)["uri"] == str(small_corpus)
        for i in inputs:
            split = i.dataset.name.rsplit("/", 1)[1]
            profile = json.loads(i.dataset.profile)
            assert profile["tokens"] == manifest["splits"][split]["tokens"] and profile["vocab_size"] == manifest["vocab_size"]
    assert runs["debug"].inputs.dataset_inputs[0].dataset.digest == runs["validate"].inputs.dataset_inputs[0].dataset.digest


def test_system_metrics_are_logged_when_asked_for(small_corpus, tmp_path, monkeypatch):
    import mlflow

    pytest.importorskip("psutil")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's own setting (default 10 s)
    assert main(["fit", *args(small_corpus, tmp_path, "--trainer.max_steps", "2", "--trainer.logger.init_args.log_system_metrics", "true")]) == 0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    assert "system/cpu_utilization_percentage" in run.data.metrics and "system/system_memory_usage_megabytes" in run.data.metrics


def test_system_metrics_without_psutil_are_refused_naming_what_to_install(monkeypatch):
    import importlib.util

    from lit_mhar.tracking import MLFlowLogger

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name, *a))
    with pytest.raises(ValueError, match="log_system_metrics=True needs psutil: pip install psutil"):
        MLFlowLogger(log_system_metrics=True)


def test_a_dataset_input_that_races_another_runs_is_logged_again(small_corpus, tmp_path, monkeypatch):
    """Two trials of a sweep log the same dataset at once: the store's lookup-then-insert races and the
    loser's insert hits the unique key (seen on PostgreSQL). The second attempt links the existing row."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from lit_mhar import tracking
    from lit_mhar.data import read_manifest

    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("race")).info.run_id
    real, calls = client.log_inputs, []

    def log_inputs(run, datasets):
        calls.append(len(datasets))
        if len(calls) == 1:
            raise MlflowException('duplicate key value violates unique constraint "dataset_pk"')
        return real(run, datasets=datasets)

    monkeypatch.setattr(client, "log_inputs", log_inputs)
    tracking.log_dataset_inputs(client, run_id, small_corpus, read_manifest(small_corpus), {"train": "training", "val": "evaluation"})
    assert calls == [2, 2]
    assert sorted(d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs) == ["data/train", "data/val"]

    calls.clear()
    monkeypatch.setattr(client, "log_inputs", lambda run, datasets: calls.append(1) or (_ for _ in ()).throw(MlflowException("refused")))
    with pytest.raises(MlflowException, match="refused"):
        tracking.log_dataset_inputs(client, run_id, small_corpus, read_manifest(small_corpus), {"train": "training"})
    assert len(calls) == tracking.DATASET_LOG_ATTEMPTS
