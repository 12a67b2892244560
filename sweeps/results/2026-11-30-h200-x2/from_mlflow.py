"""Rebuilds the `gpu20m` sweep's summary table and plots from its MLflow database.

The GPU machine returns at most 8 files per call, and the Optuna database of this run was left
behind; its MLflow database came back. Every number the report needs was also logged to each
trial's child run (``sweep/*`` metrics, ``config/*`` params, ``optuna.trial_state`` tag), so this
reads the children with MLflow's client and feeds them to ``lit_mhar.sweeps.report``'s
``summarise``, ``markdown_table`` and ``plot_vs`` (the functions ``lit-mhar sweep report`` uses).

    python sweeps/results/2026-11-30-h200-x2/from_mlflow.py PATH/mlflow.db OUTPUT_DIR
"""

import sys
from pathlib import Path

from mlflow import MlflowClient

from lit_mhar.sweeps.report import _write_csv, markdown_table, plot_vs, summarise


def rows_from_mlflow(db: str, study: str = "gpu20m") -> list[dict]:
    client = MlflowClient(f"sqlite:///{db}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`optuna.study_name` = '{study}'", max_results=1000)
    rows = []
    for run in runs:
        if "optuna.trial_number" not in run.data.tags:  # the parent run
            continue
        p, m = run.data.params, run.data.metrics
        rows.append({
            "trial": int(run.data.tags["optuna.trial_number"]),
            "state": run.data.tags.get("optuna.trial_state"),
            "scale": p["config/name"], "residual": p["config/residual"],
            "block_size": int(p["config/block_size"]), "heads": int(p["config/heads"]), "seed": int(p["sweep.seed"]),
            "val_loss": m.get("sweep/val_loss"), "tokens_per_s": m.get("sweep/tokens_per_s"), "mfu": m.get("sweep/mfu"),
            "peak_memory_gb": m.get("sweep/peak_memory_gb"), "tokens": int(p["sweep.tokens"]),
            "duration_s": m.get("sweep/duration_s"), "mlflow_run_id": run.info.run_id,
        })
    return sorted(rows, key=lambda r: r["trial"])


if __name__ == "__main__":
    db, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rows = rows_from_mlflow(db)
    summary = summarise(rows)
    _write_csv(out / "trials.csv", rows)
    _write_csv(out / "summary.csv", summary)
    (out / "summary.md").write_text(markdown_table(summary))
    plot_vs(summary, "heads", "val_loss", "validation loss (nats/token)", out / "val_loss_vs_heads.png", "val loss vs H", mark_best=True)
    plot_vs(summary, "block_size", "val_loss", "validation loss (nats/token)", out / "val_loss_vs_block_size.png", "val loss vs S", mark_best=True)
    print(f"{len(rows)} trials ({sum(r['state'] == 'COMPLETE' for r in rows)} complete)")
    print(markdown_table(summary))
