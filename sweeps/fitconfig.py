"""How the sweep reads a fit config: parsed by the fit CLI itself, and the model it describes."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import yaml


def resolve_fit_config(config: dict[str, Any]) -> dict[str, Any]:
    """Parses ``config`` with the fit CLI (``lit-mhar fit --config X --print_config``) in this process.

    Returns the fully resolved config (every default filled in). Nothing is instantiated.

    Raises:
        ValueError: the fit CLI rejects the config (unknown key, wrong type); the message is its error.
    """
    import tempfile

    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    from lit_mhar.cli.lightning import run_lightning

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f, sort_keys=False)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_lightning(["fit", "--config", f.name, "--print_config"])
        code: Any = 0
    except SystemExit as e:
        code = e.code
    finally:
        os.unlink(f.name)
    if code not in (0, None):
        message = "\n".join(line for line in err.getvalue().splitlines() if line.strip() and not line.startswith(("usage:", "tip:", " ")))
        raise ValueError(f"the fit CLI rejects this config: {message or err.getvalue().strip()}")
    return yaml.safe_load(out.getvalue())


def model_fields(resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved model config validated by :class:`ModelConfig` (raises its ValueError, which names the field)."""
    from lit_mhar.config import ModelConfig

    fields = dict(resolved["model"]["config"])
    if fields.get("seq_len") is None:  # linked from the data at instantiation
        fields["seq_len"] = resolved["data"]["seq_len"]
    config = ModelConfig(**fields)
    return {k: getattr(config, k) for k in ("name", "residual", "heads", "block_size", "d_model", "n_layer", "seq_len")}


def flops_per_token(resolved: dict[str, Any]) -> float:
    """Training FLOPs per token of the resolved config's model (:meth:`lit_mhar.model.LM.flops_per_token`),
    built on the meta device (no memory, no time)."""
    import torch

    from lit_mhar.config import ModelConfig
    from lit_mhar.model import LM

    fields = dict(resolved["model"]["config"])
    seq_len = int(resolved["data"]["seq_len"])
    fields["seq_len"] = fields.get("seq_len") or seq_len
    fields["vocab_size"] = fields.get("vocab_size") or _vocab_size(resolved)
    with torch.device("meta"):
        model = LM(ModelConfig(**fields))
    return model.flops_per_token(seq_len)


def _vocab_size(resolved: dict[str, Any]) -> int:
    """The vocabulary the data gives the model (its manifest), or the default 8192 before the data exists."""
    import json
    from pathlib import Path

    path = Path(str(resolved["data"]["data_dir"])).expanduser() / "manifest.json"
    return int(json.loads(path.read_text())["vocab_size"]) if path.is_file() else 8192
