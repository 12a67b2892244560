"""MLflow with a tracking server, and sweeps whose storage is PostgreSQL.

A real ``mlflow server`` on loopback (backed by PostgreSQL when ``LIT_MHAR_TEST_POSTGRES`` names a
server, else sqlite), real ``lit-mhar fit`` and ``lit-mhar sweep run`` logging to it through
``MLFLOW_TRACKING_URI``, and every check read back through MLflow's REST API. The server down at
the start, killed mid-run, a resumed fit continuing its run, and two sweep commands sharing one
PostgreSQL study.

``LIT_MHAR_TEST_POSTGRES`` is a URL of a PostgreSQL server whose user may create databases
(``postgresql://lit_mhar@127.0.0.1:PORT/postgres``); ``.ci/run`` starts a throwaway one and sets
it. Each use gets a database of its own, dropped afterwards. Without it the PostgreSQL test is
skipped and the MLflow server is backed by sqlite.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import optuna
import pytest
import requests
import torch
import yaml

from lit_mhar.cli import main
from lit_mhar.module import LitLM
from lit_mhar.sweeps.runner import open_storage
from lit_mhar.tracking import TrackingUnavailable

ROOT = Path(__file__).resolve().parents[1]
POSTGRES = os.environ.get("LIT_MHAR_TEST_POSTGRES")
S = optuna.trial.TrialState


# ----------------------------------------------------------------------------- PostgreSQL, the MLflow server, REST


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _admin_conninfo() -> str:
    from sqlalchemy.engine import make_url

    return make_url(POSTGRES).set(drivername="postgresql").render_as_string(hide_password=False)


def create_database(prefix: str) -> str:
    """A new, empty database on the ``LIT_MHAR_TEST_POSTGRES`` server; returns its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(POSTGRES).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    with psycopg.connect(_admin_conninfo(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


class Server:
    """``mlflow server`` on 127.0.0.1 in its own process group; ``uri`` is its tracking URI."""

    def __init__(self, backend: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "server.log"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", self.uri.rsplit(":", 1)[1],
                   "--backend-store-uri", backend, "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"]
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + 240  # database migrations and imports: 10-40 s on two busy cores
        while True:
            try:
                if requests.get(self.uri + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def runs(uri: str, experiment: str) -> list[dict[str, Any]]:
    """Every run of ``experiment``, read through the REST API, with metrics/params/tags as dicts."""
    got = requests.get(f"{uri}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": experiment}, timeout=30)
    got.raise_for_status()
    experiment_id = got.json()["experiment"]["experiment_id"]
    found = requests.post(f"{uri}/api/2.0/mlflow/runs/search", json={"experiment_ids": [experiment_id], "max_results": 1000}, timeout=30)
    found.raise_for_status()
    out = []
    for run in found.json().get("runs", []):
        data = run.get("data", {})
        out.append({
            "info": run["info"],
            "metrics": {m["key"]: m["value"] for m in data.get("metrics", [])},
            "params": {p["key"]: p["value"] for p in data.get("params", [])},
            "tags": {t["key"]: t["value"] for t in data.get("tags", [])},
        })
    return out


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    got = requests.get(f"{uri}/api/2.0/mlflow/metrics/get-history", params={"run_id": run_id, "metric_key": key}, timeout=30)
    got.raise_for_status()
    return sorted((m["step"], m["value"]) for m in got.json().get("metrics", []))


def artifacts(uri: str, run_id: str, path: str = "") -> set[str]:
    got = requests.get(f"{uri}/api/2.0/mlflow/artifacts/list", params={"run_id": run_id, "path": path}, timeout=30)
    got.raise_for_status()
    return {f["path"] for f in got.json().get("files", [])}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """One MLflow server for the module: PostgreSQL-backed when LIT_MHAR_TEST_POSTGRES is set, else sqlite."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    database = create_database("mlflow") if POSTGRES else None
    srv = Server(database or f"sqlite:///{folder / 'mlflow.db'}", folder)
    try:
        yield srv
    finally:
        srv.stop()
        if database:
            drop_database(database)


def fit_args(data: Path, tmp: Path, experiment: str, *extra: str) -> list[str]:
    """A tiny debug fit (6 steps, validations at 3 and 6) into ``tmp``; MLflow from MLFLOW_TRACKING_URI."""
    return [
        "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--data.data_dir", str(data), "--data.seq_len", "32", "--data.batch_size", "4",
        "--model.config.d_model", "32", "--model.config.n_layer", "1", "--model.config.ffn_dim", "64",
        "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--data.val_tokens", "256",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp / "runs"), "--trainer.logger.init_args.experiment_name", experiment,
        *extra,
    ]


GRID = [{"residual": ["prenorm"]}, {"residual": ["attnres"], "heads": [2]}]  # 2 points: one per worker


def sweep_file(tmp: Path, stdlib_corpus: Path, study: str, storage: str, experiment: str) -> Path:
    """sweeps/debug.yaml on GRID with a tiny model (8 steps per trial); MLflow from MLFLOW_TRACKING_URI."""
    sweep = yaml.safe_load((ROOT / "sweeps" / "debug.yaml").read_text())
    sweep["base"]["model"]["config"].update(d_model=32, n_layer=1, n_head=2, n_kv_head=1, ffn_dim=64)
    sweep["base"]["model"]["warmup_steps"] = 2
    sweep["base"]["data"].update(data_dir=str(stdlib_corpus), seq_len=32, batch_size=4, val_tokens=256)
    sweep["base"]["trainer"].update(log_every_n_steps=2)
    sweep.update(study=study, space=GRID, objective={"tokens": 1024, "evals": 2}, storage=storage, mlflow={"experiment": experiment},
                 output_dir=str(tmp / "runs"))
    path = tmp / f"{study}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def val_losses(storage: str, study: str) -> dict[str, float]:
    """Grid point (JSON) -> val/loss of the study's COMPLETE trials; fails if a point completed twice."""
    trials = optuna.load_study(study_name=study, storage=open_storage(storage)).get_trials()
    done = [t for t in trials if t.state == S.COMPLETE]
    points = [json.dumps(t.params, sort_keys=True) for t in done]
    assert len(points) == len(set(points)), f"a grid point ran twice: {points}"
    return dict(zip(points, (t.value for t in done)))


@pytest.fixture(scope="module")
def sqlite_sweep(server, stdlib_corpus, tmp_path_factory) -> dict[str, Any]:
    """GRID swept once on sqlite (two workers of one command), logging to the server: the reference for the PostgreSQL sweep."""
    tmp = tmp_path_factory.mktemp("sqlite-sweep")
    storage = f"sqlite:///{tmp / 'sweeps.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", server.uri)
        mp.chdir(tmp)
        assert main(["sweep", "run", "--config", str(sweep_file(tmp, stdlib_corpus, "grid", storage, "sweep-sqlite")), "--workers", "2"]) == 0
    return {"losses": val_losses(storage, "grid"), "experiment": "sweep-sqlite"}


# ----------------------------------------------------------------------------- a tracking server


def test_fit_logs_metrics_params_tags_and_config_to_a_tracking_server(server, stdlib_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.chdir(tmp_path)
    main(fit_args(stdlib_corpus, tmp_path, "fit-server", "--model.config.residual", "attnres", "--model.config.heads", "2"))
    (run,) = runs(server.uri, "fit-server")
    assert run["info"]["status"] == "FINISHED"
    assert re.fullmatch(r"debug-attnres-H2-S1-\d{8}T\d{6}Z", run["info"]["run_name"]), run["info"]["run_name"]
    for key in ("train/loss", "val/loss", "perf/tokens_per_s", "routing/site_00/entropy"):
        assert key in run["metrics"], key
    assert [step for step, _ in history(server.uri, run["info"]["run_id"], "train/loss")] == [0, 1, 2, 3, 4, 5]
    assert run["params"]["config/heads"] == "2" and run["params"]["config/residual"] == "attnres"
    assert run["tags"]["lit_mhar.git_commit"] and run["tags"]["version.torch"] == torch.__version__
    assert "config.yaml" in artifacts(server.uri, run["info"]["run_id"])  # through the server's artifact proxy
    (folder,) = (tmp_path / "runs").glob(f"*/{run['info']['run_id']}")
    assert (folder / "config.yaml").is_file() and not (folder / "untracked_metrics.csv").exists()


def test_sweep_logs_its_parent_and_one_child_per_grid_point_to_a_tracking_server(server, sqlite_sweep):
    found = runs(server.uri, sqlite_sweep["experiment"])
    (parent,) = [r for r in found if r["tags"].get("lit_mhar.sweep") == "parent"]
    assert parent["info"]["run_name"] == "grid" and parent["info"]["status"] == "FINISHED"
    assert "trials/val_loss" in parent["metrics"]
    children = [r for r in found if r["tags"].get("mlflow.parentRunId") == parent["info"]["run_id"]]
    assert len(children) == len(found) - 1 == 2
    by_point = {}
    for child in children:
        assert child["info"]["status"] == "FINISHED" and child["tags"]["optuna.trial_state"] == "COMPLETE"
        assert child["metrics"]["sweep/val_loss"] == child["metrics"]["val/loss"]  # the fit logged into the child
        assert "config.yaml" in artifacts(server.uri, child["info"]["run_id"])
        point = {k[len("sweep."):]: v for k, v in child["params"].items() if k in ("sweep.residual", "sweep.heads")}
        by_point[json.dumps({k: (int(v) if k == "heads" else v) for k, v in point.items()}, sort_keys=True)] = child["metrics"]["sweep/val_loss"]
    assert by_point == pytest.approx(sqlite_sweep["losses"])


def _open_storage_in_a_process(url: str) -> str:
    from lit_mhar.sweeps.runner import open_storage

    try:
        open_storage(url)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test reports what each process got
        return f"{type(e).__name__}: {e}"


@pytest.mark.skipif(not POSTGRES, reason="LIT_MHAR_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
def test_workers_opening_a_new_postgresql_storage_at_once_all_succeed():
    """Optuna creates its schema on first use; workers starting together on an empty database race
    on CREATE TYPE (IntegrityError on PostgreSQL), which failed every worker but one."""
    import multiprocessing

    storage = create_database("race")
    try:
        with multiprocessing.get_context("fork").Pool(3) as pool:  # fork: no re-import, the race starts at once
            assert pool.map(_open_storage_in_a_process, [storage] * 3) == ["ok"] * 3
    finally:
        drop_database(storage)


@pytest.mark.skipif(not POSTGRES, reason="LIT_MHAR_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
def test_two_sweep_commands_share_a_postgresql_study_each_grid_point_once_with_the_sqlite_results(server, stdlib_corpus, sqlite_sweep, tmp_path):
    """Two `lit-mhar sweep run` processes (as on two machines) on one PostgreSQL study, logging to the MLflow server."""
    storage = create_database("sweep")
    try:
        path = sweep_file(tmp_path, stdlib_corpus, "grid", storage, "sweep-postgres")
        env = dict(os.environ, MLFLOW_TRACKING_URI=server.uri)
        procs = [subprocess.Popen([sys.executable, "-m", "lit_mhar.cli", "sweep", "run", "--config", str(path)], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert sum("created study" in o for o in outputs) == 1  # one creator; the other joined the same study
        trials = optuna.load_study(study_name="grid", storage=open_storage(storage)).get_trials()
        ran = [t for t in trials if not t.user_attrs.get("lit_mhar.surplus")]  # a point enqueued twice at the same instant is closed unrun
        assert len(ran) == 2 and all(t.state == S.COMPLETE for t in ran), [(t.number, t.state, t.user_attrs) for t in trials]
        assert len({t.user_attrs["lit_mhar.pid"] for t in ran}) == 2, outputs  # both commands ran trials
        # every grid point exactly once, with the val/loss of the sqlite run: CPU fits with fixed seeds are deterministic
        assert val_losses(storage, "grid") == sqlite_sweep["losses"]
        found = runs(server.uri, "sweep-postgres")
        assert sum(r["tags"].get("lit_mhar.sweep") == "parent" for r in found) == 1 and len(found) == 3
    finally:
        drop_database(storage)


# ----------------------------------------------------------------------------- losing the server


def test_unreachable_server_fails_fit_and_sweep_at_once_naming_the_uri(stdlib_corpus, tmp_path, monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data" / "stdlib"  # would be prepared (the default corpus) if the fit got that far
    start = time.perf_counter()
    with pytest.raises(TrackingUnavailable, match=re.escape(f"MLflow tracking server {uri} is unreachable")):
        main(fit_args(data, tmp_path, "down", "--data.prepare_if_missing", "true"))
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()

    path = sweep_file(tmp_path, stdlib_corpus, "down", f"sqlite:///{tmp_path / 'sweeps.db'}", "down")
    start = time.perf_counter()
    with pytest.raises(TrackingUnavailable, match=re.escape(uri)):
        main(["sweep", "run", "--config", str(path)])
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "sweeps.db").exists() and not (tmp_path / "runs").exists()


def test_server_killed_mid_run_training_finishes_and_reports_the_loss(stdlib_corpus, tmp_path, monkeypatch, capsys):
    dying = Server(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "server")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", dying.uri)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once rather than back off for minutes
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        monkeypatch.chdir(tmp_path)
        original = LitLM.on_validation_end

        def kill_after_the_first_validation(self) -> None:
            original(self)
            if not self.trainer.sanity_checking and self.global_step == 3:
                dying.stop(signal.SIGKILL)

        monkeypatch.setattr(LitLM, "on_validation_end", kill_after_the_first_validation)
        start = time.perf_counter()
        main(fit_args(stdlib_corpus, tmp_path, "dies"))
        elapsed = time.perf_counter() - start
    finally:
        dying.stop()
    err = capsys.readouterr().err
    assert err.count("MLflow tracking LOST at step") == 1, err
    assert f"{dying.uri} is INCOMPLETE: tracking was lost at step" in err and "untracked_metrics.csv" in err
    assert elapsed < 120, "a dead server stalled training"

    (last,) = (tmp_path / "runs").rglob("last.ckpt")
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 6  # training went to the end
    lost = checkpoint["mlflow"]["tracking_lost"]
    assert lost["step"] >= 3 and lost["tracking_uri"] == dying.uri and lost["run_id"] == checkpoint["mlflow"]["run_id"]
    with (last.parent.parent / "untracked_metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["metric"] for r in rows} >= {"train/loss", "val/loss"}
    assert all(int(r["step"]) >= lost["step"] for r in rows) and max(int(r["step"]) for r in rows) == 5  # train/loss of the last step


# ----------------------------------------------------------------------------- resuming


def test_resumed_fit_continues_its_mlflow_run(server, stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.chdir(tmp_path)
    main(fit_args(stdlib_corpus, tmp_path, "resume", "--trainer.max_steps", "3"))
    (first,) = (tmp_path / "runs").rglob("last.ckpt")
    before = first.read_bytes()
    # more steps, and a changed data argument: MLflow keeps a param's first value, and says so
    main(fit_args(stdlib_corpus, tmp_path, "resume", "--ckpt_path", str(first), "--data.prepare_if_missing", "false"))
    assert "keeps its first value of prepare_if_missing" in capsys.readouterr().err

    (run,) = runs(server.uri, "resume")
    run_id = run["info"]["run_id"]
    assert run["info"]["status"] == "FINISHED" and run["params"]["prepare_if_missing"] == "None"
    assert [step for step, _ in history(server.uri, run_id, "train/loss")] == [0, 1, 2, 3, 4, 5]  # both fits
    assert len(history(server.uri, run_id, "val/loss")) == 2
    (resumed,) = [p for p in (tmp_path / "runs").rglob("last.ckpt") if p != first]
    assert resumed.parent.parent.parent == first.parent.parent  # inside the same run's folder, in resumed-<time>/
    assert torch.load(resumed, map_location="cpu", weights_only=False)["mlflow"]["run_id"] == run_id
    assert first.read_bytes() == before  # the checkpoint resumed from is not overwritten
    segment = resumed.parent.parent.name
    assert re.fullmatch(r"resumed-\d{8}T\d{6}Z", segment)
    assert "prepare_if_missing: false" in (resumed.parent.parent / "config.yaml").read_text()
    assert {"config.yaml", segment} <= artifacts(server.uri, run_id) and f"{segment}/config.yaml" in artifacts(server.uri, run_id, segment)
