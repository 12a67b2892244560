"""``lit-mhar convert``: a converted model's logits are its source's, for every source format.

Hugging Face sources are small random models the tests write with the real tensor names of Llama
and Qwen3; their logits come from an independent plain-torch forward over the safetensors files
(the architecture as transformers computes it), not from lit-mhar's LM.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from lit_mhar.cli import main
from lit_mhar.config import ModelConfig
from lit_mhar.checkpoint import read_checkpoint, write_checkpoint
from lit_mhar.convert import convert
from lit_mhar.model import LM
from lit_mhar.module import LitLM

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- source models


def hf_config(model_type: str, **overrides) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 80,
        "vocab_size": 131,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100.0,  # small, so positions matter on a few tokens
        "max_position_embeddings": 64,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if model_type == "qwen3":
        # Qwen3's head_dim is independent of hidden_size / heads (0.6B: 1024 wide, 16 heads of 128)
        cfg.update(head_dim=16, attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        cfg.update(attention_bias=False, mlp_bias=False, rope_scaling=None, pretraining_tp=1)
    cfg.update(overrides)
    return cfg


def hf_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the real transformers names; scaled so every one changes the logits."""
    g = torch.Generator().manual_seed(seed)
    d, L, H, KV, ffn, V = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"))
    hd = cfg.get("head_dim") or d // H
    mat = lambda o, i: torch.randn(o, i, generator=g) / math.sqrt(i)  # noqa: E731
    gain = lambda n: 1 + 0.5 * torch.randn(n, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": 0.05 * torch.randn(V, d, generator=g), "model.norm.weight": gain(d)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = gain(d)
        t[p + "post_attention_layernorm.weight"] = gain(d)
        t[p + "self_attn.q_proj.weight"] = mat(H * hd, d)
        t[p + "self_attn.k_proj.weight"] = mat(KV * hd, d)
        t[p + "self_attn.v_proj.weight"] = mat(KV * hd, d)
        t[p + "self_attn.o_proj.weight"] = mat(d, H * hd)
        if cfg["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = gain(hd)
            t[p + "self_attn.k_norm.weight"] = gain(hd)
        t[p + "mlp.gate_proj.weight"] = mat(ffn, d)
        t[p + "mlp.up_proj.weight"] = mat(ffn, d)
        t[p + "mlp.down_proj.weight"] = mat(d, ffn)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = 0.3 * mat(V, d)
    return t


def write_hf(directory: Path, cfg: dict, tensors: dict[str, torch.Tensor], sharded: bool, dtype=torch.float32) -> Path:
    """A Hugging Face-format model folder: config.json + model.safetensors, or 2 shards + index."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def reference_logits(directory: Path, idx: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Llama / Qwen3 forward (float64 by default) from config.json and the safetensors files, as transformers computes it."""
    cfg = json.loads((directory / "config.json").read_text())
    W: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        W.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    H, KV, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    B, T = idx.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=dtype) / hd)
    freqs = torch.outer(torch.arange(T, dtype=dtype), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    x = W["model.embed_tokens.weight"][idx]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        if cfg["model_type"] == "qwen3":
            q, k = rms(q, W[p + "self_attn.q_norm.weight"]), rms(k, W[p + "self_attn.k_norm.weight"])
        q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(hd) + mask).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, H * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    return rms(x, W["model.norm.weight"]) @ head.T


def converted_logits(output: Path, idx: torch.Tensor) -> torch.Tensor:
    cfg, weights, _ = read_checkpoint(output / "model.ckpt")
    model = LM(cfg)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(idx)


def tree_digest(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + f.read_bytes() + str(f.stat().st_mtime_ns).encode())
    return h.hexdigest()


def random_ids(vocab: int, T: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------- logits equal the source's

HF_CASES = {
    # id: (model_type, config overrides, sharded, stored dtype, routing heads, block size)
    "qwen3-tied-headdim16-onefile-full-H1": ("qwen3", {"tie_word_embeddings": True}, False, torch.float32, 1, 1),
    "qwen3-untied-bf16-sharded-block2-H8": ("qwen3", {}, True, torch.bfloat16, 8, 2),
    "llama-untied-sharded-full-H4": ("llama", {}, True, torch.float32, 4, 1),
    "llama-tied-bf16-onefile-block3-H2": ("llama", {"tie_word_embeddings": True}, False, torch.bfloat16, 2, 3),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_model_converts_to_delta_with_the_source_logits(case, tmp_path):
    model_type, overrides, sharded, dtype, heads, block = HF_CASES[case]
    cfg = hf_config(model_type, **overrides)
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), sharded, dtype)
    if model_type == "llama" and not sharded:  # older Llama checkpoints store this buffer; it is not a weight
        extra = load_file(str(src / "model.safetensors"))
        extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        save_file(extra, str(src / "model.safetensors"))
    out = convert(str(src), str(tmp_path / "out"), heads=heads, block_size=block)
    idx = random_ids(cfg["vocab_size"])
    expected = reference_logits(src, idx)
    got = converted_logits(out, idx)
    assert got.dtype == torch.float32 and got.shape == (3, 24, cfg["vocab_size"])
    assert (got.double() - expected).abs().max().item() <= 1e-5
    assert expected.std() > 0.2, "logits this small would not test the mapping"
    model_cfg, weights, ckpt = read_checkpoint(out / "model.ckpt")
    assert (model_cfg.residual, model_cfg.heads, model_cfg.block_size) == ("delta", heads, block)
    assert model_cfg.qk_norm == (model_type == "qwen3") and model_cfg.head_dim == cfg.get("head_dim", 12)
    assert model_cfg.rope_base == cfg["rope_theta"] and model_cfg.norm_eps == cfg["rms_norm_eps"]
    routing = [k for k in weights if k.endswith((".query", ".gate"))]
    assert len(routing) == 2 * (2 * cfg["num_hidden_layers"] + 1) and all(not weights[k].any() for k in routing)
    report = json.loads((out / "conversion.json").read_text())
    assert report["format"] == f"hf-{model_type}" and report["logit_check"]["max_abs_diff"] <= 1e-5
    assert report["source_dtypes"]["model.norm.weight"] == str(dtype).removeprefix("torch.")
    assert ckpt["lit_mhar_conversion"]["format"] == f"hf-{model_type}"


def test_reference_forward_notices_a_wrong_mapping(tmp_path):
    """The check above could fail: swapping two weights of the same shape moves the logits by far more than 1e-5."""
    cfg = hf_config("qwen3")
    tensors = hf_tensors(cfg)
    idx = random_ids(cfg["vocab_size"])
    good = reference_logits(write_hf(tmp_path / "good", cfg, tensors, False), idx)
    for a, b in (("input_layernorm", "post_attention_layernorm"), ("self_attn.q_norm", "self_attn.k_norm"), ("mlp.gate_proj", "mlp.up_proj")):
        swapped = dict(tensors)
        swapped[f"model.layers.1.{a}.weight"], swapped[f"model.layers.1.{b}.weight"] = tensors[f"model.layers.1.{b}.weight"], tensors[f"model.layers.1.{a}.weight"]
        bad = reference_logits(write_hf(tmp_path / a, cfg, swapped, False), idx)
        assert (bad - good).abs().max() > 1e-2, f"swapping {a} and {b} went unnoticed"


@pytest.mark.parametrize("heads,block", [(1, 1), (4, 1), (2, 3)], ids=["full-H1", "full-H4", "block3-H2"])
def test_lit_mhar_prenorm_checkpoint_converts_with_the_source_logits(heads, block, tmp_path):
    cfg = ModelConfig(d_model=32, n_layer=3, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=32)
    source = LM(cfg)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.3 * torch.randn_like(p))  # norms away from 1, larger weights: every weight matters
    write_checkpoint(tmp_path / "prenorm.ckpt", cfg, source.state_dict(), {}, {})
    digest = tree_digest(tmp_path / "prenorm.ckpt")
    out = convert(str(tmp_path / "prenorm.ckpt"), str(tmp_path / "out"), heads=heads, block_size=block, seq_len=48)
    idx = random_ids(97, 40)
    with torch.no_grad():
        expected = LM(ModelConfig(**{**cfg.to_dict(), "seq_len": 48}))
        expected.load_state_dict(source.state_dict())
        expected = expected.eval()(idx)
    assert (converted_logits(out, idx) - expected).abs().max().item() <= 1e-5
    assert tree_digest(tmp_path / "prenorm.ckpt") == digest, "the source checkpoint was modified"


def test_converted_checkpoint_loads_in_litlm_with_the_mid_training_learning_rates(tmp_path):
    cfg = hf_config("llama", vocab_size=64)
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), False)
    (src / "tokenizer.json").write_text("{}")
    out = convert(str(src), str(tmp_path / "out"), heads=4, block_size=2)
    assert sorted(p.name for p in out.iterdir()) == ["conversion.json", "fit.yaml", "model.ckpt", "tokenizer.json"]
    lit = LitLM.load_from_checkpoint(out / "model.ckpt")  # weights_only, through the CLI's instantiator
    assert lit.config.residual == "delta" and lit.config.qk_norm is False
    assert lit.hparams.lr == 5e-5 and lit.hparams.routing_lr_multiplier == 100.0
    assert all(not p.any() for n, p in lit.model.named_parameters() if n.endswith(("query", "gate")))
    fit = yaml.safe_load((out / "fit.yaml").read_text())["model"]
    assert fit["init_from"] == str((out / "model.ckpt").resolve()) and fit["routing_lr_multiplier"] == 100.0
    assert {"vocab_size", "seq_len"}.isdisjoint(fit["config"]), "the CLI links these from the data"


# ----------------------------------------------------------------------------- refusals


def test_source_is_read_only_and_existing_output_is_refused_unless_overwrite(tmp_path):
    cfg = hf_config("qwen3")
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), True, torch.bfloat16)
    digest = tree_digest(src)
    convert(str(src), str(tmp_path / "out"))
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(str(src), str(tmp_path / "out"), heads=2)
    assert read_checkpoint(tmp_path / "out" / "model.ckpt")[0].heads == 1
    convert(str(src), str(tmp_path / "out"), heads=2, overwrite=True)
    assert read_checkpoint(tmp_path / "out" / "model.ckpt")[0].heads == 2
    for inside in (src / "converted", src, tmp_path):
        with pytest.raises(ValueError, match="overlaps the source"):
            convert(str(src), str(inside), overwrite=True)
    assert tree_digest(src) == digest, "the source folder was modified"
    assert not list(tmp_path.glob(".*tmp*")), "a temporary folder was left behind"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c, t: c.update(model_type="mistral", architectures=["MistralForCausalLM"]), "unsupported architecture model_type='mistral'"),
        (lambda c, t: c.update(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
        (lambda c, t: t.pop("model.layers.2.mlp.down_proj.weight"), r"missing tensor\(s\) \['model.layers.2.mlp.down_proj.weight'\]"),
        (lambda c, t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}), "model.layers.0.self_attn.q_proj.bias"),
        (lambda c, t: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (lambda c, t: c.update(use_sliding_window=True), "use_sliding_window"),
        (lambda c, t: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda c, t: c.pop("rms_norm_eps"), r"missing \['rms_norm_eps'\]"),
        (lambda c, t: t.update({"model.norm.weight": torch.ones(40)}), r"model.norm.weight: \(40,\) \(expected \(48,\)\)"),
    ],
    ids=["mistral", "classifier-head", "missing-tensor", "bias", "rope-scaling", "sliding-window", "gelu", "missing-key", "wrong-shape"],
)
def test_unsupported_sources_are_refused_naming_the_problem(edit, message, tmp_path):
    cfg = hf_config("qwen3")
    tensors = hf_tensors(cfg)
    edit(cfg, tensors)
    src = write_hf(tmp_path / "src", cfg, tensors, False)
    with pytest.raises(ValueError, match=message):
        convert(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_source_shard_or_routed_source_or_bad_heads_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        convert("Qwen/Qwen3-0.6B", str(tmp_path / "out"))
    cfg = hf_config("llama")
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), True)
    with pytest.raises(ValueError, match="heads=5 must divide hidden_size=48"):
        convert(str(src), str(tmp_path / "out"), heads=5)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        convert(str(src), str(tmp_path / "out"))
    routed = ModelConfig(residual="attnres", heads=2, d_model=32, n_layer=1, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=50, seq_len=8)
    write_checkpoint(tmp_path / "mhar.ckpt", routed, LM(routed).state_dict(), {}, {})
    with pytest.raises(ValueError, match="residual='attnres' model; convert takes a prenorm model"):
        convert(str(tmp_path / "mhar.ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_head_dim_and_qk_norm_config():
    cfg = ModelConfig(d_model=48, n_head=4, n_kv_head=2, head_dim=16, qk_norm=False)
    model = LM(cfg)
    assert model.blocks[0].attn.q_proj.weight.shape == (64, 48) and model.blocks[0].attn.o_proj.weight.shape == (48, 64)
    assert not any("q_norm" in n or "k_norm" in n for n, _ in model.named_parameters())
    assert ModelConfig(d_model=48, n_head=4).head_dim == 12 and ModelConfig().qk_norm is True
    with pytest.raises(ValueError, match="head_dim=7 must be an even integer"):
        ModelConfig(head_dim=7)
    with pytest.raises(ValueError, match="n_head=5 must divide d_model=48 .or set head_dim."):
        ModelConfig(d_model=48, n_head=5, n_kv_head=1)
    assert ModelConfig(d_model=48, n_head=5, n_kv_head=1, head_dim=8).head_dim == 8


# ----------------------------------------------------------------------------- mid-training through the CLI


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A tiny dataset from a few real stdlib modules, prepared through the CLI (vocabulary 400)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / "json" / name) for name in ("__init__.py", "decoder.py", "encoder.py")] + [str(stdlib / "textwrap.py"), str(stdlib / "shlex.py")]
    out = tmp_path_factory.mktemp("corpus") / "data"
    args = ["prepare", "--output_dir", str(out), "--source", "files", "--vocab_size", "400", "--val_fraction", "0.3", "--chunk_bytes", "64KB", "--files", json.dumps(files)]
    assert main(args) == 0
    return out


def test_fit_continues_a_converted_model_with_routing_at_100x_the_backbone_lr(small_corpus, tmp_path):
    import mlflow

    cfg = hf_config("qwen3", vocab_size=512)  # padded beyond the data's 400 ids, as real models are
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), False)
    out = convert(str(src), str(tmp_path / "converted"), heads=4, block_size=2)
    converted = read_checkpoint(out / "model.ckpt")[1]
    main([
        "fit", "--config", str(out / "fit.yaml"),
        "--data.data_dir", str(small_corpus), "--data.seq_len", "32", "--data.batch_size", "4",
        "--trainer.max_steps", "3", "--data.val_tokens", "128", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "runs"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--trainer.logger.init_args.artifact_location", str(tmp_path / "artifacts"),
    ])  # fmt: skip
    last = next((tmp_path / "runs").rglob("last.ckpt"))
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 3
    lrs = sorted(g["initial_lr"] for g in state["optimizer_states"][0]["param_groups"])
    assert lrs[0] == 5e-5 and lrs[-1] == pytest.approx(100 * 5e-5)
    trained = {k[len("model.") :]: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    assert any(trained[k].abs().max() > 0 for k in trained if k.endswith(".gate")), "no routing gate opened"
    assert not torch.equal(trained["blocks.0.attn.q_proj.weight"], converted["blocks.0.attn.q_proj.weight"])
    # the run's checkpoints stand alone: the converted model's config (vocabulary 512), no init file
    hp = state["hyper_parameters"]
    assert hp["init_from"] is None and hp["config"]["vocab_size"] == 512 and hp["config"]["head_dim"] == 16
    assert LitLM.load_from_checkpoint(last).model.embed.weight.shape == (512, 48)
    assert state["mlflow"]["run_id"] in str(last) and state["mlflow"]["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(state["mlflow"]["run_id"])
    assert run.data.params["init_from"] == str((out / "model.ckpt").resolve())


def test_init_from_refuses_a_config_that_does_not_describe_the_checkpoint(tmp_path):
    cfg = hf_config("llama")
    out = convert(str(write_hf(tmp_path / "src", cfg, hf_tensors(cfg), False)), str(tmp_path / "out"), heads=4)
    ckpt_cfg = read_checkpoint(out / "model.ckpt")[0]
    with pytest.raises(ValueError, match=r"heads: given 2, checkpoint 4; qk_norm: given True, checkpoint False"):
        LitLM(ModelConfig(**{**ckpt_cfg.to_dict(), "heads": 2, "qk_norm": True}), init_from=str(out / "model.ckpt"))
    with pytest.raises(ValueError, match="larger than the checkpoint's embedding table"):
        LitLM(ModelConfig(**{**ckpt_cfg.to_dict(), "vocab_size": 1000}), init_from=str(out / "model.ckpt"))
    lit = LitLM(ModelConfig(**{**ckpt_cfg.to_dict(), "vocab_size": 100, "seq_len": 20}), init_from=str(out / "model.ckpt"))
    assert lit.config.vocab_size == cfg["vocab_size"] and lit.config.seq_len == 20
    idx = random_ids(cfg["vocab_size"], 20)
    with torch.no_grad():
        assert (lit.model.eval()(idx).double() - reference_logits(tmp_path / "src", idx)).abs().max() <= 1e-5


def test_a_lit_mhar_source_brings_its_training_tokenizer_and_overwrite_spares_foreign_files(tmp_path):
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=32)
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text('{"the": "tokenizer"}')
    write_checkpoint(tmp_path / "prenorm.ckpt", cfg, LM(cfg).state_dict(), {}, {"datamodule_hyper_parameters": {"data_dir": str(data)}})
    out = convert(str(tmp_path / "prenorm.ckpt"), str(tmp_path / "out"))
    assert (out / "tokenizer.json").read_text() == '{"the": "tokenizer"}'
    assert json.loads((out / "conversion.json").read_text())["tokenizer"] == str((data / "tokenizer.json").resolve())
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="convert did not write"):
        convert(str(tmp_path / "prenorm.ckpt"), str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.ckpt").is_file()


# ----------------------------------------------------------------------------- what transformers computes as plain Llama / Qwen3


@pytest.mark.parametrize(
    "overrides",
    [{"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": "default"}}, {"hidden_act": "swish"}, {"rope_theta": None},
     {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}],
    ids=["rope_type-default", "type-default", "swish", "no-rope_theta", "rope_parameters-default"],
)  # fmt: skip
def test_plain_configs_that_transformers_computes_as_plain_rope_are_accepted(overrides, tmp_path):
    """rope_scaling {"rope_type": "default"}, hidden_act "swish" and a missing rope_theta (10000) were refused."""
    cfg = hf_config("llama", **overrides)
    if cfg.get("rope_theta") is None:
        cfg.pop("rope_theta")
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), False)
    out = convert(str(src), str(tmp_path / "out"))
    idx = random_ids(cfg["vocab_size"])
    assert (converted_logits(out, idx).double() - reference_logits(src, idx)).abs().max().item() <= 1e-5
    assert read_checkpoint(out / "model.ckpt")[0].rope_base == cfg.get("rope_theta", 10000.0)


@pytest.mark.parametrize(
    "overrides, message",
    [({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
     ({"hidden_size": 47}, "num_attention_heads=4 must divide hidden_size=47"),
     ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be an integer >= 1"),
     ({"intermediate_size": "80"}, "intermediate_size='80' must be an integer")],
)  # fmt: skip
def test_errors_about_a_hugging_face_config_name_its_keys(overrides, message, tmp_path):
    """They named lit-mhar's fields (n_kv_head, d_model), which config.json does not have."""
    cfg = hf_config("llama", **overrides)
    src = write_hf(tmp_path / "src", cfg, hf_tensors(hf_config("llama")), False)
    with pytest.raises(ValueError, match=f"config.json: {message}") as e:
        convert(str(src), str(tmp_path / "out"))
    import re

    said = str(e.value).split("config.json: ", 1)[1]
    assert not re.search(r"\b(n_kv_head|d_model|n_head|n_layer|ffn_dim|ModelConfig)\b", said), said


def test_convert_says_what_its_logit_check_compares(tmp_path, capsys):
    """It printed "max |logit difference| on random input", which read as a comparison with the source."""
    cfg = hf_config("qwen3")
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), False)
    assert main(["convert", "--source", str(src), "--output_dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "logits checked on random ids against lit-mhar's prenorm model with the same weights: max |difference|" in printed
    report = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert report["logit_check"]["against"] == "lit-mhar's prenorm LM with the source's weights"
    check = report["source_check"]
    if check["against"]:
        assert "against the source's own forward in transformers" in printed and check["max_abs_diff"] <= 1e-3
    else:
        assert f"not against the source's own forward ({check['skipped']}" in printed
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert check == {"against": None, "skipped": "transformers is not installed"}
        assert "(transformers is not installed: pip install transformers to check that too)" in printed


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_converted_logits_equal_the_source_models_own_forward_in_transformers(model_type, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = hf_config(model_type, tie_word_embeddings=model_type == "qwen3")
    src = write_hf(tmp_path / "src", cfg, hf_tensors(cfg), True)
    out = convert(str(src), str(tmp_path / "out"), heads=2, block_size=2)
    check = json.loads((out / "conversion.json").read_text())["source_check"]
    assert check["against"].startswith(f"transformers {transformers.__version__} ") and check["max_abs_diff"] <= 1e-4, check
    import lit_mhar.convert as conversion

    monkeypatch.setattr(conversion, "HF_LOGIT_TOLERANCE", 0.0)  # a model transformers computes otherwise is refused
    with pytest.raises(ValueError, match="differ from the source model's own forward .*nothing written"):
        convert(str(src), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
