"""Optuna sweeps over heads H, block size S and scale, tracked in MLflow.

``lit-mhar sweep run --config sweeps/h_sweep.yaml`` runs (or resumes) a study:
:func:`lit_mhar.sweeps.runner.run`. ``lit-mhar sweep report --study NAME`` writes its tables and
plots: :func:`lit_mhar.sweeps.report.report`. The sweep file format is described in
:mod:`lit_mhar.sweeps.space`.
"""

from __future__ import annotations

from typing import Callable


def commands() -> list[Callable]:
    """The ``lit-mhar sweep`` subcommands (``run``, ``report``), for jsonargparse's ``CLI``."""
    from lit_mhar.sweeps.report import report
    from lit_mhar.sweeps.runner import run

    return [run, report]
