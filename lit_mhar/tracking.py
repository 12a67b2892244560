"""MLflow tracking that fails fast when the server is down at the start and never stops training later.

``lit-mhar fit`` (and every sweep trial) logs through :class:`MLFlowLogger`, Lightning's logger with
two additions:

* **At the start** an ``http(s)://`` tracking server is asked for one experiment
  (:func:`check_tracking_uri`, no retries) before any data or model work: an unreachable server, or
  one that answers with an error, raises :class:`TrackingUnavailable` naming the URI.
  ``lit-mhar fit`` checks before it prepares data or builds the model, the logger again when it is
  built, ``lit-mhar sweep run`` before it opens its study.
* **During training** a failed call to the server (MLflow raises after its own retries) does not
  end the run. The logger prints one warning with the step and the error, stops calling the
  server (no more stalls of the training loop), appends every later metric to
  ``untracked_metrics.csv`` in the run's folder (``runs/<experiment_id>/<run_id>/``, beside
  ``config.yaml`` and the checkpoints), is recorded in every later checkpoint
  (``checkpoint["mlflow"]["tracking_lost"]``, written by ``LitLM.on_save_checkpoint``), and prints
  a closing message at the end of the fit. It does not reconnect; the run stays RUNNING on the
  server.

How long a dead server holds up the first failed call is MLflow's retry policy:
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (default 7 retries, exponential backoff from
``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` = 2 s) and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (120 s per
request); this module leaves them as you set them.
"""

from __future__ import annotations

import csv
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.pytorch.loggers import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a local sqlite store ``./mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def absolute_tracking_uri(uri: str) -> str:
    """``uri`` with a relative sqlite / file / plain path made absolute (from the working directory),
    so a checkpoint's record of its MLflow store stays valid from any directory."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).absolute())
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + str(Path(uri[len("file:") :]).absolute())
    if "://" not in uri and not uri.startswith("file:"):
        return str(Path(uri).absolute())
    return uri


# The MLflow UI (3.x) opens an experiment by its kind: without this tag it guesses and may open
# the GenAI overview instead of the training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def tag_experiment(client: Any, experiment_id: str) -> None:
    """Marks the experiment as model training (:data:`EXPERIMENT_KIND`) unless it has a kind already."""
    key, value = EXPERIMENT_KIND
    if key not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, key, value)


def log_dataset_inputs(client: Any, run_id: str, data_dir: str | os.PathLike, manifest: Mapping[str, Any], splits: Mapping[str, str]) -> None:
    """Logs a prepared dataset's splits as the run's MLflow dataset inputs (the runs table's Dataset column).

    Each split is a dataset ``<folder>/<split>`` whose source is the dataset folder, whose digest
    is that of its ``manifest.json`` (so two runs trained on the same prepared data show the same
    digest) and whose profile holds the split's tokens, documents and chunks and the vocabulary.

    Args:
        client: an ``mlflow.MlflowClient``.
        run_id: the run.
        data_dir: the dataset folder (``lit-mhar prepare``'s output).
        manifest: its ``manifest.json``.
        splits: split -> MLflow's dataset context (``{"train": "training", "val": "evaluation"}``).

    Raises:
        mlflow.exceptions.MlflowException: the store refused the inputs ``DATASET_LOG_ATTEMPTS``
            times (a refusal is retried: concurrent runs logging the same dataset race in the store).
    """
    import hashlib
    import json
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    folder = Path(data_dir).absolute()
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]
    with warnings.catch_warnings():
        # a local folder reads as two local sources alike; either is this folder
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        source = resolve_dataset_source(str(folder))

    class TokenDataset(MetaDataset):
        def __init__(self, name: str, profile: dict[str, Any]) -> None:
            super().__init__(source, name=name, digest=digest)
            self._profile = profile

        @property
        def profile(self) -> dict[str, Any]:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile)}

    inputs = []
    for split, context in splits.items():
        counts = (manifest.get("splits") or {}).get(split) or {}
        profile = {k: counts.get(k) for k in ("tokens", "documents", "chunks")} | {"vocab_size": manifest.get("vocab_size"), "source": manifest.get("source")}
        dataset = TokenDataset(f"{folder.name}/{split}", profile)
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
    from mlflow.exceptions import MlflowException

    for attempt in range(DATASET_LOG_ATTEMPTS):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except MlflowException:
            # The store looks the dataset up, then inserts it: two runs of one experiment that log the same
            # dataset at once (a sweep's trials) race, and the loser hits the unique key. Again, it finds the row.
            if attempt == DATASET_LOG_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


DATASET_LOG_ATTEMPTS = 4


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server cannot be used; the message names the URI, the error and what to do."""


def redact(uri: str) -> str:
    """``uri`` without its password (``scheme://user:***@host``), for messages and checkpoints."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", uri)


def check_tracking_uri(uri: str, timeout: float = 10.0) -> None:
    """Raises :class:`TrackingUnavailable` unless the MLflow server at ``uri`` answers; a no-op for other URIs.

    For ``http://`` and ``https://`` URIs: one ``GET /api/2.0/mlflow/experiments/search`` without
    retries (MLflow's own client retries for minutes), with MLflow's credentials from the
    environment (``MLFLOW_TRACKING_TOKEN``, or ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``) and TLS
    settings (``MLFLOW_TRACKING_INSECURE_TLS``, ``MLFLOW_TRACKING_SERVER_CERT_PATH``). A connection
    error, no answer within ``timeout`` seconds, or an HTTP error status fails. Local stores
    (``sqlite:``, ``file:``, paths) and other schemes (``databricks``) are not checked.
    """
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    env = os.environ
    headers, auth = {}, None
    if env.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
    elif env.get("MLFLOW_TRACKING_USERNAME"):
        auth = (env["MLFLOW_TRACKING_USERNAME"], env.get("MLFLOW_TRACKING_PASSWORD", ""))
    verify: Any = env.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or env.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true"
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search"
    hint = (
        "Start the server (mlflow server --host HOST --port PORT --backend-store-uri URI), correct the URI "
        "(MLFLOW_TRACKING_URI, or the tracking_uri option), or log locally (unset MLFLOW_TRACKING_URI: sqlite:///mlflow.db)."
    )
    try:
        response = requests.get(url, params={"max_results": 1}, headers=headers, auth=auth, timeout=timeout, verify=verify)
    except requests.RequestException as e:
        raise TrackingUnavailable(f"MLflow tracking server {redact(uri)} is unreachable ({type(e).__name__}: {e}). {hint}") from None
    if response.status_code >= 400:
        raise TrackingUnavailable(
            f"MLflow tracking server {redact(uri)} answered HTTP {response.status_code} ({response.text[:200].strip()}). {hint}"
        )


class MLFlowLogger(_LightningMLFlowLogger):
    """Lightning's ``MLFlowLogger`` that checks the server when built and survives losing it later.

    Takes the arguments of ``lightning.pytorch.loggers.MLFlowLogger``; see the module docstring for
    what happens when the server is unreachable at the start or later. With ``run_id`` (an existing
    run: a sweep trial, or ``fit --ckpt_path`` continuing its run), hyperparameters whose logged
    value differs are not sent (MLflow refuses to change a param; the run's later ``config.yaml``
    artifact has the new values), and a note names them.

    Args:
        log_system_metrics: Also log the machine's CPU, memory, disk and network use and, with
            ``nvidia-ml-py`` installed, every GPU's utilisation and memory (MLflow's system metrics,
            ``system/*``, every 10 s) while the command runs. Needs ``psutil``.

    Attributes:
        tracking_lost: None while tracking works; after a failure ``{"step", "time" (UTC ISO 8601),
            "error", "tracking_uri", "run_id"}``, JSON-serialisable.
        untracked_dir: the folder of ``untracked_metrics.csv`` (columns ``step, metric, value``);
            ``lit-mhar fit`` sets it to the run's folder. None keeps the untracked metrics in
            ``untracked_metrics`` (memory) instead.
        untracked_metrics: ``(step, name, value)`` not sent to the server, when ``untracked_dir`` is None.

    Raises:
        TrackingUnavailable: from ``__init__``, on rank 0, when an ``http(s)://`` server does not answer.
        ValueError: ``log_system_metrics`` without ``psutil`` installed.
    """

    def __init__(self, *args: Any, log_system_metrics: bool = False, **kwargs: Any) -> None:
        if log_system_metrics:
            import importlib.util

            if importlib.util.find_spec("psutil") is None:
                raise ValueError("log_system_metrics=True needs psutil: pip install psutil (and nvidia-ml-py for GPU metrics)")
        super().__init__(*args, **kwargs)
        self.log_system_metrics = log_system_metrics
        self._system_metrics: Any = None
        self.tracking_lost: Optional[dict[str, Any]] = None
        self.untracked_dir: Optional[Path] = None
        self.untracked_metrics: list[tuple[int, str, float]] = []
        self._untracked_count = 0
        self._last_step = 0
        self._existing_run = self._run_id is not None
        if rank_zero_only.rank == 0:  # only rank 0 talks to the server
            check_tracking_uri(self._tracking_uri)

    @rank_zero_only
    def start_system_metrics(self) -> None:
        """Starts logging MLflow's system metrics into this logger's run, if ``log_system_metrics``
        (once; :meth:`finalize` stops it)."""
        if self.log_system_metrics and self._system_metrics is None and self.tracking_lost is None:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_metrics = SystemMetricsMonitor(self.run_id, resume_logging=self._existing_run, tracking_uri=self._tracking_uri)
            self._system_metrics.start()

    def _untracked_path(self) -> Optional[Path]:
        return None if self.untracked_dir is None else Path(self.untracked_dir) / "untracked_metrics.csv"

    def _lose(self, error: BaseException, what: str) -> None:
        self.tracking_lost = {
            "step": self._last_step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "error": f"{type(error).__name__}: {error}"[:1000],
            "tracking_uri": redact(self._tracking_uri),
            "run_id": self._run_id,
        }
        where = self._untracked_path() or "memory (logger.untracked_metrics)"
        print(
            f"[lit-mhar] WARNING: MLflow tracking LOST at step {self._last_step}: {what} failed "
            f"({self.tracking_lost['error'][:300]}). Training continues; run {self._run_id} at "
            f"{self.tracking_lost['tracking_uri']} receives nothing more. Later metrics go to {where}; "
            "checkpoints record the loss under ['mlflow']['tracking_lost'].",
            file=sys.stderr,
            flush=True,
        )

    def _keep(self, metrics: Mapping[str, float], step: Optional[int]) -> None:
        rows = [(int(step or 0), str(k), float(v)) for k, v in metrics.items() if not isinstance(v, str)]
        self._untracked_count += len(rows)
        path = self._untracked_path()
        if path is None:
            self.untracked_metrics.extend(rows)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "metric", "value"])
            writer.writerows(rows)

    # Every call that reaches the server: a failure ends tracking, never training.

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self._last_step = max(self._last_step, int(step or 0))
        if self.tracking_lost is None:
            try:
                return super().log_metrics(metrics, step)
            except Exception as e:  # noqa: BLE001
                self._lose(e, "logging metrics")
        self._keep(metrics, step)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if self.tracking_lost is not None:
            return  # config.yaml beside the checkpoints has them
        try:
            if self._existing_run:
                params = self._unchanged(params)
            super().log_hyperparams(params)
        except Exception as e:  # noqa: BLE001
            self._lose(e, "logging hyperparameters")

    def _unchanged(self, params: Any) -> dict[str, Any]:
        """``params`` (flattened) without those the existing run holds with another value."""
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

        flat = _flatten_dict(_convert_params(params))
        logged = self.experiment.get_run(self.run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in logged and logged[k] != str(v)[:250])
        if changed:
            print(
                f"[lit-mhar] note: MLflow run {self.run_id} keeps its first value of {', '.join(changed)} "
                "(a param cannot change); this fit's values are in its config.yaml.",
                file=sys.stderr,
                flush=True,
            )
        return {k: v for k, v in flat.items() if k not in changed}

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        if self.tracking_lost is None:
            try:
                super().after_save_checkpoint(checkpoint_callback)
            except Exception as e:  # noqa: BLE001
                self._lose(e, "uploading a checkpoint")

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self._system_metrics is not None:
            monitor, self._system_metrics = self._system_metrics, None
            try:
                monitor.finish()  # its last samples, before the run is closed
            except Exception as e:  # noqa: BLE001 - system metrics never fail a run
                print(f"[lit-mhar] note: MLflow system metrics stopped with an error ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        if self.tracking_lost is None:
            try:
                return super().finalize(status)
            except Exception as e:  # noqa: BLE001
                self._lose(e, "closing the run")
        lost = self.tracking_lost
        print(
            f"[lit-mhar] MLflow run {lost['run_id']} at {lost['tracking_uri']} is INCOMPLETE: tracking was lost at step "
            f"{lost['step']}, and the fit went on to its end ({status}). {self._untracked_count} metric values logged "
            f"after the loss are in {self._untracked_path() or 'logger.untracked_metrics (memory)'}.",
            file=sys.stderr,
            flush=True,
        )
