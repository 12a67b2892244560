"""The ``lit-mhar`` command line, run for real on small real data (stdlib files) in tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lit_mhar.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


def fit_args(data: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--data.data_dir", str(data), "--data.seq_len", "32", "--data.batch_size", "4",
        "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
        "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--data.val_tokens", "256",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp / "runs"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp / 'mlflow.db'}",
        "--trainer.logger.init_args.artifact_location", str(tmp / "artifacts"),
        "--model.routing_log_every_n_steps", "2",
        *extra,
    ]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / config), "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "residual:" in printed and "block_size:" in printed


@pytest.mark.parametrize("value, printed", [("true", "compile: true"), ("model", "compile: model"), ("sublayers", "compile: sublayers"), ("false", "compile: false"),
                                            ("auto", "compile: auto")])
def test_compile_takes_a_layout_or_a_bool_on_the_command_line(value, printed, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / "configs" / "350m" / "block_mhar.yaml"), "--model.compile", value, "--print_config"])
    assert exit_.value.code == 0 and printed in capsys.readouterr().out


def test_gpu_configs_train_compiled(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "350m" / "prenorm.yaml"), "--print_config"])
    assert "  compile: true" in capsys.readouterr().out


def test_an_unknown_compile_layout_is_one_line_naming_the_choices(stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.compile", "whole",
                                      "--trainer.accelerator", "cpu", "--data.data_dir", str(stdlib_corpus)])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "compile='whole'" in line and "'auto', 'sublayers', 'model'" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before any run or folder


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--trainer.accelerator", "cpu"], "trainer.accelerator='cpu'"),
        (["--trainer.accelerator", "cpu", "--model.activation_checkpointing", "true"], "trainer.accelerator='cpu'"),
        (["--trainer.accumulate_grad_batches", "2"], "accumulate_grad_batches=2"),
        (["--trainer.devices", "2"], "trainer.devices="),
        (["--trainer.num_nodes", "2"], "trainer.num_nodes=2"),
        (["--trainer.strategy", "ddp"], "trainer.strategy='ddp'"),
    ],
)
def test_cuda_graph_with_a_trainer_it_cannot_run_on_is_one_line_before_any_work(extra, named, stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # the GPU checks pass as on a one-GPU machine, so each case reaches the setting it names
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.cuda_graph", "true",
                                      "--data.data_dir", str(stdlib_corpus), "--trainer.accelerator", "gpu", "--trainer.devices", "1", *extra])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "model.cuda_graph=True" in line and named in line and "--model.cuda_graph false" in line
    assert named != "trainer.devices=" or "2" in line.split("trainer.devices=")[1][:4]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before any run or folder


def test_cuda_graph_without_a_gpu_names_the_one_remedy_that_works_here(stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.cuda_graph", "true",
                                      "--data.data_dir", str(stdlib_corpus)])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "got trainer.accelerator='auto' (no CUDA GPU here); pass --model.cuda_graph false (this machine has no CUDA GPU)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-1"])
def test_accumulate_grad_batches_below_one_is_one_line_before_any_work(value, stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--trainer.accumulate_grad_batches", value,
                                      "--trainer.accelerator", "cpu", "--data.data_dir", str(stdlib_corpus)])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"trainer.accumulate_grad_batches={int(value)}; need an integer >= 1" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cuda_graph_with_activation_checkpointing_is_refused_by_name(stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.cuda_graph", "true",
                                      "--model.activation_checkpointing", "true", "--trainer.accelerator", "gpu", "--data.data_dir", str(stdlib_corpus)])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "model.activation_checkpointing=True" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in ("fit", "validate", "test", "prepare"):
        assert f"  {verb} " in out


def test_unknown_command_is_refused_with_the_valid_ones(capsys):
    assert main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_bad_model_value_fails_before_training(small_corpus, tmp_path):
    with pytest.raises(ValueError, match="ModelConfig.heads=3 must divide d_model=32"):
        main(fit_args(small_corpus, tmp_path, "--model.config.residual", "attnres", "--model.config.heads", "3"))
    assert not (tmp_path / "runs").exists()


def test_fit_trains_every_variant_family_and_logs_the_run_to_mlflow(small_corpus, tmp_path):
    import mlflow

    main(fit_args(small_corpus, tmp_path, "--model.config.residual", "attnres", "--model.config.heads", "4", "--model.config.block_size", "3"))
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "val/loss", "perf/tokens_per_s", "routing/site_00/max_weight", "routing/site_04/entropy"):
        assert key in run.data.metrics, f"{key} not logged"
    # the model's vocabulary came from the data, not from a default
    vocab = json.loads((small_corpus / "manifest.json").read_text())["vocab_size"]
    assert run.data.params["config/vocab_size"] == str(vocab) and run.data.params["config/heads"] == "4"
    assert run.data.tags["lit_mhar.git_commit"] and run.data.tags["version.torch"] == torch.__version__
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()
    assert "block_size: 3" in config and f"vocab_size: {vocab}" not in config.split("model:")[0]
    ckpts = sorted(p.name for p in (tmp_path / "runs").rglob("*.ckpt"))
    assert len(ckpts) == 2 and "last.ckpt" in ckpts, ckpts  # the best by val/loss and the last
    assert (next((tmp_path / "runs").rglob("last.ckpt")).parent.parent / "config.yaml").is_file()


def test_fit_resumes_from_a_checkpoint_where_it_stopped(small_corpus, tmp_path):
    main(fit_args(small_corpus, tmp_path, "--model.config.residual", "delta", "--model.config.heads", "2", "--trainer.max_steps", "3"))
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    before = ckpt.read_bytes()
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 3
    main(fit_args(small_corpus, tmp_path, "--model.config.residual", "delta", "--model.config.heads", "2", "--ckpt_path", str(ckpt)))
    resumed = [p for p in (tmp_path / "runs").rglob("last.ckpt") if p != ckpt]
    assert len(resumed) == 1, "a resumed fit is a new run with its own checkpoint folder"
    assert torch.load(resumed[0], map_location="cpu", weights_only=False)["global_step"] == 6
    assert ckpt.read_bytes() == before, "the checkpoint resumed from must not be touched"


def test_a_fit_through_main_leaves_the_process_tracking_uri_as_it_was(small_corpus, tmp_path, monkeypatch):
    """Lightning's MLFlowLogger sets MLflow's process-wide tracking URI (and MLFLOW_TRACKING_URI):
    a second main() in the same process must not log into the first one's store."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    main(fit_args(small_corpus, tmp_path, "--trainer.max_steps", "2"))
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert str(tmp_path) not in mlflow.get_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    main(fit_args(small_corpus, tmp_path / "second", "--trainer.max_steps", "2"))
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///elsewhere.db" and not (tmp_path / "elsewhere.db").exists()


def test_fit_refuses_a_resume_that_cannot_continue_the_checkpoint_before_any_work(small_corpus, tmp_path, monkeypatch, capsys):
    """``fit --ckpt_path`` with another data.seq_len or batch_size (the saved data-loader state
    cannot continue), or with trainer.max_steps at or below the checkpoint's step (nothing to
    train): exit 2 naming the value and the checkpoint's, before the run folder of a resume exists;
    the checkpoint's MLflow run stays FINISHED and the checkpoint untouched."""
    import mlflow

    main(fit_args(small_corpus, tmp_path, "--trainer.max_steps", "3"))
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    before = ckpt.read_bytes()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    folders = sorted(p for p in (tmp_path / "runs").rglob("*") if p.is_dir())
    capsys.readouterr()
    cases = [
        (("--data.seq_len", "16"), "data.seq_len=16 differs from the checkpoint's 32"),
        (("--data.batch_size", "2"), "data.batch_size=2 differs from the checkpoint's 4"),
        (("--trainer.max_steps", "3"), "trainer.max_steps=3 is not above the checkpoint's step 3"),
        (("--trainer.max_steps", "2"), "trainer.max_steps=2 is not above the checkpoint's step 3"),
    ]
    for extra, message in cases:
        monkeypatch.setattr(sys, "argv", ["lit-mhar", *fit_args(small_corpus, tmp_path, "--ckpt_path", str(ckpt), *extra)])
        assert main() == 2, extra
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith(f"lit-mhar fit: error: {message} ({ckpt})"), line
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert sorted(p for p in (tmp_path / "runs").rglob("*") if p.is_dir()) == folders, "no resumed-* folder"
    assert ckpt.read_bytes() == before


def test_replaced_model_options_names_what_the_checkpoint_replaces_but_not_the_data_links(capsys):
    """The model options ``--ckpt_path``'s hyperparameters replaced are named (nested keys dotted,
    the asked value then the checkpoint's); the options linked from the data are not; equal ones
    give nothing. A resume with another data seed is refused."""
    from jsonargparse import Namespace

    from lit_mhar.cli.lightning import check_resume, replaced_model_options

    def model(lr=0.002, **config):
        base = {"residual": "prenorm", "heads": 1, "block_size": 1, "vocab_size": None, "seq_len": None}
        return Namespace(lr=lr, config=Namespace(**{**base, **config}))

    saved = model(vocab_size=100, seq_len=32)
    assert replaced_model_options(model(), saved) == []
    assert replaced_model_options(model(lr=0.01, residual="attnres", heads=4), saved) == [
        "lr=0.01 (checkpoint: 0.002)", "config.residual='attnres' (checkpoint: 'prenorm')", "config.heads=4 (checkpoint: 1)",
    ]
    checkpoint = {"global_step": 5, "datamodule_hyper_parameters": {"seq_len": 32, "batch_size": 4, "seed": 42, "num_workers": 0}}
    config = Namespace(data=Namespace(seq_len=32, batch_size=4, seed=7, num_workers=0), trainer=Namespace(max_steps=-1), model=model())
    with pytest.raises(ValueError, match=r"data.seed=7 differs from the checkpoint's 42"):
        check_resume(checkpoint, config, "x.ckpt")
    assert capsys.readouterr().err == ""


def test_fit_trains_hyper_connections(small_corpus, tmp_path):
    import mlflow

    main(fit_args(small_corpus, tmp_path, "--model.config.residual", "hyper", "--model.config.hc_rate", "2", "--model.config.hc_dynamic", "true"))
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["config/hc_rate"] == "2"
    assert "val/loss" in run.data.metrics and not any(k.startswith("routing/") for k in run.data.metrics)


# ----------------------------------------------------------------------------- errors: one line for the user's, tracebacks for ours


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


def test_data_that_cannot_serve_the_fit_is_refused_through_the_cli_before_any_run_exists(tmp_path, monkeypatch, capsys):
    """A val split with no block of seq_len + 1 tokens (the train split has them) and a damaged chunk:
    one line and exit 2 from `lit-mhar fit`, and no MLflow store, run folder or FAILED run left."""
    import random
    import shutil

    from lit_mhar.data import prepare

    words = ["alpha", "beta", "gamma", "delta", "route", "depth", "query", "key", "value", "block"]
    rng = random.Random(0)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):  # ~150 words each: the val split (one document at val_tokens=64) is shorter than 257 tokens
        (docs / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(150)) + "\n")
    data = tmp_path / "data"
    prepare(str(data), source="files", files=[str(p) for p in sorted(docs.glob("*.txt"))], vocab_size=300, val_tokens=64)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")

    def fit(data_dir: Path, *extra: str) -> str:
        monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--data.data_dir", str(data_dir),
                                          "--data.val_tokens", "null", "--trainer.accelerator", "cpu", *extra])
        assert main() == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert sorted(p.name for p in work.iterdir()) == []  # no mlflow.db, no runs/
        return line

    line = fit(data, "--data.seq_len", "256")
    assert "the val split of" in line and "seq_len + 1 = 257 tokens" in line, line
    damaged = tmp_path / "damaged"
    shutil.copytree(data, damaged)
    chunk = next((damaged / "train").glob("chunk-*.bin"))
    chunk.write_bytes(chunk.read_bytes()[:10])
    line = fit(damaged, "--data.seq_len", "32")
    assert f"chunk {chunk} is damaged" in line and "lit-mhar prepare" in line, line


def test_user_error_prints_one_line_and_exits_2_without_a_traceback(small_corpus, tmp_path, monkeypatch, capsys):
    """Run as the command (args from sys.argv): a ModelConfig ValueError raised while LightningCLI instantiates."""
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *fit_args(small_corpus, tmp_path, "--model.config.residual", "attnres", "--model.config.heads", "3")])
    assert main() == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert error_lines(err) == [
        "lit-mhar fit: error: ModelConfig.heads=3 must divide d_model=32; valid: [1, 2, 4, 8, 16, 32] (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv("LIT_MHAR_DEBUG", "1")  # the traceback, on request
    with pytest.raises(ValueError, match="heads=3 must divide"):
        main()


def test_missing_and_existing_paths_are_user_errors(small_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "probe", "--checkpoint", str(tmp_path / "no.ckpt"), "--data_dir", str(small_corpus), "--output_dir", str(tmp_path / "p")])
    assert main() == 2
    assert error_lines(capsys.readouterr().err) == [
        f"lit-mhar probe: error: checkpoint '{tmp_path / 'no.ckpt'}' does not exist (or is not a file); give a lit-mhar checkpoint "
        "file (runs/<experiment id>/<run id>/checkpoints/last.ckpt) (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "prepare", "--output_dir", str(small_corpus), "--source", "files", "--files", '["x.txt"]'])
    assert main() == 2  # FileExistsError: the dataset is there and --overwrite is not given
    err = capsys.readouterr().err
    assert "Traceback" not in err and error_lines(err)[0].startswith(f"lit-mhar prepare: error: output_dir='{small_corpus}' is not empty")


def _torch_shape_mismatch() -> None:
    torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))  # ValueError from inside torch


def _cuda_failure() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize(
    "raise_, error",
    [(_torch_shape_mismatch, ValueError), (lambda: int("x"), ValueError), (_cuda_failure, RuntimeError), (lambda: {}["k"], KeyError)],
    ids=["value-error-from-torch", "value-error-not-from-lit-mhar", "runtime-error", "key-error"],
)
def test_internal_errors_keep_their_traceback(raise_, error, monkeypatch):
    from lit_mhar import cli

    def broken(steps: int = 1) -> None:
        """A command that fails inside, not because of its arguments."""
        raise_()

    monkeypatch.setitem(cli.FUNCTION_VERBS, "probe", (lambda: broken, "fails"))
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "probe"])
    with pytest.raises(error):
        main()


def test_interrupted_command_prints_one_line_and_exits_130(monkeypatch, capsys):
    from lit_mhar import cli

    def interrupted(steps: int = 1) -> None:
        """A command stopped by Ctrl-C (or by SIGTERM, which sweep run turns into KeyboardInterrupt)."""
        raise KeyboardInterrupt("signal SIGTERM")

    monkeypatch.setitem(cli.FUNCTION_VERBS, "probe", (lambda: interrupted, "stops"))
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "probe"])
    assert main() == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "lit-mhar probe: interrupted"
    with pytest.raises(KeyboardInterrupt):
        main(["probe"])  # called from Python: it propagates


def test_called_from_python_errors_propagate(tmp_path):
    with pytest.raises(FileNotFoundError, match="no.ckpt"):
        main(["probe", "--checkpoint", str(tmp_path / "no.ckpt"), "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "p")])


def test_the_console_script_prints_no_traceback(tmp_path):
    """The real entry point, in a subprocess: exit status 2 and one line on stderr."""
    proc = subprocess.run([sys.executable, "-m", "lit_mhar.cli", "probe", "--checkpoint", "no.ckpt", "--data_dir", "no", "--output_dir", "p"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lit-mhar probe: error: checkpoint 'no.ckpt' does not exist (or is not a file); give a lit-mhar checkpoint "
        "file (runs/<experiment id>/<run id>/checkpoints/last.ckpt) (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]


# ----------------------------------------------------------------------------- checks before anything is created, and where a fit saved


def test_gpu_config_without_cuda_is_a_user_error_before_anything_is_created(tmp_path, monkeypatch, capsys):
    """All 20m+ configs set trainer.accelerator: gpu; on a machine without CUDA: one line, exit 2, no run, no folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "fit", "--config", str(ROOT / "configs" / "100m" / "mhar.yaml"),
                                      "--data.data_dir", str(tmp_path / "data")])
    assert main() == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "MisconfigurationException" not in err
    (line,) = error_lines(err)
    assert line.startswith("lit-mhar fit: error: trainer.accelerator='gpu' but no CUDA GPU is available")
    assert "--trainer.accelerator cpu" in line and "configs/debug.yaml" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no dataset, no mlflow.db, no runs/


def test_check_accelerator_passes_cpu_and_auto_and_counts_gpus(monkeypatch):
    from lit_mhar.cli.lightning import check_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for accelerator in ("cpu", "auto", None):
        check_accelerator(accelerator, 1)
    for accelerator in ("gpu", "cuda", "GPU"):
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            check_accelerator(accelerator, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_accelerator("gpu", 1)
    check_accelerator("gpu", "auto")
    check_accelerator("gpu", -1)
    with pytest.raises(ValueError, match="asks for 2 GPU"):
        check_accelerator("gpu", 2)
    with pytest.raises(ValueError, match="asks for 2 GPU"):
        check_accelerator("gpu", "0,1")


def test_missing_ckpt_path_fails_before_the_logger_and_run_folder_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = fit_args(tmp_path / "data", tmp_path, "--ckpt_path", str(tmp_path / "nope.ckpt"))
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        main(args)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "data").exists()
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *args])
    assert main() == 2
    assert error_lines(capsys.readouterr().err) == [
        f"lit-mhar fit: error: ckpt_path='{tmp_path / 'nope.ckpt'}' does not exist (or is not a file); give a checkpoint file "
        "(runs/<experiment id>/<run id>/checkpoints/last.ckpt) or one of last, best, hpc (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]
    from lit_mhar.cli.lightning import check_ckpt_path

    for special in ("last", "best", "hpc", "registry", "registry:model:v1", "s3://bucket/x.ckpt", None, ""):
        check_ckpt_path(special)  # Lightning resolves these itself


def test_fit_refuses_negative_step_and_epoch_limits_before_any_work(tmp_path, monkeypatch, capsys):
    """``--trainer.max_steps -5`` (Lightning refuses it only once the Trainer exists, with a
    traceback): exit 2, one line naming the value and what is valid, before the data, the run
    folder or the MLflow store exist; so is 0 (a fit of no step, which Lightning would run and log as
    an empty run), with its own message. -1 (no limit), positive limits and None (epochs) pass the check."""
    from lit_mhar.cli.lightning import check_trainer_limits

    monkeypatch.chdir(tmp_path)
    for flag, value in (("--trainer.max_steps", "-5"), ("--trainer.max_epochs", "-2")):
        monkeypatch.setattr(sys, "argv", ["lit-mhar", *fit_args(tmp_path / "data", tmp_path, flag, value)])
        assert main() == 2
        name = flag.split(".")[-1]
        unset = " (or unset)" if name == "max_epochs" else ""
        assert error_lines(capsys.readouterr().err) == [
            f"lit-mhar fit: error: trainer.{name}={value} must be -1 (no limit) or an integer >= 1{unset} (LIT_MHAR_DEBUG=1 shows the traceback)"
        ]
        assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "data").exists()
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *fit_args(tmp_path / "data", tmp_path, "--trainer.max_steps", "0")])
    assert main() == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("lit-mhar fit: error: trainer.max_steps=0 would fit no step") and "lit-mhar validate --ckpt_path" in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "data").exists()
    with pytest.raises(ValueError, match="max_epochs=0 would fit no step"):
        check_trainer_limits(5, 0)
    for steps, epochs in ((-1, None), (1, -1), (7, 3)):
        check_trainer_limits(steps, epochs)
    with pytest.raises(ValueError, match="max_steps=None must be"):
        check_trainer_limits(None, None)


def test_fit_refuses_a_checkpoint_folder_that_holds_checkpoints_before_any_work(tmp_path, monkeypatch, capsys):
    """``--checkpoint.dirpath`` holding another run's ``last.ckpt``: exit 2 naming the folder and its
    checkpoints, before the data, the run folder or the MLflow store exist; the checkpoint is untouched.
    A folder holding other files only, or none, is accepted by the check."""
    from lit_mhar.cli.lightning import check_checkpoint_dirpath

    monkeypatch.chdir(tmp_path)
    held = tmp_path / "held"
    held.mkdir()
    (held / "last.ckpt").write_bytes(b"another run")
    args = fit_args(tmp_path / "data", tmp_path, "--checkpoint.dirpath", str(held))
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *args])
    assert main() == 2
    assert error_lines(capsys.readouterr().err) == [
        f"lit-mhar fit: error: checkpoint.dirpath='{held}' already holds checkpoints (last.ckpt); a fit never saves beside "
        "another run's. Give an empty or new folder, or leave --checkpoint.dirpath unset (each run then saves under its own "
        "run folder, runs/<experiment id>/<run id>/checkpoints) (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "data").exists()
    assert (held / "last.ckpt").read_bytes() == b"another run" and sorted(p.name for p in held.iterdir()) == ["last.ckpt"]
    (held / "last.ckpt").unlink()
    (held / "notes.txt").write_text("mine")
    for accepted in (held, tmp_path / "new", None, "s3://bucket/checkpoints"):
        check_checkpoint_dirpath(accepted)
    with pytest.raises(FileExistsError, match=r"checkpoint.dirpath=.*notes.txt' is a file, not a folder"):
        check_checkpoint_dirpath(held / "notes.txt")  # Lightning would fail only at its first save, after training


def test_validate_without_a_checkpoint_says_so_and_names_its_run_after_the_command(small_corpus, tmp_path, capsys):
    """``validate`` with no ``--ckpt_path`` scores a fresh model: a note on stderr, and its MLflow run
    is named ``validate-<preset>-...`` so that it does not pass for a fit."""
    args = fit_args(small_corpus, tmp_path, "--data.val_tokens", "128")
    main(["validate", *args[1:]])
    assert "[lit-mhar] note: validate without --ckpt_path runs a freshly initialised model" in capsys.readouterr().err
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    assert run.info.run_name.startswith("validate-debug-prenorm-H1-S1-"), run.info.run_name


def test_validate_from_a_checkpoint_leaves_it_alone_and_does_not_warn_about_checkpoint_folders(small_corpus, tmp_path, capsys):
    """``validate --ckpt_path`` scores the checkpoint without Lightning's note that the checkpoint
    callback's folder changed (validate saves no checkpoint), leaves the checkpoint untouched, and
    logs a run of its own, ``validate-...``, whose folder holds its ``config.yaml`` and no checkpoint.
    Model options given beside it are replaced by the checkpoint's, and a note on stderr names them."""
    main(fit_args(small_corpus, tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"))
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    before = ckpt.read_bytes()
    saved_lr = torch.load(ckpt, map_location="cpu", weights_only=False)["hyper_parameters"]["lr"]
    args = fit_args(small_corpus, tmp_path, "--data.val_tokens", "128", "--ckpt_path", str(ckpt), "--model.lr", "0.0123")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["validate", *args[1:]])
    notes = [line for line in capsys.readouterr().err.splitlines() if "replaced by the checkpoint's" in line]
    assert notes == [
        "[lit-mhar] note: validate --ckpt_path uses the checkpoint's model; these model options of --config and the command line "
        f"are replaced by the checkpoint's: lr=0.0123 (checkpoint: {saved_lr!r})"
    ]
    assert not [w for w in caught if "dirpath has changed" in str(w.message)], [str(w.message) for w in caught]
    assert ckpt.read_bytes() == before
    assert [p for p in (tmp_path / "runs").rglob("*.ckpt") if p.parent != ckpt.parent] == []
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    (validate,) = [r for r in runs if r.info.run_name.startswith("validate-")]
    assert "val/loss" in validate.data.metrics
    assert (tmp_path / "runs" / validate.info.experiment_id / validate.info.run_id / "config.yaml").is_file()


def test_fit_says_where_it_saved_the_run_and_checkpoints(small_corpus, tmp_path, capsys):
    main(fit_args(small_corpus, tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                  "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[lit-mhar] ")]
    from mlflow import MlflowClient

    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("lit-mhar").experiment_id])
    checkpoints = tmp_path / "runs" / run.info.experiment_id / run.info.run_id / "checkpoints"
    assert lines[0] == f"[lit-mhar] MLflow run {run.info.run_id} in experiment 'lit-mhar' (id {run.info.experiment_id}) at sqlite:///{tmp_path / 'mlflow.db'}"
    assert lines[1].startswith(f"[lit-mhar] checkpoints in {checkpoints} (last: {checkpoints / 'last.ckpt'}; best: {checkpoints}")
    assert (checkpoints / "last.ckpt").is_file()
