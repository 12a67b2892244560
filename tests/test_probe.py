"""``lit-mhar probe`` on a tiny MHAR model trained for a few steps by the real CLI, on real data."""

from __future__ import annotations

import json
import math
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_mhar.cli import main
from lit_mhar.config import ModelConfig
from lit_mhar.checkpoint import read_checkpoint, write_checkpoint
from lit_mhar.data import TokenDataModule
from lit_mhar.model import LM
from lit_mhar.probe import pairwise_jsd, probe

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A prepared corpus and an MHAR (H=4) model trained on it for 6 steps through ``lit-mhar fit``."""
    tmp = tmp_path_factory.mktemp("probe")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / "json" / n) for n in ("__init__.py", "decoder.py", "encoder.py")] + [str(stdlib / "textwrap.py"), str(stdlib / "shlex.py")]
    data = tmp / "data"
    assert main(["prepare", "--output_dir", str(data), "--source", "files", "--vocab_size", "400", "--val_fraction", "0.3", "--chunk_bytes", "64KB", "--files", json.dumps(files)]) == 0
    main([
        "fit", "--config", str(ROOT / "configs" / "debug" / "mhar.yaml"),
        "--data.data_dir", str(data), "--data.seq_len", str(SEQ), "--data.batch_size", "4",
        "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
        "--model.lr", "0.01", "--model.warmup_steps", "0", "--model.routing_lr_multiplier", "10",
        "--trainer.max_steps", "6", "--data.val_tokens", str(4 * SEQ), "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp / "runs"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp / 'mlflow.db'}",
        "--trainer.logger.init_args.artifact_location", str(tmp / "artifacts"),
    ])  # fmt: skip
    (ckpt,) = (tmp / "runs").rglob("last.ckpt")
    return {"tmp": tmp, "data": data, "ckpt": ckpt, "uri": f"sqlite:///{tmp / 'mlflow.db'}"}


def direct_weights(ckpt: Path, data: Path, batch_size: int) -> tuple[LM, list[np.ndarray]]:
    """Routing weights ``[N, tokens, H]`` of every site on the first val batch, straight from the model."""
    cfg, weights, _ = read_checkpoint(ckpt)
    model = LM(cfg)
    model.load_state_dict(weights)
    batch = next(iter(TokenDataModule(str(data), seq_len=SEQ, batch_size=batch_size).val_dataloader()))
    with torch.no_grad():
        _, routing = model.eval()(batch[:, :-1], return_routing=True)
    return model, [w.double().flatten(1, 2).numpy() for w in routing]


def test_probe_reports_the_routing_of_every_site_and_logs_it_to_the_checkpoints_run(trained, tmp_path):
    import mlflow

    out = tmp_path / "probe"
    assert main(["probe", "--checkpoint", str(trained["ckpt"]), "--data_dir", str(trained["data"]), "--output_dir", str(out), "--max_tokens", "300", "--batch_size", "4"]) == 0
    result = json.loads((out / "probe.json").read_text())
    assert result["tokens"] == 9 * SEQ and result["split"] == "val" and result["global_step"] == 6
    assert result["site_names"] == ["attn0", "mlp0", "attn1", "mlp1", "final"]
    assert len(result["sites"]) == 5
    for s in result["sites"]:
        mixing = np.array(s["mixing"])
        assert mixing.shape == (4, s["n_sources"]) == (4, s["index"] + 1)
        np.testing.assert_allclose(mixing.sum(1), 1, atol=1e-9)
        assert 1 / s["n_sources"] - 1e-9 <= s["max_weight"] <= 1 and 0 <= s["entropy"] <= s["max_entropy"] + 1e-9
        assert 0 <= s["head_jsd"] <= math.log(2)
        assert s["index"] == 0 or -1 <= s["query_cosine"] <= 1
    first = result["sites"][0]
    assert first["max_weight"] == pytest.approx(1) and first["entropy"] == pytest.approx(0, abs=1e-9) and first["head_jsd"] == pytest.approx(0, abs=1e-9)
    assert first["query_cosine"] is None, "one source: the query gets no gradient and stays zero"
    # six steps at a high routing LR: the deeper sites no longer route uniformly, and heads disagree
    last = result["sites"][-1]
    assert last["max_weight"] > 1 / last["n_sources"] + 1e-3 and last["head_jsd"] > 1e-5
    for png in ("mixing.png", "depth.png", "heads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # logged to the run that trained the checkpoint, found through the record LitLM put in it
    assert result["mlflow"]["found_by"] == "checkpoint" and result["mlflow"]["run_id"] in str(trained["ckpt"])
    client = mlflow.MlflowClient(tracking_uri=trained["uri"])
    run = client.get_run(result["mlflow"]["run_id"])
    assert run.data.metrics["probe/site_04/max_weight"] == pytest.approx(last["max_weight"])
    assert run.data.metrics["probe/site_02/head_jsd"] == pytest.approx(result["sites"][2]["head_jsd"])
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "probe/val-step6")}
    assert {"probe/val-step6/probe.json", "probe/val-step6/mixing.png", "probe/val-step6/heads.png"} <= logged


def test_probe_numbers_equal_a_direct_computation_on_the_same_tokens(trained, tmp_path):
    result = probe(str(trained["ckpt"]), str(trained["data"]), str(tmp_path / "p"), max_tokens=3 * SEQ, batch_size=3, mlflow=False)
    assert result["tokens"] == 3 * SEQ and result["mlflow"]["run_id"] is None
    model, routing = direct_weights(trained["ckpt"], trained["data"], batch_size=3)
    for s, w, site in zip(result["sites"], routing, model.routing_sites()):
        np.testing.assert_allclose(np.array(s["mixing"]), w.mean(1).T, atol=1e-9)
        np.testing.assert_allclose(s["max_weight"], w.max(0).mean(), atol=1e-9)
        ent = -(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0)).sum(0)
        np.testing.assert_allclose(s["entropy"], ent.mean(), atol=1e-9)
        jsd = []
        for a in range(4):
            for b in range(a + 1, 4):
                p, q = w[..., a], w[..., b]
                m = (p + q) / 2
                kl = lambda x: np.where(x > 0, x * np.log(np.where(x > 0, x, 1) / m), 0).sum(0)  # noqa: E731
                jsd.append(((kl(p) + kl(q)) / 2).mean())
        np.testing.assert_allclose(s["head_jsd"], np.mean(jsd), atol=1e-9)
        q = site.query.detach().double().view(4, -1)
        cos = [torch.nn.functional.cosine_similarity(q[a], q[b], dim=0).item() for a in range(4) for b in range(a + 1, 4)]
        if s["index"] == 0:
            assert s["query_cosine"] is None and not site.query.any()
        else:
            np.testing.assert_allclose(s["query_cosine"], np.mean(cos), atol=1e-9)


def test_pairwise_jsd_is_zero_for_equal_heads_and_ln2_for_disjoint_ones():
    p = torch.tensor([[1.0, 1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.5]], dtype=torch.float64)  # N=2 sources, H=4 heads
    jsd = pairwise_jsd(p)
    assert jsd.shape == (4, 4) and torch.equal(jsd, jsd.T) and not jsd.diagonal().any()
    assert jsd[0, 1] == 0 and jsd[0, 2] == pytest.approx(math.log(2))
    # against the definition: H(m) - (H(a) + H(b)) / 2 for (0.5, 0.5) vs (1, 0)
    m = torch.tensor([0.75, 0.25], dtype=torch.float64)
    assert jsd[3, 0] == pytest.approx(-(m * m.log()).sum().item() - 0.5 * math.log(2))


def test_untrained_delta_block_model_routes_uniformly(trained, tmp_path):
    cfg = ModelConfig(residual="delta", heads=2, block_size=3, d_model=32, n_layer=3, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=400, seq_len=SEQ)
    write_checkpoint(tmp_path / "delta.ckpt", cfg, LM(cfg).state_dict(), {}, {})
    result = probe(str(tmp_path / "delta.ckpt"), str(trained["data"]), str(tmp_path / "p"), max_tokens=2 * SEQ, batch_size=2)  # no run: not logged
    assert result["source_names"] == ["emb", "block1", "block2"]
    assert [s["n_sources"] for s in result["sites"]] == [1, 2, 2, 2, 3, 3, 3]
    for s in result["sites"]:
        np.testing.assert_allclose(s["mixing"], 1 / s["n_sources"], atol=1e-7)
        assert s["max_weight"] == pytest.approx(1 / s["n_sources"]) and s["entropy"] == pytest.approx(math.log(s["n_sources"]))
        assert s["head_jsd"] == pytest.approx(0, abs=1e-9) and s["query_cosine"] is None and s["gate_rms"] == 0
    assert result["mlflow"]["run_id"] is None and (tmp_path / "p" / "heads.png").is_file()


def test_probe_refuses_a_prenorm_checkpoint_before_writing_anything(trained, tmp_path):
    cfg = ModelConfig(d_model=32, n_layer=1, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=400, seq_len=SEQ)
    write_checkpoint(tmp_path / "prenorm.ckpt", cfg, LM(cfg).state_dict(), {}, {})
    with pytest.raises(ValueError, match="residual='prenorm' model: it has no routing sites, so there is nothing to probe"):
        probe(str(tmp_path / "prenorm.ckpt"), str(trained["data"]), str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()
    # a file that is no torch checkpoint at all (a config passed by mistake): a ValueError naming it, not torch's error
    (tmp_path / "fit.yaml").write_text("model:\n  lr: 0.001\n")
    with pytest.raises(ValueError, match=r"fit\.yaml: not a lit-mhar checkpoint \(torch\.load could not read it: \w+\); give a lit-mhar checkpoint file"):
        probe(str(tmp_path / "fit.yaml"), str(trained["data"]), str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()


def test_probe_refuses_a_non_empty_output_folder_and_bad_arguments(trained, tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = (str(trained["ckpt"]), str(trained["data"]), str(out))
    with pytest.raises(FileExistsError, match="overwrite"):
        probe(*args, max_tokens=SEQ, mlflow=False)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"probe did not write \(\['keep.txt'\]\)"):
        probe(*args, max_tokens=SEQ, mlflow=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"], "overwrite must never delete the user's files"
    (out / "keep.txt").unlink()
    probe(*args, max_tokens=SEQ, batch_size=1, mlflow=False)
    with pytest.raises(ValueError, match=r"seq_len=64 must be an integer in \[1, 32\]"):
        probe(*args, seq_len=64, overwrite=True)
    with pytest.raises(ValueError, match="max_tokens=8 is less than one sequence"):
        probe(*args, max_tokens=8, overwrite=True)
    first = (out / "probe.json").stat().st_mtime_ns
    probe(*args, max_tokens=SEQ, batch_size=1, mlflow=False, overwrite=True)  # replaces its own output
    assert (out / "probe.json").stat().st_mtime_ns != first


def test_probe_finds_the_run_of_an_older_checkpoint_from_its_path(trained, tmp_path):
    """Checkpoints written before LitLM recorded its MLflow run: the run id is in Lightning's path."""
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    del state["mlflow"]
    old = trained["ckpt"].with_name("old.ckpt")
    torch.save(state, old)
    try:
        result = probe(str(old), str(trained["data"]), str(tmp_path / "p"), split="train", max_tokens=4 * SEQ, batch_size=4, tracking_uri=trained["uri"])
    finally:
        old.unlink()
    assert result["mlflow"]["found_by"] == "path" and result["mlflow"]["run_id"] == old.parent.parent.name
    assert result["split"] == "train" and result["mlflow"]["artifact_path"] == "probe/train-step6"
    # without the store it is not guessed: no run, nothing created
    moved = tmp_path / "elsewhere" / "1" / ("0" * 32) / "checkpoints" / "x.ckpt"
    moved.parent.mkdir(parents=True)
    shutil.copyfile(trained["ckpt"], moved)
    state["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path / 'gone.db'}", "run_id": "0" * 32, "experiment_id": "1"}
    torch.save(state, moved)
    result = probe(str(moved), str(trained["data"]), str(tmp_path / "q"), max_tokens=SEQ, batch_size=1)
    assert result["mlflow"]["run_id"] is None and not (tmp_path / "gone.db").exists()


def test_probe_names_a_missing_data_dir_and_the_dataset_to_pass_or_how_to_make_one(trained, tmp_path, monkeypatch, capsys):
    ckpt, data, out = str(trained["ckpt"]), trained["data"], tmp_path / "p"
    with pytest.raises(FileNotFoundError) as error:
        probe(ckpt, str(tmp_path / "nope"), str(out))
    assert str(error.value).startswith(f"data_dir='{tmp_path / 'nope'}': no such folder. --data_dir takes a dataset written by lit-mhar prepare")
    assert str(error.value).endswith(f"the checkpoint was trained on {data}: pass --data_dir {data}")  # recorded by lit-mhar fit
    with pytest.raises(FileNotFoundError, match=rf"data_dir='{re.escape(str(data / 'val'))}' has no manifest.json .*did you mean --data_dir {re.escape(str(data))}\?$"):
        probe(ckpt, str(data / "val"), str(out))
    with pytest.raises(FileNotFoundError, match=r"is a file, not a dataset folder"):
        probe(ckpt, str(data / "manifest.json"), str(out))
    # a checkpoint whose training data is gone: how to prepare data with the model's tokenizer
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    state["datamodule_hyper_parameters"]["data_dir"] = str(tmp_path / "gone")
    moved = tmp_path / "ckpt" / "model.ckpt"
    moved.parent.mkdir()
    torch.save(state, moved)
    with pytest.raises(FileNotFoundError) as error:
        probe(str(moved), str(tmp_path / "nope"), str(out))
    assert str(error.value).endswith(
        f"make one: lit-mhar prepare --output_dir {tmp_path / 'nope'} --source files --files '[\"corpus/*.txt\"]' --tokenizer MODEL_TOKENIZER.json"
    )
    shutil.copyfile(data / "tokenizer.json", moved.parent / "tokenizer.json")  # as lit-mhar convert leaves it
    with pytest.raises(FileNotFoundError, match=re.escape(f"--tokenizer {moved.parent / 'tokenizer.json'}") + "$"):
        probe(str(moved), str(tmp_path / "nope"), str(out))
    assert not out.exists()
    # the command: one line, exit status 2
    monkeypatch.setattr("sys.argv", ["lit-mhar", "probe", "--checkpoint", ckpt, "--data_dir", str(tmp_path / "nope"), "--output_dir", str(out)])
    assert main() == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.startswith(f"lit-mhar probe: error: data_dir='{tmp_path / 'nope'}': no such folder.") and f"pass --data_dir {data}" in line


def test_the_cli_lists_probe_and_convert(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  probe " in out and "  convert " in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_on_gpu_matches_the_cpu(trained, tmp_path):
    cpu = probe(str(trained["ckpt"]), str(trained["data"]), str(tmp_path / "cpu"), max_tokens=4 * SEQ, batch_size=4, device="cpu", mlflow=False)
    gpu = probe(str(trained["ckpt"]), str(trained["data"]), str(tmp_path / "gpu"), max_tokens=4 * SEQ, batch_size=4, device="cuda", mlflow=False)
    assert gpu["device"].startswith("cuda") and gpu["tokens"] == cpu["tokens"]
    for a, b in zip(cpu["sites"], gpu["sites"]):
        np.testing.assert_allclose(b["mixing"], a["mixing"], atol=1e-4)
        assert b["max_weight"] == pytest.approx(a["max_weight"], abs=1e-4) and b["head_jsd"] == pytest.approx(a["head_jsd"], abs=1e-4)
