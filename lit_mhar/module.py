"""The LightningModule that trains every residual variant."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import Metric

from lit_mhar.config import ModelConfig
from lit_mhar.model import COMPILE_LAYOUTS, LM
from lit_mhar.routing import routing_stats

if TYPE_CHECKING:
    from lightning.pytorch.strategies import FSDPStrategy

# LitLM's ``compile`` values: off, or LM.compile_for_training's layouts (True is "auto").
COMPILE_CHOICES = (False, True, *COMPILE_LAYOUTS)

def check_compile(compile: Any) -> None:
    """Raises ValueError unless ``compile`` is one of :data:`COMPILE_CHOICES` (LitLM's ``compile``;
    the fit CLI checks it before any work)."""
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile in COMPILE_CHOICES)):
        raise ValueError(f"LitLM: compile={compile!r}; valid: {list(COMPILE_CHOICES)}")


# Dense bf16 peak of the GPUs we know, in FLOP/s (vendor datasheets, SXM parts), for MFU.
PEAK_BF16_FLOPS: dict[str, float] = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device: torch.device) -> Optional[float]:
    """Datasheet dense bf16 FLOP/s of ``device``, or None for CPUs and unknown GPUs (no MFU then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def fsdp_strategy(**kwargs: Any) -> FSDPStrategy:
    """Lightning's ``FSDPStrategy`` wrapping every ``Attention`` and every ``MLP`` as its own FSDP unit.

    ``lit-mhar fit --trainer.strategy fsdp`` uses it. The 2L sublayer units hold the matmul weights:
    each is all-gathered just before its sublayer runs (again when a checkpointed sublayer is
    recomputed) and freed after. Everything else is the root unit: the embedding, the LM head, the
    norms, every routing site's pseudo-query, key-norm gain and Delta gate (2L + 1 sites of 2d or
    3d values; 0.19M / 0.28M parameters at 1b) and the hyper-connections. Like every parameter
    they are sharded at rest (each rank stores and updates 1/N of the root's flat parameter and its
    AdamW state) and gathered for the whole forward and backward, where every site reads them. Not one unit per ``Block``: two-phase
    block routing routes all sites of a block of S sublayers when the block starts, reading the
    pseudo-queries of later layers, whose units would still be sharded. The depth history (the
    sources routing reads) is activation memory of each rank, not a parameter; FSDP does not touch
    it (``activation_checkpointing`` is what shrinks it).

    Args:
        kwargs: passed to ``FSDPStrategy`` (``sharding_strategy``, ``cpu_offload``,
            ``state_dict_type``, ...); ``auto_wrap_policy`` replaces the policy above.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    from lit_mhar.model import MLP, Attention

    kwargs.setdefault("auto_wrap_policy", {Attention, MLP})
    return FSDPStrategy(**kwargs)


def next_token_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy in nats (float32, 0-d) of ``logits`` ``[B, T, V]`` (any float dtype;
    computed in float32) against token ids ``targets`` ``[B, T]`` (int64): the mean over tokens (the
    training loss), or with ``reduction="sum"`` the sum (validation adds sums over its fixed token set)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


class TokenMean(Metric):
    """The mean loss per token over a whole evaluation: float64 sums of token losses and token counts,
    added over batches and, at ``compute``, over ranks. ``val/loss`` and ``test/loss`` are this, so
    one checkpoint gets one value however the fixed set is cut into batches or shared among devices.
    NaN propagates (a diverged model must not score as finite).

    (torchmetrics' ``MeanMetric`` would do, but with ``nan_strategy="disable"`` it ignores its weights.)
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, total: Tensor, count: int) -> None:
        """Adds ``total`` (0-d, the summed loss of ``count`` tokens) to the evaluation."""
        self.total += total.detach().to(torch.float64)
        self.count += count

    def compute(self) -> Tensor:
        """The mean loss per token so far (float64, 0-d)."""
        return self.total / self.count


class TrainingLoss(torch.nn.Module):
    """The training forward as one module: :func:`next_token_loss` of ``model``'s logits for
    ``inputs`` against ``targets`` (int64 ``[B, T]`` each): what :func:`graph_training_loss` captures."""

    def __init__(self, model: LM) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return next_token_loss(self.model(inputs), targets)


def graph_training_loss(model: LM, inputs: Tensor, targets: Tensor, warmup_steps: int = 3) -> TrainingLoss:
    """The training loss of ``model`` with its forward and its backward captured as two CUDA graphs.

    ``torch.cuda.make_graphed_callables`` runs ``warmup_steps`` forwards and backwards of
    :class:`TrainingLoss` on a side stream (compilation, Triton's first launches, the allocator),
    then captures one forward and one backward on ``inputs`` / ``targets`` (int64 ``[B, T]`` on the
    GPU, copied, so the batch itself is not kept). The result is a module that replays them: called on new tokens of the same shape it copies them
    into the captured inputs and replays the forward graph; ``backward()`` on its loss replays the
    backward graph and hands every parameter's gradient to autograd, where the optimizer and
    gradient clipping use them as usual. The host enqueues two graph launches per step instead of
    every kernel, which routed models (many small kernels: the fused routing ops, two-phase block
    routing's merges) gain from where the host's enqueue time shows in the step (BENCHMARKS.md has
    what it gains at each scale). The warm-up
    forwards and backwards only compute gradients for the capture (``torch.autograd.grad``): no
    parameter's ``.grad`` changes.

    The capture runs under the caller's autocast state (on or off, its dtype) with autocast's
    weight-cast cache off, which a capture cannot hold. Each call's loss tensor is the captured output,
    overwritten by the next call: clone it to keep it. Gradients are written into captured buffers
    that each parameter's ``.grad`` may then alias: clear them (``zero_grad(set_to_none=True)``, the
    default) between steps; do not accumulate gradients over several calls. The model's parameters
    must keep their tensors (update them in place, as optimizers do).

    Every capture keeps its routing ops' offset tables' pinned host memory (a few hundred bytes)
    for the life of the process (``lit_mhar.kernels.launch.offsets``).

    Raises:
        ValueError: ``inputs`` and ``targets`` of different shapes, not ``[B, T]`` or not integer
            tokens, ``model.activation_checkpointing`` on (its recomputation saves the RNG state,
            which a capture cannot read), ``warmup_steps`` < 1, or ``model``, ``inputs`` or
            ``targets`` not on a CUDA device.
    """
    def is_tokens(t: Tensor) -> bool:
        return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)

    if inputs.shape != targets.shape or inputs.dim() != 2 or not (is_tokens(inputs) and is_tokens(targets)):
        raise ValueError(
            f"graph_training_loss: inputs and targets must be integer token ids of one shape [B, T]; got {tuple(inputs.shape)} {inputs.dtype} and {tuple(targets.shape)} {targets.dtype}"
        )
    if model.activation_checkpointing:
        raise ValueError(
            "graph_training_loss: a model with activation_checkpointing=True cannot be captured (its recomputation saves the RNG state); "
            "set model.activation_checkpointing = False first"
        )
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
        raise ValueError(f"graph_training_loss: warmup_steps={warmup_steps!r}; need an integer >= 1 (compilation and first launches must not be captured)")
    where = [t.device.type for t in (inputs, targets, next(model.parameters()))]
    if any(w != "cuda" for w in where):
        raise ValueError(f"graph_training_loss: CUDA graphs need the model and tokens on a CUDA device; got model, inputs, targets on {where[2]}, {where[0]}, {where[1]}")
    # the caller's autocast (on or off, its dtype), without the weight-cast cache, which a capture cannot hold
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(TrainingLoss(model), (inputs.clone(), targets.clone()), num_warmup_iters=warmup_steps)
    torch.cuda.empty_cache()  # the warm-up's blocks, cached for its side stream, which nothing else would reuse
    return graphed


class LitLM(L.LightningModule):
    """Next-token language modelling for every residual variant (prenorm, AttnRes, MHAR, Delta, Hyper-Connections).

    Batches are int64 token ids ``[B, T + 1]``; inputs are the first T, targets the last T.
    Logs ``train/loss`` (every step's, written at the loggers' steps; the progress bar shows it as
    ``loss`` every ``log_every_n_steps`` steps, when ``perf/*`` are measured too, so that only those
    steps wait for the GPU),
    ``val/loss`` (the validation loss, nats per token), ``perf/tokens_per_s``,
    ``perf/mfu`` (on GPUs with a known peak; FLOPs from :meth:`LM.flops_per_token`),
    ``perf/peak_memory_gb`` (``torch.cuda.max_memory_allocated``) and, every
    ``routing_log_every_n_steps`` steps (at those steps only), ``routing/site_XX/max_weight`` and
    ``.../entropy``.

    Args:
        config: the model: preset name, residual variant, heads H, block size S and overrides.
        lr: peak learning rate of AdamW.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        warmup_steps: linear warm-up steps from 0 to ``lr``.
        weight_decay: AdamW weight decay on matrices (not on norms, embeddings-free vectors or routing parameters,
            which include every hyper-connection weight: decay would pull their identity init towards zero).
        betas: AdamW betas.
        adam_eps: AdamW epsilon.
        routing_lr_multiplier: the routing parameters (pseudo-queries, key gains, gates; the
            hyper-connection weights) train at ``lr * routing_lr_multiplier`` (Delta AttnRes
            fine-tuning used about 100x).
        routing_log_every_n_steps: how often routing statistics are computed and logged (0: never).
        compile: ``torch.compile`` the model (:meth:`lit_mhar.model.LM.compile_for_training`);
            checkpoints load with or without it. ``true`` or ``"auto"``: the whole model where
            nothing is routed (prenorm, Hyper-Connections), else attention, MLP and every norm
            module by module with routing eager on the fused kernels (the layouts BENCHMARKS.md
            measures). ``"sublayers"`` or ``"model"`` choose one for
            every variant. ``false``: eager. Other values raise ValueError.
        activation_checkpointing: Recompute every sublayer (routing, pre-norm, attention / MLP) in
            the backward pass instead of keeping its activations (``torch.utils.checkpoint``,
            non-reentrant; see :class:`lit_mhar.model.LM`): between forward and backward only the
            residual stream and the depth history's sources stay in memory, for about one more
            forward pass of compute. Gradients are unchanged. A training setting, not part of the
            model config: checkpoints load with or without it. Use this rather than an FSDP
            ``activation_checkpointing_policy`` on ``Block`` (a block appends to the depth history,
            so recomputing a whole block would append twice).
        init_from: A lit-mhar checkpoint (such as ``model.ckpt`` written by ``lit-mhar convert``)
            whose model weights this run starts from: a new run at step 0 with a fresh optimizer
            and schedule (mid-training), where ``fit --ckpt_path`` would resume the checkpoint's
            own run. ``config`` must describe the checkpoint's model (``convert`` writes a
            ``fit.yaml`` that does), except ``seq_len`` (RoPE is computed, not stored) and
            ``vocab_size``, which may be smaller than the checkpoint's (data tokenised with the
            source model's tokenizer, whose embedding table is often padded); the checkpoint's
            vocabulary is kept. Checkpoints of such a run store the model's own config and no
            ``init_from``, so they load without the file.
        cuda_graph: Capture the training forward and backward (model, LM head, cross-entropy) as
            two CUDA graphs on the first training batch and replay them for every batch of that
            shape (:func:`graph_training_loss`; a batch of another shape runs eagerly, with a
            warning). The host then enqueues two graphs per step instead of every kernel, which
            helps where its launches show in the step (routed models, many small kernels; see
            :func:`graph_training_loss` for what it measured).
            The optimizer step, gradient clipping, the schedule, validation and the routing
            statistics run as usual. One CUDA device only (``trainer.devices: 1``, no DDP or
            FSDP), no gradient accumulation, no ``activation_checkpointing``: the fit refuses
            those when it starts. Not saved with the hyperparameters: a checkpoint resumes with
            or without it, as the resuming command says.

    Raises:
        ValueError: a bad hyperparameter, ``config`` does not match the ``init_from`` checkpoint,
            or ``cuda_graph`` with ``activation_checkpointing``; at the start of a fit,
            ``cuda_graph`` off a single CUDA device or with ``accumulate_grad_batches`` > 1.
        FileNotFoundError: ``init_from`` does not exist.
    """

    def __init__(
        self,
        config: ModelConfig,
        lr: float = 5e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        routing_lr_multiplier: float = 1.0,
        routing_log_every_n_steps: int = 50,
        compile: Union[bool, str] = False,
        init_from: Optional[str] = None,
        activation_checkpointing: bool = False,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__()
        check_compile(compile)
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"LitLM: cuda_graph={cuda_graph!r} must be true or false")
        if cuda_graph and activation_checkpointing:
            raise ValueError(
                f"LitLM: cuda_graph=True cannot capture activation_checkpointing={activation_checkpointing!r} (its recomputation saves the RNG state); turn one of them off"
            )
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0 or routing_lr_multiplier <= 0:
            raise ValueError(
                f"LitLM: need lr > 0 (got {lr}), 0 <= min_lr_ratio <= 1 (got {min_lr_ratio}), "
                f"warmup_steps >= 0 (got {warmup_steps}), routing_lr_multiplier > 0 (got {routing_lr_multiplier})"
            )
        # cuda_graph is how this process runs the step, not part of the run: a resumed fit
        # (--ckpt_path, whose saved hyperparameters replace the command line's) takes its own
        self.save_hyperparameters(ignore=["cuda_graph"])
        self._cuda_graph = cuda_graph
        weights = None
        if init_from is not None:
            from lit_mhar.checkpoint import read_checkpoint, resolve_init_config

            source_config, weights, _ = read_checkpoint(init_from)
            config = resolve_init_config(config, source_config, init_from)
        self.config = config
        self.model = LM(config, activation_checkpointing=activation_checkpointing)
        if weights is not None:
            self.model.load_state_dict(weights)
        # FSDP (use_orig_params) turns sharded parameters into 1-D views: the weight-decay split is
        # decided on the shapes seen here, before any strategy wraps the model
        self._param_dims = {name: p.dim() for name, p in self.model.named_parameters()}
        if compile is not False:  # in place (nn.Module.compile): state_dict keys stay those of the eager model
            self.model.compile_for_training("auto" if compile is True else compile)
        self._window_start: Optional[float] = None
        self._window_tokens = self._window_batches = 0
        self._window_shape: tuple[torch.device, int] = (torch.device("cpu"), 0)  # device and sequence length of the last batch
        self._bar_step: Optional[int] = None  # the last logging step: the optimizer step whose train/loss the progress bar shows
        self._graphed: list[TrainingLoss] = []  # with cuda_graph: the captured training loss, once the first batch came (a list: not a submodule)
        self._graph_shape: Optional[torch.Size] = None  # the captured inputs' shape
        self._graph_fallback_warned = False
        self.val_loss, self.test_loss = TokenMean(), TokenMean()
        self._passes_warned = False

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` for token ids ``[B, T]``."""
        return self.model(idx)

    def _loss(self, batch: Tensor) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        return next_token_loss(self(inputs), targets)

    def _training_loss(self, batch: Tensor) -> Tensor:
        if not self._cuda_graph:
            return self._loss(batch)
        self._check_no_accumulation()  # (again at every step: a GradientAccumulationScheduler sets it after setup)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if not self._graphed:
            self._graphed.append(graph_training_loss(self.model, inputs, targets))
            self._graph_shape = inputs.shape
        if inputs.shape != self._graph_shape:  # another shape (a short last batch): eager, same model
            if not self._graph_fallback_warned:
                rank_zero_warn(
                    f"LitLM(cuda_graph=True): a training batch of {tuple(inputs.shape)} tokens, not the captured {tuple(self._graph_shape)}, "
                    "runs eagerly (so does every later batch of another shape)"
                )
                self._graph_fallback_warned = True
            return self._loss(batch)
        return self._graphed[0](inputs, targets)

    def _release_graphs(self) -> None:
        # A graph holds the addresses of the parameters, gradients and activations of the fit that
        # captured it; Lightning moves the model off the GPU when a fit ends, so each fit captures anew.
        self._graphed.clear()
        self._graph_shape, self._graph_fallback_warned = None, False

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._graphed:
            self._release_graphs()
            torch.cuda.empty_cache()

    def setup(self, stage: str) -> None:
        if stage != "fit" or not self._cuda_graph:
            return
        self._release_graphs()
        from lightning.pytorch.strategies import SingleDeviceStrategy

        strategy, device = self.trainer.strategy, self.trainer.strategy.root_device
        if not isinstance(strategy, SingleDeviceStrategy) or device.type != "cuda":
            raise ValueError(
                f"LitLM: cuda_graph=True needs one CUDA device (trainer.accelerator gpu, trainer.devices 1); "
                f"got {type(strategy).__name__} on {device}"
            )
        self._check_no_accumulation()

    def _check_no_accumulation(self) -> None:
        if self.trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"LitLM: cuda_graph=True cannot accumulate gradients (the captured backward overwrites them); "
                f"trainer.accumulate_grad_batches={self.trainer.accumulate_grad_batches} at step {self.global_step}, need 1"
            )

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._training_loss(batch)
        # The mean over ranks (the global batch's loss), to the loggers only: Lightning reads a value
        # shown in the progress bar back to the host at every step (.item(), which waits for the
        # GPU to finish all queued work), so the bar shows it as "loss", read at the loggers' steps.
        # A captured loss is overwritten by the next replay: the logged value is a copy.
        self.log("train/loss", loss.detach().clone() if self._graphed else loss, sync_dist=True)
        every = self.hparams.routing_log_every_n_steps
        if self.config.routed and every and self.global_step % every == 0:
            self._log_routing(batch[:, :-1])
        return loss

    def configure_callbacks(self) -> list[L.Callback]:
        # a fit stops at the first non-finite loss or gradient norm and never saves NaN weights
        from lit_mhar.callbacks import StopOnNonFinite

        return [StopOnNonFinite()]

    def on_fit_start(self) -> None:
        # The hyperparameters hold the config as given (a preset name, overrides, None for preset
        # fields); runs are compared on the model they trained: every resolved field, model/<field>.
        resolved = {f"model/{k}": v for k, v in self.config.to_dict().items()}
        for logger in self.loggers:
            logger.log_hyperparams(resolved)

    def on_train_start(self) -> None:
        self._bar_step = None  # each fit shows its first step's loss

    def _data_passes(self) -> Optional[float]:
        """Passes over the training split so far: batches trained / batches in one epoch (None without a length)."""
        per_epoch = self.trainer.num_training_batches
        if not per_epoch or math.isinf(per_epoch):
            return None
        return (self.trainer.fit_loop.epoch_loop.total_batch_idx + 1) / per_epoch

    def _at_last_batch(self) -> bool:
        """Whether this batch ends the fit (max_steps reached, or the last batch of the last epoch)."""
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return self.global_step >= trainer.max_steps
        last_epoch = trainer.max_epochs is not None and trainer.max_epochs > 0 and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def on_train_batch_end(self, outputs: Any, batch: Tensor, batch_idx: int) -> None:
        # Every fit validates at its last step, so a short run (or one whose max_steps is not a multiple of
        # val_check_interval) still reports val/loss: Lightning validates when a hook sets should_stop.
        if self.trainer.enable_validation and self._at_last_batch():
            self.trainer.should_stop = True
        passes = self._data_passes()
        if passes is not None and passes > 1 and not self._passes_warned:
            self._passes_warned = True
            rank_zero_warn(
                f"LitLM: step {self.global_step} starts pass {math.ceil(passes)} over the training split "
                f"({self.trainer.num_training_batches} batches a pass): from here the model sees repeated data and its "
                "validation loss can measure memorisation; prepare a larger corpus (lit-mhar prepare --source python) "
                "or lower trainer.max_steps"
            )
        # Throughput over windows that end at the loggers' steps (every log_every_n_steps optimizer
        # steps; a validation ends one early), where Lightning reads train/loss back for the loggers
        # anyway: the window's end and the progress bar's loss wait for the GPU there and nowhere
        # else, so the GPU queue is not drained every step.
        self._window_tokens += batch[:, :-1].numel()
        self._window_batches += 1
        self._window_shape = (batch.device, batch.shape[1] - 1)
        step, every = self.global_step, self.trainer.log_every_n_steps  # every 0: Lightning never logs
        logging_step = step != self._bar_step and (self._bar_step is None or bool(self.trainer.fast_dev_run) or (every > 0 and step % every == 0))
        if self._window_start is None or logging_step:
            self._close_window()
        if logging_step:
            self._show_loss()

    def _show_loss(self) -> None:
        """Shows the latest ``train/loss`` in the progress bar as ``loss``: a value on the host, which
        Lightning can read back at every step without waiting for the GPU."""
        loss = self.trainer.callback_metrics.get("train/loss")
        if loss is not None:
            self.log("loss", torch.tensor(float(loss)), prog_bar=True, logger=False)
        self._bar_step = self.global_step

    def on_validation_start(self) -> None:
        # the batches since the last window end are measured before validation time enters them
        # (with val_check_interval < log_every_n_steps no full window would ever end)
        if not self.trainer.sanity_checking and self._window_start is not None and self._window_batches:
            self._close_window()

    def on_validation_end(self) -> None:
        self._window_start, self._window_tokens, self._window_batches = None, 0, 0

    def _close_window(self) -> None:
        """Logs the open window's tokens/s (and MFU, peak memory on GPUs) and starts the next window."""
        device, seq_len = self._window_shape
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        perf: dict[str, float] = {}
        if self._window_start is not None:
            tokens_per_s = self._window_tokens * self.trainer.world_size / (now - self._window_start)
            perf["perf/tokens_per_s"] = tokens_per_s
            peak = peak_flops(device)
            if peak:
                per_device = tokens_per_s / self.trainer.world_size
                perf["perf/mfu"] = self.model.flops_per_token(seq_len) * per_device / peak
        if device.type == "cuda":
            perf["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        passes = self._data_passes()
        if passes is not None:
            perf["data/epochs"] = passes
        if perf:
            # Straight to the loggers, once per window: a value given to self.log would be sent again at
            # every later logging step until the next window ends. Step numbering as Lightning's for
            # train metrics (the index of this optimizer step). The loggers write on rank 0 only.
            for logger in self.loggers:
                logger.log_metrics(perf, step=max(self.global_step - 1, 0))
        self._window_start, self._window_tokens, self._window_batches = now, 0, 0

    @torch.no_grad()
    def _log_routing(self, inputs: Tensor) -> None:
        """Max routing weight and entropy (nats) per routing site, on the current batch, logged at
        this step only: given to self.log, Lightning would log the value again at every later
        logging step until the next one is computed."""
        stats: dict[str, Tensor] = {}
        _, weights = self.model(inputs, return_routing=True)
        for site, w in enumerate(weights):
            stats[f"routing/site_{site:02d}/max_weight"], stats[f"routing/site_{site:02d}/entropy"] = routing_stats(w)
        values = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one read from the device
        for logger in self.loggers:  # they write on rank 0 only; steps numbered as train/loss's
            logger.log_metrics(values, step=self.global_step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.hparams.get("init_from") is not None:
            # self-contained: the model's own config (the init checkpoint's vocabulary), no init file
            hp = checkpoint["hyper_parameters"]
            hp["config"] = self.config.to_dict() if isinstance(hp.get("config"), dict) else self.config
            hp["init_from"] = None
        # The MLflow run this checkpoint belongs to, for tools that report back to it (lit-mhar probe)
        # and for `fit --ckpt_path` to continue it; `tracking_lost` is set when the logger
        # (lit_mhar.tracking.MLFlowLogger) lost the server before this checkpoint.
        from lightning.pytorch.loggers import MLFlowLogger

        from lit_mhar.tracking import absolute_tracking_uri

        # Only global rank 0 writes checkpoint files, and only there is the logger's experiment (the
        # MLflow client) real: on the other ranks Lightning replaces it by a no-op.
        for logger in self.loggers if self.trainer.is_global_zero else ():
            if isinstance(logger, MLFlowLogger) and logger.run_id is not None:
                checkpoint["mlflow"] = {
                    "tracking_uri": absolute_tracking_uri(logger.experiment.tracking_uri),
                    "experiment_id": str(logger.experiment_id),
                    "run_id": str(logger.run_id),
                    "tracking_lost": getattr(logger, "tracking_lost", None),
                }
                break

    def _score(self, batch: Tensor, metric: TokenMean, name: str, prog_bar: bool) -> None:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        metric.update(next_token_loss(self(inputs), targets, reduction="sum"), targets.numel())
        # the metric object, not a value: Lightning calls compute() (all batches, all ranks) at the epoch's end
        self.log(name, metric, prog_bar=prog_bar)

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self._score(batch, self.val_loss, "val/loss", prog_bar=True)

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self._score(batch, self.test_loss, "test/loss", prog_bar=False)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        routing = {id(p) for p in self.model.routing_parameters()}
        decay, no_decay, route = [], [], []
        for name, p in self.model.named_parameters():
            name = name.replace("_fsdp_wrapped_module.", "")
            if id(p) in routing:
                route.append(p)
            elif self._param_dims[name] >= 2 and name != "embed.weight":
                decay.append(p)
            else:
                no_decay.append(p)
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": route, "weight_decay": 0.0, "lr": hp.lr * hp.routing_lr_multiplier},
        ]
        groups = [g for g in groups if g["params"]]
        # Lightning refuses to clip gradients for optimizers that unscale internally (fused AdamW
        # advertises that), so the fused kernel is used on GPUs only when nothing is clipped.
        fused = self.device.type == "cuda" and not (self._trainer and self.trainer.gradient_clip_val)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.adam_eps, fused=fused)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(hp.warmup_steps, total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
