"""lit-mhar checkpoints: reading, checking and writing them, and finding their tokenizer.

Every command that reads a checkpoint (``fit --ckpt_path`` and ``--model.init_from``,
``validate`` / ``test`` / ``predict``, ``generate``, ``probe``, ``convert``) goes through
:func:`load_checkpoint_file`, so an unreadable file, one that is not a lit-mhar checkpoint, and one
whose weights are not finite (a fit that diverged) give the same one-line error everywhere.

This module sits below training and the analysis verbs: it imports torch and the model config only.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from lit_mhar.config import ModelConfig

# Where a fit saves its checkpoints, as the errors about a missing one name it.
CHECKPOINT_LAYOUT = "runs/<experiment id>/<run id>/checkpoints"
TOKENIZER_NAME = "tokenizer.json"  # as lit_mhar.data.TOKENIZER_NAME (not imported: it pulls in litdata)
MANIFEST_NAME = "manifest.json"  # as lit_mhar.data.MANIFEST_NAME
# ModelConfig fields an init_from run may change: RoPE is computed from seq_len, not stored, and
# data tokenised with the source's tokenizer may use fewer ids than its (padded) embedding table.
_FREE_FIELDS = ("name", "seq_len", "vocab_size", "init_std")


class UnreadableCheckpoint(ValueError):
    """A file ``torch.load`` cannot read at all (not a torch checkpoint, or a truncated one):
    :func:`load_checkpoint_file`'s error, naming the file."""


class NonFiniteCheckpoint(ValueError):
    """A checkpoint whose model weights hold NaN or infinity (saved by a fit that diverged)."""


def load_checkpoint_file(path: str | os.PathLike, weights_only: bool = True, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The dict of a torch checkpoint file, memory-mapped (tensors are paged in when used).

    Args:
        path: The file.
        weights_only: ``torch.load``'s safe mode (no code from the file runs; :class:`ModelConfig`
            is allowed). False reads anything Lightning writes (what Lightning itself does).
        map_location: Where tensors go.

    Raises:
        FileNotFoundError: no such file.
        UnreadableCheckpoint: (a ValueError) ``torch.load`` cannot read it: a truncated or
            damaged file, or not a checkpoint at all (a YAML passed as one); one line naming it.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist (or is not a file); give a lit-mhar checkpoint file "
            f"({CHECKPOINT_LAYOUT}/last.ckpt)"
        )
    try:
        with torch.serialization.safe_globals([ModelConfig]):
            checkpoint = torch.load(p, map_location=map_location, weights_only=weights_only, mmap=True)
    except Exception as e:  # a truncated file, a YAML: RuntimeError, UnpicklingError, EOFError, ...
        raise UnreadableCheckpoint(
            f"{p}: not a lit-mhar checkpoint (torch.load could not read it: {type(e).__name__}); give a lit-mhar checkpoint "
            f"file ({CHECKPOINT_LAYOUT}/last.ckpt), a complete one: a truncated file (a copy or a save that did not finish) "
            "cannot be read"
        ) from e
    if not isinstance(checkpoint, dict):
        raise UnreadableCheckpoint(f"{p}: not a lit-mhar checkpoint (it holds a {type(checkpoint).__name__}, not a dict)")
    return checkpoint


def check_finite_weights(state_dict: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Raises :class:`NonFiniteCheckpoint` when a floating-point tensor of ``state_dict`` holds NaN
    or infinity, naming the first such tensor, how many there are and what to do.

    Reads every tensor once (a checkpoint about to be used is read anyway)."""
    bad = [k for k, v in state_dict.items() if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        raise NonFiniteCheckpoint(
            f"{path}: the model's weights are not finite (NaN or inf in {bad[0]!r}{more}): it was saved by a fit that "
            "diverged. Use an earlier checkpoint of that run, or train again with a lower --model.lr"
        )


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> tuple[ModelConfig, dict[str, Tensor], dict[str, Any]]:
    """The model config, LM weights and the whole dict of a lit-mhar (:class:`LitLM`) checkpoint.

    Reads with :func:`load_checkpoint_file` (``weights_only``, memory-mapped). The config is
    ``hyper_parameters["config"]``, a dict (checkpoints written by the CLI or ``convert``) or a
    :class:`ModelConfig` (a LitLM built in Python).

    Returns:
        ``(config, weights, checkpoint)``: weights are the ``LM`` state dict (the ``model.`` entries
        of ``checkpoint["state_dict"]``, prefix removed), finite.

    Raises:
        FileNotFoundError: no such file.
        UnreadableCheckpoint: (a ValueError) the file is not a torch checkpoint, or truncated.
        NonFiniteCheckpoint: (a ValueError) a weight holds NaN or infinity.
        ValueError: the file has no LitLM hyperparameter ``config`` or no
            ``model.*`` weights, or the config has fields this version does not know.
    """
    p = Path(path)
    checkpoint = load_checkpoint_file(p, map_location=map_location)
    config = (checkpoint.get("hyper_parameters") or {}).get("config")
    if config is None:
        raise ValueError(f"{p}: not a lit-mhar checkpoint (no LitLM hyper_parameters['config'])")
    if isinstance(config, dict):
        known = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{p}: config has unknown ModelConfig field(s) {unknown}; valid: {sorted(known)}")
        config = ModelConfig(**config)
    elif not isinstance(config, ModelConfig):
        raise ValueError(f"{p}: hyper_parameters['config'] is a {type(config).__name__}, expected a dict or ModelConfig")
    weights = {k[len("model.") :]: v for k, v in checkpoint.get("state_dict", {}).items() if k.startswith("model.")}
    if not weights:
        raise ValueError(f"{p}: no model.* weights in state_dict")
    check_finite_weights(weights, p)
    return config, weights, checkpoint


def resolve_init_config(config: ModelConfig, source: ModelConfig, path: str) -> ModelConfig:
    """The config of a run started from checkpoint ``path`` whose config is ``source`` (see LitLM ``init_from``).

    Every field but ``seq_len``, ``vocab_size`` (``config``'s may not exceed ``source``'s), ``name``
    and ``init_std`` must agree; the result is ``source`` with ``config``'s ``seq_len``.

    Raises:
        ValueError: naming every field that differs, or a vocabulary larger than the checkpoint's.
    """
    if not isinstance(config, ModelConfig):
        config = ModelConfig(**config)
    differ = [
        f"{f.name}: given {getattr(config, f.name)!r}, checkpoint {getattr(source, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(config, f.name) != getattr(source, f.name)
    ]
    if differ:
        raise ValueError(
            f"init_from={path!r}: model.config does not describe the checkpoint's model ({'; '.join(differ)}). "
            f"Pass the checkpoint's config, e.g. --config {Path(path).parent / 'fit.yaml'} as written by lit-mhar convert"
        )
    if config.vocab_size > source.vocab_size:
        raise ValueError(
            f"init_from={path!r}: the data's vocabulary ({config.vocab_size} ids) is larger than the checkpoint's "
            f"embedding table ({source.vocab_size}); tokenise the data with the source model's tokenizer"
        )
    return ModelConfig(**{**source.to_dict(), "seq_len": config.seq_len})


def write_checkpoint(path: Path, config: ModelConfig, weights: dict[str, Tensor], hparams: dict[str, Any], extra: dict[str, Any]) -> None:
    """Writes a step-0 Lightning checkpoint of :class:`LitLM` that ``LitLM.load_from_checkpoint``,
    ``lit-mhar validate|test --ckpt_path`` and ``--model.init_from`` read.

    ``weights`` is the LM's state dict, stored under LitLM's ``model.`` prefix. Hyperparameters hold the config as a dict and the
    CLI's instantiator, as checkpoints written by ``lit-mhar fit`` do; no optimizer state (it is
    not a run to resume).
    """
    import lightning

    state = {f"model.{k}": v for k, v in weights.items()}
    checkpoint = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": state,
        "hparams_name": "kwargs",
        "hyper_parameters": {"config": config.to_dict(), **hparams, "_instantiator": "lightning.pytorch.cli.instantiate_module"},
        **extra,
    }
    torch.save(checkpoint, path)


def _data_dirs(ckpt: str | os.PathLike, checkpoint: dict[str, Any]) -> list[Path]:
    """The dataset folder of the checkpoint's DataModule hyperparameters (``data_dir``, which
    ``lit-mhar fit`` checkpoints store), where it may be now: as stored when absolute; a relative
    one was relative to the folder training ran in, which is not stored, so it is looked for from
    each folder above the checkpoint (nearest first; ``lit-mhar fit`` writes checkpoints under
    ``runs/`` in the folder it runs in), then from the current folder."""
    data_dir = (checkpoint.get("datamodule_hyper_parameters") or {}).get("data_dir")
    if not data_dir:
        return []
    data = Path(str(data_dir)).expanduser()
    if data.is_absolute():
        return [data]
    roots = [*Path(ckpt).expanduser().absolute().parent.parents, Path.cwd()]
    return list(dict.fromkeys(root / data for root in roots))


def tokenizer_candidates(ckpt: str | os.PathLike, checkpoint: dict[str, Any]) -> list[Path]:
    """Where the tokenizer of a checkpoint may be, in the order looked at: ``tokenizer.json`` beside
    the checkpoint (``lit-mhar convert`` writes it there), then in the dataset folder of the
    checkpoint's DataModule hyperparameters (see :func:`_data_dirs`)."""
    paths = [Path(ckpt).expanduser().parent / TOKENIZER_NAME]
    paths += [d / TOKENIZER_NAME for d in _data_dirs(ckpt, checkpoint) if d / TOKENIZER_NAME not in paths]
    return paths


def training_vocabulary(ckpt: str | os.PathLike, checkpoint: dict[str, Any], config: ModelConfig) -> tuple[int, str]:
    """The vocabulary size the model of a checkpoint was trained on, and where that comes from.

    In order: the ``vocab_size`` of its training data's ``manifest.json`` (the data may use fewer
    ids than a padded embedding table, as data tokenised for a converted Hugging Face model does);
    the size of the ``tokenizer.json`` beside the checkpoint (``lit-mhar convert`` writes the
    source's there); else the model's embedding table, ``config.vocab_size``.

    Returns:
        ``(ids, where)``: the size and a phrase naming its source, for messages.
    """
    import json

    for data in _data_dirs(ckpt, checkpoint):
        manifest = data / MANIFEST_NAME
        if manifest.is_file():
            try:
                return int(json.loads(manifest.read_text())["vocab_size"]), f"its training data ({manifest})"
            except (ValueError, KeyError, TypeError):
                pass  # not a manifest lit-mhar can read: look further
    beside = Path(ckpt).expanduser().parent / TOKENIZER_NAME
    if beside.is_file():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(beside)).get_vocab_size(with_added_tokens=True), f"the tokenizer beside the checkpoint ({beside})"
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception on a file it cannot parse
            pass
    return config.vocab_size, "the model's embedding table (vocab_size)"
