"""``lit-mhar fit|validate|test|predict``: LightningCLI over :class:`LitLM` and :class:`TokenDataModule`."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import lit_mhar
from lit_mhar.data import TokenDataModule
from lit_mhar.module import LitLM

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "lit-mhar"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a local sqlite store ``./mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


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

    The config is also written beside the run's checkpoints. Other loggers get the config file in
    their log dir as LightningCLI does by default.
    """

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                for key, value in run_tags().items():
                    logger.experiment.set_tag(logger.run_id, key, value)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "config.yaml"
                    path.write_text(text)
                    logger.experiment.log_artifact(logger.run_id, str(path))
                run_dir = Path(trainer.default_root_dir) / str(logger.experiment_id) / str(logger.run_id)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.yaml").write_text(text)


class LitMharCLI(LightningCLI):
    """LightningCLI with the data -> model links and lit-mhar's defaults (MLflow, bf16 on GPU)."""

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
                    "class_path": "lightning.pytorch.loggers.MLFlowLogger",
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
        return super().instantiate_trainer(**kwargs)


def run_lightning(args: Optional[list[str]] = None) -> LitMharCLI:
    """Run a LightningCLI subcommand (``fit``, ``validate``, ``test``, ``predict``) with ``args``."""
    return LitMharCLI(
        LitLM,
        TokenDataModule,
        save_config_callback=MLflowSaveConfig,
        save_config_kwargs={"save_to_log_dir": False},
        args=args,
    )
