"""Inside one trial's process: the fit, the pruning callback, and the result file the runner reads.

The runner starts ``python -m lit_mhar.sweeps.trial --config TRIAL.yaml --result RESULT.json`` for
every trial, so a crash, an out-of-memory error or a hard kill ends that process only. This module
runs ``lit-mhar fit`` in it and writes what happened to ``RESULT.json``:

``{"status": "ok" | "error", "error": "Type: message", "oom": bool, "pruned_at": k | null,
"global_step": int}``.

:class:`OptunaPruning` is the pruning callback. optuna-integration's
``PyTorchLightningPruningCallback`` reports at ``trainer.current_epoch`` (every validation of a
step-budgeted run would land on step 0) and raises ``TrialPruned`` inside ``fit``; this one reports
the k-th validation as step k, rebuilds the trial from the storage and its id (it runs in another
process than the study's ``optimize``), and stops the trainer cleanly instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import lightning as L

from lit_mhar.processes import RUNNER_DIED


class OptunaPruning(L.Callback):
    """Reports each validation's ``monitor`` to an Optuna trial and stops the fit when the pruner says so.

    The k-th validation of a run of ``max_steps`` steps with ``evals`` validations is reported as
    step k (1-based), so trials with different batch sizes are compared after equal token counts.
    When ``trial.should_prune()`` is true it sets the user attribute ``lit_mhar.pruned_at`` and
    ``trainer.should_stop``; the runner then records the trial as PRUNED.

    The callback also stops the fit if the runner that started this process has died (the parent
    pid changed), so a killed sweep leaves no orphaned training behind. (On Linux the runner also
    asks the kernel to send the trial :data:`lit_mhar.processes.RUNNER_DIED` when it dies: the trial stops at once.)

    Args:
        storage: Optuna storage URL (``sqlite:///...``, ``postgresql://...``) or ``journal:PATH``.
        study_name: The study.
        trial_id: The trial's storage id (not its number).
        pruner: The pruner settings (:class:`lit_mhar.sweeps.space.Pruner` as a mapping).
        evals: Validations in the run.
        max_steps: Optimizer steps in the run.
        monitor: The logged metric reported to Optuna.
    """

    def __init__(
        self,
        storage: str,
        study_name: str,
        trial_id: int,
        pruner: dict[str, Any],
        evals: int,
        max_steps: int,
        monitor: str = "val/loss",
    ) -> None:
        super().__init__()
        self.storage, self.study_name, self.trial_id = storage, study_name, trial_id
        self.pruner, self.evals, self.max_steps, self.monitor = pruner, evals, max_steps, monitor
        self.pruned_at: Optional[int] = None
        self.orphaned = False
        self.startup_s: Optional[float] = None  # from the runner starting this process to the end of the first step
        self._parent = os.getppid()
        self._trial: Any = None

    def _optuna_trial(self) -> Any:
        if self._trial is None:
            import optuna

            from lit_mhar.sweeps.storage import open_storage
            from lit_mhar.sweeps.space import Pruner

            study = optuna.load_study(
                study_name=self.study_name,
                storage=open_storage(self.storage),
                sampler=optuna.samplers.RandomSampler(),
                pruner=Pruner(**self.pruner).build(self.evals),
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        return self._trial

    def _check_parent(self, trainer: L.Trainer) -> None:
        if os.getppid() != self._parent:
            self.orphaned = True
            trainer.should_stop = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_parent(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> Optional[int]:
        self._check_parent(trainer)
        return -1 if self.orphaned else None  # -1 skips the rest of the epoch

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check_parent(trainer)
        started = os.environ.get("LIT_MHAR_TRIAL_STARTED")
        if self.startup_s is None and started:
            self.startup_s = round(time.time() - float(started), 2)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.pruned_at is not None or self.orphaned:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise RuntimeError(f"OptunaPruning: metric {self.monitor!r} was not logged; logged: {sorted(trainer.callback_metrics)}")
        step = max(1, round(trainer.global_step * self.evals / self.max_steps))
        trial = self._optuna_trial()
        trial.report(float(value), step)
        if trial.should_prune():
            self.pruned_at = step
            trial.set_user_attr("lit_mhar.pruned_at", step)
            trainer.should_stop = True


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def run_trial(config: str, result: str) -> int:
    """Runs ``lit-mhar fit --config config`` and writes the outcome to ``result``. Returns the exit status.

    Exit status 0 with ``"status": "ok"`` when fit returned (also when pruned), 1 when it raised,
    3 when the runner died and the fit stopped itself.
    """
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    from lit_mhar.cli.lightning import run_lightning

    outcome: dict[str, Any] = {"status": "error", "error": None, "oom": False, "pruned_at": None, "global_step": None}
    code = 1
    parent = os.getppid()
    sys.argv = sys.argv[:1]  # LightningCLI takes the args below, not this module's own
    stopped_by: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        # the runner's SIGTERM (a timeout, Ctrl-C) or the kernel's RUNNER_DIED: end now, from any
        # phase, and still write the result. (Lightning adds its own SIGTERM handler before this
        # one, and on a KeyboardInterrupt stops the processes it launched.)
        stopped_by.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(RUNNER_DIED, stop)
    try:
        cli = run_lightning(["fit", "--config", config])
        pruning = next((c for c in cli.trainer.callbacks if isinstance(c, OptunaPruning)), None)
        outcome.update(status="ok", global_step=cli.trainer.global_step, pruned_at=pruning and pruning.pruned_at,
                       startup_s=pruning and pruning.startup_s)
        code = 0
        if pruning is not None and pruning.orphaned:  # the runner died: this run is not a result
            code = _orphaned(outcome)
    except BaseException as e:  # noqa: BLE001 - every failure is the trial's result
        # (the parent pid alone does not tell: when the runner is killed, its threads die one by
        # one, and the kernel may signal this process before it gives it a new parent)
        if RUNNER_DIED in stopped_by or os.getppid() != parent:
            code = _orphaned(outcome)
        elif stopped_by:
            outcome["error"] = "stopped by SIGTERM (from the sweep runner)"
        elif isinstance(e, SystemExit):  # jsonargparse reports bad arguments by exiting
            if e.code in (0, None):
                outcome.update(status="ok")
                code = 0
            else:
                outcome["error"] = f"the fit arguments were rejected (exit {e.code}); see the trial log"
        else:
            outcome.update(error=f"{type(e).__name__}: {e}"[:2000], oom=_is_oom(e), traceback=traceback.format_exc()[-4000:])
            traceback.print_exc()
    for signum in (signal.SIGTERM, RUNNER_DIED):  # a second signal must not cut the result short
        signal.signal(signum, signal.SIG_IGN)
    Path(result).write_text(json.dumps(outcome, indent=2) + "\n")
    if code == 3:
        _close_orphaned_run(config)
    return code


def _orphaned(outcome: dict[str, Any]) -> int:
    """Records a trial whose runner died as not a result; returns the exit status 3."""
    outcome.update(status="error", error="stopped: the sweep runner that started this trial died")
    return 3


def _close_orphaned_run(config: str) -> None:
    """Closes the MLflow run of a trial whose runner died as KILLED (the run id and store of the
    trial's config). Best effort, after the result is written: the interrupt may have cut an MLflow
    write short and left its store locked, and the next ``sweep run`` closes the run as KILLED anyway."""
    import yaml

    logger = ((yaml.safe_load(Path(config).read_text()) or {}).get("trainer") or {}).get("logger") or {}
    init = (logger.get("init_args") or {}) if isinstance(logger, dict) else {}
    if not (init.get("run_id") and init.get("tracking_uri")):
        return
    try:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=init["tracking_uri"])
        client.set_tag(init["run_id"], "optuna.trial_state", "FAIL")
        client.set_terminated(init["run_id"], "KILLED")
    except Exception as e:  # noqa: BLE001
        print(f"[lit-mhar] note: could not close MLflow run {init['run_id']} as KILLED ({type(e).__name__}: {e}); "
              "the next `lit-mhar sweep run` of this study closes it", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_mhar.sweeps.trial", description=run_trial.__doc__)
    parser.add_argument("--config", required=True, help="the trial's fit config (YAML)")
    parser.add_argument("--result", required=True, help="where to write the outcome (JSON)")
    args = parser.parse_args(argv)
    return run_trial(args.config, args.result)


if __name__ == "__main__":
    # Run the module's canonical copy: the callback jsonargparse instantiates is
    # lit_mhar.sweeps.trial.OptunaPruning, not this __main__'s class of the same name.
    from lit_mhar.sweeps.trial import main as _main

    sys.exit(_main())
