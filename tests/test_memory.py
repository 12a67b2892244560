"""Before any work, fit refuses a seq_len the model or the data cannot take, and a step that cannot fit in memory."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_mhar import LM, ModelConfig
from lit_mhar.cli import main
from lit_mhar.memory import activation_elements_per_token, training_bytes

ROOT = Path(__file__).resolve().parents[1]


def fit(data: Path, tmp: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", str(data), "--data.batch_size", "4",
            "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp / "runs"), "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp / 'mlflow.db'}", *extra]  # fmt: skip


def refused(argv: list[str], tmp: Path, monkeypatch, capsys) -> str:
    """The one error line of ``lit-mhar ARGV``, which must exit 2 before any run or folder exists."""
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *argv])
    assert main() == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert not (tmp / "runs").exists() and not (tmp / "mlflow.db").exists(), "refused after the run was created"
    return line


def test_a_seq_len_above_the_presets_context_is_refused_before_any_work(small_corpus, tmp_path, monkeypatch, capsys):
    """--data.seq_len 100000 on the debug model grew to 24 GB until the OOM killer ended it."""
    line = refused(fit(small_corpus, tmp_path, "--data.seq_len", "100000"), tmp_path, monkeypatch, capsys)
    assert "data.seq_len=100000 is longer than the model's context of 256 tokens, the debug preset's (ModelConfig.name); give --data.seq_len 256 or less" in line


def test_a_seq_len_above_the_checkpoints_context_is_refused(small_corpus, tmp_path, monkeypatch, capsys):
    assert main(fit(small_corpus, tmp_path, "--data.seq_len", "32", "--trainer.logger", "false")) == 0
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    later = tmp_path / "later"
    validate = ["validate", *fit(small_corpus, later, "--data.seq_len", "64", "--ckpt_path", str(ckpt))[1:]]
    at = validate.index("--trainer.max_steps")
    del validate[at : at + 2]
    line = refused(validate, later, monkeypatch, capsys)
    assert f"data.seq_len=64 is longer than the model's context of 32 tokens, the checkpoint's ({ckpt}); give --data.seq_len 32 or less" in line
    line = refused(fit(small_corpus, later, "--data.seq_len", "64", "--model.init_from", str(ckpt)), later, monkeypatch, capsys)
    assert "context of 32 tokens, the checkpoint's it starts from" in line


@pytest.fixture(scope="module")
def small_chunks(tmp_path_factory) -> Path:
    """A dataset cut into 4 KB chunks (about 2000 tokens each)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("chunks") / "data"
    files = [str(stdlib / n) for n in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py")]
    assert main(["prepare", "--output_dir", str(out), "--source", "files", "--vocab_size", "300", "--val_fraction", "0.3",
                 "--chunk_bytes", "4KB", "--files", json.dumps(files)]) == 0  # fmt: skip
    return out


def test_a_seq_len_above_the_datas_longest_block_is_refused_before_the_run_exists(small_chunks, tmp_path, monkeypatch, capsys):
    from lit_mhar.data import longest_block

    longest = longest_block(small_chunks, "train")
    assert 1000 < longest < 2047
    line = refused(fit(small_chunks, tmp_path, "--model.config.name", "100m", "--data.seq_len", str(longest + 1)), tmp_path, monkeypatch, capsys)
    assert f"data.seq_len={longest + 1} is longer than any block the train split of {small_chunks} holds: its largest chunk has {longest + 1} tokens" in line
    assert f"Give --data.seq_len {longest} or less, or prepare the data again with a larger --chunk_bytes" in line


def test_a_step_that_cannot_fit_in_memory_is_refused_and_a_tight_one_warned(small_corpus, tmp_path, monkeypatch, capsys):
    import lit_mhar.memory

    args = fit(small_corpus, tmp_path, "--data.seq_len", "32", "--data.batch_size", "64", "--trainer.accelerator", "cpu")
    cfg = ModelConfig.from_name("debug", d_model=32, n_layer=2, ffn_dim=64, vocab_size=400, seq_len=32)
    needed = training_bytes(cfg, 64)
    monkeypatch.setattr(lit_mhar.memory, "available_bytes", lambda device: needed // 2)
    line = refused(args, tmp_path, monkeypatch, capsys)
    assert f"a training step of 64 x 32 tokens of this model (debug prenorm, d=32, L=2) needs about {needed / 2**30:.1f} GiB (estimated)" in line
    assert "it would run out of memory; lower --data.batch_size or --data.seq_len, or pass --model.activation_checkpointing true" in line
    monkeypatch.setattr(lit_mhar.memory, "available_bytes", lambda device: int(needed * 1.1))
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *args])
    assert main() == 0
    assert "[lit-mhar] warning: a training step of 64 x 32 tokens" in capsys.readouterr().err


def saved_elements_per_token(cfg: ModelConfig, batch: int = 2) -> float:
    """What the eager training step saves for its backward pass, measured (float32 elements per token)."""
    model = LM(cfg)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
    return sum(saved.values()) / 4 / tokens.numel()


@pytest.mark.parametrize("residual, routed, n_layer", [("prenorm", {}, 2), ("prenorm", {}, 8), ("attnres", {"heads": 4}, 8), ("attnres", {"heads": 4, "block_size": 4}, 8),
                                                      ("delta", {"heads": 2}, 4), ("hyper", {}, 4)])  # fmt: skip
def test_the_activation_estimate_is_within_a_fifth_of_what_the_step_saves(residual, routed, n_layer):
    cfg = ModelConfig.from_name("debug", residual=residual, n_layer=n_layer, vocab_size=256, seq_len=64, **routed)
    measured = saved_elements_per_token(cfg) + cfg.vocab_size  # + the logits' gradient at the backward's peak
    assert abs(activation_elements_per_token(cfg) / measured - 1) < 0.2
