"""What ``lit-mhar fit`` prints: the useful lines, without known, harmless noise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NOISE = (
    "litlogger",  # Lightning's advertisement
    "is deprecated",  # Lightning's own use of a deprecated torch API
    "`IterableDataset` has `__len__` defined",  # litdata divides its length among workers itself
    "Total Flops",  # 0: Lightning counts FLOPs only with an example input
    "| FLOPs",
    "The dirpath has changed",  # a resumed fit saves into a folder of its own, on purpose
    "Cannot dispatch to fused implementation",
)


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_mhar.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_fit_and_its_resume_print_no_known_noise_and_keep_the_useful_lines(small_corpus, tmp_path):
    """A fit printed Lightning's litlogger tip, a deprecation warning, `Total FLOPs: 0`, an
    `IterableDataset __len__` warning, and on resume "dirpath has changed"."""
    args = ["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", str(small_corpus), "--data.seq_len", "32",
            "--data.batch_size", "4", "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
            "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path / "runs"),
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]  # fmt: skip
    first = command(*args, "--trainer.max_steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    resumed = command(*args, "--trainer.max_steps", "6", "--ckpt_path", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for run in (first, resumed):
        printed = run.stdout + run.stderr
        assert not [n for n in NOISE if n in printed], printed
        assert "Trainable params" in printed and "[lit-mhar] MLflow run" in printed and "[lit-mhar] checkpoints in" in printed
        (flops,) = [line for line in printed.splitlines() if "Training FLOPs per token" in line]
        assert float(flops.split()[0]) > 0, flops
    assert "Restored all states from the checkpoint" in resumed.stderr
