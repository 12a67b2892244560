"""``lit-mhar sweep run``: an Optuna study whose trials are real ``fit`` runs, tracked in MLflow.

How a sweep runs (every step uses Optuna's or MLflow's public API):

* **Study.** ``optuna.create_study(load_if_exists=False)`` on the sweep's storage; when the study
  exists, ``optuna.load_study``. This is ``load_if_exists`` with a winner: the unique study name
  makes exactly one worker the creator, and only the creator creates the MLflow parent run and
  stores the sweep's definition in the study's user attributes. Every later worker or re-run
  compares its sweep with the stored one and refuses to mix different sweeps in one study.
* **Grid.** Every point of the grid is enqueued into the study (``study.enqueue_trial``) and each
  worker's ``study.optimize`` takes the oldest waiting trial, an atomic WAITING -> RUNNING
  transition in the storage, so two workers never take the same trial. Enqueueing, taking a trial
  and storing its parameters happen under a file lock beside a sqlite or journal storage, so
  workers on one machine never enqueue a point twice. On a database server there is no lock; a
  point enqueued twice by workers that started at the same instant is detected when the second
  copy is taken (an earlier trial holds the same point) and that copy is closed as FAIL with
  ``lit_mhar.surplus`` set, without running. TPE / random sampling runs until the study holds
  ``sampler.n_trials`` trials.
* **Resume.** Re-running the command loads the study: COMPLETE and PRUNED points are never run
  again; FAIL points with a recorded reason (a crash, an OOM, an invalid model) are not either,
  unless ``--retry_failed true``; points whose trial was interrupted (Ctrl-C, SIGTERM, the
  worker killed) are enqueued again. A trial left RUNNING by a killed worker is found by the
  worker's host and process id on the same machine, and by Optuna's heartbeat
  (``heartbeat_interval`` / ``grace_period``, RDB storages) from anywhere.
* **Trials.** Each trial is a subprocess (``python -m lit_mhar.sweeps.trial``) that runs
  ``lit-mhar fit`` on the composed config, so a crash or an out-of-memory error ends that
  process only: the trial is recorded FAIL with its reason and the study goes on. Before it
  starts, the config is parsed by the fit CLI (``--print_config``) and the model config is
  validated; a point that fails either (H not dividing d, say) is FAIL with that reason.
* **MLflow.** One parent run per study; one child run per trial (tag ``mlflow.parentRunId``) that
  the trial's ``MLFlowLogger`` logs into (``run_id``), so the child holds the fit's resolved
  config, metrics and versions, plus the sweep's tags ``optuna.trial_number`` /
  ``optuna.trial_state`` and summary metrics ``sweep/val_loss``, ``sweep/tokens_per_s``,
  ``sweep/peak_memory_gb``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from jsonargparse.typing import Path_fr

from lit_mhar.processes import RUNNER_DIED, die_with_parent
from lit_mhar.tracking import redact
from lit_mhar.sweeps.space import (
    Budget,
    Objective,
    Pruner,
    Sampler,
    SearchSpace,
    SweepSpec,
    Tracking,
    budget_overrides,
    compose_trial_config,
    deep_merge,
    get_dotted,
    point_key,
    point_scale,
    set_dotted,
    token_budget,
)

ATTR = "lit_mhar."  # prefix of every user attribute the sweep stores in Optuna
HOST = socket.gethostname()
_STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_log = logging.getLogger("lit_mhar.sweeps")


class TrialFailed(Exception):
    """A trial that ended without a result; its message is the reason stored with the trial."""


def say(study: str, message: str) -> None:
    """One line of sweep progress on stdout."""
    print(f"[sweep {study}] {message}", flush=True)


# ----------------------------------------------------------------------------- storage


def absolute_sqlite(url: str) -> str:
    """``url`` with a relative sqlite path made absolute (so subprocesses and locks agree); other URLs unchanged."""
    from sqlalchemy.engine import make_url

    if not url.startswith("sqlite"):
        return url
    parsed = make_url(url)
    if not parsed.database or parsed.database == ":memory:":
        raise ValueError(f"storage {url!r} is an in-memory database, which cannot be shared by workers or resumed; use sqlite:///sweeps.db")
    return str(parsed.set(database=str(Path(parsed.database).expanduser().absolute())))


def open_storage(url: str, heartbeat_interval: Optional[int] = None, grace_period: Optional[int] = None) -> Any:
    """The Optuna storage for ``url``.

    Args:
        url: An RDB URL for SQLAlchemy (``sqlite:///sweeps.db``, ``postgresql://user:pw@host/db``,
            ``mysql+pymysql://...``) or ``journal:PATH`` for an Optuna journal file (a shared file
            system without a database server).
        heartbeat_interval: RDB only: seconds between a running trial's heartbeats; a trial
            silent for ``grace_period`` seconds is marked FAIL by the next worker.
        grace_period: RDB only; default 4 x heartbeat_interval.

    Raises:
        ValueError: the URL is neither form, or the storage cannot be opened (the message has the
            URL, password hidden, and the underlying error).
    """
    import warnings

    import optuna

    # Heartbeats are marked experimental in Optuna; they are how a dead worker's trial is found.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        path = journal_path(url)
        if path is not None:
            if not path.parent.is_dir():
                raise FileNotFoundError(f"folder {path.parent} does not exist")
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(str(path)))
        if "://" not in url:
            raise ValueError("not a URL")
        url = absolute_sqlite(url)
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        if url.startswith("sqlite") and not Path(url.split(":///", 1)[1]).parent.is_dir():
            raise FileNotFoundError(f"folder {Path(url.split(':///', 1)[1]).parent} does not exist")
        grace = None if heartbeat_interval is None else (grace_period or 4 * heartbeat_interval)
        lock = StorageLock(url)  # two processes creating a new sqlite schema at once collide ("table trials already exists")
        lock.acquire()
        try:
            return _create_rdb_storage(url, engine_kwargs, heartbeat_interval, grace)
        finally:
            lock.release()
    except Exception as e:  # noqa: BLE001 - any failure to open is reported with the URL
        detail = " ".join(str(e).split())  # drivers' messages span lines: one line for the CLI's error
        raise ValueError(
            f"storage {redact(url)!r} is unreachable ({type(e).__name__}: {detail}). Valid: an RDB URL such as "
            "sqlite:///sweeps.db or postgresql://user:password@host/db (with its driver installed), or journal:PATH"
        ) from None


def _create_rdb_storage(url: str, engine_kwargs: Optional[dict], heartbeat_interval: Optional[int], grace: Optional[int],
                        attempts: int = 20) -> Any:
    """``optuna.storages.RDBStorage``, retried while another process creates the same schema.

    Workers on several machines that open a new database server study at the same moment all
    issue Optuna's ``CREATE TYPE`` / ``CREATE TABLE``; the losers get an ``IntegrityError`` or
    ``ProgrammingError`` ("already exists") and succeed once the winner has committed. Other
    errors (a refused connection, bad credentials: ``OperationalError``) are raised at once.
    """
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval, grace_period=grace)
        except (IntegrityError, ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.25 * (attempt + 1))


def journal_path(url: str) -> Optional[Path]:
    """The absolute file of a ``journal:PATH`` storage URL; None for any other storage."""
    return Path(url[len("journal:"):]).expanduser().absolute() if url.startswith("journal:") else None


class StorageLock:
    """An inter-process lock beside a file storage (sqlite, journal); a no-op for database servers.

    Workers hold it while they enqueue grid points, take a trial and store its parameters, so
    workers on one machine never take the same point; it is released before the trial trains.
    """

    def __init__(self, url: str) -> None:
        from filelock import FileLock

        journal, path = journal_path(url), None
        if journal is not None:
            path = str(journal)
        elif url.startswith("sqlite"):
            path = absolute_sqlite(url).split(":///", 1)[1]
        self._lock = FileLock(path + ".sweep-lock") if path else None

    def acquire(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def release(self) -> None:
        """Releases the lock if this process holds it (safe to call twice)."""
        if self._lock is not None and self._lock.is_locked:
            self._lock.release(force=True)


# ----------------------------------------------------------------------------- process liveness


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` from /proc (Linux), to tell a reused pid apart; None elsewhere."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _process_start(pid) in (None, start)


# ----------------------------------------------------------------------------- fit config parsing


def resolve_fit_config(config: dict[str, Any]) -> dict[str, Any]:
    """Parses ``config`` with the fit CLI (``lit-mhar fit --config X --print_config``) in this process.

    Returns the fully resolved config (every default filled in). Nothing is instantiated.

    Raises:
        ValueError: the fit CLI rejects the config (unknown key, wrong type); the message is its error.
    """
    import tempfile

    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    from lit_mhar.cli.lightning import run_lightning

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f, sort_keys=False)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_lightning(["fit", "--config", f.name, "--print_config"])
        code: Any = 0
    except SystemExit as e:
        code = e.code
    finally:
        os.unlink(f.name)
    if code not in (0, None):
        message = "\n".join(line for line in err.getvalue().splitlines() if line.strip() and not line.startswith(("usage:", "tip:", " ")))
        raise ValueError(f"the fit CLI rejects this config: {message or err.getvalue().strip()}")
    return yaml.safe_load(out.getvalue())


def model_fields(resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved model config validated by :class:`ModelConfig` (raises its ValueError, which names the field)."""
    from lit_mhar.config import ModelConfig

    fields = dict(resolved["model"]["config"])
    if fields.get("seq_len") is None:  # linked from the data at instantiation
        fields["seq_len"] = resolved["data"]["seq_len"]
    config = ModelConfig(**fields)
    return {k: getattr(config, k) for k in ("name", "residual", "heads", "block_size", "d_model", "n_layer", "seq_len")}


# ----------------------------------------------------------------------------- the run context


@dataclass
class Context:
    """Everything a worker needs; picklable, so ``--workers N`` hands it to spawned processes."""

    study: str
    storage: str
    spec: SweepSpec
    pruner: Pruner
    objective: Objective
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    output_dir: str
    trial_timeout: Optional[float]
    retry_failed: bool
    retry_before: int  # with retry_failed: FAIL trials numbered below this are retried
    keep_checkpoints: bool
    heartbeat_interval: Optional[int]
    grace_period: Optional[int]
    grid: list[dict[str, Any]] = field(default_factory=list)
    gpu: Optional[str] = None
    worker: int = 0

    @property
    def is_grid(self) -> bool:
        return self.spec.sampler.name == "grid"


def _client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def _tracking_uri(tracking: Tracking) -> str:
    uri = tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    return absolute_sqlite(uri) if uri.startswith("sqlite") else uri


def _experiment_id(client: Any, tracking: Tracking) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(tracking.experiment)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            raise ValueError(f"MLflow experiment {tracking.experiment!r} is deleted; restore it or choose another mlflow.experiment")
        return experiment.experiment_id
    try:
        return client.create_experiment(tracking.experiment, artifact_location=tracking.artifact_location)
    except MlflowException:  # created by another worker in the meantime
        return client.get_experiment_by_name(tracking.experiment).experiment_id


def _is_ours(t: Any) -> bool:
    return ATTR + "point" in t.user_attrs and not t.user_attrs.get(ATTR + "surplus")


def _fail_dead_trials(study: Any, ctx: Context) -> None:
    """Marks FAIL the RUNNING trials whose worker on this host has died (its MLflow run KILLED)."""
    import optuna

    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        attrs = t.user_attrs
        if attrs.get(ATTR + "host") != HOST or ATTR + "pid" not in attrs:
            continue
        if _alive(int(attrs[ATTR + "pid"]), attrs.get(ATTR + "pid_start")):
            continue
        study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        say(ctx.study, f"trial {t.number} was left RUNNING by worker {attrs[ATTR + 'pid']}, which is gone: marked FAIL (interrupted)")
        _close_child(ctx, attrs.get(ATTR + "mlflow_run_id"), "KILLED", "FAIL")


def _close_child(ctx: Context, run_id: Optional[str], status: str, state: str) -> None:
    if not run_id:
        return
    try:
        client = _client(ctx.tracking_uri)
        client.set_tag(run_id, "optuna.trial_state", state)
        if client.get_run(run_id).info.status != status:
            client.set_terminated(run_id, status)
    except Exception as e:  # noqa: BLE001 - a tracking hiccup must not stop the sweep
        _log.warning("could not close MLflow run %s: %s", run_id, e)


def _covering(t: Any, ctx: Context) -> bool:
    """Whether trial ``t`` accounts for its point (so the point is not enqueued again)."""
    import optuna

    S = optuna.trial.TrialState
    if not _is_ours(t):
        return False
    if t.state in (S.WAITING, S.RUNNING, S.COMPLETE, S.PRUNED):
        return True
    failed_with_reason = t.state == S.FAIL and ATTR + "fail_reason" in t.user_attrs
    return failed_with_reason and not (ctx.retry_failed and t.number < ctx.retry_before)


def _enqueue_missing(study: Any, ctx: Context) -> int:
    """Enqueues every grid point no trial accounts for; returns how many."""
    covered = {t.user_attrs[ATTR + "point"] for t in study.get_trials(deepcopy=False) if _covering(t, ctx)}
    missing = [p for p in ctx.grid if point_key(p) not in covered]
    for point in missing:
        study.enqueue_trial(point, user_attrs={ATTR + "point": point_key(point)})
    return len(missing)


def _counted(study: Any, ctx: Context, below: Optional[int] = None) -> int:
    """Trials that count towards sampler.n_trials (interrupted and surplus ones do not)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if (below is None or t.number < below) and _covering(t, ctx))


def _nothing_left(study: Any, ctx: Context) -> bool:
    import optuna

    if ctx.is_grid:
        return not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    return _counted(study, ctx) >= int(ctx.spec.sampler.n_trials or 0)


# ----------------------------------------------------------------------------- one trial


class SweepObjective:
    """The objective ``study.optimize`` calls: takes a point, runs its fit in a subprocess, returns the loss."""

    def __init__(self, ctx: Context, study: Any, lock: StorageLock) -> None:
        self.ctx, self.study, self.lock = ctx, study, lock
        self.client = _client(ctx.tracking_uri)

    # -- claiming a point, under the lock
    def _surplus(self, trial: Any, reason: str) -> None:
        trial.set_user_attr(ATTR + "surplus", True)
        trial.set_user_attr(ATTR + "fail_reason", reason)
        raise TrialFailed(reason)

    def _claim(self, trial: Any) -> dict[str, Any]:
        import optuna

        S = optuna.trial.TrialState
        ctx = self.ctx
        trial.set_user_attr(ATTR + "host", HOST)
        trial.set_user_attr(ATTR + "pid", os.getpid())
        trial.set_user_attr(ATTR + "pid_start", _process_start(os.getpid()))
        if ctx.is_grid:
            key = trial.user_attrs.get(ATTR + "point")
            if key is None:
                self._surplus(trial, "not run: every grid point was already taken when this trial was created")
            earlier = [
                t.number
                for t in self.study.get_trials(deepcopy=False)
                if t.number < trial.number and _is_ours(t) and t.user_attrs[ATTR + "point"] == key
                and t.state in (S.WAITING, S.RUNNING, S.COMPLETE, S.PRUNED)
            ]
            if earlier:
                self._surplus(trial, f"not run: trial {min(earlier)} holds the same grid point (enqueued twice by concurrent workers)")
            return ctx.spec.space.suggest(trial, json.loads(key))
        if _counted(self.study, ctx, below=trial.number) >= int(ctx.spec.sampler.n_trials or 0):
            self._surplus(trial, f"not run: the study already holds sampler.n_trials={ctx.spec.sampler.n_trials} trials")
        params = ctx.spec.space.suggest(trial)
        trial.set_user_attr(ATTR + "point", point_key(params))
        return params

    def __call__(self, trial: Any) -> float:
        try:
            params = self._claim(trial)
        finally:
            self.lock.release()  # taken by the worker loop before study.optimize asked for this trial
        return self._run(trial, params)

    # -- running it
    def _fail(self, trial: Any, run_id: Optional[str], reason: str, status: str = "FAILED") -> None:
        trial.set_user_attr(ATTR + "fail_reason", reason)
        say(self.ctx.study, f"trial {trial.number} FAIL: {reason}")
        if run_id:
            try:
                self.client.set_tag(run_id, "lit_mhar.fail_reason", reason[:5000])
            except Exception:  # noqa: BLE001
                pass
            _close_child(self.ctx, run_id, status, "FAIL")
        raise TrialFailed(reason)

    def _child_run(self, trial: Any, params: dict[str, Any]) -> str:
        from mlflow.entities import Param
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        ctx = self.ctx
        label = " ".join(f"{k}={v}" for k, v in params.items())
        run = self.client.create_run(
            ctx.experiment_id,
            run_name=f"{ctx.study} #{trial.number} {label}"[:250],
            tags={
                MLFLOW_PARENT_RUN_ID: ctx.parent_run_id,
                "optuna.study_name": ctx.study,
                "optuna.storage": redact(ctx.storage),
                "optuna.trial_number": str(trial.number),
                "optuna.trial_state": "RUNNING",
                "lit_mhar.sweep_point": point_key(params),
            },
        )
        self.client.log_batch(run.info.run_id, params=[Param(f"sweep.{k}", str(v)) for k, v in params.items()])
        trial.set_user_attr(ATTR + "mlflow_run_id", run.info.run_id)
        return run.info.run_id

    def _trial_config(self, trial: Any, config: dict[str, Any], resolved: dict[str, Any], budget: Budget, run_id: str,
                      trial_dir: Path) -> dict[str, Any]:
        ctx = self.ctx
        config = deep_merge(config, {})
        for key, value in {
            **budget_overrides(budget, resolved),
            "trainer.default_root_dir": str(trial_dir / "fit"),
            "trainer.enable_progress_bar": False,
            "trainer.logger": {
                "class_path": "lit_mhar.tracking.MLFlowLogger",
                "init_args": {"tracking_uri": ctx.tracking_uri, "run_id": run_id, "log_model": False},
            },
        }.items():
            set_dotted(config, key, value)
        if not ctx.keep_checkpoints:  # a sweep keeps numbers, not weights
            set_dotted(config, "checkpoint.save_top_k", 0)
            set_dotted(config, "checkpoint.save_last", False)
        callbacks = get_dotted(config, "trainer.callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        callbacks.append({
            "class_path": "lit_mhar.sweeps.trial.OptunaPruning",
            "init_args": {
                "storage": ctx.storage,
                "study_name": ctx.study,
                "trial_id": trial._trial_id,  # the storage id; the number is not unique across studies
                "pruner": asdict(ctx.pruner),
                "evals": ctx.objective.evals,
                "max_steps": budget.max_steps,
                "monitor": ctx.objective.metric,
            },
        })
        set_dotted(config, "trainer.callbacks", callbacks)
        return config

    def _metrics(self, run_id: str) -> dict[str, list[Any]]:
        names = {"loss": self.ctx.objective.metric, "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "peak_memory_gb": "perf/peak_memory_gb"}
        return {k: self.client.get_metric_history(run_id, m) for k, m in names.items()}

    def _run(self, trial: Any, params: dict[str, Any]) -> float:
        import optuna

        ctx = self.ctx
        started = time.time()
        trial_dir = Path(ctx.output_dir) / ctx.study / f"trial-{trial.number:04d}"
        run_id = None
        try:
            run_id = self._child_run(trial, params)
            if trial_dir.exists():
                self._fail(trial, run_id, f"{trial_dir} already exists; refusing to write over an earlier sweep's files")
            trial_dir.mkdir(parents=True)
            config = compose_trial_config(ctx.spec.base, ctx.spec.per_scale, params)
            # What the point asks for, kept for the report even if the config turns out invalid.
            trial.set_user_attr(ATTR + "model", {
                "name": get_dotted(config, "model.config.name", "debug"), "residual": get_dotted(config, "model.config.residual", "prenorm"),
                "heads": get_dotted(config, "model.config.heads", 1), "block_size": get_dotted(config, "model.config.block_size", 1),
            })
            try:
                resolved = resolve_fit_config(config)
                model = model_fields(resolved)
                budget = token_budget(ctx.objective, resolved)
            except (ValueError, TypeError) as e:
                (trial_dir / "trial.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                self.client.log_artifact(run_id, str(trial_dir / "trial.yaml"))
                self._fail(trial, run_id, f"invalid config: {e}")
            seed = resolved.get("seed_everything")
            for key, value in {"model": model, "seed": seed, "tokens": budget.tokens, "max_steps": budget.max_steps,
                               "tokens_per_step": budget.tokens_per_step, "gpu": ctx.gpu}.items():
                trial.set_user_attr(ATTR + key, value)
            from mlflow.entities import Param

            self.client.log_batch(run_id, params=[
                Param("sweep.tokens", str(budget.tokens)), Param("sweep.max_steps", str(budget.max_steps)),
                Param("sweep.evals", str(ctx.objective.evals)),
            ])
            trial_config = self._trial_config(trial, config, resolved, budget, run_id, trial_dir)
            (trial_dir / "trial.yaml").write_text(yaml.safe_dump(trial_config, sort_keys=False))
            self.client.log_artifact(run_id, str(trial_dir / "trial.yaml"))
            say(ctx.study, f"trial {trial.number} {json.dumps(params)}: {model['residual']} H={model['heads']} S={model['block_size']} "
                           f"{model['name']}, {budget.max_steps} steps = {budget.tokens:,} tokens; log {trial_dir / 'trial.log'}")
            outcome = self._subprocess(trial, run_id, trial_dir)
            return self._finish(trial, run_id, trial_dir, outcome, budget, started)
        except (TrialFailed, optuna.TrialPruned):
            raise
        except Exception as e:  # noqa: BLE001 - the runner's own failure for this trial
            self._fail(trial, run_id, f"{type(e).__name__}: {e}")
            raise  # unreachable: _fail raises

    def _subprocess(self, trial: Any, run_id: str, trial_dir: Path) -> dict[str, Any]:
        ctx = self.ctx
        env = dict(os.environ, PYTHONUNBUFFERED="1", JSONARGPARSE_DEPRECATION_WARNINGS="off")
        if ctx.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = ctx.gpu
        result = trial_dir / "result.json"
        command = [sys.executable, "-m", "lit_mhar.sweeps.trial", "--config", str(trial_dir / "trial.yaml"), "--result", str(result)]
        with open(trial_dir / "trial.log", "wb") as log:
            # Own session: a Ctrl-C in the terminal reaches the runner, which stops the trial itself;
            # the kernel signals the trial when the runner dies, however it dies (kill -9 included)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=functools.partial(die_with_parent, RUNNER_DIED, os.getpid()))
            try:
                code = proc.wait(timeout=ctx.trial_timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                self._upload_log(run_id, trial_dir)
                self._fail(trial, run_id, f"timed out after trial_timeout={ctx.trial_timeout:g} s")
            except BaseException:  # KeyboardInterrupt / SIGTERM: stop the trial, record it as interrupted
                _stop(proc)
                self._upload_log(run_id, trial_dir)
                _close_child(ctx, run_id, "KILLED", "FAIL")
                raise
        self._upload_log(run_id, trial_dir)
        outcome = json.loads(result.read_text()) if result.is_file() else {}
        if code != 0 or outcome.get("status") != "ok":
            if outcome.get("error"):
                reason = ("out of memory: " if outcome.get("oom") else "") + outcome["error"]
            elif code < 0:
                reason = f"the trial process was killed by signal {signal.Signals(-code).name}" + (
                    " (the kernel's out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else "")
            else:
                reason = f"the trial process exited with status {code} without a result; last lines of its log:\n{_tail(trial_dir / 'trial.log')}"
            self._fail(trial, run_id, reason)
        return outcome

    def _upload_log(self, run_id: str, trial_dir: Path) -> None:
        with contextlib.suppress(Exception):
            self.client.log_artifact(run_id, str(trial_dir / "trial.log"))

    def _finish(self, trial: Any, run_id: str, trial_dir: Path, outcome: dict[str, Any], budget: Budget, started: float) -> float:
        import optuna
        from mlflow.entities import Metric

        ctx = self.ctx
        history = self._metrics(run_id)
        losses = sorted(history["loss"], key=lambda m: (m.step, m.timestamp))
        tokens_per_s = [m.value for m in history["tokens_per_s"]]
        summary = {
            "tokens_per_s": float(_median(tokens_per_s)) if tokens_per_s else None,
            "mfu": float(_median([m.value for m in history["mfu"]])) if history["mfu"] else None,
            "peak_memory_gb": max((m.value for m in history["peak_memory_gb"]), default=None),
            "duration_s": round(time.time() - started, 1),
            "global_step": outcome.get("global_step"),
        }
        for key, value in summary.items():
            trial.set_user_attr(ATTR + key, value)
        now = int(time.time() * 1000)
        metrics = [Metric(f"sweep/{k}", v, now, 0) for k, v in summary.items() if isinstance(v, (int, float))]
        if outcome.get("pruned_at") is not None:
            self.client.log_batch(run_id, metrics=metrics)
            _close_child(ctx, run_id, "FINISHED", "PRUNED")
            last = f"{losses[-1].value:.4f}" if losses else "n/a"
            say(ctx.study, f"trial {trial.number} PRUNED after validation {outcome['pruned_at']}/{ctx.objective.evals} ({ctx.objective.metric} {last})")
            raise optuna.TrialPruned(f"pruned after validation {outcome['pruned_at']} of {ctx.objective.evals}")
        # Lightning logs a validation inside the epoch at the step count before the optimizer step
        # that triggered it, so check the count of validations and the step reached, not the step.
        steps_logged = sorted({m.step for m in losses})
        if outcome.get("global_step") != budget.max_steps or len(steps_logged) != ctx.objective.evals:
            self._fail(trial, run_id, f"the fit stopped at step {outcome.get('global_step')} of {budget.max_steps} with "
                                      f"{len(steps_logged)} of {ctx.objective.evals} validations of {ctx.objective.metric} logged")
        value = float(losses[-1].value)
        if not math.isfinite(value):
            self._fail(trial, run_id, f"{ctx.objective.metric} is {value} at step {budget.max_steps} (diverged)")
        trial.set_user_attr(ATTR + "val_loss", value)
        self.client.log_batch(run_id, metrics=[*metrics, Metric("sweep/val_loss", value, now, 0)])
        self.client.log_batch(ctx.parent_run_id, metrics=[Metric("trials/val_loss", value, now, trial.number)])
        _close_child(ctx, run_id, "FINISHED", "COMPLETE")
        rate = f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else ""
        say(ctx.study, f"trial {trial.number} COMPLETE {ctx.objective.metric}={value:.4f}{rate}, {summary['duration_s']:.0f} s")
        return value


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the trial's process group, SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Quiet(logging.Filter):
    """Drops the traceback Optuna prints for a TrialFailed: the reason is the whole story."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TrialFailed):
            record.exc_info = None
        return True


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def work(ctx: Context) -> None:
    """One worker: takes trials until the grid (or ``sampler.n_trials``) is done. ``--workers N`` runs N of these."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _work(ctx)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _work(ctx: Context) -> None:
    import optuna

    optimize_logger = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _Quiet) for f in optimize_logger.filters):
        optimize_logger.addFilter(_Quiet())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(ctx.storage, ctx.heartbeat_interval, ctx.grace_period)
    study = optuna.load_study(
        study_name=ctx.study, storage=storage, sampler=ctx.spec.sampler.build(ctx.worker), pruner=ctx.pruner.build(ctx.objective.evals)
    )
    lock = StorageLock(ctx.storage)
    objective = SweepObjective(ctx, study, lock)
    while True:
        lock.acquire()
        try:
            _fail_dead_trials(study, ctx)
            if ctx.is_grid:
                _enqueue_missing(study, ctx)
            if _nothing_left(study, ctx):
                return
            study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=False)
        finally:
            lock.release()


def _work_in_process(ctx: Context) -> None:
    import multiprocessing

    die_with_parent(signal.SIGTERM, multiprocessing.parent_process().pid)  # a killed `sweep run` takes its workers along
    try:
        work(ctx)
    except KeyboardInterrupt:
        sys.exit(130)


# ----------------------------------------------------------------------------- the study


STUDY_MARK_GRACE_S = 10.0  # how long an empty, unmarked study may wait for its creator's "initialising" mark


def _await_sweep_study(study: Any, reload: Any, name: str, where: str) -> Any:
    """``study`` (an existing Optuna study) once the lit-mhar sweep that created it has finished
    initialising it (its ``spec`` user attribute set), reloading it with ``reload()`` every second.

    Another ``sweep run`` may have created it an instant ago and not marked it yet: an empty study
    without the "initialising" mark is given ``STUDY_MARK_GRACE_S`` seconds to get it.

    Raises:
        ValueError: the study holds trials but no lit-mhar mark, or stays unmarked past the grace
            (not a lit-mhar sweep), or was marked "initialising" but not finished within 120 s.
    """
    start = time.time()
    while ATTR + "spec" not in study.user_attrs:
        if ATTR + "initialising" not in study.user_attrs:
            if study.get_trials(deepcopy=False) or time.time() - start > STUDY_MARK_GRACE_S:
                raise ValueError(
                    f"study {name!r} exists in {where} but was not made by lit-mhar sweep; choose another study name (nothing was changed)"
                )
        elif time.time() - start > 120:
            raise ValueError(
                f"study {name!r} was created by {study.user_attrs[ATTR + 'initialising']} but never finished initialising; "
                f"delete it (optuna delete-study --study-name {name} --storage URL) or choose another name"
            )
        time.sleep(1)
        study = reload()
    return study


def _init_study(ctx_args: dict[str, Any], spec: SweepSpec, tracking: Tracking, storage: Any, sweep_text: str) -> tuple[Any, str, str, str, bool]:
    """Creates the study (and its MLflow parent run) or loads it and checks it is the same sweep.

    Returns ``(study, tracking_uri, experiment_id, parent_run_id, created)``.

    Raises:
        ValueError: the study exists but is not a lit-mhar sweep, or was made by a different sweep.
    """
    import optuna
    from mlflow.entities import Param

    name = ctx_args["study"]
    sampler = spec.sampler.build()
    pruner = ctx_args["pruner"].build(spec.objective.evals)
    fingerprint = json.loads(json.dumps(spec.fingerprint()))
    try:
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", sampler=sampler, pruner=pruner, load_if_exists=False)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        created = False
    if created:
        study.set_user_attr(ATTR + "initialising", f"{HOST}:{os.getpid()}")
        tracking_uri = _tracking_uri(tracking)
        client = _client(tracking_uri)
        experiment_id = _experiment_id(client, tracking)
        from lit_mhar.cli.lightning import run_tags

        parent = client.create_run(
            experiment_id,
            run_name=name,
            tags={"optuna.study_name": name, "optuna.storage": redact(ctx_args["storage"]), "lit_mhar.sweep": "parent", **run_tags()},
        )
        parent_id = parent.info.run_id
        client.log_batch(parent_id, params=[
            Param("sampler", spec.sampler.name), Param("pruner", ctx_args["pruner"].name),
            Param("objective.tokens", str(spec.objective.tokens)), Param("objective.evals", str(spec.objective.evals)),
            Param("objective.metric", spec.objective.metric), Param("grid_size", str(len(spec.space.grid()) if spec.sampler.name == "grid" else "")),
        ])
        client.log_text(parent_id, sweep_text, "sweep.yaml")
        study.set_user_attr(ATTR + "mlflow", {"tracking_uri": tracking_uri, "experiment_id": experiment_id, "parent_run_id": parent_id})
        study.set_user_attr(ATTR + "output_dir", str(Path(ctx_args["output_dir"]).absolute()))
        study.set_user_attr(ATTR + "spec", fingerprint)  # last: marks the study as ready
        return study, tracking_uri, experiment_id, parent_id, True
    study = _await_sweep_study(
        study, lambda: optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner), name, redact(ctx_args["storage"])
    )
    stored = study.user_attrs[ATTR + "spec"]
    if stored != fingerprint:
        differs = sorted(k for k in set(stored) | set(fingerprint) if stored.get(k) != fingerprint.get(k))
        raise ValueError(
            f"study {name!r} in {redact(ctx_args['storage'])} was made by a different sweep ({', '.join(differs)} differ"
            f"{'; stored ' + json.dumps({k: stored.get(k) for k in differs})[:800] if differs else ''}). Resuming would mix "
            "two sweeps in one study: use another --study name (nothing was changed)"
        )
    info = study.user_attrs[ATTR + "mlflow"]
    if tracking.tracking_uri and _tracking_uri(tracking) != info["tracking_uri"]:
        say(name, f"note: this study logs to {info['tracking_uri']} (set when it was created), not {_tracking_uri(tracking)}")
    return study, info["tracking_uri"], info["experiment_id"], info["parent_run_id"], False


def _representatives(space: SearchSpace, grid: list[dict[str, Any]], base: dict[str, Any]) -> list[dict[str, Any]]:
    """A few points that between them use every parameter name and every scale: checked before any trial."""
    if grid:
        chosen: dict[tuple, dict[str, Any]] = {}
        for point in grid:
            chosen.setdefault((tuple(point), point_scale(base, point)), point)
        return list(chosen.values())
    (sub,) = space.subspaces
    from lit_mhar.sweeps.space import Range

    first = {n: (d.values[0] if not isinstance(d, Range) else (int(d.low) if d.integer else d.low)) for n, d in sub.items()}
    points = [first]
    if "scale" in sub and not isinstance(sub["scale"], Range):
        points = [dict(first, scale=s) for s in sub["scale"].values]
    return points


def _gpus(workers: int) -> list[Optional[str]]:
    """The CUDA_VISIBLE_DEVICES value of each worker: one GPU each, or none on a machine without GPUs."""
    if workers == 1:
        return [None]
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return [None] * workers
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or [str(i) for i in range(count)]
    if workers > len(visible):
        raise ValueError(f"workers={workers} but only {len(visible)} GPU(s) are visible; one worker trains on one GPU")
    return visible[:workers]


def _summary(study: Any, ctx: Context) -> str:
    import optuna

    S = optuna.trial.TrialState
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(ATTR + "surplus")]
    counts = {s.name: sum(t.state == s for t in trials) for s in (S.COMPLETE, S.PRUNED, S.FAIL, S.RUNNING, S.WAITING)}
    text = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    done = [t for t in trials if t.state == S.COMPLETE]
    if done:
        best = min(done, key=lambda t: t.value)
        text += f"; best trial {best.number} {ctx.objective.metric}={best.value:.4f} {json.dumps(best.params)}"
    return text or "no trials"


def _exit_status(study: Any, ctx: Context) -> int:
    """0 when ``study`` holds a COMPLETE trial (it has a result), else 1 after one line on stderr saying why."""
    import optuna

    S = optuna.trial.TrialState
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(ATTR + "surplus")]
    if any(t.state == S.COMPLETE for t in trials):
        return 0
    counts = {s.name: sum(t.state == s for t in trials) for s in (S.FAIL, S.PRUNED, S.RUNNING, S.WAITING)}
    text = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no trials"
    reasons = [t for t in trials if t.state == S.FAIL and t.user_attrs.get(ATTR + "fail_reason")]
    last = ""
    if reasons:  # the latest: after a --retry_failed it is the current one
        reason = " ".join(str(reasons[-1].user_attrs[ATTR + "fail_reason"]).split())
        last = f"; trial {reasons[-1].number} failed with: {reason[:300]}{'...' if len(reason) > 300 else ''}"
    others = " (other workers are still running trials)" if counts["RUNNING"] or counts["WAITING"] else ""
    retry = " --retry_failed true runs failed points again once fixed." if ctx.is_grid else ""
    print(
        f"lit-mhar sweep run: error: no trial of study {ctx.study!r} has completed{others} ({text}){last}. "
        f"Trial logs: {Path(ctx.output_dir) / ctx.study}/trial-NNNN/trial.log.{retry}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _close_parent(client: Any, parent_id: str, status: str, study: Any) -> str:
    """Ends the MLflow parent run with ``status`` and an end time; FAILED when ``status`` is FINISHED but no trial
    completed (the command exits 1). RUNNING (other workers still at it) only sets the status. Returns the status set."""
    import optuna

    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(ATTR + "surplus")]
    if status == "FINISHED" and not any(t.state == optuna.trial.TrialState.COMPLETE for t in trials):
        status = "FAILED"
    with contextlib.suppress(Exception):
        if status == "RUNNING":
            client.update_run(parent_id, status=status)
        else:
            client.set_terminated(parent_id, status=status, end_time=int(time.time() * 1000))
    return status


def run(
    study: str,
    space: Union[dict[str, Any], list[dict[str, Any]]],
    base_config: Optional[Path_fr] = None,
    base: Optional[dict[str, Any]] = None,
    per_scale: Optional[dict[str, dict[str, Any]]] = None,
    sampler: Sampler = Sampler(),
    pruner: Pruner = Pruner(),
    objective: Objective = Objective(),
    storage: str = "sqlite:///sweeps.db",
    mlflow: Tracking = Tracking(),
    workers: int = 1,
    output_dir: str = "runs/sweeps",
    trial_timeout: Optional[float] = None,
    retry_failed: bool = False,
    keep_checkpoints: bool = False,
    heartbeat_interval: int = 60,
    grace_period: Optional[int] = None,
) -> int:
    """Runs (or resumes) a sweep: an Optuna study whose trials are ``lit-mhar fit`` runs, tracked in MLflow.

    Give the sweep file with ``--config sweeps/h_sweep.yaml``; any field can be overridden on the
    command line (``--storage postgresql://...``, ``--workers 2``, ``--objective.tokens 5e6``).
    Running the same command again resumes the study; running it in several shells, or with
    ``--workers N``, shares the study's points between the workers, each point once.

    Args:
        study: Name of the Optuna study and of the MLflow parent run ([A-Za-z0-9._-]).
        space: Parameter -> list of values (categorical) or {low, high, log, step, type} (a range for
            tpe/random), or a list of such mappings: a grid that is the union of their products.
            Names: heads, block_size, residual, scale (the preset), seed (seed_everything and
            data.seed), lr (model.lr), or any dotted fit argument (model.warmup_steps, data.batch_size).
        base_config: A fit config file every trial starts from (as ``lit-mhar fit --config`` takes;
            relative to the sweep file).
        base: A fit config inline, merged over base_config.
        per_scale: Fit settings merged over the base for each preset scale (e.g. batch size and
            learning rate per scale); when given, every scale the space uses needs an entry.
        sampler: grid (every point once), tpe or random, with n_trials and seed.
        pruner: none, median or hyperband, judged on the objective's intermediate validations.
        objective: Training tokens per trial, validations per trial, and the metric minimised.
        storage: Optuna storage: an RDB URL (sqlite:///sweeps.db, postgresql://...) or journal:PATH.
        mlflow: MLflow experiment, tracking URI and artifact location of the parent and child runs.
        workers: Worker processes this command starts; with GPUs, one GPU each (CUDA_VISIBLE_DEVICES).
        output_dir: Trials write their config, log and result to OUTPUT_DIR/STUDY/trial-NNNN/.
        trial_timeout: Seconds after which a trial is stopped and recorded FAIL (None: no limit).
        retry_failed: Run again the grid points whose trials failed in earlier runs of the command.
        keep_checkpoints: Keep each trial's checkpoints (the best and last; default: none are written).
        heartbeat_interval: Seconds between heartbeats of a running trial (RDB storages), by which a
            trial of a killed worker on another machine is found and run again.
        grace_period: Seconds without a heartbeat after which a trial counts as dead (default 4x interval).

    Returns:
        The exit status of ``lit-mhar sweep run``: 0 when the study holds at least one COMPLETE
        trial when the command ends (Optuna has a ``best_trial``), even if other trials failed: a
        FAIL trial does not stop the sweep. 1 when it holds none (every trial failed or was
        pruned, or a resumed study whose points all failed before), with a line on stderr that
        gives the counts, the latest failure's reason and where the trial logs are.

    Raises:
        ValueError: before any trial starts: an unknown parameter, an empty grid, an invalid range,
            an unreachable storage, a config the fit CLI rejects, or an existing study made by a
            different sweep. A point whose model config is invalid (H not dividing d) is recorded
            as a FAIL trial with the reason, and the sweep goes on.
        lit_mhar.tracking.TrackingUnavailable: the MLflow tracking server (``mlflow.tracking_uri``,
            else ``MLFLOW_TRACKING_URI``) does not answer; checked before the study is opened.
    """
    if not isinstance(study, str) or not _STUDY_NAME.match(study):
        raise ValueError(f"study={study!r} must be a non-empty name of letters, digits, '.', '_' and '-'")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an integer >= 1")
    if objective.tokens < 1 or objective.evals < 1:
        raise ValueError(f"objective.tokens={objective.tokens} and objective.evals={objective.evals} must be >= 1")
    if trial_timeout is not None and trial_timeout <= 0:
        raise ValueError(f"trial_timeout={trial_timeout} must be > 0 seconds (or null for no limit)")
    if heartbeat_interval < 1 or (grace_period is not None and grace_period <= heartbeat_interval):
        raise ValueError(f"need heartbeat_interval >= 1 (got {heartbeat_interval}) and grace_period > heartbeat_interval (got {grace_period})")
    if sampler.name != "grid" and (sampler.n_trials is None or sampler.n_trials < 1):
        raise ValueError(f"sampler.name={sampler.name!r} needs sampler.n_trials >= 1 (got {sampler.n_trials})")
    if retry_failed and sampler.name != "grid":
        raise ValueError("retry_failed applies to grid sweeps; for tpe/random raise sampler.n_trials instead")
    if pruner.name == "hyperband" and not 1 <= pruner.min_resource <= objective.evals:
        raise ValueError(f"pruner.min_resource={pruner.min_resource} must be in [1, objective.evals={objective.evals}]")

    # ---- the sweep's definition
    merged: dict[str, Any] = {}
    if base_config is not None:
        path = Path(str(getattr(base_config, "absolute", base_config)))
        loaded = yaml.safe_load(path.read_text()) if path.is_file() else None
        if not isinstance(loaded, dict):
            raise ValueError(f"base_config={str(base_config)!r} is not a readable fit config (a YAML mapping)")
        merged = loaded
    if base:
        merged = deep_merge(merged, base)
    if not merged:
        raise ValueError("give the fit config the trials start from: base_config (a file) and/or base (inline)")
    per_scale = per_scale or {}
    from lit_mhar.config import PRESETS

    for scale_name, settings in per_scale.items():
        if scale_name not in PRESETS or not isinstance(settings, dict):
            raise ValueError(f"per_scale.{scale_name}: keys are presets {list(PRESETS)} and values fit-config mappings")
    parsed = SearchSpace.parse(space)
    parsed.check_sampler(sampler)
    grid = parsed.grid() if sampler.name == "grid" else []
    if per_scale:
        missing = sorted({point_scale(merged, p) for p in (grid or _representatives(parsed, [], merged))} - set(per_scale))
        if missing:
            raise ValueError(f"per_scale has no entry for scale(s) {missing}; add one per scale the space uses")
    spec = SweepSpec(base=merged, per_scale=per_scale, space=parsed, sampler=sampler, objective=objective)

    # ---- checks that need the storage and the fit CLI, before anything is created
    from lit_mhar.tracking import check_tracking_uri

    check_tracking_uri(_tracking_uri(mlflow))  # an MLflow server that does not answer: TrackingUnavailable, at once
    storage_url = storage if storage.startswith("journal:") else absolute_sqlite(storage) if "://" in storage else storage
    journal = journal_path(storage_url)
    new_journal = journal is not None and not journal.exists()
    optuna_storage = open_storage(storage_url, heartbeat_interval, grace_period)
    import optuna

    try:
        exists = study in optuna.get_all_study_names(storage=optuna_storage)
        study_dir = Path(output_dir) / study
        if not exists and study_dir.exists() and any(study_dir.iterdir()):
            raise ValueError(f"{study_dir} holds files of an earlier sweep named {study!r}; remove it or use another --output_dir (nothing was changed)")
        representatives = _representatives(parsed, grid, merged)
        say(study, f"checking the fit config of {len(representatives)} representative point(s)")
        resolved_configs = []
        from lit_mhar.cli.lightning import check_accelerator, check_cuda_graph

        for point in representatives:
            try:
                resolved_configs.append(resolve_fit_config(compose_trial_config(merged, per_scale, point)))
                trainer = resolved_configs[-1].get("trainer") or {}
                check_accelerator(trainer.get("accelerator"), trainer.get("devices"))  # gpu on a machine without one
                check_cuda_graph(resolved_configs[-1])
                token_budget(objective, resolved_configs[-1])
            except ValueError as e:
                raise ValueError(f"point {json.dumps(point)}: {e}") from None
    except ValueError:
        if new_journal and journal.is_file() and journal.stat().st_size == 0:
            journal.unlink()  # the empty journal file opening the storage created: a refused sweep leaves nothing
        raise

    sweep_text = yaml.safe_dump(
        {"study": study, "space": space, "base": merged, "per_scale": per_scale, "sampler": asdict(sampler), "pruner": asdict(pruner),
         "objective": asdict(objective), "storage": redact(storage_url), "mlflow": asdict(mlflow)}, sort_keys=False)
    study_obj, tracking_uri, experiment_id, parent_id, created = _init_study(
        {"study": study, "storage": storage_url, "pruner": pruner, "output_dir": output_dir}, spec, mlflow, optuna_storage, sweep_text
    )
    if tracking_uri != _tracking_uri(mlflow):
        check_tracking_uri(tracking_uri)  # a resumed study logs where it was created
    ctx = Context(
        study=study, storage=storage_url, spec=spec, pruner=pruner, objective=objective, tracking_uri=tracking_uri,
        experiment_id=experiment_id, parent_run_id=parent_id, output_dir=str(Path(output_dir).absolute()),
        trial_timeout=trial_timeout, retry_failed=retry_failed, retry_before=len(study_obj.trials), keep_checkpoints=keep_checkpoints,
        heartbeat_interval=heartbeat_interval if not storage_url.startswith("journal:") else None, grace_period=grace_period, grid=grid,
    )
    size = f"{len(grid)} grid points" if grid else f"{sampler.n_trials} {sampler.name} trials"
    say(study, f"{'created' if created else 'resuming'} study in {redact(storage_url)}: {size}, {objective.tokens:,} tokens each; "
               f"MLflow {tracking_uri} parent run {parent_id}")
    _prepare_data(ctx, resolved_configs)
    client = _client(tracking_uri)
    client.update_run(parent_id, status="RUNNING")
    status = "FINISHED"
    try:
        gpus = _gpus(workers)
        if workers == 1:
            work(ctx)
        else:
            import multiprocessing

            spawn = multiprocessing.get_context("spawn")
            procs = []
            for i, gpu in enumerate(gpus):
                worker_ctx = Context(**{**ctx.__dict__, "gpu": gpu, "worker": i})
                procs.append(spawn.Process(target=_work_in_process, args=(worker_ctx,), name=f"sweep-worker-{i}"))
                procs[-1].start()
                say(study, f"worker {i} (pid {procs[-1].pid})" + (f" on GPU {gpu}" if gpu is not None else ""))
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                status = "KILLED"
    except KeyboardInterrupt:
        status = "KILLED"
        say(study, "interrupted; run the same command again to resume")
        raise
    finally:
        final = optuna.load_study(study_name=study, storage=optuna_storage)
        S = optuna.trial.TrialState
        unfinished = final.get_trials(deepcopy=False, states=(S.RUNNING, S.WAITING))
        if status == "FINISHED" and unfinished:
            status = "RUNNING"  # other workers are still at it
        _close_parent(client, parent_id, status, final)
        say(study, _summary(final, ctx))
    return _exit_status(final, ctx)


def _prepare_data(ctx: Context, resolved_configs: list[dict[str, Any]]) -> None:
    """Prepares a missing default corpus once, before the first trial (so its time is not a trial's)."""
    seen = set()
    for resolved in resolved_configs:
        data = resolved["data"]
        from lit_mhar.data import prepares_by_itself

        directory = Path(data["data_dir"]).expanduser().absolute()
        if directory in seen or (directory / "manifest.json").is_file() or not prepares_by_itself(directory, data.get("prepare_if_missing")):
            seen.add(directory)
            continue
        seen.add(directory)
        say(ctx.study, f"preparing the default corpus into {directory} before the first trial")
        from lit_mhar.data import TokenDataModule

        TokenDataModule(data_dir=str(directory), seq_len=data["seq_len"], batch_size=data["batch_size"], prepare_if_missing=True)
