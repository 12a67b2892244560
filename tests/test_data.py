"""prepare (text / JSONL / Parquet / the python source -> litdata token chunks) and TokenDataModule
(batches, resume, the fixed validation set, damaged and changed data)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import sysconfig
import threading
import time
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader
from tokenizers import Tokenizer

import lit_mhar.corpus as corpus_module
import lit_mhar.data as data
from lit_mhar.data import EOS_TOKEN, TokenDataModule, prepare, read_manifest, verify_dataset

VOCAB = 300


# ----------------------------------------------------------------------------- helpers


def _score(key: str, salt: str = "") -> float:
    """The documented hash, written out independently of the implementation."""
    return int.from_bytes(hashlib.blake2b((salt + key).encode(), digest_size=8).digest(), "big") / 2**64


def _is_val(key: str, val_fraction: float) -> bool:
    """The documented split rule."""
    return _score(key) < val_fraction


def _content_key(data: bytes) -> str:
    """A plain-text file's key: its content digest."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _shuffled(keys: list[str], seed: int = 0) -> list[str]:
    """The documented document order in the chunks."""
    return sorted(keys, key=lambda k: _score(k, f"shuffle-{seed}:"))


def _stream(split_dir: Path) -> np.ndarray:
    """Every token of one split, in stored order (block_size=1 drops nothing at chunk ends)."""
    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=1))
    return np.concatenate([np.asarray(x) for x in dataset]).astype(np.int64)


def _decoded_documents(data_dir: Path, split: str) -> list[str]:
    """The split's token stream cut at EOS and decoded; asserts the stream ends with EOS."""
    manifest = read_manifest(data_dir)
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    stream = _stream(data_dir / split)
    assert stream[-1] == manifest["eos_id"]
    cuts = np.flatnonzero(stream == manifest["eos_id"])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tokenizer.decode(stream[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, cuts)]


def _prepare_files(out: Path, files: list[str], **kwargs) -> Path:
    """prepare(source="files") with the tiny defaults of these tests."""
    return prepare(str(out), source="files", files=files, **{"vocab_size": VOCAB, "chunk_bytes": "4KB", **kwargs})


_SNIPPETS = [
    "def f(x):\n    return x * {i}  # ünïcödé\n",
    "class C{i}:\n    '''数据 {i}'''\n    pass\n",
    "for k in range({i}):\n\tprint(k, 'emoji \U0001f600')\n",
    "x = [{i}, {i}, {i}]   \n\n\nassert sum(x) == 3 * {i}\n",
]


def _doc(i: int) -> str:
    return "".join(_SNIPPETS[(i + j) % len(_SNIPPETS)].format(i=i * 7 + j) for j in range(3 + i % 5))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """40 small text documents, one empty and one whitespace-only file, one with invalid UTF-8."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"doc{i:02d}.py").write_text(_doc(i), encoding="utf-8")
    (root / "empty.py").write_text("")
    (root / "blank.py").write_text("  \n\n")
    (root / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    return root


def _expected_documents(corpus: Path, split: str, val_fraction: float) -> list[str]:
    """The split's documents in shuffled order (text files keyed by content)."""
    docs = {}
    for path in sorted(corpus.iterdir()):
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        if text.strip() and _is_val(_content_key(raw), val_fraction) == (split == "val"):
            docs[_content_key(raw)] = text
    return [docs[k] for k in _shuffled(list(docs))]


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datasets") / "text"
    return _prepare_files(out, [str(corpus / "*.py")], val_fraction=0.25)


# ----------------------------------------------------------------------------- prepare: sources


def test_text_files_round_trip_each_document_followed_by_eos(corpus, dataset):
    manifest = read_manifest(dataset)
    for split in ("train", "val"):
        expected = _expected_documents(corpus, split, 0.25)
        assert expected, f"corpus gives an empty {split} split; pick other file names"
        assert _decoded_documents(dataset, split) == expected
        assert manifest["splits"][split]["documents"] == len(expected)
        assert manifest["splits"][split]["tokens"] == len(_stream(dataset / split))
    assert manifest["split_rule"]["threshold"] == 0.25  # the corpus is far below val_tokens: val_fraction decides
    assert manifest["inputs"]["empty_documents_skipped"] == 2
    assert manifest["inputs"]["documents_with_undecodable_bytes"] == 1
    assert manifest["data_digest"] == corpus_module.data_digest(dataset)
    assert manifest["tokenizer"]["origin"] == "trained" and manifest["vocab_size"] == VOCAB
    assert manifest["eos_id"] == Tokenizer.from_file(str(dataset / "tokenizer.json")).token_to_id(EOS_TOKEN)
    assert sorted(p.name for p in dataset.iterdir()) == ["manifest.json", "tokenizer.json", "train", "val"]
    assert manifest["splits"]["train"]["chunks"] > 1  # chunk_bytes is honoured


def test_jsonl_records_are_documents_split_by_file_and_line(tmp_path):
    records = [{"id": i, "text": _doc(i)} for i in range(30)]
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "")  # blank lines are skipped but keep line numbers
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = _prepare_files(tmp_path / "out", [str(path)], val_fraction=0.3)
    numbered = [(n, json.loads(line)["text"]) for n, line in enumerate(lines, 1) if line]
    val = [text for n, text in numbered if _is_val(f"corpus.jsonl:{n}", 0.3)]
    train = [text for n, text in numbered if not _is_val(f"corpus.jsonl:{n}", 0.3)]
    assert val and train
    assert _decoded_documents(out, "val") == val  # one shard: records keep their order
    assert _decoded_documents(out, "train") == train
    # one path given as a string, not a list (as `--files corpus.jsonl` parses): the same dataset
    single = _prepare_files(tmp_path / "single", str(path), val_fraction=0.3)
    assert _decoded_documents(single, "val") == val and _decoded_documents(single, "train") == train


def test_parquet_column_is_read_and_null_rows_skipped(tmp_path):
    texts = [_doc(i) for i in range(25)] + [None]
    pq.write_table(pa.table({"content": texts, "n": list(range(26))}), tmp_path / "c.parquet")
    out = _prepare_files(tmp_path / "out", [str(tmp_path / "c.parquet")], text_field="content", val_fraction=0.3)
    docs = _decoded_documents(out, "train") + _decoded_documents(out, "val")
    assert sorted(docs) == sorted(texts[:-1])
    assert read_manifest(out)["splits"]["train"]["documents"] + read_manifest(out)["splits"]["val"]["documents"] == 25


def test_split_does_not_depend_on_corpus_location_or_file_order(corpus, dataset, tmp_path):
    moved = tmp_path / "elsewhere" / "deeper"
    moved.mkdir(parents=True)
    for p in corpus.iterdir():
        (moved / p.name).write_bytes(p.read_bytes())
    files = [str(p) for p in sorted(moved.iterdir(), reverse=True)]
    out = _prepare_files(tmp_path / "again", files, val_fraction=0.25)
    a, b = read_manifest(dataset), read_manifest(out)
    assert a["splits"] == b["splits"]
    assert sorted(_decoded_documents(out, "val")) == sorted(_decoded_documents(dataset, "val"))


def test_same_inputs_give_identical_chunks(corpus, dataset, tmp_path):
    out = _prepare_files(tmp_path / "twin", [str(corpus / "*.py")], val_fraction=0.25)
    for split in ("train", "val"):
        names = sorted(p.name for p in (dataset / split).glob("chunk-*.bin"))
        assert names == sorted(p.name for p in (out / split).glob("chunk-*.bin"))
        assert all((dataset / split / n).read_bytes() == (out / split / n).read_bytes() for n in names)


def test_tiny_corpus_still_gets_a_val_document(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(_doc(i))
    out = _prepare_files(tmp_path / "out", [str(tmp_path / "*.txt")], val_fraction=0.01)
    manifest = read_manifest(out)
    assert len(manifest["split_rule"]["overrides"]) == 1  # all three hash to train; one is moved across
    splits = manifest["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"]) == (2, 1)
    assert len(_decoded_documents(out, "val")) == 1


def test_user_tokenizer_is_copied_and_used(dataset, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": _doc(i)}) + "\n" for i in range(12)))
    out = _prepare_files(tmp_path / "out", [str(path)], tokenizer=str(dataset / "tokenizer.json"), val_fraction=0.3)
    manifest = read_manifest(out)
    assert manifest["tokenizer"]["origin"] == "file"
    assert (out / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()
    assert manifest["vocab_size"] == read_manifest(dataset)["vocab_size"]
    documents = _decoded_documents(out, "train") + _decoded_documents(out, "val")
    assert sorted(documents) == sorted(_doc(i) for i in range(12))


def test_stdlib_source_lists_every_stdlib_py_file_but_site_packages():
    roots, sources = corpus_module._stdlib_files()
    assert roots == [Path(sysconfig.get_paths()["stdlib"]).resolve()]
    names = [s.name for s in sources]
    assert names == sorted(names) and len(names) > 500
    assert all(k.endswith(".py") and "site-packages" not in k and "dist-packages" not in k for k in names)
    assert "stdlib/json/decoder.py" in names and "stdlib/os.py" in names


def test_python_source_reads_the_stdlib_and_every_site_packages_folder():
    roots = dict(corpus_module.python_roots())
    assert roots["stdlib"] == Path(sysconfig.get_paths()["stdlib"]).resolve()
    sites = [p for label, p in roots.items() if label != "stdlib"]
    assert Path(sysconfig.get_paths()["purelib"]).resolve() in sites
    assert all(p.name in ("site-packages", "dist-packages") or p == Path(sysconfig.get_paths()["platlib"]).resolve() for p in sites)
    # lightning is installed: its files are found under a site folder (walked, not prepared: the whole
    # environment would take minutes here)
    import lightning

    pkg = Path(lightning.__file__).resolve().parent
    site = next(p for p in sites if pkg.is_relative_to(p))
    found = corpus_module._walk_py(site / "lightning" / "fabric", "site-0")
    assert str(pkg / "fabric" / "__init__.py") in {f.path for f in found}


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> dict:
    """A tiny interpreter layout for source='python': a stdlib and a site-packages folder of three
    packages of 12 modules each, where one package vendors a copy of another's modules."""
    stdlib, site = tmp_path / "lib" / "python3", tmp_path / "lib" / "python3" / "site-packages"
    texts = {}
    for pkg in ("alpha", "beta", "gamma"):
        (site / pkg).mkdir(parents=True)
        for i in range(12):
            text = f"# {pkg} module {i}\n" + _doc(i + 40 * len(pkg))
            (site / pkg / f"m{i:02d}.py").write_text(text)
            texts[f"{pkg}/m{i:02d}.py"] = text
    (site / "gamma" / "_vendor").mkdir()
    for i in range(5):  # exact copies: one document each
        (site / "gamma" / "_vendor" / f"m{i:02d}.py").write_text(texts[f"alpha/m{i:02d}.py"])
    for i in range(6):
        (stdlib / f"std{i}.py").write_text(f"# stdlib {i}\n" + _doc(i + 200))
        texts[f"std{i}.py"] = f"# stdlib {i}\n" + _doc(i + 200)
    (site / "alpha" / "__pycache__").mkdir()
    (site / "alpha" / "__pycache__" / "junk.py").write_text("never read")
    monkeypatch.setattr(corpus_module, "python_roots", lambda: [("stdlib", stdlib), ("site-0", site)])
    return texts


def test_python_source_removes_duplicates_and_mixes_packages_across_chunks(fake_python, tmp_path):
    out = prepare(str(tmp_path / "py"), source="python", vocab_size=VOCAB, chunk_bytes="4KB", val_fraction=0.1)
    manifest = read_manifest(out)
    assert manifest["source"] == "python"
    assert manifest["inputs"]["files"] == 36 + 5 + 6 and manifest["inputs"]["duplicate_files_removed"] == 5
    documents = _decoded_documents(out, "train") + _decoded_documents(out, "val")
    assert sorted(documents) == sorted(fake_python.values())  # every module once, no __pycache__
    # path order would fill the first chunks with alpha's modules alone; shuffled, each holds several packages
    stream = _stream(out / "train")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    first_chunk = json.loads((out / "train" / "index.json").read_text())["chunks"][0]["dim"]
    text = tokenizer.decode(stream[:first_chunk].tolist(), skip_special_tokens=False)
    assert len({pkg for pkg in ("alpha", "beta", "gamma", "stdlib") if f"# {pkg} " in text}) >= 3


def test_python_source_with_no_py_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(corpus_module, "python_roots", lambda: [("stdlib", tmp_path / "empty")])
    with pytest.raises(FileNotFoundError, match="source='python': no .py file"):
        prepare(str(tmp_path / "out"), source="python")
    assert not (tmp_path / "out").exists()


def test_chunks_do_not_depend_on_the_number_of_workers(corpus, dataset, tmp_path):
    out = _prepare_files(tmp_path / "two", [str(corpus / "*.py")], val_fraction=0.25, num_workers=2)
    one = _prepare_files(tmp_path / "one", [str(corpus / "*.py")], val_fraction=0.25, num_workers=1)
    assert read_manifest(out)["data_digest"] == read_manifest(one)["data_digest"] == read_manifest(dataset)["data_digest"]


def test_val_split_targets_val_tokens_and_the_tokenizer_never_sees_it(fake_python, tmp_path):
    out = prepare(str(tmp_path / "py"), source="python", vocab_size=VOCAB, chunk_bytes="4KB", val_fraction=0.5, val_tokens=3000)
    manifest = read_manifest(out)
    rule = manifest["split_rule"]
    assert rule["threshold"] < 0.5  # val_tokens, not val_fraction, decided
    assert 1000 < manifest["splits"]["val"]["tokens"] < 9000  # about val_tokens, in whole documents
    # the tokenizer sample is every document at or above val_fraction in hash order (the corpus is far
    # below tokenizer_sample_bytes), so never a validation document
    unique = {_content_key(t.encode()): t for t in fake_python.values()}
    assert manifest["tokenizer_sample"]["bytes"] == sum(len(t.encode()) for k, t in unique.items() if _score(k) >= 0.5)


# ----------------------------------------------------------------------------- prepare: refusals


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        pytest.param(dict(vocab_size=256), ValueError, "vocab_size", id="vocab_size<257"),
        pytest.param(dict(val_fraction=0.0), ValueError, "val_fraction", id="val_fraction=0"),
        pytest.param(dict(val_fraction=1.0), ValueError, "val_fraction", id="val_fraction=1"),
        pytest.param(dict(chunk_bytes="lots"), ValueError, "chunk_bytes", id="chunk_bytes-unparsable"),
        pytest.param(dict(chunk_bytes="1KB"), ValueError, "chunk_bytes", id="chunk_bytes<4KB"),
        pytest.param(dict(num_workers=0), ValueError, "num_workers", id="num_workers=0"),
        pytest.param(dict(source="web"), ValueError, "source", id="unknown-source"),
        pytest.param(dict(source="files"), ValueError, "needs files", id="files-source-without-files"),
        pytest.param(dict(files=["a.txt"]), ValueError, "only read with source='files'", id="stdlib-with-files"),
        pytest.param(dict(source="python", files=["a.txt"]), ValueError, "only read with source='files'", id="python-with-files"),
        pytest.param(dict(val_tokens=0), ValueError, "val_tokens", id="val_tokens=0"),
        pytest.param(dict(shuffle_seed=-1), ValueError, "shuffle_seed", id="shuffle_seed<0"),
        pytest.param(dict(tokenizer_sample_bytes=0), ValueError, "tokenizer_sample_bytes", id="tokenizer_sample_bytes=0"),
        pytest.param(
            dict(source="files", files=["a.txt", "missing.txt"]), FileNotFoundError, "missing.txt", id="missing-file"
        ),
        pytest.param(dict(source="files", files=["*.nothing"]), FileNotFoundError, r"\*\.nothing", id="empty-glob"),
        pytest.param(dict(source="files", files=["a.txt", "a.json"]), ValueError, r"\.jsonl", id=".json"),
        pytest.param(dict(source="files", files=["a.txt", "a.jsonl.gz"]), ValueError, "compressed", id=".gz"),
        pytest.param(dict(source="files", files=["a.txt", "sub"]), ValueError, "directory", id="directory"),
        pytest.param(dict(source="files", files=["a.txt"]), ValueError, "at least 2 non-empty", id="one-document"),
        pytest.param(
            dict(source="files", files=["a.txt", "a.parquet"]), ValueError, "no column text_field='text'.*'content'",
            id="parquet-without-column",
        ),
        pytest.param(
            dict(source="files", files=["a.txt", "bad.jsonl"]), ValueError, r"bad\.jsonl:3: no field text_field='text'",
            id="jsonl-line-without-field",
        ),
        pytest.param(dict(tokenizer="nope.json"), FileNotFoundError, "nope.json", id="missing-tokenizer"),
        pytest.param(dict(tokenizer="no_eos.json"), ValueError, r"<\|endoftext\|>", id="tokenizer-without-eos"),
    ],
)
def test_bad_input_raises_before_anything_is_written(tmp_path, monkeypatch, kwargs, error, match):
    monkeypatch.chdir(tmp_path)
    for name in ("a.txt", "a.json", "a.jsonl.gz"):
        Path(name).write_text("hello world\n")
    Path("sub").mkdir()
    pq.write_table(pa.table({"content": ["x"]}), "a.parquet")
    Path("bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    from tokenizers import Tokenizer as T, models

    T(models.BPE()).save("no_eos.json")
    before = _entries(tmp_path)
    with pytest.raises(error, match=match):
        prepare("out", **kwargs)
    assert _entries(tmp_path) == before


def test_refuses_to_write_into_an_existing_dataset(dataset):
    manifest = (dataset / "manifest.json").read_text()
    with pytest.raises(FileExistsError, match="not empty.*overwrite"):
        prepare(str(dataset), source="files", files=["whatever.txt"])
    assert (dataset / "manifest.json").read_text() == manifest


def test_overwrite_replaces_a_dataset_but_never_foreign_files(corpus, tmp_path):
    out = tmp_path / "ds"
    kwargs = dict(source="files", files=[str(corpus / "*.py")], val_fraction=0.25, chunk_bytes="4KB")
    prepare(str(out), vocab_size=VOCAB, **kwargs)
    prepare(str(out), vocab_size=VOCAB + 20, overwrite=True, **kwargs)
    assert read_manifest(out)["vocab_size"] == VOCAB + 20
    assert _entries(tmp_path) == ["ds"]  # no temporary or old siblings left behind

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        prepare(str(foreign), vocab_size=VOCAB, **kwargs)
    with pytest.raises(ValueError, match="refusing to delete.*notes.txt"):
        prepare(str(foreign), vocab_size=VOCAB, overwrite=True, **kwargs)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_failure_midway_leaves_no_dataset_and_keeps_the_old_one(corpus, tmp_path, monkeypatch):
    kwargs = dict(source="files", files=[str(corpus / "*.py")], vocab_size=VOCAB, val_fraction=0.25, chunk_bytes="4KB")
    old = prepare(str(tmp_path / "old"), **kwargs)
    manifest = (old / "manifest.json").read_text()

    def crash(split_dir):
        raise RuntimeError("disk full")

    monkeypatch.setattr(corpus_module, "data_digest", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(str(tmp_path / "new"), **kwargs)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(str(old), overwrite=True, **kwargs)
    assert _entries(tmp_path) == ["old"]
    assert (old / "manifest.json").read_text() == manifest


# ----------------------------------------------------------------------------- DataModule


def test_datamodule_batches_are_int64_blocks_of_seq_len_plus_one(dataset):
    dm = TokenDataModule(str(dataset), seq_len=31, batch_size=4)
    assert (dm.vocab_size, dm.seq_len) == (VOCAB, 31)  # known right after __init__ for link_arguments
    chunk_dims = [c["dim"] for c in json.loads((dataset / "train" / "index.json").read_text())["chunks"]]
    batches = list(dm.train_dataloader())
    assert len(batches) == sum(d // 32 for d in chunk_dims) // 4  # blocks never span chunks; last batch dropped
    for batch in batches:
        assert batch.shape == (4, 32) and batch.dtype == torch.int64
        assert 0 <= batch.min() and batch.max() < VOCAB
    val = list(dm.val_dataloader())
    assert val and all(b.shape[1:] == (32,) and b.dtype == torch.int64 for b in val)


def test_train_loader_shuffles_every_block_once_and_val_keeps_stream_order(dataset):
    dm = TokenDataModule(str(dataset), seq_len=15, batch_size=2)
    train = torch.cat(list(dm.train_dataloader()))
    unshuffled = StreamingDataset(str(dataset / "train"), item_loader=TokensLoader(block_size=16))
    in_order = torch.stack([torch.from_numpy(np.asarray(x).astype(np.int64)) for x in unshuffled])
    assert not torch.equal(train, in_order[: len(train)])
    assert len(in_order) - len(train) < 2  # only the last partial batch is dropped
    assert Counter(map(tuple, train.tolist())) <= Counter(map(tuple, in_order.tolist()))

    val = torch.cat(list(dm.val_dataloader()))
    stream = torch.from_numpy(_stream(dataset / "val"))
    val_chunks = json.loads((dataset / "val" / "index.json").read_text())["chunks"]
    expected, start = [], 0
    for chunk in val_chunks:  # in order, each chunk's tail (< 16 tokens) unread
        n = chunk["dim"] // 16 * 16
        expected.append(stream[start : start + n].view(-1, 16))
        start += chunk["dim"]
    assert torch.equal(val, torch.cat(expected))


def test_train_batches_draw_from_the_whole_chunk_not_a_window(tmp_path):
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "lambda", "yield", "None", "x", "y", "(", ")", ":"]
    path = tmp_path / "random.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=400))}) + "\n" for _ in range(100)))
    out = _prepare_files(tmp_path / "one_chunk", [str(path)], val_fraction=0.1, chunk_bytes="16MB")
    assert read_manifest(out)["splits"]["train"]["chunks"] == 1
    in_order = StreamingDataset(str(out / "train"), item_loader=TokensLoader(block_size=16))
    blocks = [np.asarray(b).tobytes() for b in in_order]
    position = {block: i for i, block in enumerate(blocks)}
    # litdata's default shuffle window is 256 blocks; this chunk holds many times that, all distinct
    assert len(blocks) > 1000 and len(position) == len(blocks)
    spans = []
    for batch, _ in zip(TokenDataModule(str(out), seq_len=15, batch_size=16).train_dataloader(), range(10)):
        rows = [position[row.numpy().astype(np.uint16).tobytes()] for row in batch]
        spans.append(max(rows) - min(rows))
    assert np.median(spans) > len(blocks) / 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_train_loader_continues_with_the_next_batch(dataset, num_workers):
    dm = TokenDataModule(str(dataset), seq_len=15, batch_size=4, num_workers=num_workers)
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(4)]
    del it

    resumed = TokenDataModule(str(dataset), seq_len=15, batch_size=4, num_workers=num_workers).train_dataloader()
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(4))]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == 4


class _Recorder(L.LightningModule):
    """Records the batches it trains on; one parameter with a zero learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return self.w * batch.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(max_steps: int, ckpt_dir: Path | None = None) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if ckpt_dir else []
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=bool(ckpt_dir),
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )


def test_fit_resumed_from_a_checkpoint_trains_on_the_batches_an_uninterrupted_run_sees_next(dataset, tmp_path):
    def dm():
        return TokenDataModule(str(dataset), seq_len=63, batch_size=8)

    per_epoch = len(dm().train_dataloader())
    total = per_epoch + 4  # crosses an epoch boundary: the second epoch is reshuffled
    full = _Recorder()
    _trainer(total, tmp_path).fit(full, dm())
    assert len(full.seen) == total
    assert not torch.equal(torch.cat(full.seen[:4]), torch.cat(full.seen[per_epoch : per_epoch + 4]))
    for step in (2, per_epoch):  # mid-epoch, and at the end of an epoch
        resumed = _Recorder()
        _trainer(total).fit(resumed, dm(), ckpt_path=next(tmp_path.glob(f"*-step={step}.ckpt")))
        assert len(resumed.seen) == total - step
        assert all(torch.equal(a, b) for a, b in zip(resumed.seen, full.seen[step:]))


def test_reading_a_local_dataset_creates_no_cache(dataset, monkeypatch):
    import litdata.streaming.dataset

    def no_cache(*args, **kwargs):
        raise AssertionError("litdata tried to create a cache directory")

    monkeypatch.setattr(litdata.streaming.dataset, "_try_create_cache_dir", no_cache)
    files = {p: p.stat().st_mtime_ns for p in dataset.rglob("*")}
    dm = TokenDataModule(str(dataset), seq_len=15, batch_size=4)
    loader = dm.train_dataloader()
    assert next(iter(loader)).shape == (4, 16) and next(iter(dm.val_dataloader())).shape == (4, 16)
    assert loader.dataset.input_dir.path == str(dataset / "train")
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*")} == files


def test_missing_dataset_error_names_the_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"lit-mhar prepare --output_dir {tmp_path / 'nothing'}")):
        TokenDataModule(str(tmp_path / "nothing"), prepare_if_missing=False)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train").mkdir()
    with pytest.raises(FileNotFoundError, match=r"(?s)no manifest\.json.*--overwrite true"):
        TokenDataModule(str(tmp_path / "half"))
    assert not (tmp_path / "nothing").exists()


def test_missing_dataset_is_prepared_once_by_concurrent_modules(dataset, tmp_path, monkeypatch):
    calls = []

    def fake_prepare(output_dir: str, source: str) -> Path:
        assert source == "stdlib"
        calls.append(output_dir)
        tmp = Path(output_dir + ".tmp")
        shutil.copytree(dataset, tmp)
        time.sleep(0.3)  # long enough for the other module to reach the lock
        tmp.rename(output_dir)  # like prepare: the directory appears complete
        return Path(output_dir)

    monkeypatch.setattr(data, "prepare", fake_prepare)
    monkeypatch.chdir(tmp_path)  # the default data/stdlib of this folder: prepared without being asked
    target = tmp_path / "data" / "stdlib"
    modules: list[TokenDataModule] = []
    threads = [threading.Thread(target=lambda: modules.append(TokenDataModule("data/stdlib", seq_len=31, batch_size=2))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [str(target)]
    assert [m.vocab_size for m in modules] == [VOCAB, VOCAB]
    assert (tmp_path / "data" / "stdlib.lock").exists()
    assert [m.hparams.data_dir for m in modules] == [str(target)] * 2  # absolute in checkpoints: usable from any folder


def test_a_missing_dataset_elsewhere_is_not_prepared_unless_asked(dataset, tmp_path, monkeypatch):
    """A mistyped --data.data_dir must not silently become a new stdlib corpus there."""
    monkeypatch.setattr(data, "prepare", lambda output_dir, source: pytest.fail(f"prepared {output_dir}"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"(?s)No dataset at .*data/mine.*only at data/stdlib.*--data\.prepare_if_missing true"):
        TokenDataModule("data/mine")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    "kwargs", [dict(seq_len=0), dict(batch_size=0), dict(num_workers=-1)], ids=lambda k: next(iter(k))
)
def test_datamodule_rejects_bad_sizes(dataset, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TokenDataModule(str(dataset), **kwargs)


def test_too_long_seq_len_is_refused_when_the_module_is_built(dataset):
    with pytest.raises(ValueError, match=r"split of .* holds 0 blocks of seq_len \+ 1 = 4097 tokens"):
        TokenDataModule(str(dataset), seq_len=4096)


def test_val_tokens_scores_the_first_blocks_of_the_val_split(dataset):
    every = TokenDataModule(str(dataset), seq_len=15, batch_size=4).val_blocks()
    first = TokenDataModule(str(dataset), seq_len=15, batch_size=4, val_tokens=15 * 5 + 7).val_blocks()
    assert np.array_equal(first, every[:5])
    with pytest.raises(ValueError, match="val_tokens=.* is more than the .* tokens of the val split"):
        TokenDataModule(str(dataset), seq_len=15, val_tokens=10**9)
    with pytest.raises(ValueError, match="val_tokens=3 is less than one block"):
        TokenDataModule(str(dataset), seq_len=15, val_tokens=3)


def test_val_loss_of_one_checkpoint_is_the_same_at_any_batch_size(dataset):
    from lit_mhar.config import ModelConfig
    from lit_mhar.module import LitLM

    L.seed_everything(0)
    model = LitLM(ModelConfig.from_name("debug", residual="attnres", heads=2, vocab_size=VOCAB, seq_len=31))
    losses = []
    for batch_size in (4, 8, 5):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        dm = TokenDataModule(str(dataset), seq_len=31, batch_size=batch_size)
        losses.append(trainer.validate(model, datamodule=dm, verbose=False)[0]["val/loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0] == pytest.approx(losses[2], rel=1e-6)
    # and it is the mean over the whole set's tokens, not a mean of batch means (5 does not divide the blocks)
    blocks = torch.from_numpy(dm.val_blocks().astype(np.int64))
    assert len(blocks) % 5
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(blocks[:, :-1]).flatten(0, 1), blocks[:, 1:].flatten())
    assert losses[2] == pytest.approx(float(expected), rel=1e-5)


def test_val_blocks_are_shared_among_ranks_without_repeats(dataset):
    blocks = TokenDataModule(str(dataset), seq_len=15).val_blocks()
    from unittest import mock

    shares = []
    for rank in range(3):
        with mock.patch("torch.distributed.is_initialized", return_value=True), \
                mock.patch("torch.distributed.get_rank", return_value=rank), mock.patch("torch.distributed.get_world_size", return_value=3):
            shares.append(list(data.ValBlocks(blocks)))
    got = sorted(b.tobytes() for share in shares for b in share)
    assert got == sorted(b.tobytes() for b in blocks)


def test_a_truncated_chunk_is_named_before_any_work(dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    chunk = next((copy / "train").glob("chunk-*.bin"))
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"chunk {re.escape(str(chunk))} is damaged \(100 bytes, index.json says .*lit-mhar prepare --output_dir {re.escape(str(copy))}"):
        TokenDataModule(str(copy))


def test_a_manifest_whose_digest_does_not_match_its_data_is_refused(dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    assert verify_dataset(copy)["data_digest"] == read_manifest(dataset)["data_digest"]
    chunk = next((copy / "val").glob("chunk-*.bin"))
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 1  # same size, other tokens
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="its token data has digest .* but its manifest says"):
        verify_dataset(copy)


@pytest.mark.slow
def test_default_datamodule_prepares_the_stdlib_corpus(tmp_path):
    dm = TokenDataModule(str(tmp_path / "stdlib"), seq_len=128, batch_size=2, prepare_if_missing=True)
    manifest = read_manifest(tmp_path / "stdlib")
    _, sources = corpus_module._stdlib_files()
    assert manifest["source"] == "stdlib" and dm.vocab_size == manifest["vocab_size"] == 8192
    splits, inputs = manifest["splits"], manifest["inputs"]
    assert inputs["files"] == len(sources)
    assert splits["train"]["documents"] + splits["val"]["documents"] == inputs["documents"]
    assert manifest["splits"]["train"]["tokens"] > 1_000_000 and manifest["splits"]["val"]["tokens"] > 10_000
    tokenizer = Tokenizer.from_file(str(tmp_path / "stdlib" / "tokenizer.json"))
    text = tokenizer.decode(next(iter(dm.val_dataloader()))[0].tolist())
    assert len(text) > 128  # BPE merges: more than one character per token on Python code


def _rng_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state().numpy().tobytes()


def test_validation_draws_nothing_from_the_global_random_state(dataset):
    """A DataLoader iterator draws its base seed from the global torch RNG unless it has a generator of
    its own: each validation would shift the random stream of training."""
    dm = TokenDataModule(str(dataset), seq_len=8, batch_size=2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(3):
        assert len(list(dm.val_dataloader())) > 0
    assert torch.equal(torch.rand(3), expected)


def test_preparing_a_corpus_leaves_every_random_state_as_it_was(corpus, tmp_path):
    """A fit that prepares its data first must train as every later fit of the same config does."""
    L.seed_everything(3)
    before = _rng_states()
    _prepare_files(tmp_path / "p", [str(corpus / "*.py")], val_fraction=0.25, num_workers=2)
    assert _rng_states() == before


def test_a_datamodule_that_prepares_restores_the_random_states(dataset, tmp_path, monkeypatch):
    def noisy_prepare(output_dir: str, source: str) -> Path:
        random.random(), np.random.rand(), torch.rand(3)  # whatever preparing might draw
        shutil.copytree(dataset, output_dir)
        return Path(output_dir)

    monkeypatch.setattr(data, "prepare", noisy_prepare)
    monkeypatch.chdir(tmp_path)
    L.seed_everything(3)
    before = _rng_states()
    TokenDataModule("data/stdlib", seq_len=31, batch_size=2)
    assert (tmp_path / "data" / "stdlib" / "manifest.json").is_file() and _rng_states() == before
