"""Lightning callbacks every lit-mhar fit runs with (:meth:`lit_mhar.module.LitLM.configure_callbacks`)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

from lit_mhar.checkpoint import NonFiniteCheckpoint, check_finite_weights


class TrainingDiverged(RuntimeError):
    """A fit stopped at a non-finite training loss or gradient norm; the message names the step
    and what to try. ``lit-mhar fit`` prints it as one line and exits with status 1."""


_LOSS, _GRAD = 0, 1  # rows of StopOnNonFinite's record
_WHAT = {_LOSS: "the training loss", _GRAD: "the gradient norm"}


class StopOnNonFinite(L.Callback):
    """Stops a fit at the first non-finite training loss or gradient norm, before a checkpoint of
    the broken weights is saved.

    Every step records, on the device, the first step whose loss (``training_step``'s output) or
    total gradient norm (before clipping) is NaN or infinite: no host synchronisation per step.
    The record is read back where the host waits anyway: at every step on a CPU, at the loggers'
    steps (``trainer.log_every_n_steps``) on a GPU, before each validation and at the end of
    training. A non-finite value there raises :class:`TrainingDiverged` naming the first such step;
    Lightning then marks the run failed and saves nothing more. Independently, every checkpoint
    about to be saved has its weights checked, so no checkpoint (``last.ckpt`` included) ever
    holds NaN or infinite weights. Under ``16-mixed`` precision an infinite gradient is the loss
    scaler's business (it skips that step), so only the loss is checked there. Steps are numbered
    as the loggers number ``train/loss`` (the first optimizer step is 0).
    """

    def __init__(self) -> None:
        super().__init__()
        self._first: Optional[Tensor] = None  # int64 [2] on the device: first bad step per _LOSS/_GRAD, -1 none
        self._step = 0

    def _record(self, row: int, value: Tensor) -> None:
        if self._first is None or self._first.device != value.device:
            self._first = torch.full((2,), -1, dtype=torch.long, device=value.device)
        bad = ~torch.isfinite(value.detach()).all()
        cell = self._first[row : row + 1]
        cell.masked_fill_(bad & (cell < 0), self._step)  # a Python scalar: no copy to the device

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self._record(_GRAD, torch.nn.utils.get_total_norm(grads, foreach=True))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._record(_LOSS, loss)
        every = trainer.log_every_n_steps
        if pl_module.device.type == "cpu" or (every > 0 and trainer.global_step % every == 0):
            self._check(trainer, pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._check(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._check(trainer, pl_module, collective=False)  # every rank dumps, not necessarily together
        try:
            check_finite_weights(checkpoint.get("state_dict") or {}, "the checkpoint about to be saved")
        except NonFiniteCheckpoint as e:
            raise TrainingDiverged(f"{e} (not saved; training stopped at step {trainer.global_step})") from None

    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule, collective: bool = True) -> None:
        """Raises :class:`TrainingDiverged` if a step so far (on any rank) had a non-finite value."""
        if self._first is None:
            return
        first = trainer.strategy.all_gather(self._first) if collective and trainer.world_size > 1 else self._first
        found = [(step, row) for ranks in first.view(-1, 2).tolist() for row, step in enumerate(ranks) if step >= 0]
        if not found:
            return
        step, row = min(found)
        raise TrainingDiverged(_diverged_message(trainer, pl_module, step, row))


def _diverged_message(trainer: L.Trainer, pl_module: L.LightningModule, step: int, row: int) -> str:
    lr = getattr(pl_module, "hparams", {}).get("lr")
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    saved = f"the latest checkpoint, {last}, is from before it" if last else "no checkpoint was saved"
    tries = [f"a lower --model.lr{f' (it is {lr:g})' if isinstance(lr, (int, float)) else ''}", "a longer --model.warmup_steps"]
    if not trainer.gradient_clip_val:
        tries.append("--trainer.gradient_clip_val 1.0")
    return (
        f"training diverged: {_WHAT[row]} is NaN or infinite at step {step}{' (its loss was finite)' if row == _GRAD else ''}; "
        f"stopped, and {saved}. Try {', '.join(tries[:-1])} or {tries[-1]}"
    )


class ModelSummary(L.pytorch.callbacks.ModelSummary):
    """Lightning's model summary, with the training FLOPs per token of :meth:`LM.flops_per_token`
    (the formula of ``perf/mfu``) in place of Lightning's FLOPs column and total, which Lightning
    measures only for a module with an ``example_input_array`` and otherwise prints as 0.
    ``lit-mhar fit`` puts it in place of Lightning's default summary (same ``max_depth``)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model, config = getattr(pl_module, "model", None), getattr(pl_module, "config", None)
        self._flops = model.flops_per_token(config.seq_len) if hasattr(model, "flops_per_token") and config is not None else None
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data: list, total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int, **summarize_kwargs: Any) -> None:  # fmt: skip
        import logging

        from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table, get_human_readable_count

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns)
        lines = [line for line in table.splitlines() if not line.rstrip().endswith("Total Flops")]
        if self._flops:
            lines.append(f"{get_human_readable_count(int(self._flops)):<10}Training FLOPs per token (6N + attention, as perf/mfu counts them)")
        logging.getLogger(L.pytorch.callbacks.model_summary.__name__).info("\n" + "\n".join(lines))
