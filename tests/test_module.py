"""LitLM: optimiser groups, schedule and checkpoint keys."""

import lightning as L
import pytest
import torch

from lit_mhar import ModelConfig
from lit_mhar.module import LitLM


def module(**kw) -> LitLM:
    return LitLM(ModelConfig.from_name("debug", residual="delta", heads=2, vocab_size=64, seq_len=16), **kw)


def attach(m: LitLM, **trainer_kw) -> None:
    m.trainer = L.Trainer(max_steps=100, logger=False, enable_checkpointing=False, enable_progress_bar=False, **trainer_kw)


@pytest.mark.parametrize("compile", [True, "sublayers", "model"])
def test_compiled_module_keeps_the_eager_checkpoint_keys(compile):
    assert list(module(compile=compile).state_dict()) == list(module().state_dict())


@pytest.mark.parametrize(
    "residual, compile, whole, sublayers",
    [
        ("delta", False, False, False), ("delta", True, False, True), ("delta", "sublayers", False, True), ("delta", "model", True, False),
        ("prenorm", True, True, False), ("hyper", True, True, False), ("attnres", True, False, True), ("prenorm", "sublayers", False, True),
        ("prenorm", "auto", True, False), ("attnres", "auto", False, True),
    ],
)
def test_compile_true_compiles_the_whole_model_unless_it_routes_then_its_sublayers(residual, compile, whole, sublayers):
    routed = dict(heads=2) if residual in ("attnres", "delta") else {}
    lm = LitLM(ModelConfig.from_name("debug", residual=residual, vocab_size=64, seq_len=16, **routed), compile=compile).model
    assert (lm._compiled_call_impl is not None) is whole
    compiled = [m._compiled_call_impl is not None for b in lm.blocks for m in (b.attn_norm, b.attn, b.mlp_norm, b.mlp)]
    assert compiled == [sublayers] * len(compiled) and (lm.norm._compiled_call_impl is not None) is sublayers
    assert all(s._compiled_call_impl is None for s in lm.routing_sites())  # a routing site is never compiled on its own


def test_compile_for_training_rejects_an_unknown_layout_by_name():
    lm = module().model
    with pytest.raises(ValueError, match="layout='blocks'.*valid"):
        lm.compile_for_training("blocks")
    assert lm._compiled_call_impl is None and lm.blocks[0].attn._compiled_call_impl is None


@pytest.mark.parametrize("bad", ["whole", "True", "", 1, 0, None])
def test_compile_rejects_an_unknown_value_by_name(bad):
    with pytest.raises(ValueError, match=f"compile={bad!r}.*valid"):
        module(compile=bad)


def test_routing_parameters_train_at_their_own_learning_rate_without_weight_decay():
    m = module(lr=1e-3, routing_lr_multiplier=100.0)
    attach(m)
    opt = m.configure_optimizers()["optimizer"]
    routing = {id(p) for p in m.model.routing_parameters()}
    (group,) = [g for g in opt.param_groups if any(id(p) in routing for p in g["params"])]
    assert {id(p) for p in group["params"]} == routing
    assert group["lr"] == pytest.approx(1e-3 * 100 / m.hparams.warmup_steps)  # first warm-up step
    assert group["weight_decay"] == 0.0
    decayed = [g for g in opt.param_groups if g["weight_decay"] > 0]
    assert decayed and all(p.dim() == 2 for g in decayed for p in g["params"])


def test_schedule_warms_up_then_decays_to_min_lr_ratio():
    m = module(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    attach(m)
    conf = m.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_clipped_runs_use_an_optimizer_lightning_can_clip():
    from lightning.pytorch.plugins.precision.amp import _optimizer_handles_unscaling

    # pretend the module sits on a GPU, where the fused AdamW kernel is chosen when allowed
    clipped, unclipped = module(), module()
    attach(clipped, gradient_clip_val=1.0)
    attach(unclipped)
    clipped._device = unclipped._device = torch.device("cuda", 0)
    assert not _optimizer_handles_unscaling(clipped.configure_optimizers()["optimizer"])
    assert _optimizer_handles_unscaling(unclipped.configure_optimizers()["optimizer"])


@pytest.mark.parametrize("bad", [dict(lr=0.0), dict(min_lr_ratio=1.5), dict(warmup_steps=-1), dict(routing_lr_multiplier=0.0)])
def test_bad_hyperparameters_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        module(**bad)


def test_hyper_connection_weights_are_not_weight_decayed():
    """[A_m | A_r] starts as [e_l | I]: decay would pull the copies' identity path towards zero."""
    m = LitLM(ModelConfig.from_name("debug", residual="hyper", hc_rate=4, vocab_size=64, seq_len=16))
    attach(m)
    opt = m.configure_optimizers()["optimizer"]
    hc = {id(p) for name, p in m.model.named_parameters() if "_hc." in name}
    assert hc and hc == {id(p) for p in m.model.routing_parameters()}
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if hc & {id(p) for p in g["params"]})


@pytest.mark.parametrize("global_zero", [True, False], ids=["rank0", "rank1"])
def test_checkpoint_records_the_mlflow_run_on_rank_zero_only(global_zero, tmp_path, monkeypatch):
    """A resumed multi-process fit gives every rank's logger the run id; off rank 0 its experiment is a no-op,
    so the checkpoint hook must not read it there (it raised AttributeError on rank 1)."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import MLFlowLogger
    from lightning.pytorch.utilities import rank_zero_only

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    run_id = logger.run_id  # creates the run (as rank 0 did in the first fit)
    monkeypatch.setattr(rank_zero_only, "rank", 0 if global_zero else 1)
    resumed = MLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=run_id)
    module = LitLM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32))
    module._trainer = SimpleNamespace(loggers=[resumed], is_global_zero=global_zero)
    checkpoint = {"hyper_parameters": {}}
    module.on_save_checkpoint(checkpoint)
    if global_zero:
        assert checkpoint["mlflow"]["run_id"] == run_id and checkpoint["mlflow"]["tracking_uri"].startswith("sqlite:////")
    else:
        assert "mlflow" not in checkpoint


def test_throughput_is_logged_once_per_window_never_repeated(tmp_path):
    """perf/tokens_per_s is measured over windows of log_every_n_steps batches that validation restarts;
    each window's value must reach the logger once, at the step it was measured, not again at a later
    logging step (Lightning re-sends the last value logged with self.log at every logging step)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    m = LitLM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=64, seq_len=16), warmup_steps=1)
    rows = torch.randint(0, 64, (64, 17))
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    trainer = L.Trainer(max_steps=14, log_every_n_steps=2, val_check_interval=5, limit_val_batches=1, logger=CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(m, loader, loader)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = [(int(r["step"]), float(r["perf/tokens_per_s"])) for r in csv.DictReader(f) if r.get("perf/tokens_per_s")]
    assert len(logged) >= 3, logged
    values = [v for _, v in logged]
    assert len(set(values)) == len(values), f"a window's throughput was logged more than once: {logged}"


def test_the_resolved_model_shape_is_logged_as_hyperparameters(tmp_path):
    """Preset fields are None in the hyperparameters as given; runs must show the shape they trained."""
    from lightning.pytorch.loggers import CSVLogger

    m = LitLM(ModelConfig.from_name("debug", residual="attnres", heads=2, vocab_size=64, seq_len=16))
    loader = torch.utils.data.DataLoader(torch.randint(0, 64, (4, 17)), batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(m, loader)
    import yaml

    logged = yaml.unsafe_load(next(tmp_path.rglob("hparams.yaml")).read_text())  # CSVLogger writes tuples as python/tuple
    assert logged["model/d_model"] == m.config.d_model and logged["model/n_layer"] == m.config.n_layer
    assert logged["model/heads"] == 2 and logged["model/residual"] == "attnres" and logged["model/vocab_size"] == 64


def _throughput_steps(tmp_path, samples: int, **trainer_kw) -> list[int]:
    """Fits a one-layer model on ``samples`` random sequences (batches of 2, one validation batch)
    with a CSVLogger in ``tmp_path``; the steps at which ``perf/tokens_per_s`` was logged."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    m = LitLM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=64, seq_len=16), warmup_steps=1)
    loader = torch.utils.data.DataLoader(torch.randint(0, 64, (samples, 17)), batch_size=2)
    trainer = L.Trainer(limit_val_batches=1, logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    trainer.fit(m, loader, loader)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("perf/tokens_per_s")]


def test_throughput_is_logged_when_validation_comes_before_a_full_window(tmp_path):
    """val_check_interval (3) < log_every_n_steps (10): validation ends each window early; each one is
    still measured (before, every window was dropped at validation and no tokens/s was ever logged)."""
    logged = _throughput_steps(tmp_path, samples=64, max_steps=12, log_every_n_steps=10, val_check_interval=3)
    assert len(logged) >= 3 and len(set(logged)) == len(logged), logged


def test_progress_bar_shows_the_loss_read_at_logging_steps_not_a_tensor_every_step(tmp_path):
    """Lightning reads every progress-bar value back to the host at every step (``.item()``, which on
    a GPU waits for all queued work): train/loss goes to the loggers only, and the bar's ``loss`` is
    a host value taken at the loggers' steps (and the first), equal to train/loss logged there,
    where the throughput windows end too."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    m = LitLM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=64, seq_len=16), warmup_steps=1)
    loader = torch.utils.data.DataLoader(torch.randint(0, 64, (64, 17)), batch_size=2)

    class Bar(L.Callback):
        """The bar's values after each training batch, as Lightning's progress bar reads them (a
        callback's batch-end hook runs before the module's: it sees the batch before's values)."""

        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx:
                self.seen.append(dict(trainer.progress_bar_metrics))

        def on_train_end(self, trainer, pl_module):
            self.seen.append(dict(trainer.progress_bar_metrics))

    bar = Bar()
    trainer = L.Trainer(max_steps=9, log_every_n_steps=4, logger=CSVLogger(tmp_path), enable_checkpointing=False, callbacks=[bar],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(m, loader)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(logged) == [3, 7], logged
    # the throughput windows end at the same steps: one wait for the GPU per logging interval
    assert [int(r["step"]) for r in rows if r.get("perf/tokens_per_s")] == [3, 7]
    assert all("train/loss" not in seen for seen in bar.seen), "a tensor of every step is in the progress bar"
    # batches 1 to 9: the first shows its own loss, 4 and 8 the loss the loggers got (steps 3 and 7)
    shown = [seen.get("loss") for seen in bar.seen]
    assert len(shown) == 9 and all(isinstance(v, float) for v in shown), shown
    assert shown[3] == pytest.approx(logged[3]) and shown[7] == pytest.approx(logged[7])
    assert shown[4:7] == [shown[3]] * 3 and shown[8] == shown[7] and shown[1:3] == [shown[0]] * 2 and shown[0] != shown[3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_steps_between_logging_steps_never_wait_for_the_gpu(tmp_path):
    """On a GPU a training batch that neither ends a throughput window nor reaches the loggers
    enqueues its work without one synchronisation (``torch.cuda.set_sync_debug_mode``), so the host
    can run ahead of the GPU; the read-backs at the loggers' steps are seen by the same check."""
    import warnings

    from lightning.pytorch.loggers import CSVLogger

    syncs: dict[int, int] = {}

    class Watch(L.Callback):
        batch = None  # the batch whose work (and end-of-batch logging) is being enqueued

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            Watch.batch = batch_idx
            syncs.setdefault(batch_idx, 0)
            torch.cuda.set_sync_debug_mode("warn")

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode(0)

    def record(message, category, filename, lineno, file=None, line=None):
        if Watch.batch is not None and "synchroniz" in str(message):
            syncs[Watch.batch] += 1

    cfg = ModelConfig.from_name("debug", residual="attnres", heads=2, block_size=2, n_layer=2, vocab_size=64, seq_len=16)
    m = LitLM(cfg, warmup_steps=1, routing_log_every_n_steps=0)
    loader = torch.utils.data.DataLoader(torch.randint(0, 64, (64, 17)), batch_size=2, pin_memory=True)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=12, log_every_n_steps=4, logger=CSVLogger(tmp_path), callbacks=[Watch()],
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            trainer.fit(m, loader)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    # batch indices: the first starts a throughput window; windows end, and the loggers and the
    # progress bar read back, at 3, 7, 11 (optimizer steps 4, 8, 12)
    quiet = [b for b in range(12) if b not in (0, 3, 7, 11)]
    assert all(syncs[b] == 0 for b in quiet), syncs
    assert all(syncs[b] > 0 for b in (3, 7, 11)), syncs


def test_progress_bar_loss_with_logging_off_fast_dev_run_and_a_second_fit():
    """log_every_n_steps=0 (Lightning's "never log"): the bar shows the first step's loss and fit
    does not fail; fast_dev_run logs every step, and so does the bar; a second fit of the same
    module shows its own first step, not the loss the first fit left there."""
    torch.manual_seed(0)
    m = LitLM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=64, seq_len=16), warmup_steps=1)
    loader = torch.utils.data.DataLoader(torch.randint(0, 64, (16, 17)), batch_size=2)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    shown = []

    class Bar(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            shown.append(trainer.progress_bar_metrics.get("loss"))

    first = L.Trainer(max_steps=3, log_every_n_steps=0, callbacks=[Bar()], **quiet)
    first.fit(m, loader)
    assert shown[0] is None and shown[1] == shown[2] and shown[1] == first.progress_bar_metrics["loss"]
    shown.clear()
    dev = L.Trainer(fast_dev_run=3, callbacks=[Bar()], **quiet)
    dev.fit(m, loader)
    assert shown[0] is None and None not in shown[1:] and len({shown[1], shown[2], dev.progress_bar_metrics["loss"]}) == 3, shown


def test_no_throughput_window_ends_every_step_when_logging_is_off(tmp_path):
    """log_every_n_steps=0 (Lightning's "never log"): throughput windows end at validations only,
    not after every batch (each end waits for the GPU and writes perf/tokens_per_s to the loggers)."""
    perf = _throughput_steps(tmp_path, samples=32, max_steps=8, log_every_n_steps=0, val_check_interval=4)
    assert perf == [3, 7], perf  # the two validations' window ends


def test_cuda_graph_refuses_activation_checkpointing_and_a_non_bool_by_name():
    with pytest.raises(ValueError, match="cuda_graph=True cannot capture activation_checkpointing=True"):
        module(cuda_graph=True, activation_checkpointing=True)
    with pytest.raises(ValueError, match="cuda_graph='yes' must be true or false"):
        module(cuda_graph="yes")


def test_cuda_graph_fit_off_one_cuda_device_is_refused_when_it_starts(tmp_path):
    m = module(cuda_graph=True)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    batches = torch.utils.data.DataLoader(torch.randint(0, 64, (4, 17)), batch_size=2)
    with pytest.raises(ValueError, match="cuda_graph=True needs one CUDA device.*SingleDeviceStrategy on cpu"):
        trainer.fit(m, batches)
    assert not m._graphed and m.global_step == 0


def test_graph_training_loss_refuses_bad_tokens_and_cpu_tensors_by_name():
    from lit_mhar.module import graph_training_loss

    lm = module().model
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="need the model and tokens on a CUDA device; got model, inputs, targets on cpu, cpu, cpu"):
        graph_training_loss(lm, tokens, tokens)
    for inputs, targets, named in [(tokens, tokens[:, 1:], r"\(2, 8\) torch.int64 and \(2, 7\)"), (tokens.float(), tokens, "torch.float32"),
                                   (tokens.bool(), tokens, "torch.bool"), (tokens[0], tokens[0], r"\(8,\)")]:
        with pytest.raises(ValueError, match=f"integer token ids of one shape.*{named}"):
            graph_training_loss(lm, inputs, targets)
    for bad in (0, "3", 1.5, True, None):
        with pytest.raises(ValueError, match=f"warmup_steps={bad!r}; need an integer >= 1"):
            graph_training_loss(lm, tokens, tokens, warmup_steps=bad)
    lm.activation_checkpointing = True
    with pytest.raises(ValueError, match="a model with activation_checkpointing=True cannot be captured.*set model.activation_checkpointing = False"):
        graph_training_loss(lm, tokens, tokens)


def test_cuda_graph_is_not_saved_with_the_hyperparameters_so_a_resume_takes_its_own():
    m = module(cuda_graph=True)
    assert m._cuda_graph is True and "cuda_graph" not in m.hparams
    assert "cuda_graph" not in module().hparams


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("residual, heads, block_size", [("delta", 2, 2), ("attnres", 2, 1), ("prenorm", 1, 1)])
def test_graphed_training_loss_gives_the_eager_loss_and_gradients(residual, heads, block_size):
    """On new tokens after the capture the replayed forward and backward give the eager model's loss
    and every parameter's gradient, bit for bit; a bad shape or device is refused by name."""
    from lit_mhar.module import TrainingLoss, graph_training_loss

    cfg = ModelConfig.from_name("debug", residual=residual, heads=heads, block_size=block_size, vocab_size=64, seq_len=16)
    torch.manual_seed(0)
    lm = LitLM(cfg).model.cuda()
    for site in lm.routing_sites():  # non-zero queries: routing is not uniform
        site.query.data.normal_()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (3, 17), generator=g).cuda() for _ in range(3)]
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = graph_training_loss(lm, batches[0][:, :-1], batches[0][:, 1:])
        assert all(p.grad is None for p in lm.parameters())  # the warm-up changed no .grad
        for batch in batches[1:]:
            lm.zero_grad(set_to_none=True)
            eager = TrainingLoss(lm)(batch[:, :-1], batch[:, 1:])
            eager.backward()
            expected = [p.grad.clone() for p in lm.parameters()]
            lm.zero_grad(set_to_none=True)
            loss = graphed(batch[:, :-1], batch[:, 1:])
            loss.backward()
            assert torch.equal(loss, eager)
            for p, e in zip(lm.parameters(), expected):
                assert torch.equal(p.grad, e)
    with pytest.raises(ValueError, match=r"one shape \[B, T\]; got \(3, 16\) torch.int64 and \(3, 15\)"):
        graph_training_loss(lm, batches[0][:, :-1], batches[0][:, 2:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_fit_trains_as_the_eager_fit(compile, tmp_path):
    """Four steps of Lightning's loop (bf16 autocast, clipping, the schedule), compiled or not, with
    the training step's forward and backward captured end with the eager fit's parameters, bit for
    bit; the last batch, of another shape, runs eagerly with a warning. A second fit of the same
    module captures anew (the first fit's graph is released when it ends)."""
    cfg = ModelConfig.from_name("debug", residual="delta", heads=2, block_size=2, vocab_size=64, seq_len=16)
    tokens = torch.randint(0, 64, (7, 17), generator=torch.Generator().manual_seed(3))  # batches of 2, 2, 2, 1

    def fit(m, steps):
        trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, gradient_clip_val=1.0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
        trainer.fit(m, torch.utils.data.DataLoader(tokens, batch_size=2))
        assert not m._graphed and m.global_step == steps  # released at the end of the fit
        return [p.detach().cpu().clone() for p in m.model.parameters()]  # (Lightning moves the model to the CPU at the end)

    torch.manual_seed(0)
    initial = [p.detach().clone() for p in LitLM(cfg).model.parameters()]
    params = []
    for graph in (False, True):
        torch.manual_seed(0)
        m = LitLM(cfg, cuda_graph=graph, compile=compile, warmup_steps=1)
        if graph:
            with pytest.warns(UserWarning, match=r"a training batch of \(1, 16\) tokens, not the captured \(2, 16\), runs eagerly"):
                params.append(fit(m, 4))
        else:
            params.append(fit(m, 4))
    assert not all(torch.equal(p, q) for p, q in zip(params[0], initial))  # it trained
    for p, q in zip(*params):
        assert torch.equal(p, q)
    # a second fit of the graphed module (its parameters have new addresses now): 2 more steps, as the eager module's
    again = [fit(m, 2)]
    torch.manual_seed(0)
    eager = LitLM(cfg, compile=compile, warmup_steps=1)
    fit(eager, 4)
    again.append(fit(eager, 2))
    for p, q in zip(*again):
        assert torch.equal(p, q)


def test_cuda_graph_refuses_gradient_accumulation_at_a_step_before_any_capture():
    """A GradientAccumulationScheduler sets accumulate_grad_batches after setup: each step checks it again."""
    m = module(cuda_graph=True)
    attach(m, accelerator="cpu", accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="cannot accumulate gradients.*accumulate_grad_batches=2 at step 0, need 1"):
        m._training_loss(torch.randint(0, 64, (2, 17)))
    assert not m._graphed


def _trained(data_dir, **trainer_kw) -> dict:
    from lit_mhar.data import TokenDataModule

    L.seed_everything(0)
    m = LitLM(ModelConfig.from_name("debug", residual="attnres", heads=2, d_model=32, n_layer=1, ffn_dim=64, vocab_size=300, seq_len=16),
              warmup_steps=2, routing_log_every_n_steps=0)
    trainer = L.Trainer(max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, check_val_every_n_epoch=None, accelerator="cpu", **trainer_kw)
    trainer.fit(m, TokenDataModule(str(data_dir), seq_len=16, batch_size=4, val_tokens=16 * 8))
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_how_often_validation_runs_does_not_change_training(stdlib_corpus):
    """Validation reads the fixed set with its own loader and draws nothing training uses: the weights after
    8 steps are the same bit for bit whether it ran every 2 steps, every 8, or never."""
    rare = _trained(stdlib_corpus, val_check_interval=8)
    often = _trained(stdlib_corpus, val_check_interval=2)
    never = _trained(stdlib_corpus, val_check_interval=8, limit_val_batches=0)
    assert all(torch.equal(rare[k], often[k]) and torch.equal(rare[k], never[k]) for k in rare)


def test_every_fit_validates_at_its_last_step(stdlib_corpus, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lit_mhar.data import TokenDataModule

    L.seed_everything(0)
    m = LitLM(ModelConfig.from_name("debug", d_model=32, n_layer=1, ffn_dim=64, vocab_size=300, seq_len=16))
    trainer = L.Trainer(max_steps=7, val_check_interval=5, check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(m, TokenDataModule(str(stdlib_corpus), seq_len=16, batch_size=4, val_tokens=64))
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert [int(r["step"]) for r in rows if r.get("val/loss")] == [4, 6]  # after step 5 (val_check_interval), and the last, 7
    assert trainer.global_step == 7


def test_passes_over_the_training_split_are_logged_and_a_repeat_is_warned_once(stdlib_corpus, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lit_mhar.data import TokenDataModule

    dm = TokenDataModule(str(stdlib_corpus), seq_len=255, batch_size=16, val_tokens=255)
    per_epoch = dm.blocks("train") // 16
    L.seed_everything(0)
    m = LitLM(ModelConfig.from_name("debug", d_model=32, n_layer=1, ffn_dim=64, vocab_size=300, seq_len=255))
    trainer = L.Trainer(max_steps=per_epoch + 3, log_every_n_steps=1, limit_val_batches=0, logger=CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.warns(UserWarning, match=r"starts pass 2 over the training split") as record:
        trainer.fit(m, dm)
    assert sum("over the training split" in str(w.message) for w in record) == 1
    import csv

    epochs = [float(r["data/epochs"]) for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("data/epochs")]
    assert epochs[0] == pytest.approx(1 / per_epoch) and max(epochs) == pytest.approx((per_epoch + 3) / per_epoch)
