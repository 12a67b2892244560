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

import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from jsonargparse.typing import Path_fr

from lit_mhar.sweeps.fitconfig import resolve_fit_config
from lit_mhar.sweeps.mlflow_runs import _client, _close_parent, _experiment_id, _tracking_uri
from lit_mhar.sweeps.objective import Context
from lit_mhar.sweeps.space import (
    Objective,
    Pruner,
    Sampler,
    SearchSpace,
    SweepSpec,
    Tracking,
    compose_trial_config,
    deep_merge,
    point_scale,
    token_budget,
)
from lit_mhar.sweeps.storage import ATTR, HOST, absolute_sqlite, journal_path, open_storage, say
from lit_mhar.sweeps.worker import _work_in_process, work
from lit_mhar.tracking import redact

_STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# Re-exported: the storage helpers other modules and the report import from here.
__all__ = ["run", "open_storage", "absolute_sqlite", "journal_path", "resolve_fit_config", "ATTR", "say"]


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


def _create_parent(client: Any, experiment_id: str, name: str, ctx_args: dict[str, Any], spec: SweepSpec, sweep_text: str) -> str:
    """A new MLflow parent run for study ``name`` with its settings and ``sweep.yaml``; returns its id."""
    from mlflow.entities import Param

    from lit_mhar.cli.lightning import run_tags

    parent = client.create_run(
        experiment_id,
        run_name=name,
        tags={"optuna.study_name": name, "optuna.storage": redact(ctx_args["storage"]), "lit_mhar.sweep": "parent", **run_tags()},
    )
    client.log_batch(parent.info.run_id, params=[
        Param("sampler", spec.sampler.name), Param("pruner", ctx_args["pruner"].name),
        Param("objective.tokens", str(spec.objective.tokens)), Param("objective.evals", str(spec.objective.evals)),
        Param("objective.metric", spec.objective.metric), Param("grid_size", str(len(spec.space.grid()) if spec.sampler.name == "grid" else "")),
    ])
    client.log_text(parent.info.run_id, sweep_text, "sweep.yaml")
    return parent.info.run_id


def _given_uri(tracking: Tracking) -> str:
    """The tracking URI as given (a relative sqlite path stays relative: stored in a study, it resolves where the study resumes)."""
    return tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def _check_corpora(name: str, stored: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ValueError when a dataset the study trained on has changed (another ``data_digest``)."""
    for data_dir, info in current.items():
        old = stored.get(data_dir)
        if old is not None and old["digest"] != info["digest"]:
            raise ValueError(
                f"study {name!r} trained on {data_dir} with data digest {old['digest']}, but the dataset there now has digest "
                f"{info['digest']}: its trials would not be comparable. Rebuild the corpus as it was (lit-mhar prepare with the same "
                "files, --source, --vocab_size, --val_tokens, --shuffle_seed and chunk_bytes, or the same --tokenizer) or start a new study "
                "(nothing was changed)"
            )


def _init_study(ctx_args: dict[str, Any], spec: SweepSpec, tracking: Tracking, storage: Any, sweep_text: str) -> tuple[Any, str, str, str, bool]:
    """Creates the study (and its MLflow parent run) or loads it and checks it is the same sweep on the same data.

    What the study stores holds no absolute path: the output folder and a sqlite tracking store as
    given (relative to the folder the command runs in), the datasets by their ``data_dir`` and
    digest. So a study's storage file carried to another machine resumes there once the corpus is
    rebuilt identically; when the stored MLflow parent run is not in the tracking store there, a new
    parent run is made and recorded.

    Returns ``(study, tracking_uri, experiment_id, parent_run_id, created)``.

    Raises:
        ValueError: the study exists but is not a lit-mhar sweep, was made by a different sweep, or
            trained on a dataset that has changed since.
    """
    import optuna
    from mlflow.exceptions import MlflowException

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
        parent_id = _create_parent(client, experiment_id, name, ctx_args, spec, sweep_text)
        study.set_user_attr(ATTR + "mlflow", {"tracking_uri": _given_uri(tracking), "experiment_id": experiment_id, "parent_run_id": parent_id})
        study.set_user_attr(ATTR + "output_dir", str(ctx_args["output_dir"]))
        study.set_user_attr(ATTR + "corpora", ctx_args["corpora"])
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
    _check_corpora(name, study.user_attrs.get(ATTR + "corpora") or {}, ctx_args["corpora"])
    info = dict(study.user_attrs[ATTR + "mlflow"])
    tracking_uri = absolute_sqlite(info["tracking_uri"]) if info["tracking_uri"].startswith("sqlite") else info["tracking_uri"]
    if tracking.tracking_uri and _tracking_uri(tracking) != tracking_uri:
        say(name, f"note: this study logs to {info['tracking_uri']} (set when it was created), not {_tracking_uri(tracking)}")
    client = _client(tracking_uri)
    try:
        client.get_run(info["parent_run_id"])
    except MlflowException:  # a fresh tracking store (the study's storage moved to another machine)
        info["experiment_id"] = _experiment_id(client, tracking)
        old, info["parent_run_id"] = info["parent_run_id"], _create_parent(client, info["experiment_id"], name, ctx_args, spec, sweep_text)
        study.set_user_attr(ATTR + "mlflow", info)
        say(name, f"note: MLflow parent run {old} is not in {redact(tracking_uri)}; its trials continue under new parent run {info['parent_run_id']}")
    return study, tracking_uri, info["experiment_id"], info["parent_run_id"], False


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


def _gpus(workers: int, trials_per_gpu: int = 1) -> list[Optional[str]]:
    """The CUDA_VISIBLE_DEVICES value of each worker process: ``trials_per_gpu`` processes on each of
    ``workers`` GPUs, or none set on a machine without GPUs (and for one GPU: the visible default)."""
    if workers == 1:
        return [None] * trials_per_gpu
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return [None] * workers
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or [str(i) for i in range(count)]
    if workers > len(visible):
        raise ValueError(f"workers={workers} but only {len(visible)} GPU(s) are visible; one worker trains on one GPU")
    return [gpu for gpu in visible[:workers] for _ in range(trials_per_gpu)]


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
    max_passes: float = 1.0,
    trials_per_gpu: int = 1,
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
        max_passes: The most passes over its training split a trial may make: a sweep whose
            budget would repeat the data more is refused before any trial starts (0: no check).
            Validation loss after repeated data measures memorisation as much as learning.
        trials_per_gpu: Trials that train at once on each GPU (``workers`` GPUs, or the one
            visible), for small models that leave a GPU mostly idle. Their tokens/s are then
            shared: the report says so and gives no throughput ratios from them.

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
    if isinstance(trials_per_gpu, bool) or not isinstance(trials_per_gpu, int) or trials_per_gpu < 1:
        raise ValueError(f"trials_per_gpu={trials_per_gpu!r} must be an integer >= 1")
    if isinstance(max_passes, bool) or not isinstance(max_passes, (int, float)) or not max_passes >= 0:
        raise ValueError(f"max_passes={max_passes!r} must be a number >= 0 (passes over the training split a trial may make; 0: no check)")
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
        try:
            loaded = yaml.safe_load(path.read_text()) if path.is_file() else None
        except yaml.MarkedYAMLError as e:
            where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
            raise ValueError(f"base_config={str(base_config)!r} ({path}): not valid YAML: {e.problem}{where}; correct the file") from None
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
        corpora = _corpora(study, resolved_configs)
        check_passes(resolved_configs, objective, corpora, max_passes)
    except ValueError:
        if new_journal and journal.is_file() and journal.stat().st_size == 0:
            journal.unlink()  # the empty journal file opening the storage created: a refused sweep leaves nothing
        raise

    sweep_text = yaml.safe_dump(
        {"study": study, "space": space, "base": merged, "per_scale": per_scale, "sampler": asdict(sampler), "pruner": asdict(pruner),
         "objective": asdict(objective), "storage": redact(storage_url), "mlflow": asdict(mlflow)}, sort_keys=False)
    study_obj, tracking_uri, experiment_id, parent_id, created = _init_study(
        {"study": study, "storage": storage_url, "pruner": pruner, "output_dir": output_dir, "corpora": corpora},
        spec, mlflow, optuna_storage, sweep_text,
    )
    if tracking_uri != _tracking_uri(mlflow):
        check_tracking_uri(tracking_uri)  # a resumed study logs where it was created
    ctx = Context(
        study=study, storage=storage_url, spec=spec, pruner=pruner, objective=objective, tracking_uri=tracking_uri,
        experiment_id=experiment_id, parent_run_id=parent_id, output_dir=str(Path(output_dir).absolute()),
        trial_timeout=trial_timeout, retry_failed=retry_failed, retry_before=len(study_obj.trials), keep_checkpoints=keep_checkpoints,
        heartbeat_interval=heartbeat_interval if not storage_url.startswith("journal:") else None, grace_period=grace_period, grid=grid,
        corpora=corpora, trials_per_gpu=trials_per_gpu,
    )
    size = f"{len(grid)} grid points" if grid else f"{sampler.n_trials} {sampler.name} trials"
    say(study, f"{'created' if created else 'resuming'} study in {redact(storage_url)}: {size}, {objective.tokens:,} tokens each; "
               f"MLflow {tracking_uri} parent run {parent_id}")
    client = _client(tracking_uri)
    client.update_run(parent_id, status="RUNNING")
    status = "FINISHED"
    procs: list[Any] = []
    try:
        gpus = _gpus(workers, trials_per_gpu)
        if len(gpus) == 1:
            work(ctx)
        else:
            import multiprocessing

            spawn = multiprocessing.get_context("spawn")
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
        # each worker stops its trial and records it as interrupted before the study is read below
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=60)
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


def _corpora(study: str, resolved_configs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The datasets the trials read, keyed by data_dir as the sweep file gives it: each prepared first when it
    is a default corpus that is missing (so its time is no trial's), then read whole and checked against its
    manifest's digest (:func:`lit_mhar.data.verify_dataset`). Returns data_dir -> ``{"digest", "train_tokens", "source"}``.

    Raises:
        ValueError: a dataset whose chunks are damaged or differ from its manifest's digest.
        FileNotFoundError: a dataset that is missing and is not a default corpus.
    """
    from lit_mhar.data import TokenDataModule, default_source, verify_dataset

    corpora: dict[str, dict[str, Any]] = {}
    for resolved in resolved_configs:
        data = resolved["data"]
        given = str(data["data_dir"])
        if given in corpora:
            continue
        directory = Path(given).expanduser().absolute()
        if not (directory / "manifest.json").is_file():
            source = default_source(directory, data.get("prepare_if_missing"))
            if source is None:
                raise FileNotFoundError(f"data.data_dir={given!r}: no dataset there; create it with lit-mhar prepare --output_dir {given} ...")
            say(study, f"preparing the {source} corpus into {directory} before the first trial")
            TokenDataModule(data_dir=str(directory), seq_len=data["seq_len"], batch_size=data["batch_size"], prepare_if_missing=True)
        manifest = verify_dataset(directory)
        corpora[given] = {"digest": manifest["data_digest"], "train_tokens": int(manifest["splits"]["train"]["tokens"]),
                          "source": manifest["source"]}
    return corpora


def passes(budget_tokens: int, seq_len: int, train_tokens: int) -> float:
    """Passes over a training split of ``train_tokens`` that a trial of ``budget_tokens`` makes: each sequence of
    ``seq_len`` predicted tokens reads a block of ``seq_len + 1``."""
    return budget_tokens * (seq_len + 1) / seq_len / max(1, train_tokens)


def check_passes(resolved_configs: list[dict[str, Any]], objective: Objective, corpora: dict[str, dict[str, Any]], max_passes: float) -> None:
    """Refuses a sweep whose trials would pass over their training split more than ``max_passes`` times (0: no check).

    Raises:
        ValueError: naming the corpus, its training tokens, the budget, the passes and what to change.
    """
    if not max_passes:
        return
    for resolved in resolved_configs:
        data = resolved["data"]
        corpus = corpora[str(data["data_dir"])]
        budget = token_budget(objective, resolved)
        n = passes(budget.tokens, int(data["seq_len"]), corpus["train_tokens"])
        if n > max_passes:
            raise ValueError(
                f"a trial of objective.tokens={objective.tokens:,} ({budget.tokens:,} tokens in whole steps) would pass over the "
                f"training split of {data['data_dir']} ({corpus['source']} corpus, {corpus['train_tokens']:,} tokens) {n:.2f} times, "
                f"more than --max_passes {max_passes:g}: its validation loss would measure memorisation as much as learning. "
                "Lower objective.tokens, prepare a larger corpus (lit-mhar prepare --source python --output_dir data/python), "
                "or raise --max_passes (0 turns this check off)"
            )
