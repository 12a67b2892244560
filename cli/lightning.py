"""``lit-mhar fit|validate|test|predict``: LightningCLI over :class:`LitLM` and :class:`TokenDataModule`."""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichModelSummary
from lightning.pytorch.callbacks import ModelSummary as _LightningModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import lit_mhar
from lit_mhar.callbacks import ModelSummary
from lit_mhar.checkpoint import CHECKPOINT_LAYOUT, check_finite_weights, load_checkpoint_file
from lit_mhar.data import TokenDataModule
from lit_mhar.module import LitLM, check_compile
from lit_mhar.tracking import absolute_tracking_uri, check_tracking_uri, log_dataset_inputs, redact, tag_experiment, tracking_uri

DEFAULT_EXPERIMENT = "lit-mhar"


def git_commit() -> str:
    """The git commit of the lit-mhar source tree (with ``-dirty`` for uncommitted changes), or ``unknown``."""
    here = Path(lit_mhar.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_tags() -> dict[str, str]:
    """Versions and provenance stored with every run so it can be reproduced from MLflow alone."""
    import lightning
    import triton

    tags = {
        "lit_mhar.version": lit_mhar.__version__,
        "lit_mhar.git_commit": git_commit(),
        "version.python": platform.python_version(),
        "version.torch": torch.__version__,
        "version.lightning": lightning.__version__,
        "version.triton": triton.__version__,
        "version.cuda": str(torch.version.cuda),
    }
    if torch.cuda.is_available():
        tags["gpu"] = torch.cuda.get_device_name(0)
    return tags


class MLflowSaveConfig(SaveConfigCallback):
    """Stores the full resolved config (``config.yaml`` artifact), versions and git commit in the MLflow run.

    It also tags the run's experiment as model training (the MLflow UI then opens it on its runs),
    logs the prepared dataset's splits as the run's dataset inputs (fit: train and val; validate /
    test: val) and starts the logger's system metrics where they are asked for
    (:mod:`lit_mhar.tracking`).

    The config is also written to the run's folder ``<default_root_dir>/<experiment_id>/<run_id>/``,
    beside its checkpoints, and that folder becomes the logger's ``untracked_dir``
    (:class:`lit_mhar.tracking.MLFlowLogger`). Other loggers get the config file in their log dir as
    LightningCLI does by default.

    Args:
        segment: Set when this fit continues an earlier fit's run (``fit --ckpt_path``): the
            sub-folder of the run's folder, and of its artifacts, that this fit's ``config.yaml``
            goes to, so the first fit's config is kept. The run is marked RUNNING again.
    """

    def __init__(self, *args: Any, segment: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.segment = segment

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                client, run_id = logger.experiment, logger.run_id
                if self.segment:
                    client.update_run(run_id, status="RUNNING")
                for key, value in run_tags().items():
                    client.set_tag(run_id, key, value)
                tag_experiment(client, str(logger.experiment_id))
                datamodule = trainer.datamodule
                if isinstance(datamodule, TokenDataModule):
                    splits = {"train": "training", "val": "evaluation"} if stage == "fit" else {"val": "evaluation"}
                    log_dataset_inputs(client, run_id, datamodule.data_dir, datamodule.manifest, splits)
                if hasattr(logger, "start_system_metrics"):
                    logger.start_system_metrics()
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "config.yaml"
                    path.write_text(text)
                    client.log_artifact(run_id, str(path), self.segment)
                run_dir = Path(trainer.default_root_dir) / str(logger.experiment_id) / str(run_id)
                (run_dir / (self.segment or "")).mkdir(parents=True, exist_ok=True)
                (run_dir / (self.segment or "") / "config.yaml").write_text(text)
                if hasattr(logger, "untracked_dir"):
                    logger.untracked_dir = run_dir


_GPU_ACCELERATORS = ("gpu", "cuda")


def _device_count(devices: Any) -> Optional[int]:
    """The number of devices ``trainer.devices`` asks for; None for ``auto``/-1 or anything not a fixed count."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices if devices > 0 else None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            return int(text) if int(text) > 0 else None
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
    return None


def check_accelerator(accelerator: Any, devices: Any = None) -> None:
    """Raises ValueError when ``trainer.accelerator`` asks for CUDA GPUs this machine does not have.

    ``accelerator`` ``gpu``/``cuda`` with ``torch.cuda.is_available()`` False, or a fixed ``devices``
    count above ``torch.cuda.device_count()``. Anything else (``auto``, ``cpu``, an object) passes.
    Used by the fit CLI before any data or model work, and by ``lit-mhar sweep run`` before any trial.
    """
    if not isinstance(accelerator, str) or accelerator.strip().lower() not in _GPU_ACCELERATORS:
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator!r} but no CUDA GPU is available on this machine "
            "(torch.cuda.is_available() is False); to train on the CPU pass --trainer.accelerator cpu "
            "with a smaller config, e.g. --config configs/debug.yaml"
        )
    wanted, available = _device_count(devices), torch.cuda.device_count()
    if wanted is not None and wanted > available:
        raise ValueError(
            f"trainer.devices={devices!r} asks for {wanted} GPU(s) but {available} is/are visible; "
            f"pass --trainer.devices {available} (or fewer)"
        )


def _setting(config: Any, key: str, default: Any = None) -> Any:
    """``config``'s dotted ``key``: a jsonargparse namespace's own lookup, or a walk down nested dicts."""
    if not isinstance(config, dict):
        return config.get(key, default)
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def check_cuda_graph(config: Any) -> None:
    """Raises ValueError when a fit asks for ``model.cuda_graph`` with a trainer it cannot run on:
    an accelerator other than one CUDA GPU (``cpu``, ``auto`` without a GPU, more than one device
    or node, a strategy other than ``auto``), ``trainer.accumulate_grad_batches`` other than 1, or
    ``model.activation_checkpointing``. ``config`` is the fit CLI's namespace or a nested dict of the
    same keys (a sweep's trial config). Used by the fit CLI before any data or model work and by
    ``lit-mhar sweep run`` before any trial (LitLM checks the devices and the accumulation again
    when the fit starts)."""
    if _setting(config, "model.cuda_graph") is not True:
        return
    accelerator = _setting(config, "trainer.accelerator")
    name = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    strategy = _setting(config, "trainer.strategy", "auto")
    devices = _setting(config, "trainer.devices")
    one_gpu = "pass --trainer.accelerator gpu --trainer.devices 1 --trainer.num_nodes 1 --trainer.strategy auto"
    why = hint = None
    if name not in (*_GPU_ACCELERATORS, "auto") or (name == "auto" and not torch.cuda.is_available()):
        why, hint = f"trainer.accelerator={accelerator!r}" + (" (no CUDA GPU here)" if name == "auto" else ""), one_gpu
    elif (_device_count(devices) or torch.cuda.device_count()) != 1:
        why, hint = f"trainer.devices={devices!r}", one_gpu
    elif _setting(config, "trainer.num_nodes", 1) not in (1, None):
        why, hint = f"trainer.num_nodes={_setting(config, 'trainer.num_nodes')!r}", one_gpu
    elif not (isinstance(strategy, str) and strategy.strip().lower() == "auto"):
        why, hint = f"trainer.strategy={strategy!r}", one_gpu
    elif _setting(config, "trainer.accumulate_grad_batches", 1) not in (1, None):
        why = f"trainer.accumulate_grad_batches={_setting(config, 'trainer.accumulate_grad_batches')!r} (the captured backward overwrites gradients)"
        hint = "pass --trainer.accumulate_grad_batches 1 with a larger --data.batch_size"
    elif _setting(config, "model.activation_checkpointing"):
        why = "model.activation_checkpointing=True (its recomputation saves the RNG state, which a capture cannot read)"
        hint = "pass --model.activation_checkpointing false"
    if why:
        remedy = "pass --model.cuda_graph false (this machine has no CUDA GPU)" if not torch.cuda.is_available() else f"{hint}, or --model.cuda_graph false"
        raise ValueError(
            f"model.cuda_graph=True needs one CUDA GPU (strategy auto, one node), no gradient accumulation and no activation "
            f"checkpointing; got {why}; {remedy}"
        )


def _model_context(config: Any, subcommand: str, checkpoint: Optional[dict]) -> tuple[Optional[int], str]:
    """The longest sequence the model of this command can take and where that comes from: the
    checkpoint's ``seq_len`` for validate / test / predict ``--ckpt_path`` and fit's
    ``--model.init_from``, else the preset's context (``ModelConfig.name``); None for what is not
    known here (a fit resumed from ``--ckpt_path``: :func:`check_resume` holds it to the checkpoint's)."""
    from lit_mhar.config import PRESETS

    if subcommand == "fit" and config.get("ckpt_path"):
        return None, ""
    source, where = None, ""
    if subcommand != "fit" and checkpoint is not None:
        source, where = checkpoint, f"the checkpoint's ({config['ckpt_path']})"
    init = config.get("model.init_from") if subcommand == "fit" else None
    if init and Path(str(init)).is_file():
        source, where = load_checkpoint_file(str(init)), f"the checkpoint's it starts from ({init})"
    if source is not None:
        saved = (source.get("hyper_parameters") or {}).get("config")
        seq_len = saved.get("seq_len") if isinstance(saved, dict) else getattr(saved, "seq_len", None)
        return (seq_len, where) if isinstance(seq_len, int) else (None, "")
    name = config.get("model.config.name")
    if name in PRESETS:
        return PRESETS[name]["seq_len"], f"the {name} preset's (ModelConfig.name)"
    return None, ""


def check_seq_len(config: Any, subcommand: str, checkpoint: Optional[dict] = None) -> None:
    """Raises ValueError, before any work, for a ``data.seq_len`` above the model's context
    (:func:`_model_context`) or above the longest block the split this command reads can serve
    (:func:`lit_mhar.data.longest_block`: ``train`` for fit, ``val`` for validate / test). A
    dataset not prepared yet is checked when it is."""
    from lit_mhar.config import PRESETS
    from lit_mhar.data import MANIFEST_NAME, longest_block

    seq_len = config.get("data.seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        return
    context, where = _model_context(config, subcommand, checkpoint)
    if context is not None and seq_len > context:
        others = ", ".join(f"{n} {p['seq_len']}" for n, p in PRESETS.items() if p["seq_len"] >= seq_len)
        raise ValueError(
            f"data.seq_len={seq_len} is longer than the model's context of {context} tokens, {where}; give --data.seq_len "
            f"{context} or less" + (f", or a preset with a longer context (--model.config.name: {others})" if others and "preset" in where else "")
        )
    split = {"fit": "train", "validate": "val", "test": "val"}.get(subcommand)
    data_dir = config.get("data.data_dir")
    if split is None or not data_dir or not (Path(str(data_dir)) / MANIFEST_NAME).is_file():
        return
    longest = longest_block(str(data_dir), split)
    if seq_len > longest:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than any block the {split} split of {data_dir} holds: its largest chunk has "
            f"{longest + 1} tokens, and a block (seq_len + 1 tokens) never spans chunks. Give --data.seq_len {longest} or less, "
            "or prepare the data again with a larger --chunk_bytes (lit-mhar prepare)"
        )


def check_memory(config: Any) -> None:
    """Refuses a fit whose training step cannot fit in the memory of its device (estimated,
    :func:`lit_mhar.memory.training_bytes`), before any work; warns (stderr) where it may not.

    On the CPU the estimate is the path that runs (eager, float32): more than the available RAM is
    refused, more than 80 % of it gets a warning. On a GPU it is an upper bound (the fused kernels
    and compiled models keep less): more than twice the device's free memory is refused, more than
    its free memory gets a warning. Nothing is checked where the model or the device is not known yet.

    Raises:
        ValueError: naming the estimate, what is available and what to lower.
    """
    from lit_mhar.config import ModelConfig
    from lit_mhar.data import MANIFEST_NAME
    from lit_mhar.memory import available_bytes, training_bytes

    seq_len, batch = config.get("data.seq_len"), config.get("data.batch_size")
    data_dir = config.get("data.data_dir")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seq_len, batch)):
        return
    manifest = Path(str(data_dir)) / MANIFEST_NAME if data_dir else None
    vocab = json.loads(manifest.read_text()).get("vocab_size") if manifest is not None and manifest.is_file() else None
    init = config.get("model.init_from")
    try:
        if init and Path(str(init)).is_file():
            saved = load_checkpoint_file(str(init))["hyper_parameters"]["config"]
            fields = saved if isinstance(saved, dict) else saved.to_dict()
        else:
            fields = _flat_dict(config.get("model.config"))
        cfg = ModelConfig(**{**fields, "seq_len": seq_len, **({"vocab_size": vocab} if vocab else {})})
    except (ValueError, TypeError, KeyError):
        return  # an invalid model is refused by name where it is built
    accelerator = str(config.get("trainer.accelerator") or "auto").lower()
    gpu = accelerator in _GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if gpu and torch.cuda.is_available() else torch.device("cpu")
    free = available_bytes(device)
    if free is None:
        return
    precision = str(config.get("trainer.precision") or "")
    needed = training_bytes(cfg, batch, mixed_precision="16" in precision, activation_checkpointing=bool(config.get("model.activation_checkpointing")))
    refuse, warn = (free, 0.8 * free) if device.type == "cpu" else (2 * free, free)
    if needed <= warn:
        return
    what = (
        f"a training step of {batch} x {seq_len} tokens of this model ({cfg.name} {cfg.residual}, d={cfg.d_model}, L={cfg.n_layer}) "
        f"needs about {needed / 2**30:.1f} GiB (estimated), and {'this GPU has' if device.type == 'cuda' else 'this machine has'} "
        f"{free / 2**30:.1f} GiB free"
    )
    remedy = "lower --data.batch_size or --data.seq_len, or pass --model.activation_checkpointing true"
    if needed > refuse:
        raise ValueError(f"{what}: it would run out of memory; {remedy}")
    print(f"[lit-mhar] warning: {what}; it may run out of memory ({remedy})", file=sys.stderr, flush=True)


def _flat_dict(value: Any) -> dict:
    """A jsonargparse namespace (or dict) of ModelConfig's fields as a plain dict."""
    if value is None:
        return {}
    return dict(value.items()) if hasattr(value, "items") else dict(vars(value))


def check_accumulate_grad_batches(value: Any) -> None:
    """Raises ValueError unless ``trainer.accumulate_grad_batches`` is unset or an integer >= 1
    (Lightning fails on 0 only inside its loop, after the data and the run exist). Used by the fit CLI
    before any work."""
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"trainer.accumulate_grad_batches={value!r}; need an integer >= 1 (1: no accumulation)")


def check_limit_val_batches(value: Any) -> None:
    """Raises ValueError for a ``trainer.limit_val_batches`` other than 1.0 (score the whole validation
    set) or 0 (no validation): a number or fraction of batches would make ``val/loss`` depend on the
    batch size and the device count. ``data.val_tokens`` is how to score less. Used by the CLI before any work."""
    if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and value in (0, 1.0)):
        return
    raise ValueError(
        f"trainer.limit_val_batches={value!r}: validation scores a fixed set of tokens, so that one checkpoint gets one "
        "val/loss at any batch size or device count; remove it (or give 1.0, or 0 for no validation) and set "
        "--data.val_tokens N to score the first N tokens of the val split"
    )


def _is_special_ckpt_path(ckpt_path: str) -> bool:
    """Whether Lightning resolves ``ckpt_path`` itself: ``last``, ``best``, ``hpc``, ``registry[:...]``, or a URL."""
    text = ckpt_path.strip()
    if text in ("last", "best", "hpc") or "://" in text:
        return True
    return text.lower() == "registry" or text.lower().startswith("registry:")


def check_trainer_limits(max_steps: Any, max_epochs: Any) -> None:
    """Raises ValueError for a ``trainer.max_steps`` or ``trainer.max_epochs`` that is not -1 (no
    limit) or an integer >= 1 (max_epochs may be None too): Lightning refuses the negative ones
    only once the Trainer is built, and takes 0 as a fit that trains nothing and still opens an
    MLflow run and a run folder. Used by the fit CLI before any data or model work."""
    for name, value, unset in (("max_steps", max_steps, False), ("max_epochs", max_epochs, True)):
        if value is None and unset:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"trainer.{name}={value!r} must be -1 (no limit) or an integer >= 1" + (" (or unset)" if unset else ""))
        if value == 0:
            raise ValueError(
                f"trainer.{name}=0 would fit no step (and log an empty run); give -1 (no limit) or an integer >= 1"
                + (" (or leave it unset)" if unset else "") + ", or evaluate a checkpoint with `lit-mhar validate --ckpt_path CKPT`"
            )


def check_ckpt_path(ckpt_path: Any) -> None:
    """Raises FileNotFoundError when ``--ckpt_path`` names a local file that does not exist."""
    if not ckpt_path or not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = os.fspath(ckpt_path)
    if _is_special_ckpt_path(text):
        return
    if not Path(text).is_file():  # as Lightning reads it (no ~ expansion)
        raise FileNotFoundError(
            f"ckpt_path={text!r} does not exist (or is not a file); give a checkpoint file "
            f"({CHECKPOINT_LAYOUT}/last.ckpt) or one of last, best, hpc"
        )


def check_checkpoint_dirpath(dirpath: Any) -> None:
    """Raises FileExistsError when fit's ``--checkpoint.dirpath`` already holds checkpoints
    (``*.ckpt``): Lightning would save beside them (``last-v1.ckpt``), so the folder's ``last.ckpt``
    would stay another run's and a resume from it would silently continue that run; and when it
    names an existing file (Lightning would fail only at the first save, after training)."""
    if not dirpath or not isinstance(dirpath, (str, os.PathLike)) or "://" in os.fspath(dirpath):
        return
    folder = Path(os.fspath(dirpath))
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(
            f"checkpoint.dirpath={os.fspath(dirpath)!r} is a file, not a folder; give a new or empty folder for the "
            f"checkpoints, or leave --checkpoint.dirpath unset ({CHECKPOINT_LAYOUT})"
        )
    found = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise FileExistsError(
            f"checkpoint.dirpath={os.fspath(dirpath)!r} already holds checkpoints ({shown}); a fit never saves beside "
            "another run's. Give an empty or new folder, or leave --checkpoint.dirpath unset (each run then saves under "
            f"its own run folder, {CHECKPOINT_LAYOUT})"
        )


_FIT_LOCKS: list[Optional[Any]] = []  # the checkpoint-folder locks fits in this process hold (run_lightning releases them)


def lock_checkpoint_dirpath(dirpath: Any) -> Optional[Any]:
    """Takes the lock of fit's ``--checkpoint.dirpath`` (a ``filelock.FileLock`` on the hidden file
    ``.DIR.lock`` beside the folder) for the whole fit, so two fits started together into one
    folder cannot both save there; then checks the folder again (:func:`check_checkpoint_dirpath`:
    the other fit may have saved meanwhile). None for an unset or remote ``dirpath``. The lock is
    the operating system's: it goes with a process that dies, however it dies.

    Raises:
        FileExistsError: another fit holds the lock, or the folder holds checkpoints.
    """
    if not dirpath or not isinstance(dirpath, (str, os.PathLike)) or "://" in os.fspath(dirpath):
        return None
    from filelock import FileLock, Timeout

    folder = Path(os.fspath(dirpath)).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder.with_name(f".{folder.name}.lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise FileExistsError(
            f"checkpoint.dirpath={os.fspath(dirpath)!r} is in use: another lit-mhar fit is saving its checkpoints there "
            f"now (it holds {lock.lock_file}). Give another folder, wait for that fit to end, or leave --checkpoint.dirpath "
            f"unset (each run then saves under its own run folder, {CHECKPOINT_LAYOUT})"
        ) from None
    try:
        check_checkpoint_dirpath(dirpath)
    except BaseException:
        lock.release()
        raise
    return lock


def _local_checkpoint(ckpt_path: Any) -> Optional[dict]:
    """``--ckpt_path`` loaded (memory-mapped) where it names a local file, its model weights checked
    finite; None for none and for what Lightning resolves itself (``last``, ``best``, a remote path).

    Raises:
        UnreadableCheckpoint: (a ValueError) a truncated or damaged file, or not a checkpoint.
        NonFiniteCheckpoint: (a ValueError) weights holding NaN or infinity (a fit that diverged).
    """
    if not ckpt_path or not isinstance(ckpt_path, (str, os.PathLike)) or not Path(os.fspath(ckpt_path)).is_file():
        return None
    checkpoint = load_checkpoint_file(os.fspath(ckpt_path), weights_only=False)  # as Lightning reads it
    check_finite_weights(checkpoint.get("state_dict") or {}, os.fspath(ckpt_path))
    return checkpoint


# What a resumed fit's data stream must share with the checkpoint's (the litdata loader's saved
# state is only valid for the same blocks, batches, shuffling and workers; TokenDataModule).
RESUME_DATA_KEYS = ("seq_len", "batch_size", "seed", "num_workers")


def check_resume(checkpoint: dict, config: Any, ckpt_path: str) -> None:
    """Checks ``fit --ckpt_path`` against the checkpoint before any work.

    Args:
        checkpoint: The loaded checkpoint (``torch.load``; tensors need not be read).
        config: The fit command's parsed configuration (``data.*``, ``trainer.max_steps``, ``model.config``).
        ckpt_path: The checkpoint's path, for the messages.

    Raises:
        ValueError: a ``data.seq_len``, ``batch_size``, ``seed`` or ``num_workers`` other than the
            checkpoint's (the saved data-loader state cannot continue: litdata would fail after
            the model is built and the MLflow run reopened), or a ``trainer.max_steps`` (not -1)
            at or below the checkpoint's step (the fit would train nothing).
    """
    saved = checkpoint.get("datamodule_hyper_parameters") or {}
    for key in RESUME_DATA_KEYS:
        given, was = config.get(f"data.{key}"), saved.get(key)
        if key in saved and given is not None and given != was:
            raise ValueError(
                f"data.{key}={given!r} differs from the checkpoint's {was!r} ({ckpt_path}): a resumed fit continues the "
                f"checkpoint's data stream, which needs the same {', '.join(RESUME_DATA_KEYS)}. Give --data.{key} {was}, "
                "or start a new fit from its weights (--model.init_from CKPT, no --ckpt_path)"
            )
    step, max_steps = checkpoint.get("global_step"), config.get("trainer.max_steps", -1)
    if isinstance(step, int) and isinstance(max_steps, int) and max_steps != -1 and max_steps <= step:
        raise ValueError(
            f"trainer.max_steps={max_steps} is not above the checkpoint's step {step} ({ckpt_path}): the resumed fit would "
            f"train no step. Give --trainer.max_steps above {step} (it counts from the start of the first fit), or -1"
        )


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested Namespace / dict (jsonargparse's parsed ``model``)."""
    items = value.items() if isinstance(value, dict) else (vars(value).items() if hasattr(value, "__dict__") else None)
    if items is None:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def replaced_model_options(before: Any, after: Any) -> list[str]:
    """``"key=asked (checkpoint: saved)"`` for every model option ``--ckpt_path``'s hyperparameters
    replaced (``before``/``after``: the parsed ``model`` namespaces), leaving out those that flow
    from the data (``config.vocab_size``, ``config.seq_len``)."""
    linked = {"config.vocab_size", "config.seq_len"}
    was, now = _flat(before), _flat(after)
    return [f"{k}={was[k]!r} (checkpoint: {now[k]!r})" for k in was if k in now and k not in linked and was[k] != now[k]]


def utc_stamp() -> str:
    """The current UTC time as ``20261130T070312Z``."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _mlflow_init_args(config: Any) -> Any:
    """The ``init_args`` of the configured logger if it is one MLflow logger, else None."""
    logger = config.get("trainer.logger")
    class_path = logger.get("class_path") if hasattr(logger, "get") else None
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # jsonargparse reports it when it instantiates the logger
    if not (isinstance(cls, type) and issubclass(cls, MLFlowLogger)):
        return None
    if logger.get("init_args") is None:
        logger["init_args"] = type(logger)()
    return logger["init_args"]


class LitMharCLI(LightningCLI):
    """LightningCLI with the data -> model links and lit-mhar's defaults (MLflow, bf16 on GPU).

    Before any data or model work, with an MLflow logger (the default:
    :class:`lit_mhar.tracking.MLFlowLogger`):

    * an ``http(s)://`` tracking server is checked: :class:`lit_mhar.tracking.TrackingUnavailable`
      (naming the URI) if it does not answer;
    * ``fit --ckpt_path CKPT`` without a ``run_id`` continues the MLflow run the checkpoint records
      (``checkpoint["mlflow"]``, written by ``LitLM``) when it logs to the same tracking URI:
      metrics go on in that run, and this fit's checkpoints and ``config.yaml`` go to
      ``<run folder>/resumed-<UTC time>/`` (the checkpoint resumed from is never overwritten);
    * a new run without a ``run_name`` is named ``<preset>-<residual>-H<heads>-S<block_size>-<UTC time>``,
      prefixed ``validate-``, ``test-`` or ``predict-`` for those commands (MLflow's random names
      repeat under a fixed seed: ``seed_everything`` seeds them);
    * ``fit --checkpoint.dirpath`` holding checkpoints is refused (:func:`check_checkpoint_dirpath`),
      as is one another fit is saving into now (:func:`lock_checkpoint_dirpath`: held until the fit ends),
      as is a ``trainer.max_steps`` or ``max_epochs`` of 0 or below -1 (:func:`check_trainer_limits`), and a
      resume whose data settings or ``max_steps`` cannot continue the checkpoint (:func:`check_resume`),
      and ``validate`` / ``test`` / ``predict`` without ``--ckpt_path`` print a note that they run a fresh model.
    """

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's (a private hook: the one place where the parsed options and the
        checkpoint's both exist): with ``--ckpt_path`` the model's options come from the checkpoint's saved
        hyperparameters. A note on stderr names those of ``--config`` and the command line that this
        replaced (the run's ``config.yaml`` records what ran). The checkpoint is read and checked
        first (:func:`_local_checkpoint`): a truncated file or non-finite weights are one line."""
        sub = self.config.get("subcommand")
        # read first: Lightning's own read of a truncated file is a traceback without its name
        self._checkpoint = _local_checkpoint(self.config[sub].get("ckpt_path")) if sub else None
        before = self.config[sub].get("model") if sub else None
        before = before.clone() if hasattr(before, "clone") else before
        super()._parse_ckpt_path()
        if before is None:
            return
        replaced = replaced_model_options(before, self.config[sub].get("model"))
        if replaced:
            print(
                f"[lit-mhar] note: {sub} --ckpt_path uses the checkpoint's model; these model options of --config and the "
                f"command line are replaced by the checkpoint's: {', '.join(replaced)}",
                file=sys.stderr,
                flush=True,
            )

    def before_instantiate_classes(self) -> None:
        self._check_before_work()
        if self.subcommand == "fit":
            config = self.config[self.subcommand]
            # after the checks: a resumed fit's folder is known only once its run is found
            _FIT_LOCKS.append(lock_checkpoint_dirpath(config.get("checkpoint.dirpath")))

    def _check_before_work(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_accelerator(config.get("trainer.accelerator"), config.get("trainer.devices"))
        check_ckpt_path(config.get("ckpt_path"))
        if config.get("model.compile") is not None:
            check_compile(config.get("model.compile"))
        if self.subcommand in ("fit", "validate", "test"):
            check_limit_val_batches(config.get("trainer.limit_val_batches"))
        if self.subcommand == "fit":
            check_accumulate_grad_batches(config.get("trainer.accumulate_grad_batches"))
            check_cuda_graph(config)
            check_trainer_limits(config.get("trainer.max_steps", -1), config.get("trainer.max_epochs"))
            check_checkpoint_dirpath(config.get("checkpoint.dirpath"))
        resumed = getattr(self, "_checkpoint", None)  # --ckpt_path, read and checked by _parse_ckpt_path
        check_seq_len(config, self.subcommand, resumed)
        if self.subcommand == "fit":
            check_memory(config)
        if self.subcommand == "fit" and resumed is not None:
            check_resume(resumed, config, os.fspath(config["ckpt_path"]))
        elif self.subcommand in ("validate", "test", "predict") and not config.get("ckpt_path"):
            print(f"[lit-mhar] note: {self.subcommand} without --ckpt_path runs a freshly initialised model", file=sys.stderr, flush=True)
        init = _mlflow_init_args(config)
        if init is None:
            return
        if not init.get("tracking_uri"):
            init["tracking_uri"] = tracking_uri()
        check_tracking_uri(init["tracking_uri"])
        if self.subcommand == "fit" and resumed is not None and not init.get("run_id"):
            self._continue_run(config, init, resumed)
        if not init.get("run_id") and not init.get("run_name"):
            model = config.get("model.config")
            parts = [model.get(k) for k in ("name", "residual", "heads", "block_size")] if model is not None else [None] * 4
            if None not in parts:
                command = f"{self.subcommand}-" if self.subcommand in ("validate", "test", "predict") else ""
                init["run_name"] = f"{command}{parts[0]}-{parts[1]}-H{parts[2]}-S{parts[3]}-{utc_stamp()}"
            else:
                init["run_name"] = f"lit-mhar-{utc_stamp()}"

    def _continue_run(self, config: Any, init: Any, checkpoint: dict) -> None:
        """Points the logger at the MLflow run of ``config.ckpt_path``, loaded as ``checkpoint`` (see
        the class docstring)."""
        ckpt = Path(str(config["ckpt_path"]))
        record = checkpoint.get("mlflow") or {}
        if not record.get("run_id"):
            return
        here = absolute_tracking_uri(init["tracking_uri"])
        if record.get("tracking_uri", "").rstrip("/") != here.rstrip("/"):
            print(
                f"[lit-mhar] note: {ckpt} belongs to MLflow run {record['run_id']} in {redact(record.get('tracking_uri', '?'))}; "
                f"this fit logs to {redact(here)}, so it starts a new run there (set MLFLOW_TRACKING_URI or "
                "--trainer.logger.init_args.tracking_uri to that store to continue the run).",
                file=sys.stderr,
                flush=True,
            )
            return
        init["run_id"] = record["run_id"]
        segment = f"resumed-{utc_stamp()}"
        run_dir = Path(config.get("trainer.default_root_dir") or ".") / str(record["experiment_id"]) / record["run_id"]
        if config.get("checkpoint") is not None and config.get("checkpoint.dirpath") is None:
            config["checkpoint.dirpath"] = str(run_dir / segment / "checkpoints")
        if isinstance(self.save_config_callback, type) and issubclass(self.save_config_callback, MLflowSaveConfig):
            self.save_config_kwargs["segment"] = segment

    def after_fit(self) -> None:
        """Says where the fit saved its results (global rank 0): the MLflow run and the checkpoint folder."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or not trainer.is_global_zero:
            return
        for line in saved_lines(trainer):
            print(f"[lit-mhar] {line}", flush=True)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Known only once the data is prepared: the tokenizer's vocabulary and the sequence length.
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.config.seq_len", apply_on="instantiate")
        # `--checkpoint.*`: keep the best checkpoint by validation loss and always the last one.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/loss",
                "checkpoint.mode": "min",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": True,
                "trainer.logger": {
                    "class_path": "lit_mhar.tracking.MLFlowLogger",
                    "init_args": {"experiment_name": DEFAULT_EXPERIMENT, "tracking_uri": tracking_uri()},
                },
                "trainer.precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
                "trainer.default_root_dir": "runs",
            }
        )


    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        # `--trainer.strategy fsdp`: lit-mhar's wrap policy (lit_mhar.module.fsdp_strategy), not Lightning's
        # default of one unit for the whole model
        if self._get(self.config_init, "trainer", default={}).get("strategy") == "fsdp" and "strategy" not in kwargs:
            from lit_mhar.module import fsdp_strategy

            kwargs["strategy"] = fsdp_strategy()
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand in ("validate", "test", "predict") or (self.subcommand == "fit" and config.get("ckpt_path")):
            # validate & co. save no checkpoint, and a resumed fit saves into a folder of its own
            # (resumed-*): the checkpoint callback's note that its folder is not the checkpoint's is noise
            warnings.filterwarnings("ignore", message="The dirpath has changed from", category=UserWarning)
        precision = str(config.get("trainer.precision") or "")
        if "bf16" in precision or "16-mixed" in precision:
            # under mixed precision the matmuls run in 16 bits: float32 matmul precision does not apply
            _QUIET.add(_MATMUL_PRECISION_TIP)
        trainer = super().instantiate_trainer(**kwargs)
        # Lightning's default summary prints FLOPs as 0 for a module without an example input
        for i, callback in enumerate(getattr(trainer, "callbacks", ())):
            if type(callback) in (_LightningModelSummary, RichModelSummary):
                trainer.callbacks[i] = ModelSummary(max_depth=callback._max_depth)
        return trainer


# Known, harmless output of Lightning and its dependencies at every fit, matched by message.
_HARMLESS_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's own call of a torch API
    # litdata's StreamingDataset divides itself among loader workers, so its length holds for any number
    r"Your `IterableDataset` has `__len__` defined",
)
_LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"  # an advertisement, at every fit
_MATMUL_PRECISION_TIP = "torch.set_float32_matmul_precision"


class _Quiet(logging.Filter):
    """Drops the log records of Lightning's that hold one of a set of known, harmless messages."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: set[str] = set()

    def add(self, message: str) -> None:
        self.messages.add(message)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(m in text for m in self.messages)


_QUIET = _Quiet()
# where Lightning's rank_zero_info records come from (Lightning's and Fabric's module of that name)
_LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def saved_lines(trainer: L.Trainer) -> list[str]:
    """One line per place a finished fit saved something: its MLflow run, its checkpoints."""
    lines = []
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            run_id = getattr(logger, "_run_id", None)
            if run_id is None:
                continue
            experiment = getattr(logger, "_experiment_name", None)
            experiment_id = getattr(logger, "_experiment_id", None)
            where = f"experiment {experiment!r} (id {experiment_id})" if experiment_id is not None else f"experiment {experiment!r}"
            uri = redact(str(getattr(logger, "_tracking_uri", None) or tracking_uri()))
            lines.append(f"MLflow run {run_id} in {where} at {uri}")
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    if dirpath:
        paths = [("last", getattr(callback, "last_model_path", "")), ("best", getattr(callback, "best_model_path", ""))]
        named = "; ".join(f"{name}: {path}" for name, path in paths if path)
        lines.append(f"checkpoints in {dirpath}" + (f" ({named})" if named else " (none saved)"))
    return lines


def run_lightning(args: Optional[list[str]] = None) -> LitMharCLI:
    """Run a LightningCLI subcommand (``fit``, ``validate``, ``test``, ``predict``) with ``args``.

    ``args`` None reads ``sys.argv``. Raises :class:`lit_mhar.tracking.TrackingUnavailable` before
    any data or model work when the MLflow tracking server does not answer.
    """
    held = len(_FIT_LOCKS)
    _QUIET.messages = {_LITLOGGER_TIP}
    loggers = [logging.getLogger(name) for name in _LIGHTNING_INFO_LOGGERS]
    for logger in loggers:
        logger.addFilter(_QUIET)
    try:
        with warnings.catch_warnings():
            # explicit args are this function's purpose (tests, sweep trials), not a mistake to warn about
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended", category=UserWarning)
            for message in _HARMLESS_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            return LitMharCLI(
                LitLM,
                TokenDataModule,
                save_config_callback=MLflowSaveConfig,
                save_config_kwargs={"save_to_log_dir": False},
                args=args,
            )
    finally:
        for logger in loggers:
            logger.removeFilter(_QUIET)
        while len(_FIT_LOCKS) > held:  # this command's checkpoint-folder lock, however it ended
            lock = _FIT_LOCKS.pop()
            if lock is not None:
                lock.release()
