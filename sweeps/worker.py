"""A sweep worker: takes the study's next point and runs it, until the grid (or ``sampler.n_trials``) is done."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from lit_mhar.processes import die_with_parent
from lit_mhar.sweeps.mlflow_runs import _close_child
from lit_mhar.sweeps.objective import Context, SweepObjective, _counted, _covering
from lit_mhar.sweeps.space import point_key
from lit_mhar.sweeps.storage import ATTR, HOST, StorageLock, TrialFailed, _alive, open_storage, say


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
        _close_child(ctx.tracking_uri, attrs.get(ATTR + "mlflow_run_id"), "KILLED", "FAIL")


def _enqueue_missing(study: Any, ctx: Context) -> int:
    """Enqueues every grid point no trial accounts for; returns how many."""
    covered = {t.user_attrs[ATTR + "point"] for t in study.get_trials(deepcopy=False) if _covering(t, ctx)}
    missing = [p for p in ctx.grid if point_key(p) not in covered]
    for point in missing:
        study.enqueue_trial(point, user_attrs={ATTR + "point": point_key(point)})
    return len(missing)


def _nothing_left(study: Any, ctx: Context) -> bool:
    import optuna

    if ctx.is_grid:
        return not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    return _counted(study, ctx) >= int(ctx.spec.sampler.n_trials or 0)


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
