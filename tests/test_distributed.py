"""Several devices through Lightning's strategies, as far as CPUs can test them.

DDP runs for real: two processes on CPU with the gloo backend (``lit-mhar fit --trainer.devices 2
--trainer.strategy ddp``), a checkpoint resumed on one process, and the loss-parity driver of
``benchmarks/bench_ddp.py`` (2 processes with global batch B against 1 with batch B). FSDP needs a
GPU in Lightning, so here only its wrap policy, the CLI's mapping of ``--trainer.strategy fsdp``
and the optimizer groups under FSDP's flattened parameters are checked; the GPU runs are in
``benchmarks/bench_ddp.py`` and docs/scaling.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lit_mhar import LM, ModelConfig
from lit_mhar.cli import main
from lit_mhar.module import LitLM, fsdp_strategy
from lit_mhar.routing import RoutingSite

from test_cli import fit_args

ROOT = Path(__file__).resolve().parents[1]
TINY_ROUTED = ["--model.config.residual", "attnres", "--model.config.heads", "2", "--model.config.block_size", "3"]


def _load_bench_ddp():
    spec = importlib.util.spec_from_file_location("bench_ddp", ROOT / "benchmarks" / "bench_ddp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ddp"] = module  # jsonargparse imports the module of the DataModule class it is given
    spec.loader.exec_module(module)
    return module


def test_fsdp_wraps_every_attention_and_mlp_and_keeps_routing_in_the_root():
    strategy = fsdp_strategy(sharding_strategy="FULL_SHARD")
    policy = strategy.kwargs["auto_wrap_policy"]  # Lightning turns the set into a ModuleWrapPolicy
    model = LM(ModelConfig.from_name("debug", residual="delta", heads=2, block_size=3, vocab_size=64, seq_len=16))
    wrapped = {name for name, m in model.named_modules() if isinstance(m, tuple(policy._module_classes))}
    assert wrapped == {f"blocks.{i}.{s}" for i in range(model.cfg.n_layer) for s in ("attn", "mlp")}
    sites = [name for name, m in model.named_modules() if isinstance(m, RoutingSite)]
    assert len(sites) == model.cfg.n_sublayers + 1
    assert not any(site.startswith(w + ".") for site in sites for w in wrapped)  # routing parameters live in the root unit
    assert strategy.kwargs["use_orig_params"]  # LitLM's parameter groups need the original parameters


def test_fit_cli_gives_strategy_fsdp_the_lit_mhar_wrap_policy(small_corpus, tmp_path, monkeypatch):
    from lightning.pytorch.strategies import FSDPStrategy

    from lit_mhar.cli.lightning import LitMharCLI
    from lit_mhar.data import TokenDataModule

    seen = {}
    monkeypatch.setattr(LightningCLI, "_instantiate_trainer", lambda self, config, callbacks: seen.update(config))
    args = fit_args(small_corpus, tmp_path, "--trainer.strategy", "fsdp")[1:]  # without the subcommand: run=False
    LitMharCLI(LitLM, TokenDataModule, run=False, args=args)
    assert isinstance(seen["strategy"], FSDPStrategy)
    assert seen["strategy"].kwargs["auto_wrap_policy"]._module_classes == fsdp_strategy().kwargs["auto_wrap_policy"]._module_classes


def test_weight_decay_groups_do_not_depend_on_flattened_parameters():
    """FSDP (use_orig_params) shows sharded parameters as 1-D views: the groups must not change."""
    lit = LitLM(ModelConfig.from_name("debug", residual="attnres", heads=2, vocab_size=64, seq_len=16))
    lit.trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    groups = [{id(p) for p in g["params"]} for g in lit.configure_optimizers()["optimizer"].param_groups]
    for p in lit.model.parameters():
        p.data = p.data.flatten()
    flat = [{id(p) for p in g["params"]} for g in lit.configure_optimizers()["optimizer"].param_groups]
    assert flat == groups and len(groups) == 3


@pytest.mark.slow
def test_two_process_ddp_fit_on_cpu_logs_one_run_and_resumes_on_one_process(small_corpus, tmp_path):
    from mlflow import MlflowClient

    args = fit_args(small_corpus, tmp_path, *TINY_ROUTED, "--model.activation_checkpointing", "true", "--trainer.max_steps", "3")
    command = [sys.executable, "-m", "lit_mhar.cli", *args, "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output and "distributed_backend=gloo" in output
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lit-mhar").experiment_id
    (run,) = client.search_runs([experiment])  # two processes, one run (rank 0 logs)
    assert run.info.status == "FINISHED"
    assert {"train/loss", "val/loss", "perf/tokens_per_s", "routing/site_01/entropy"} <= set(run.data.metrics)
    assert run.data.params["activation_checkpointing"] == "True"
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 3

    main(fit_args(small_corpus, tmp_path, *TINY_ROUTED, "--ckpt_path", str(ckpt)))  # one process, max_steps 6
    resumed = [p for p in (tmp_path / "runs").rglob("last.ckpt") if p != ckpt]
    assert len(resumed) == 1
    assert torch.load(resumed[0], map_location="cpu", weights_only=False)["global_step"] == 6
    (continued,) = client.search_runs([experiment])  # the resumed fit continues the 2-process fit's run
    assert continued.info.run_id == run.info.run_id and continued.info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert min(steps) < 3 <= max(steps), steps  # metrics of both fits in the one run


@pytest.mark.slow
def test_two_processes_with_half_batches_match_one_process_step_for_step(small_corpus, tmp_path):
    """benchmarks/bench_ddp.py's parity run on CPU: float32, so the losses agree to rounding."""
    bench = _load_bench_ddp()
    steps, global_batch = 4, 8
    batches = bench.fixed_blocks(str(small_corpus), 32, steps * global_batch, 42, tmp_path / "batches.pt")
    extra = ["--data.data_dir", str(small_corpus), "--data.seq_len", "32", "--model.config.d_model", "32", "--model.config.n_layer", "2",
             "--model.config.ffn_dim", "64", *TINY_ROUTED, "--model.activation_checkpointing", "true"]
    config = str(ROOT / "configs" / "debug.yaml")
    common = ["--config", config, "--global_batch", str(global_batch), "--steps", str(steps), "--out", str(tmp_path),
              "--batches", str(batches), "--accelerator", "cpu", "--precision", "32-true"] + [f"--set={k}={v}" for k, v in zip(extra[::2], extra[1::2])]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ddp.py"), "train", "--devices", "2", *common],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    one = bench.train(config, 1, global_batch, steps, str(tmp_path), str(batches), "cpu", "32-true", extra)
    result = bench.compare(one, tmp_path / "parity-2dev.csv")
    assert result["steps"] == steps
    assert result["max_abs_diff"] < 1e-5, result
    assert result["last_loss_1"] < result["first_loss_1"]  # it trained
