"""The sweep's MLflow runs: the experiment, one parent run per study and one child run per trial."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Optional

from lit_mhar.sweeps.space import Tracking
from lit_mhar.sweeps.storage import ATTR, absolute_sqlite

_log = logging.getLogger("lit_mhar.sweeps")


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


def _close_child(tracking_uri: str, run_id: Optional[str], status: str, state: str) -> None:
    if not run_id:
        return
    try:
        client = _client(tracking_uri)
        client.set_tag(run_id, "optuna.trial_state", state)
        if client.get_run(run_id).info.status != status:
            client.set_terminated(run_id, status)
    except Exception as e:  # noqa: BLE001 - a tracking hiccup must not stop the sweep
        _log.warning("could not close MLflow run %s: %s", run_id, e)


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
