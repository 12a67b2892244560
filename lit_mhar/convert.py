"""``lit-mhar convert``: a pretrained prenorm model -> an equivalent Delta-routed lit-mhar model.

Delta AttnRes (Luo, Cai, Hu et al., arXiv 2605.18855) keeps the residual stream and adds a gated,
routed sum of sublayer (or block) deltas to each sublayer input::

    input_l = h_l + gate_l * sum_i alpha_{i->l} v_i,    alpha = softmax_i(q_l . RMSNorm(v_i))

With every gate at zero the routed term vanishes exactly, so the converted model computes the
source model's function; the pseudo-queries start at zero as well (uniform routing, AttnRes
Sec. 3). Training then opens the gates: the MHAR paper's 8B mid-training starts this way, and the
Delta AttnRes fine-tuning of Qwen3-0.6B trains the routing parameters at about 100x the
backbone's learning rate (5e-3 vs 5e-5).

Sources:
- a lit-mhar checkpoint of a ``residual='prenorm'`` model (``.ckpt`` file);
- a local Hugging Face-format directory of a Llama (``LlamaForCausalLM``) or Qwen3
  (``Qwen3ForCausalLM``) model: ``config.json`` plus ``*.safetensors`` (one file, or shards listed
  in ``model.safetensors.index.json``). Read with ``safetensors``; nothing is downloaded and
  ``transformers`` is not used.

The output folder holds ``model.ckpt`` (a Lightning checkpoint of :class:`LitLM`, float32),
``fit.yaml`` (the ``model:`` section that continues training it with ``lit-mhar fit``),
``conversion.json`` (source, tensor map, the logit check) and the source's ``tokenizer.json`` when
it has one. The source is only read.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lit_mhar.checkpoint import read_checkpoint, tokenizer_candidates, write_checkpoint
from lit_mhar.config import ModelConfig
from lit_mhar.model import LM
from lit_mhar.outputs import check_output_dir, staged_directory

CHECKPOINT_NAME = "model.ckpt"
FIT_CONFIG_NAME = "fit.yaml"
REPORT_NAME = "conversion.json"
HF_INDEX_NAME = "model.safetensors.index.json"
OUTPUT_NAMES = (CHECKPOINT_NAME, FIT_CONFIG_NAME, REPORT_NAME, "tokenizer.json")  # all convert writes
# model_type -> the architectures (config.json "architectures") whose weights map onto lit-mhar's LM
HF_ARCHITECTURES: dict[str, tuple[str, ...]] = {"llama": ("LlamaForCausalLM",), "qwen3": ("Qwen3ForCausalLM",)}
# ModelConfig field -> the config.json key it comes from (for messages)
HF_KEYS = {
    "d_model": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "ffn_dim": "intermediate_size", "rope_base": "rope_theta", "norm_eps": "rms_norm_eps",
}  # fmt: skip
HF_SILU = ("silu", "swish")  # transformers' names of one function, x * sigmoid(x)
HF_DEFAULT_ROPE_THETA = 10000.0
# Saved by some older Llama checkpoints; a buffer recomputed from rope_theta, not a weight.
HF_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
LOGIT_TOLERANCE = 1e-5  # against lit-mhar's own prenorm LM: the same code, only the zero routing differs
HF_LOGIT_TOLERANCE = 1e-3  # against transformers' forward: other kernels and order of float32 sums


# ----------------------------------------------------------------------------- Hugging Face sources


def _hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json; a Hugging Face-format model directory holds config.json and *.safetensors")
    return json.loads(path.read_text())


def hf_model_config(hf: dict[str, Any], heads: int, block_size: int, seq_len: Optional[int], where: str = "config.json") -> ModelConfig:
    """The Delta-routed :class:`ModelConfig` of a Llama / Qwen3 ``config.json`` (as a dict).

    Maps hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
    attention heads), head_dim (default hidden_size / heads), intermediate_size, vocab_size,
    rms_norm_eps, rope_theta (or ``rope_parameters.rope_theta``; default 10000, as transformers'),
    max_position_embeddings (the default ``seq_len``); QK-norm for Qwen3, none for Llama.
    ``hidden_act`` ``silu`` or ``swish`` (one function) and ``rope_scaling`` / ``rope_parameters``
    of ``rope_type: default`` are the plain computation lit-mhar's LM does.

    Raises:
        ValueError: an architecture other than Llama / Qwen3, a missing key, or a feature lit-mhar's
            LM does not compute (biases, another activation, RoPE scaling, sliding window
            attention), or values lit-mhar's LM cannot take (num_key_value_heads not dividing
            num_attention_heads, ...); the message names config.json's keys.
    """
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    valid = ", ".join(f"{t} ({'/'.join(a)})" for t, a in HF_ARCHITECTURES.items())
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture model_type={model_type!r} (architectures={archs}); supported: {valid}")
    wrong = [a for a in archs if a not in HF_ARCHITECTURES[model_type]]
    if wrong:
        raise ValueError(f"{where}: unsupported architecture {wrong} for model_type={model_type!r}; supported: {valid}")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps")
    missing = [k for k in required if hf.get(k) is None]
    if seq_len is None and hf.get("max_position_embeddings") is None:
        missing.append("max_position_embeddings (or pass seq_len)")
    rope = hf.get("rope_parameters") or {}
    # transformers' default for Llama and Qwen3 when config.json leaves it out
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", HF_DEFAULT_ROPE_THETA))
    if missing:
        raise ValueError(f"{where}: missing {missing} (model_type={model_type!r})")
    unsupported = []
    if hf.get("hidden_act", "silu") not in HF_SILU:
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (lit-mhar's MLP is SwiGLU with SiLU: {' or '.join(map(repr, HF_SILU))})")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            unsupported.append(f"{key}=true (lit-mhar's projections have no bias)")
    # {"rope_type": "default"} (or "type") is plain RoPE as transformers computes it; any other kind scales it
    for key, value in (("rope_scaling", hf.get("rope_scaling")), ("rope_parameters", rope)):
        if value and (not isinstance(value, dict) or value.get("rope_type", value.get("type", "default")) != "default"):
            unsupported.append(f"{key}={value!r} (lit-mhar computes plain RoPE: rope_type 'default')")
    if hf.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true (lit-mhar attends over the whole causal context)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        unsupported.append(f"layer_types={sorted(layer_types)} (only full_attention)")
    if unsupported:
        raise ValueError(f"{where}: model_type={model_type!r} uses what lit-mhar cannot compute: {'; '.join(unsupported)}")
    def number(key: str, value: Any, kind: type) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{where}: {key}={value!r} must be {'an integer' if kind is int else 'a number'}")
        return kind(value)

    n_head = number("num_attention_heads", hf["num_attention_heads"], int)
    fields_ = dict(
        vocab_size=number("vocab_size", hf["vocab_size"], int),
        seq_len=seq_len if seq_len is not None else number("max_position_embeddings", hf["max_position_embeddings"], int),
        d_model=number("hidden_size", hf["hidden_size"], int),
        n_layer=number("num_hidden_layers", hf["num_hidden_layers"], int),
        n_head=n_head,
        n_kv_head=number("num_key_value_heads", hf.get("num_key_value_heads") or n_head, int),
        head_dim=number("head_dim", hf["head_dim"], int) if hf.get("head_dim") else None,
        ffn_dim=number("intermediate_size", hf["intermediate_size"], int),
        rope_base=number("rope_theta", rope_theta, float),
        norm_eps=number("rms_norm_eps", hf["rms_norm_eps"], float),
    )
    try:
        return ModelConfig(residual="delta", heads=heads, block_size=block_size, qk_norm=model_type == "qwen3", **fields_)
    except ValueError as e:
        # ModelConfig names its own fields; the user wrote config.json's keys (seq_len is convert's own option)
        keys = {**HF_KEYS, **({} if seq_len is not None else {"seq_len": "max_position_embeddings"})}
        message = re.sub(r"\b(" + "|".join(keys) + r")\b", lambda m: keys[m.group(1)], str(e).removeprefix("ModelConfig."))
        raise ValueError(f"{where}: {message}") from None


def hf_tensor_names(cfg: ModelConfig, tied: bool) -> dict[str, str]:
    """lit-mhar LM parameter name -> Hugging Face tensor name, for every backbone parameter.

    ``lm_head.weight`` maps to ``model.embed_tokens.weight`` when the source ties its embeddings.
    """
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    names["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
        **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    }
    if cfg.qk_norm:
        per_layer.update({f"attn.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"})
    for i in range(cfg.n_layer):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    return names


def hf_weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it (sharded via the index, or not).

    Raises:
        FileNotFoundError: no ``*.safetensors`` file, or a shard the index names is absent.
        ValueError: a tensor stored twice.
    """
    from safetensors import safe_open

    index = directory / HF_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = {name: directory / file for name, file in weight_map.items()}
        absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{index}: shard(s) {absent} are not in {directory}")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory}: no *.safetensors file (and no {HF_INDEX_NAME})")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"{directory}: tensor {name!r} is in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


def read_hf_weights(directory: Path, cfg: ModelConfig, tied: bool) -> tuple[dict[str, Tensor], dict[str, str], dict[str, str]]:
    """Loads the source's tensors as lit-mhar LM weights (float32).

    Returns:
        ``(weights, names, dtypes)``: the LM state dict of the backbone, lit-mhar name -> source
        name, and the source dtype of each source tensor.

    Raises:
        ValueError: missing tensors, tensors the mapping does not use (a bias, an extra module), a
            shape that differs from the config's, or an ``lm_head.weight`` that differs from the
            tied embedding; each message names the tensors.
    """
    from safetensors import safe_open

    files = hf_weight_files(directory)
    names = hf_tensor_names(cfg, tied)
    used = set(names.values())
    missing = sorted(used - set(files))
    if missing:
        raise ValueError(f"{directory}: missing tensor(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all)")
    extra = sorted(n for n in set(files) - used if not n.endswith(HF_IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight"))
    if extra:
        raise ValueError(
            f"{directory}: tensor(s) {extra[:10]}{' ...' if len(extra) > 10 else ''} have no place in lit-mhar's "
            f"{'Qwen3' if cfg.qk_norm else 'Llama'}-style model ({len(extra)} in all)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in used | ({"lm_head.weight"} if tied and "lm_head.weight" in files else set()):
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, Tensor] = {}
    dtypes: dict[str, str] = {}
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in wanted:
                t = f.get_tensor(name)
                dtypes[name] = str(t.dtype).removeprefix("torch.")
                tensors[name] = t.float()
    if tied and "lm_head.weight" in tensors and not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
        raise ValueError(f"{directory}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    weights = {ours: tensors[theirs] for ours, theirs in names.items()}
    return weights, names, dtypes


# ----------------------------------------------------------------------------- convert


def _check_output(output: Path, source: Path, overwrite: bool) -> None:
    out, src = output.resolve(), source.resolve()
    if out == src or out in src.parents or (src.is_dir() and src in out.parents):
        raise ValueError(f"output_dir={str(output)!r} overlaps the source {str(source)!r}; the source is never written to")
    check_output_dir(output, overwrite, OUTPUT_NAMES, "convert")


def _check_ids(cfg: ModelConfig, tokens: int, seed: int = 0) -> Tensor:
    """The random token ids ``[2, tokens]`` (int64) the logit checks run on."""
    return torch.randint(0, cfg.vocab_size, (2, min(tokens, cfg.seq_len)), generator=torch.Generator().manual_seed(seed))


def _verify(source_lm: LM, converted: LM, tokens: int, seed: int = 0) -> float:
    """max |logits(converted) - logits(source_lm)| on :func:`_check_ids` (float32): the converted
    model against lit-mhar's own prenorm LM holding the source's weights."""
    idx = _check_ids(converted.cfg, tokens, seed)
    source_lm.eval(), converted.eval()
    with torch.no_grad():
        return (converted(idx) - source_lm(idx)).abs().max().item()


def _verify_with_transformers(directory: Path, hf: dict[str, Any], converted: LM, tokens: int, seed: int = 0) -> dict[str, Any]:
    """The converted model's logits against the Hugging Face source's own forward in ``transformers``
    (float32, on :func:`_check_ids`), where ``transformers`` is installed.

    Returns:
        ``{"against", "max_abs_diff", "tolerance"}``, or ``{"against": None, "skipped": why}``
        without ``transformers`` or with an architecture it does not have.
    """
    try:
        import transformers
    except ImportError:
        return {"against": None, "skipped": "transformers is not installed"}
    arch = (hf.get("architectures") or HF_ARCHITECTURES[hf["model_type"]])[0]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on a folder without generation_config.json
    try:
        cls = getattr(transformers, arch, None)  # imports the model's module: it may fail to import
        if cls is None:
            return {"against": None, "skipped": f"transformers {transformers.__version__} has no {arch}"}
        dtype = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
        source = cls.from_pretrained(str(directory), local_files_only=True, attn_implementation="eager", **dtype).eval()
    except ImportError as e:  # a broken install, or a folder named like one of its dependencies on sys.path
        return {"against": None, "skipped": f"transformers {transformers.__version__} could not load {arch} ({e})"}
    finally:
        transformers.logging.set_verbosity(verbosity)
    idx = _check_ids(converted.cfg, tokens, seed)
    with torch.no_grad():
        diff = (converted.eval()(idx) - source(input_ids=idx).logits.float()).abs().max().item()
    return {"against": f"transformers {transformers.__version__} {arch}", "max_abs_diff": diff, "tolerance": HF_LOGIT_TOLERANCE}


def convert(
    source: str,
    output_dir: str,
    heads: int = 1,
    block_size: int = 1,
    seq_len: Optional[int] = None,
    lr: float = 5e-5,
    routing_lr_multiplier: float = 100.0,
    verify_tokens: int = 64,
    overwrite: bool = False,
) -> Path:
    """Convert a pretrained prenorm model into a Delta-routed lit-mhar model with the same logits.

    The routing sites get zero pseudo-queries and zero output gates (Delta AttnRes,
    arXiv 2605.18855), so ``input_l = h_l + 0 * routed`` and the converted model computes the
    source's logits exactly; every backbone weight is copied (float32). Run ``lit-mhar fit
    --config OUTPUT_DIR/fit.yaml --data.data_dir DATA`` to continue training it (mid-training).

    Args:
        source: A lit-mhar checkpoint (``.ckpt``) of a ``residual='prenorm'`` model, or a local
            Hugging Face-format directory of a Llama or Qwen3 model (``config.json`` +
            ``*.safetensors``, sharded or not). Only read, never downloaded.
        output_dir: Folder to write ``model.ckpt``, ``fit.yaml``, ``conversion.json`` (and the
            source's ``tokenizer.json``) into; must not exist or be empty unless ``overwrite``.
        heads: Routing heads H of the converted model (MHAR; must divide the width).
        block_size: Sublayers per block S (1: full Delta AttnRes, > 1: Delta Block).
        seq_len: Longest sequence of the converted model; default: the source's (HF:
            ``max_position_embeddings``). RoPE is computed, so any value keeps the logits.
        lr: Backbone peak learning rate stored for continued training (Delta AttnRes fine-tuning:
            5e-5).
        routing_lr_multiplier: Routing parameters train at ``lr`` times this (the paper: ~100x).
        verify_tokens: Tokens per sequence of the built-in checks (2 random sequences): the
            converted model's logits against lit-mhar's own prenorm model holding the source's
            weights (the conversion fails if they differ by more than 1e-5), and, for a Hugging
            Face source where ``transformers`` is installed, against the source model's own
            forward in ``transformers`` (fails above 1e-3). 0 skips both.
        overwrite: Replace an existing non-empty ``output_dir``.

    Returns:
        The output folder.

    Raises:
        FileNotFoundError: no source at that path (nothing is downloaded), or a shard is absent.
        FileExistsError: ``output_dir`` exists, is not empty and ``overwrite`` is false.
        ValueError: a source that is not prenorm, an unsupported architecture, missing or unknown
            tensors, shapes that do not match, bad ``heads`` / ``block_size``; checked before any
            output is written. Also a source whose own forward in ``transformers`` differs from
            the converted model's (its config asks for something lit-mhar does not compute;
            nothing is written).
        RuntimeError: the converted model differs from lit-mhar's prenorm model with the same
            weights (a bug; nothing is written).
    """
    src, out = Path(source).expanduser(), Path(output_dir).expanduser()
    if not src.exists():
        raise FileNotFoundError(
            f"source={source!r} does not exist; give a lit-mhar .ckpt file or a local Hugging Face model "
            "directory (config.json + *.safetensors); nothing is downloaded"
        )
    for name, value, low in (("heads", heads, 1), ("block_size", block_size, 1), ("verify_tokens", verify_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not (lr > 0 and routing_lr_multiplier > 0):
        raise ValueError(f"lr={lr} and routing_lr_multiplier={routing_lr_multiplier} must be > 0")
    _check_output(out, src, overwrite)

    report: dict[str, Any] = {"source": str(src.resolve())}
    if src.is_dir():
        hf = _hf_config(src)
        cfg = hf_model_config(hf, heads, block_size, seq_len, where=str(src / "config.json"))
        tied = bool(hf.get("tie_word_embeddings", False))
        source_lm = LM(ModelConfig(**{**cfg.to_dict(), "residual": "prenorm", "heads": 1, "block_size": 1}))
        weights, names, dtypes = read_hf_weights(src, source_lm.cfg, tied)
        report.update(format=f"hf-{hf['model_type']}", source_config=hf, tied_embeddings=tied, tensor_map=names, source_dtypes=dtypes)
        tokenizers = [src / "tokenizer.json"]
    else:
        source_cfg, weights, checkpoint = read_checkpoint(src)
        tokenizers = tokenizer_candidates(src, checkpoint)  # beside it, or its training data's
        if source_cfg.residual != "prenorm":
            raise ValueError(
                f"source={source!r} is a residual={source_cfg.residual!r} model; convert takes a prenorm model "
                "(it already routes across depth)"
            )
        cfg = ModelConfig(**{**source_cfg.to_dict(), "residual": "delta", "heads": heads, "block_size": block_size, "seq_len": seq_len or source_cfg.seq_len})
        source_lm = LM(ModelConfig(**{**cfg.to_dict(), "residual": "prenorm", "heads": 1, "block_size": 1}))
        report.update(format="lit-mhar", source_config=source_cfg.to_dict(), source_global_step=checkpoint.get("global_step"))
        weights = {k: v.to(torch.float32, copy=True) for k, v in weights.items()}  # not the file's mmap
    # strict: every backbone parameter comes from the source, with the shape the config implies
    expected = {k: tuple(v.shape) for k, v in source_lm.state_dict().items()}
    wrong = {k: (tuple(v.shape), expected[k]) for k, v in weights.items() if k in expected and tuple(v.shape) != expected[k]}
    if wrong:
        described = "; ".join(f"{report.get('tensor_map', {}).get(k, k)}: {s} (expected {e})" for k, (s, e) in list(wrong.items())[:10])
        raise ValueError(f"source={source!r}: tensor shapes do not match its config: {described}")
    source_lm.load_state_dict(weights, strict=True, assign=True)

    converted = LM(cfg)
    missing, unexpected = converted.load_state_dict(source_lm.state_dict(), strict=False, assign=True)
    routing_ids = {id(p) for p in converted.routing_parameters()}
    routing = {n for n, p in converted.named_parameters() if id(p) in routing_ids}
    if unexpected or set(missing) != routing:
        raise RuntimeError(f"lit-mhar LM layout changed: unexpected {unexpected}, missing non-routing {sorted(set(missing) - routing)}")
    for site in converted.routing_sites():
        site.reset_parameters()  # zero queries and gates, unit key gains: identity at step 0
    diff = _verify(source_lm, converted, verify_tokens) if verify_tokens else None
    if diff is not None and not diff <= LOGIT_TOLERANCE:
        raise RuntimeError(
            f"converted logits differ from lit-mhar's prenorm model with the source's weights by {diff:.3g} > {LOGIT_TOLERANCE}; nothing written"
        )
    del source_lm
    source_check = None
    if src.is_dir() and verify_tokens:
        source_check = _verify_with_transformers(src, hf, converted, verify_tokens)
        if source_check.get("against") and not source_check["max_abs_diff"] <= HF_LOGIT_TOLERANCE:
            raise ValueError(
                f"converted logits differ from the source model's own forward ({source_check['against']}) by "
                f"{source_check['max_abs_diff']:.3g} > {HF_LOGIT_TOLERANCE}: {src / 'config.json'} asks for something lit-mhar's "
                "LM does not compute; nothing written"
            )

    import lightning
    import yaml

    from lit_mhar import __version__

    with staged_directory(out, before_replace=lambda: check_output_dir(out, overwrite, OUTPUT_NAMES, "convert")) as tmp:
        report.update(
            output_config=cfg.to_dict(),
            logit_check={
                "against": "lit-mhar's prenorm LM with the source's weights", "max_abs_diff": diff, "tolerance": LOGIT_TOLERANCE,
                "tokens": verify_tokens, "sequences": 2, "dtype": "float32",
            },
            source_check=source_check,
            lr=lr,
            routing_lr_multiplier=routing_lr_multiplier,
            versions={"lit_mhar": __version__, "torch": torch.__version__, "lightning": lightning.__version__, "python": sys.version.split()[0]},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        meta = {k: report[k] for k in ("source", "format", "logit_check", "created")}
        write_checkpoint(
            tmp / CHECKPOINT_NAME,
            cfg,
            converted.state_dict(),
            {"lr": lr, "routing_lr_multiplier": routing_lr_multiplier},
            {"lit_mhar_conversion": meta},
        )
        linked = ("vocab_size", "seq_len")  # set from the data by the CLI's links
        # a fixed seed and a validation interval that counts steps across epochs, so a short
        # mid-training run is reproducible and validated (override on the command line)
        fit = {"seed_everything": 1234, "trainer": {"val_check_interval": 100, "check_val_every_n_epoch": None}, "model": {"config": {k: v for k, v in cfg.to_dict().items() if k not in linked}, "lr": lr, "routing_lr_multiplier": routing_lr_multiplier, "init_from": str((out / CHECKPOINT_NAME).resolve())}}
        header = (
            f"# Written by lit-mhar convert from {src.resolve()}.\n"
            "# Mid-training of the converted model (new run, step 0; routing at lr * routing_lr_multiplier):\n"
            f"#   lit-mhar fit --config {out / FIT_CONFIG_NAME} --data.data_dir DATA --data.seq_len N\n"
            "# DATA must be tokenised with the source model's tokenizer (lit-mhar prepare --tokenizer ...).\n"
        )
        (tmp / FIT_CONFIG_NAME).write_text(header + yaml.safe_dump(fit, sort_keys=False))
        tokenizer = next((t for t in tokenizers if t.is_file()), None)
        if tokenizer is not None:  # so `generate` and `prepare --tokenizer` find it beside the model
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        report["tokenizer"] = str(tokenizer.resolve()) if tokenizer is not None else None
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    if diff is None:
        checked = "logits not checked (verify_tokens=0)"
    else:
        checked = f"logits checked on random ids against lit-mhar's prenorm model with the same weights: max |difference| {diff:.3g}"
        if source_check is None:
            checked += " (the source is that model)"
        elif source_check.get("against"):
            checked += f"; against the source's own forward in {source_check['against']}: {source_check['max_abs_diff']:.3g}"
        else:
            hint = ": pip install transformers to check that too" if "not installed" in source_check["skipped"] else ""
            checked += f"; not against the source's own forward ({source_check['skipped']}{hint})"
    print(f"[lit-mhar convert] {report['format']} {src} -> {out} (delta, heads={cfg.heads}, block_size={cfg.block_size}); {checked}")
    return out
