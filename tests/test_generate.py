"""Generation: KV-cached decoding against the full forward for every variant, sampling, and
``lit-mhar generate`` end to end on a checkpoint trained through the real CLI."""

from __future__ import annotations

import io
import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from test_model import naive_forward, randomize_routing  # the float64 reading of the equations

from lit_mhar import LM, ModelConfig
from lit_mhar.cli import main
from lit_mhar.generate import TextStreams, generate, generate_ids, sample_next
from lit_mhar.kernels import use_backend

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = [  # (residual, heads, block_size, n_layer): 2L = 6 sublayers unless said
    ("prenorm", 1, 1, 3),
    ("attnres", 1, 1, 3),
    ("attnres", 4, 1, 3),
    ("attnres", 2, 2, 3),  # 3 blocks
    ("attnres", 4, 4, 3),  # 2L = 6 not a multiple of S = 4: the final site sees a shorter block
    ("attnres", 2, 3, 4),  # 2L = 8, S = 3
    ("delta", 1, 1, 3),
    ("delta", 4, 1, 3),
    ("delta", 2, 4, 3),
    ("delta", 4, 2, 4),
    ("hyper", 1, 1, 3),  # Hyper-Connections, the defaults: n = 4 dynamic
]
IDS = [f"{r}-H{h}-S{s}-L{n}" for r, h, s, n in VARIANTS]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to other processes on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(residual, heads, block_size, n_layer, seed=0, **kw) -> LM:
    # init_std 0.2 so that attention and logits are far from uniform and a cache bug shows
    shape = dict(d_model=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97, seq_len=24, init_std=0.2) | kw
    cfg = ModelConfig.from_name("debug", residual=residual, heads=heads, block_size=block_size, n_layer=n_layer, **shape)
    torch.manual_seed(seed)
    model = LM(cfg).eval()
    randomize_routing(model, seed)
    return model


def decode_in_pieces(model: LM, idx: torch.Tensor, splits: list[int], tensor_pos: bool = False) -> torch.Tensor:
    """Logits of ``idx`` [B, T] computed in consecutive chunks of the given sizes through one KV cache."""
    B, T = idx.shape
    cache = model.new_cache(B, max_len=T)
    out, pos = [], 0
    for n in splits:
        p = torch.tensor(pos) if tensor_pos and pos > 0 else pos
        out.append(model(idx[:, pos : pos + n], cache=cache, pos=p))
        pos += n
    assert pos == T
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("residual,heads,block_size,n_layer", VARIANTS, ids=IDS)
def test_cached_decoding_equals_the_full_forward(residual, heads, block_size, n_layer):
    model = tiny_model(residual, heads, block_size, n_layer)
    idx = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        assert full.std() > 0.5, "logits too flat for the comparison to mean much"
        for splits, tensor_pos in (([6] + [1] * 7, False), ([1] * 13, True), ([5, 3, 1, 4], False)):
            # prefill + one token per step; every token alone from position 0; chunks at pos > 0 (masked, T > 1)
            torch.testing.assert_close(decode_in_pieces(model, idx, splits, tensor_pos), full, rtol=1e-4, atol=1e-4)


def test_cached_attention_accepts_the_output_layout_of_the_cuda_backends(monkeypatch):
    """CUDA's SDPA backends return ``[B, H, T, hd]`` with the strides of a ``[B, T, H, hd]`` tensor;
    the cached path must not assume a contiguous result (it used ``view``, which fails on that layout)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        y = sdpa(*args, **kwargs)
        return y.transpose(1, 2).contiguous().transpose(1, 2)  # same values, the flash/efficient layout

    model = tiny_model("attnres", 2, 3, 3)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided_sdpa)
        torch.testing.assert_close(decode_in_pieces(model, idx, [4] + [1] * 5), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rate,dynamic", [(1, False), (3, False), (2, True)], ids=["n1-static", "n3-static", "n2-dynamic"])
def test_hyper_connections_decode_with_the_cache_like_the_full_forward(rate, dynamic):
    """Hyper-connections are per token: the n copies of a decoded token need nothing cached."""
    model = tiny_model("hyper", 1, 1, 2, hc_rate=rate, hc_dynamic=dynamic)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(idx)
        assert full.std() > 0.5
        for splits in ([4] + [1] * 5, [2, 3, 4]):
            torch.testing.assert_close(decode_in_pieces(model, idx, splits, tensor_pos=True), full, rtol=1e-4, atol=1e-4)


def test_full_forward_still_matches_the_float64_equations_with_the_cache_code_in_place():
    model = tiny_model("attnres", 2, 4, 3).double()
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(decode_in_pieces(model, idx, [4, 1, 1, 1, 1, 1]), naive_forward(model, idx), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual,block_size", [("attnres", 2), ("delta", 4), ("attnres", 1)])
def test_cached_decoding_on_the_fused_kernel_path(residual, block_size, monkeypatch):
    """The Triton kernels (CPU interpreter): the prefill takes the two-phase path, each decode
    step one fused route + norm kernel per routing site, and the logits are the full forward's."""
    import lit_mhar.routing as routing
    from lit_mhar.kernels import triton_routing

    passes, fused = [], []
    original = routing.route_sites
    monkeypatch.setattr(routing, "route_sites", lambda sources, *a, **k: passes.append(sources[0].shape) or original(sources, *a, **k))
    kernel = triton_routing.route_norm_decode
    monkeypatch.setattr(triton_routing, "route_norm_decode", lambda history, n, *a, **k: fused.append(n) or kernel(history, n, *a, **k))
    model = tiny_model(residual, 2, block_size, 2, d_model=16, n_head=2, n_kv_head=1, ffn_dim=16)
    idx = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)  # reference path
        assert not passes and not fused
        with use_backend("triton"):
            cached = decode_in_pieces(model, idx, [3, 1, 2], tensor_pos=True)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    sites = 2 * 2 + 1
    # blocks of 2: groups {0, 1}, {2, 3, 4}, the last site joining the group before it (up to
    # JOIN_FINAL_SITE_MAX_SITES); blocks of 4: {0, 1, 2, 3, 4}; full routing: one group of 5
    # (FULL_ROUTING_GROUP = 12); block MHAR's first block is routed without phase one, Delta's keeps it
    assert routing.JOIN_FINAL_SITE_MAX_SITES == 16 and routing.FULL_ROUTING_GROUP == 12
    groups = {2: 2, 4: 1, 1: 1}[block_size] - (residual == "attnres" and block_size > 1)
    assert [s[1] for s in passes] == [3] * groups, "two-phase prefill: phase one once per block (group of sites)"
    # slots before the newest output, per site: the embedding, then one more per completed block
    expected = [1] + [1 + (l - 1) // block_size for l in range(1, sites)]
    assert fused == expected * 2, "one fused op per site in each of the two decode steps"


@pytest.mark.parametrize("residual,backend", [("attnres", "triton"), ("delta", "triton"), ("attnres", "reference")])
def test_full_routing_decode_routes_groups_of_sites_in_one_pass(residual, backend, monkeypatch):
    """Full routing's decode steps route each group of sites against the slots complete at its
    start in one pass (from DECODE_PREFIX_MIN_SOURCES slots on), each site then merges the slots
    since: the logits stay the full forward's, and groups start where they should."""
    import lit_mhar.routing as routing
    from lit_mhar.kernels import reference, triton_routing

    monkeypatch.setattr(routing, "DECODE_PREFIX_MIN_SOURCES", 3)
    monkeypatch.setattr(routing, "DECODE_ROUTING_GROUP", 2)
    module = triton_routing if backend == "triton" else reference
    passes = []
    original = module.route_sites_decode
    monkeypatch.setattr(module, "route_sites_decode", lambda h, n, q, g, *a: passes.append((n, q.shape[0])) or original(h, n, q, g, *a))
    model = tiny_model(residual, 2, 1, 3, d_model=16, n_head=2, n_kv_head=1, ffn_dim=16)  # 7 sites
    idx = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx)
        with use_backend(backend):
            cached = decode_in_pieces(model, idx, [3, 1, 2], tensor_pos=True)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    # site l has max(1, l) complete slots; groups start at sites 0, 2, 4, 6 and take the pass from 3 slots on
    assert passes == [(4, 2), (6, 1)] * 2, passes


def test_decode_history_refuses_bad_use_before_changing_state(monkeypatch):
    """A site out of order, one call too many, or a bad group setting: a clear error, and a refused
    call leaves the history as it was (the retry with the right site works). Sites that differ in
    eps are routed one by one instead of in a group."""
    import lit_mhar.routing as routing
    from lit_mhar.routing import DecodeHistory

    model = tiny_model("attnres", 2, 1, 2, d_model=16, n_head=2, n_kv_head=1, ffn_dim=16)  # 5 sites
    sites = model.routing_sites()
    norm = model.blocks[0].attn_norm
    with torch.no_grad():
        history = DecodeHistory(torch.randn(2, 16), 1, 4, sites, group_size=2, prefix_min=1)
        history.route_norm(sites[0], norm)
        history.append(torch.randn(2, 16), 0)
        before = (history.pending, history.n_routed)
        with pytest.raises(ValueError, match="expected routing site 1, got site 3"):
            history.route_norm(sites[3], norm)
        with pytest.raises(ValueError, match="not among the model sites"):
            history.route_norm(model.blocks[0].attn_site.__class__(16, 2, False, 1e-6), norm)
        assert (history.pending, history.n_routed) == before
        history.route_norm(sites[1], norm)  # the retry
        assert history.pending is None and history.n_routed == 2
        for value in (0, 2.5, "2", True):
            with pytest.raises(ValueError, match="group_size="):
                DecodeHistory(torch.randn(2, 16), 1, 4, sites, group_size=value)
            with pytest.raises(ValueError, match="prefix_min="):
                DecodeHistory(torch.randn(2, 16), 1, 4, sites, prefix_min=value)
        with pytest.raises(ValueError, match="5 routing sites for 6 sublayers"):
            DecodeHistory(torch.randn(2, 16), 1, 6, sites)
        history = DecodeHistory(torch.randn(2, 16), 1, 4, sites)
        for i, site in enumerate(sites):
            history.route_norm(site, norm)
            if i < 4:
                history.append(torch.randn(2, 16), i)
        with pytest.raises(ValueError, match="all 5 routing sites have routed already"):
            history.route_norm(sites[-1], norm)

    # a group whose sites differ in eps is routed site by site, and decodes like the full forward
    monkeypatch.setattr(routing, "DECODE_PREFIX_MIN_SOURCES", 1)
    monkeypatch.setattr(routing, "DECODE_ROUTING_GROUP", 2)
    sites[3].eps = 1e-2
    passes = []
    original = routing.route_sites_decode
    monkeypatch.setattr(routing, "route_sites_decode", lambda h, n, q, *a: passes.append((n, q.shape[0])) or original(h, n, q, *a))
    idx = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx)
        cached = decode_in_pieces(model, idx, [3, 1, 2])
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    assert passes == [(1, 2), (4, 1)] * 2, passes  # groups at sites 0 and 4; sites 2-3 (eps differ) one by one


def test_decode_step_compiles_to_one_graph_reused_at_every_position():
    """A tensor ``pos`` and in-place cache writes: one fullgraph compilation serves every step
    (what CUDA graph capture needs too), and it computes the full forward's logits."""
    model = tiny_model("attnres", 2, 2, 2)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(2, max_len=9)
        model(idx[:, :5], cache=cache, pos=0)
        step = torch.compile(model, backend="aot_eager", fullgraph=True)
        outs = [step(idx[:, 5:6], cache=cache, pos=torch.tensor(5))]
        with torch.compiler.set_stance("fail_on_recompile"):
            outs += [step(idx[:, t : t + 1], cache=cache, pos=torch.tensor(t)) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(outs, 1), full[:, 5:], rtol=1e-4, atol=1e-4)


def test_one_prompt_row_prefills_every_sample_row():
    model = tiny_model("attnres", 4, 2, 3)
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    nxt = torch.tensor([[5], [9], [11]])
    with torch.no_grad():
        cache = model.new_cache(3, max_len=8)
        model(prompt, cache=cache, pos=0)
        step = model(nxt, cache=cache, pos=7)
        full = model(torch.cat([prompt.expand(3, -1), nxt], dim=1))[:, -1:]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_cache_positions_out_of_range_are_refused():
    model = tiny_model("prenorm", 1, 1, 1)
    cache = model.new_cache(1, max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache, pos=0)
    with pytest.raises(ValueError, match="pos=3"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, pos=3)
    with pytest.raises(ValueError, match="batch of 2"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache, pos=1)
    with pytest.raises(ValueError, match="max_len=25"):
        model.new_cache(1, max_len=25)
    with pytest.raises(ValueError, match="needs a cache"):
        model(torch.zeros(1, 2, dtype=torch.long), pos=1)


def test_greedy_generation_equals_argmax_of_full_forwards_and_stops_at_the_context():
    model = tiny_model("delta", 4, 2, 3)
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(5))
    ids, reasons, _ = generate_ids(model, prompt, max_new_tokens=50, temperature=0)
    assert ids.shape == (1, 24 - 20 + 1) and reasons == ["context"]  # the last token is never fed back
    seq = prompt.tolist()
    with torch.no_grad():
        for _ in range(ids.shape[1]):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids[0].tolist() == seq[20:]


def test_generation_stops_each_sample_at_eos():
    model = tiny_model("attnres", 2, 1, 2)
    prompt = torch.tensor([3, 4, 5])
    greedy, _, _ = generate_ids(model, prompt, max_new_tokens=6, temperature=0)
    eos = int(greedy[0, 2])
    ids, reasons, _ = generate_ids(model, prompt, max_new_tokens=6, temperature=0, num_samples=2, eos_id=eos)
    assert reasons == ["eos", "eos"] and ids.shape == (2, 3) and (ids == greedy[:, :3]).all()


def test_sampling_settings_are_checked_once_and_streaming_time_is_not_decode_time(monkeypatch):
    import time

    import lit_mhar.generate as gen

    calls = []
    original = gen.check_sampling
    monkeypatch.setattr(gen, "check_sampling", lambda *a: calls.append(a) or original(*a))
    model = tiny_model("attnres", 2, 2, 2)
    prompt = torch.tensor([3, 4, 5])
    ids, _, timing = generate_ids(model, prompt, max_new_tokens=4, temperature=0.7, top_k=5, on_step=lambda _ids: time.sleep(0.2))
    assert ids.shape == (1, 4) and len(calls) == 1
    # four callbacks of 0.2 s ran inside the decode loop; the tiny model's steps take milliseconds
    assert timing["decode_s"] < 0.4, timing


def test_sampling_greedy_top_k_top_p_and_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    assert torch.equal(sample_next(logits, temperature=0), logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=5.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=5.0, top_p=1e-6, generator=g), logits.argmax(-1))
    many = torch.stack([sample_next(logits, 3.0, top_k=5, generator=g) for _ in range(200)])
    top5 = logits.topk(5, dim=-1).indices
    assert all(set(many[:, r].tolist()) <= set(top5[r].tolist()) for r in range(4))
    assert len(set(many[:, 0].tolist())) > 1, "high temperature should spread the draws"
    # nucleus: the kept set is the smallest prefix of the sorted distribution reaching p
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    draws = {int(sample_next(probs.log(), 1.0, top_p=0.8, generator=g)) for _ in range(300)}
    assert draws == {0, 1}
    a = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(7))
    b = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 .*>= 0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=0), r"top_k=0 .*>= 1"),
        (dict(top_p=0.0), r"top_p=0.0 .*0 < top_p <= 1"),
        (dict(top_p=1.5), "top_p=1.5"),
    ],
    ids=["negative-temperature", "nan-temperature", "top-k-zero", "top-p-zero", "top-p-above-one"],
)
def test_bad_sampling_settings_are_refused_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        sample_next(torch.zeros(1, 3), **kw)


def test_text_streams_print_multibyte_characters_whole(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # byte-level BPE without merges: one token per byte, so every non-ASCII character is 2+ tokens
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    eos = tok.token_to_id("<|endoftext|>")
    prompt, text = "naïve ", "über → 数学 ✓"
    new = tok.encode(text).ids
    assert len(new) > len(text), "some characters must span several tokens"
    out = io.StringIO()
    streams = TextStreams(tok, tok.encode(prompt).ids, 2, eos_id=eos, echo=out)
    writes = []
    for t in new + [eos, 5]:
        before = out.getvalue()
        streams.step([t, eos])
        writes.append(out.getvalue()[len(before) :])
    assert out.getvalue() == text and "\ufffd" not in "".join(writes)
    assert streams.texts() == [text, ""]


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Block MHAR model trained for 2 steps through `lit-mhar fit` on a tiny stdlib dataset."""
    tmp = tmp_path_factory.mktemp("gen")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / "json" / n) for n in ("__init__.py", "decoder.py", "encoder.py")] + [str(stdlib / n) for n in ("textwrap.py", "shlex.py")]
    data = tmp / "data"
    assert main(["prepare", "--output_dir", str(data), "--source", "files", "--vocab_size", "300", "--val_fraction", "0.3",
                 "--chunk_bytes", "64KB", "--files", json.dumps(files)]) == 0
    main([
        "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--data.data_dir", str(data), "--data.seq_len", "32", "--data.batch_size", "2",
        "--model.config.d_model", "32", "--model.config.n_layer", "2", "--model.config.ffn_dim", "64",
        "--model.config.residual", "attnres", "--model.config.heads", "2", "--model.config.block_size", "3",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--data.val_tokens", "64",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp / "runs"),
    ])
    (ckpt,) = (tmp / "runs").rglob("last.ckpt")
    return {"ckpt": ckpt, "data": data, "tmp": tmp}


def test_cli_generate_streams_what_the_function_returns(trained, capsys):
    args = ["--ckpt", str(trained["ckpt"]), "--prompt", "def dumps(obj", "--max_new_tokens", "12", "--seed", "3", "--top_k", "40", "--stop_at_eos", "false"]
    assert main(["generate", *args]) == 0
    printed = capsys.readouterr()
    result = generate(str(trained["ckpt"]), "def dumps(obj", max_new_tokens=12, seed=3, top_k=40, stop_at_eos=False, verbose=False)
    assert printed.out == "def dumps(obj" + result.texts[0] + "\n"
    assert "[lit-mhar generate] attnres H=2 S=3" in printed.err and "seed 3" in printed.err
    assert len(result.token_ids[0]) == 12 and result.stop_reasons == ["max_new_tokens"]
    # the tokenizer was found through the checkpoint's data_dir; the text is its decoding of the ids
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained["data"] / "tokenizer.json"))
    assert result.prompt_ids == tok.encode("def dumps(obj").ids
    assert tok.decode(result.prompt_ids + result.token_ids[0]) == "def dumps(obj" + result.texts[0]
    # --stream false prints the sample when it is done (it printed nothing at all before)
    assert main(["generate", *args, "--stream", "false"]) == 0
    printed = capsys.readouterr()
    assert printed.out == "--- sample 0 (stopped: max_new_tokens) ---\ndef dumps(obj" + result.texts[0] + "\n"
    assert "seed 3" in printed.err


def test_samples_are_reproducible_from_the_seed_and_differ_from_each_other(trained):
    kw = dict(max_new_tokens=10, num_samples=3, temperature=1.5, stop_at_eos=False, verbose=False)
    a = generate(str(trained["ckpt"]), "", seed=11, **kw)
    b = generate(str(trained["ckpt"]), "", seed=11, **kw)
    assert a.token_ids == b.token_ids and a.texts == b.texts and a.seed == 11
    assert len({tuple(t) for t in a.token_ids}) > 1
    assert a.prompt_ids == [json.loads((trained["data"] / "manifest.json").read_text())["eos_id"]]  # empty prompt: a new document


def test_prompt_longer_than_the_context_is_refused_before_the_model_is_built(trained, monkeypatch):
    import lit_mhar.generate as gen

    monkeypatch.setattr(gen, "LM", None)  # building the model would fail differently
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens long; valid: at most 32 tokens"):
        generate(str(trained["ckpt"]), "import json\n" * 40, verbose=False)


def test_unknown_checkpoint_formats_are_refused(trained, tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="is not a checkpoint lit-mhar can read: unknown checkpoint format") as e:
        generate(str(text), "x", verbose=False)
    assert "torch.save" not in str(e.value)  # torch's own advice to re-save the file is not for this user
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 1.0}}, other)
    with pytest.raises(ValueError, match="unknown checkpoint format.*not a lit-mhar checkpoint"):
        generate(str(other), "x", verbose=False)
    with pytest.raises(ValueError, match="is a directory"):
        generate(str(tmp_path), "x", verbose=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        generate(str(tmp_path / "missing.ckpt"), "x", verbose=False)


def test_missing_tokenizer_is_refused_and_one_beside_the_checkpoint_is_used(trained, tmp_path):
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=False)
    del state["datamodule_hyper_parameters"]
    moved = tmp_path / "model.ckpt"
    torch.save(state, moved)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer .*tokenizer\.json.*--tokenizer"):
        generate(str(moved), "x", verbose=False)
    (tmp_path / "tokenizer.json").write_bytes((trained["data"] / "tokenizer.json").read_bytes())
    assert len(generate(str(moved), "x", max_new_tokens=3, seed=0, stop_at_eos=False, verbose=False).token_ids[0]) == 3
    with pytest.raises(FileNotFoundError, match="tokenizer='nowhere.json'"):
        generate(str(moved), "x", tokenizer="nowhere.json", verbose=False)


def test_a_relative_dataset_folder_is_found_from_the_folders_above_the_checkpoint(trained, tmp_path, monkeypatch):
    """``lit-mhar fit --data.data_dir data/x`` stores the relative path: generate run from another
    folder finds the dataset's tokenizer beside the ``runs/`` the checkpoint is in, not in the folder
    it runs in (which may hold another dataset of that name)."""
    from lit_mhar.generate import find_tokenizer

    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=False)
    state["datamodule_hyper_parameters"]["data_dir"] = "data/stdlib"
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data" / "stdlib").mkdir(parents=True)
    (project / "data" / "stdlib" / "tokenizer.json").write_bytes((trained["data"] / "tokenizer.json").read_bytes())
    (elsewhere / "data" / "stdlib").mkdir(parents=True)
    (elsewhere / "data" / "stdlib" / "tokenizer.json").write_text("{}")  # another dataset's, in the current folder
    ckpt = project / "runs" / "1" / "abc" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save(state, ckpt)
    monkeypatch.chdir(elsewhere)
    assert find_tokenizer(ckpt, state) == project / "data" / "stdlib" / "tokenizer.json"
    assert len(generate(str(ckpt), "x", max_new_tokens=2, seed=0, stop_at_eos=False, verbose=False).token_ids[0]) == 2
    (project / "data" / "stdlib" / "tokenizer.json").unlink()  # then the current folder's, as before
    assert find_tokenizer(ckpt, state) == Path.cwd() / "data" / "stdlib" / "tokenizer.json"


def test_cli_refuses_a_negative_temperature(trained, capsys):
    with pytest.raises(ValueError, match=r"temperature=-1.0 is invalid; valid: a finite number >= 0"):
        main(["generate", "--ckpt", str(trained["ckpt"]), "--prompt", "x", "--temperature", "-1"])
    assert capsys.readouterr().out == ""


def test_a_tokenizer_of_another_size_than_the_training_data_is_refused(trained, tmp_path, monkeypatch, capsys):
    """generate --tokenizer with a smaller tokenizer than the model's data ran with exit 0 and printed gibberish."""
    from lit_mhar.corpus import _train_tokenizer

    small = tmp_path / "small.json"
    tok = _train_tokenizer(iter(["def f(x):\n    return x\n"] * 50), vocab_size=280)
    tok.save(str(small))
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size < 300
    monkeypatch.setattr(sys, "argv", ["lit-mhar", "generate", "--ckpt", str(trained["ckpt"]), "--prompt", "def", "--tokenizer", str(small)])
    assert main() == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert f"tokenizer={str(small)!r} has {size} ids, but the model was trained on a vocabulary of 300" in line
    assert str(trained["data"] / "manifest.json") in line
    # the training data's own tokenizer, given explicitly, is the model's
    assert generate(str(trained["ckpt"]), "def", max_new_tokens=2, tokenizer=str(trained["data"]), verbose=False).token_ids


def test_a_padded_embedding_table_takes_the_tokenizer_beside_the_checkpoint(trained, tmp_path):
    """A model whose embedding table is larger than its tokenizer (a converted Hugging Face model)
    accepts the tokenizer the data said it was trained with, given or found."""
    from lit_mhar.checkpoint import read_checkpoint, write_checkpoint

    cfg, weights, _ = read_checkpoint(trained["ckpt"])
    padded = type(cfg)(**{**cfg.to_dict(), "vocab_size": cfg.vocab_size + 20})
    weights = dict(weights, **{k: torch.cat([weights[k], torch.zeros(20, weights[k].shape[1])]) for k in ("embed.weight", "lm_head.weight")})
    folder = tmp_path / "converted"
    folder.mkdir()
    write_checkpoint(folder / "model.ckpt", padded, weights, {}, {})
    shutil.copyfile(trained["data"] / "tokenizer.json", folder / "tokenizer.json")
    assert generate(str(folder / "model.ckpt"), "def", max_new_tokens=2, verbose=False).token_ids
    assert generate(str(folder / "model.ckpt"), "def", max_new_tokens=2, tokenizer=str(trained["data"]), verbose=False).token_ids


def test_reported_speeds_are_the_steady_state_not_the_first_calls_compilation():
    """On a fresh GPU the first call's kernel compilation counted as decoding ("prefill 1 tok/s,
    decode 5.3 tok/s" for a 100m model): the first call of each shape here takes 1.5 s, as a
    compilation would, and the timed prefill and decode must not contain it."""
    import time

    model = LM(ModelConfig.from_name("debug", n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=32, vocab_size=50, seq_len=32)).eval()
    seen = set()
    forward = model.forward

    def first_call_compiles(idx, **kw):
        if idx.shape not in seen:
            seen.add(idx.shape)
            time.sleep(1.5)
        return forward(idx, **kw)

    model.forward = first_call_compiles
    ids, _, timing = generate_ids(model, torch.tensor([1, 2, 3]), 6, temperature=0, num_samples=2)
    assert timing["warmup_s"] >= 3.0 and timing["prefill_s"] < 1.0 and timing["decode_s"] < 1.0, timing
    model.forward = forward
    assert torch.equal(generate_ids(model, torch.tensor([1, 2, 3]), 6, temperature=0, num_samples=2, warmup=False)[0], ids)


def test_generate_says_when_the_context_stops_a_sample_and_cuts_max_new_tokens(trained, capsys):
    """The header read `(context)`, like a label; a max_new_tokens cut by the context went unsaid."""
    assert main(["generate", "--ckpt", str(trained["ckpt"]), "--prompt", "import json", "--max_new_tokens", "500",
                 "--stop_at_eos", "false", "--stream", "false", "--seed", "0"]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert printed.out.startswith("--- sample 0 (stopped: context full) ---\n")
    (note,) = [line for line in printed.err.splitlines() if "note:" in line]
    assert "max_new_tokens=500 is cut to" in note and "the model's context of 32 tokens (seq_len)" in note
    assert "(stopped: context full); prefill" in printed.err and "steady state, after a" in printed.err
