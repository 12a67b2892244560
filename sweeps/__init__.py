"""Optuna sweeps over heads H, block size S and scale, tracked in MLflow."""
