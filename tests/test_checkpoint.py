"""lit_mhar.checkpoint: every command that reads a checkpoint refuses a damaged or diverged one in one
line, and training does not depend on the analysis verbs (probe, convert, generate)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from lit_mhar.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory) -> dict:
    """An MHAR (H = 2) model trained for 3 steps through ``lit-mhar fit`` (no MLflow), a copy of its
    checkpoint with one NaN weight, and a copy cut to a fifth of its bytes (a copy that did not finish)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    assert main([
        "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--data.data_dir", str(small_corpus), "--data.seq_len", "32", "--data.batch_size", "4",
        "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
        "--model.config.residual", "attnres", "--model.config.heads", "2",
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp / "runs"),
    ]) == 0  # fmt: skip
    (ckpt,) = (tmp / "runs").rglob("last.ckpt")
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    checkpoint["state_dict"]["model.blocks.1.mlp.up_proj.weight"][0, 0] = float("nan")
    nan = tmp / "diverged.ckpt"
    torch.save(checkpoint, nan)
    truncated = tmp / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 5])
    return {"tmp": tmp, "ckpt": ckpt, "nan": nan, "truncated": truncated, "data": small_corpus}


def run(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """``lit-mhar ARGV`` as the command (sys.argv): its exit status and stderr's lines."""
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *argv])
    status = main()
    return status, capsys.readouterr().err.splitlines()


def readers(trained: dict, ckpt: Path) -> dict[str, list[str]]:
    """Every command that reads a checkpoint, reading ``ckpt``."""
    tmp, data = trained["tmp"], str(trained["data"])
    lightning = ["--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", data, "--data.seq_len", "32", "--data.batch_size", "4",
                 "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp / "runs2")]
    return {
        "fit --ckpt_path": ["fit", *lightning, "--trainer.max_steps", "6", "--ckpt_path", str(ckpt)],
        "fit --model.init_from": ["fit", *lightning, "--model.config.residual", "attnres", "--model.config.heads", "2",
                                  "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
                                  "--trainer.max_steps", "1", "--model.init_from", str(ckpt)],
        "validate": ["validate", *lightning, "--ckpt_path", str(ckpt)],
        "test": ["test", *lightning, "--ckpt_path", str(ckpt)],
        "generate": ["generate", "--ckpt", str(ckpt), "--prompt", "def", "--max_new_tokens", "2", "--tokenizer", str(trained["data"])],
        "probe": ["probe", "--checkpoint", str(ckpt), "--data_dir", data, "--output_dir", str(tmp / "probe"), "--mlflow", "false"],
        "convert": ["convert", "--source", str(ckpt), "--output_dir", str(tmp / "converted")],
    }  # fmt: skip


@pytest.mark.parametrize("command", ["fit --ckpt_path", "fit --model.init_from", "validate", "test", "generate", "probe"])
def test_a_checkpoint_with_non_finite_weights_is_refused_in_one_line(trained, command, monkeypatch, capsys):
    """validate / test on a diverged checkpoint printed val/loss nan with exit 0; generate gave a traceback."""
    status, err = run(readers(trained, trained["nan"])[command], monkeypatch, capsys)
    errors = [line for line in err if "error:" in line]
    assert status == 2 and len(errors) == 1, err[-5:]
    assert "weights are not finite" in errors[0] and "blocks.1.mlp.up_proj.weight'" in errors[0] and "diverged" in errors[0], errors[0]
    assert "Traceback" not in "\n".join(err)
    assert not (trained["tmp"] / "runs2").exists() and not (trained["tmp"] / "probe").exists()  # before any work


@pytest.mark.parametrize("command", ["fit --ckpt_path", "fit --model.init_from", "validate", "test", "generate", "probe", "convert"])
def test_a_truncated_checkpoint_is_one_line_naming_the_file(trained, command, monkeypatch, capsys):
    """fit --ckpt_path on a truncated checkpoint gave a 22-line traceback without the file's name."""
    status, err = run(readers(trained, trained["truncated"])[command], monkeypatch, capsys)
    errors = [line for line in err if "error:" in line]
    assert status == 2 and len(errors) == 1, err[-5:]
    assert "truncated.ckpt" in errors[0] and ("truncated" in errors[0].split("truncated.ckpt", 1)[1] or command == "generate"), errors[0]
    assert "Traceback" not in "\n".join(err)
    assert not (trained["tmp"] / "runs2").exists() and not (trained["tmp"] / "converted").exists()


def test_the_checkpoint_itself_still_reads(trained):
    from lit_mhar.checkpoint import read_checkpoint

    cfg, weights, _ = read_checkpoint(trained["ckpt"])
    assert cfg.heads == 2 and all(torch.isfinite(w).all() for w in weights.values())


# ----------------------------------------------------------------------------- layers

TRAINING = ("lit_mhar/module.py", "lit_mhar/callbacks.py", "lit_mhar/data.py", "lit_mhar/checkpoint.py", "lit_mhar/tracking.py", "cli/lightning.py")
ANALYSIS = {"lit_mhar.probe", "lit_mhar.convert", "lit_mhar.generate"}


def imported(path: Path) -> set[str]:
    """Every lit_mhar module ``path`` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("lit_mhar")}


@pytest.mark.parametrize("path", TRAINING)
def test_training_does_not_import_the_analysis_verbs(path):
    assert not imported(ROOT / path) & ANALYSIS, f"{path} imports {sorted(imported(ROOT / path) & ANALYSIS)}"


def test_convert_and_generate_do_not_import_each_other():
    assert "lit_mhar.generate" not in imported(ROOT / "lit_mhar" / "convert.py")
    assert "lit_mhar.convert" not in imported(ROOT / "lit_mhar" / "generate.py")


# ----------------------------------------------------------------------------- checkpoint folders


@pytest.mark.slow
def test_a_second_fit_into_a_checkpoint_folder_in_use_is_refused(small_corpus, tmp_path, monkeypatch, capsys):
    """Two fits started together on one --checkpoint.dirpath both ran (the second wrote last-v1.ckpt):
    the second is refused (exit 2) while the first runs, before any work."""
    import subprocess
    import time

    folder = tmp_path / "ckpts"
    common = ["--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", str(small_corpus), "--data.seq_len", "32",
              "--data.batch_size", "4", "--model.config.d_model", "32", "--model.config.n_layer", "1", "--model.config.ffn_dim", "32",
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--checkpoint.dirpath", str(folder)]  # fmt: skip
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, "-m", "lit_mhar.cli", "fit", *common, "--trainer.max_steps", "100000",
                                  "--trainer.val_check_interval", "100000", "--trainer.default_root_dir", str(tmp_path / "first")],
                                 stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)  # fmt: skip
    try:
        deadline = time.time() + 120
        while "Trainable params" not in log.read_text() and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, log.read_text()[-2000:]
        monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", *common, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "second")])
        assert main() == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
        assert f"checkpoint.dirpath='{folder}' is in use: another lit-mhar fit is saving its checkpoints there" in line, line
        assert not (tmp_path / "second").exists() and not list(folder.glob("*.ckpt"))
    finally:
        first.kill()
        first.wait()
    # the lock went with the killed fit: the folder is free again
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", *common, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "third")])
    assert main() == 0
    assert sorted(p.name for p in folder.glob("*.ckpt"))[-1] == "last.ckpt"
