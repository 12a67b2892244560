"""One trial: the objective ``study.optimize`` calls. It claims a point, runs its ``fit`` in a subprocess
and turns the run's metrics into the trial's value (or a FAIL / PRUNED state with its reason)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lit_mhar.processes import RUNNER_DIED, die_with_parent
from lit_mhar.sweeps.fitconfig import flops_per_token, model_fields, resolve_fit_config
from lit_mhar.sweeps.mlflow_runs import _client, _close_child
from lit_mhar.sweeps.space import (
    Budget,
    Objective,
    Pruner,
    SweepSpec,
    budget_overrides,
    compose_trial_config,
    deep_merge,
    get_dotted,
    point_key,
    set_dotted,
    token_budget,
)
from lit_mhar.sweeps.storage import ATTR, HOST, StorageLock, TrialFailed, _process_start, say
from lit_mhar.tracking import redact


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
    corpora: dict[str, dict[str, Any]] = field(default_factory=dict)  # data_dir -> digest, train tokens, source
    trials_per_gpu: int = 1
    gpu: Optional[str] = None
    worker: int = 0

    @property
    def is_grid(self) -> bool:
        return self.spec.sampler.name == "grid"


def _is_ours(t: Any) -> bool:
    return ATTR + "point" in t.user_attrs and not t.user_attrs.get(ATTR + "surplus")


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


def _counted(study: Any, ctx: Context, below: Optional[int] = None) -> int:
    """Trials that count towards sampler.n_trials (interrupted and surplus ones do not)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if (below is None or t.number < below) and _covering(t, ctx))


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
            _close_child(self.ctx.tracking_uri, run_id, status, "FAIL")
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
                budget = token_budget(ctx.objective, resolved, float(params.get("budget", 1.0)))
            except (ValueError, TypeError) as e:
                (trial_dir / "trial.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                self.client.log_artifact(run_id, str(trial_dir / "trial.yaml"))
                self._fail(trial, run_id, f"invalid config: {e}")
            seed = resolved.get("seed_everything")
            corpus = ctx.corpora.get(str(resolved["data"]["data_dir"]), {})
            from lit_mhar.sweeps.runner import passes

            for key, value in {"model": model, "seed": seed, "tokens": budget.tokens, "max_steps": budget.max_steps,
                               "tokens_per_step": budget.tokens_per_step, "gpu": ctx.gpu, "trials_per_gpu": ctx.trials_per_gpu,
                               "flops_per_token": flops_per_token(resolved), "data_digest": corpus.get("digest"),
                               "passes": passes(budget.tokens, int(resolved["data"]["seq_len"]), corpus["train_tokens"]) if corpus else None,
                               }.items():
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
        env = dict(os.environ, PYTHONUNBUFFERED="1", JSONARGPARSE_DEPRECATION_WARNINGS="off", LIT_MHAR_TRIAL_STARTED=repr(time.time()))
        # one compile cache for the study's trials (Inductor's graphs, Triton's kernels): each variant compiles once
        cache = Path(ctx.output_dir) / ctx.study / "compile-cache"
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
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
                _close_child(ctx.tracking_uri, run_id, "KILLED", "FAIL")
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
            "startup_s": outcome.get("startup_s"),
            "global_step": outcome.get("global_step"),
        }
        for key, value in summary.items():
            trial.set_user_attr(ATTR + key, value)
        now = int(time.time() * 1000)
        metrics = [Metric(f"sweep/{k}", v, now, 0) for k, v in summary.items() if isinstance(v, (int, float))]
        if outcome.get("pruned_at") is not None:
            self.client.log_batch(run_id, metrics=metrics)
            _close_child(ctx.tracking_uri, run_id, "FINISHED", "PRUNED")
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
        _close_child(ctx.tracking_uri, run_id, "FINISHED", "COMPLETE")
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
