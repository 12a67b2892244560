"""LitLM logs the routing statistics at the steps it computes them, and only there."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import Logger

from lit_mhar import ModelConfig
from lit_mhar.module import LitLM


class Recorder(Logger):
    """Keeps every ``(step, name)`` the trainer logs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.extend((step, k, float(v)) for k, v in metrics.items())

    def steps(self, name: str) -> list[int]:
        return [s for s, k, _ in self.logged if k == name]


def test_routing_statistics_are_logged_when_computed_not_repeated_at_every_logging_step():
    """Every 5 steps computed, every 2 steps logged: they were logged at steps 1, 3, 5, 7, ... with
    the value of the last computation repeated; now at steps 0, 5, 10, each its own value."""
    cfg = ModelConfig.from_name("debug", residual="attnres", heads=2, n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=64, seq_len=16)
    model = LitLM(cfg, warmup_steps=1, lr=0.05, routing_log_every_n_steps=5)
    data = torch.utils.data.DataLoader(torch.randint(0, 64, (96, 17)), batch_size=4)
    recorder = Recorder()
    trainer = L.Trainer(max_steps=12, logger=recorder, log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, data)
    assert recorder.steps("train/loss") == [1, 3, 5, 7, 9, 11]
    for site in range(3):
        assert recorder.steps(f"routing/site_{site:02d}/max_weight") == [0, 5, 10]
        assert recorder.steps(f"routing/site_{site:02d}/entropy") == [0, 5, 10]
    first = [v for s, k, v in recorder.logged if k == "routing/site_01/entropy"]
    assert first[0] != first[-1]  # the values are the ones computed then, not one repeated
