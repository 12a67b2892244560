"""lit_mhar.callbacks: a fit stops at the first non-finite loss or gradient norm and saves no NaN weights."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_mhar.callbacks import StopOnNonFinite, TrainingDiverged
from lit_mhar.cli import main

ROOT = Path(__file__).resolve().parents[1]


class InfiniteGradient(torch.autograd.Function):
    """The identity, whose gradient is infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Poisoned(L.LightningModule):
    """A linear model whose training loss (or, with ``grad``, only its gradient) becomes infinite at step ``bad``."""

    def __init__(self, bad: int, grad: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.bad, self.grad = bad, grad

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step == self.bad:
            return InfiniteGradient.apply(loss) if self.grad else loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())


def fit(model: L.LightningModule, tmp_path: Path, **kw) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=12, val_check_interval=2, limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[StopOnNonFinite(), L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], **kw,
    )  # fmt: skip
    trainer.fit(model)
    return trainer


def finite(path: Path) -> bool:
    return all(torch.isfinite(v).all() for v in torch.load(path, weights_only=False)["state_dict"].values())


@pytest.mark.parametrize("grad, what", [(False, r"the training loss is NaN or infinite at step 5;"),
                                         (True, r"the gradient norm is NaN or infinite at step 5 \(its loss was finite\);")])
def test_a_fit_stops_at_the_first_non_finite_step_and_names_it(tmp_path, grad, what):
    with pytest.raises(TrainingDiverged, match=what) as e:
        fit(Poisoned(bad=5, grad=grad), tmp_path)
    assert "ckpt/last.ckpt, is from before it" in str(e.value) and "--model.lr" in str(e.value)
    ckpts = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert ckpts and all(finite(p) for p in ckpts)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 4  # the validation before step 5


def test_a_finite_fit_runs_to_its_end(tmp_path):
    assert fit(Poisoned(bad=-1), tmp_path).global_step == 12


def test_no_checkpoint_of_non_finite_weights_is_ever_saved(tmp_path):
    """Weights made NaN without a NaN loss or gradient (here: by hand, just before a checkpoint is
    saved) are caught when the checkpoint is saved."""

    class Broken(Poisoned):
        def on_validation_epoch_end(self):
            if self.global_step == 4:
                with torch.no_grad():
                    self.layer.bias.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match="weights are not finite.*layer.bias.*not saved"):
        fit(Broken(bad=-1), tmp_path)
    assert all(finite(p) for p in (tmp_path / "ckpt").glob("*.ckpt"))


def test_a_fit_that_diverges_exits_1_naming_the_step_and_leaves_a_failed_run(small_corpus, tmp_path, monkeypatch, capsys):
    """`lit-mhar fit --model.lr 1e6`: the loss went NaN from step 3 and the fit ended FINISHED with exit 0
    and an all-NaN last.ckpt."""
    import mlflow

    monkeypatch.setattr(sys, "argv", [
        "lit-mhar", "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--data.data_dir", str(small_corpus), "--data.seq_len", "32", "--data.batch_size", "4",
        "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64", "--model.lr", "1e6",
        "--trainer.max_steps", "12", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "runs"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--trainer.logger.init_args.artifact_location", str(tmp_path / "artifacts"),
    ])  # fmt: skip
    assert main() == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("lit-mhar fit: error: training diverged: ") and "at step " in line and "--model.lr (it is 1e+06)" in line, line
    assert "Traceback" not in err
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-mhar").experiment_id])
    assert run.info.status == "FAILED"
    step = int(line.split("at step ")[1].split()[0].rstrip(";"))
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert all(torch.isfinite(torch.tensor(v)) for s, v in losses.items() if s < step)
    ckpts = list((tmp_path / "runs").rglob("*.ckpt"))
    assert ckpts and all(finite(p) for p in ckpts)
