"""Token data: ``prepare`` turns text into litdata token chunks, ``TokenDataModule`` streams them.

A prepared dataset is a directory::

    output_dir/
        train/           litdata chunks (index.json, chunk-*.bin): one flat token stream,
        val/             documents concatenated, each followed by the EOS token
        tokenizer.json   the `tokenizers` tokenizer that produced the ids
        manifest.json    source, counts, vocabulary; written last, so it marks a complete dataset

Documents go to train or val by a stable hash of their key (path relative to the corpus root,
plus ``:line`` / ``:row`` for JSONL / Parquet records), so the split does not depend on file order,
worker count or Python's salted ``hash``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import inspect
import json
import multiprocessing
import os
import shutil
import signal
import sys
import sysconfig
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union

# Older litdata releases ask PyPI for a newer version on every optimize() / StreamingDataset()
# (offline: up to a 30 s timeout). Read when litdata is imported.
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import lightning as L  # noqa: E402
import litdata  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402
from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from litdata.streaming.item_loader import TokensLoader  # noqa: E402
from litdata.utilities.format import _convert_bytes_to_int  # noqa: E402

from lit_mhar.outputs import check_output_dir, staged_directory  # noqa: E402
from lit_mhar.processes import forked_children_die_with_parent  # noqa: E402

__all__ = ["EOS_TOKEN", "MANIFEST_NAME", "TOKENIZER_NAME", "TokenDataModule", "prepare", "read_manifest"]

EOS_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
DEFAULT_DATA_DIR = "data/stdlib"  # where fit builds the default corpus by itself (relative to the current folder)
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = "lit-mhar-tokens/1"

# Extensions that are certainly not one plain-text document; reading them as text would
# silently train on garbage.
_REJECTED_SUFFIXES = {
    ".json": "JSON Lines must end in .jsonl (one JSON object per line)",
    ".gz": "compressed files are not read; decompress first",
    ".bz2": "compressed files are not read; decompress first",
    ".xz": "compressed files are not read; decompress first",
    ".zst": "compressed files are not read; decompress first",
    ".zip": "archives are not read; extract first",
    ".tar": "archives are not read; extract first",
    ".arrow": "convert to .parquet or .jsonl",
    ".feather": "convert to .parquet or .jsonl",
    ".pkl": "binary file",
    ".pt": "binary file",
    ".npy": "binary file",
    ".bin": "binary file",
    ".safetensors": "binary file",
}
_MIN_CHUNK_BYTES = 4000  # "4KB": litdata units are decimal
_OPTIMIZE_SCRATCH = ".optimize-scratch"  # litdata scratch folders, inside the build dir
_GROUP_BYTES = 2_000_000  # plain-text files are batched into optimize() inputs of about this size
_ENCODE_BATCH_CHARS = 4_000_000  # characters handed to one encode_batch call


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Source:
    """One input file. ``key`` (POSIX path relative to the corpus root) names it for the split."""

    path: str
    key: str
    kind: Literal["text", "jsonl", "parquet"]
    size: int


def _kind_of(path: str) -> Literal["text", "jsonl", "parquet"]:
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix in _REJECTED_SUFFIXES:
        raise ValueError(
            f"files: cannot read {path!r} ({_REJECTED_SUFFIXES[suffix]}). Valid inputs: .jsonl (one JSON "
            "object per line), .parquet, or any plain-text file (one document per file)."
        )
    return "text"


def _stdlib_sources() -> tuple[Path, list[_Source]]:
    """Every ``.py`` file of the running Python's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                sources.append(_Source(str(path), path.relative_to(root).as_posix(), "text", path.stat().st_size))
    sources.sort(key=lambda s: s.key)
    if not sources:
        raise FileNotFoundError(f"source='stdlib': no .py files under {root}")
    return root, sources


def _file_sources(files: list[str], text_field: str) -> tuple[Path, list[_Source]]:
    """Expands globs, checks existence, extension and (for JSONL / Parquet) the text field."""
    paths: list[str] = []
    for entry in files:
        if glob.has_magic(entry):
            matches = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"files: the pattern {entry!r} matches no file")
            paths.extend(matches)
        else:
            paths.append(entry)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"files: not found: {', '.join(map(repr, missing))}")
    dirs = [p for p in paths if os.path.isdir(p)]
    if dirs:
        raise ValueError(f"files: {dirs[0]!r} is a directory; pass files or a glob such as '{dirs[0]}/*.txt'")
    resolved = [Path(p).resolve() for p in paths]
    seen: set[Path] = set()
    for p, r in zip(paths, resolved):
        if r in seen:
            raise ValueError(f"files: {p!r} is listed twice")
        seen.add(r)
    root = Path(os.path.commonpath([str(r.parent) for r in resolved]))
    sources = [
        _Source(str(r), r.relative_to(root).as_posix(), _kind_of(str(r)), r.stat().st_size) for r in resolved
    ]
    for s in sources:
        if s.kind == "parquet":
            _check_parquet_field(s.path, text_field)
    return root, sources


def _check_parquet_field(path: str, text_field: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column text_field={text_field!r}; columns: {schema.names}")
    type_ = schema.field(text_field).type
    if not (pa.types.is_string(type_) or pa.types.is_large_string(type_)):
        raise ValueError(f"{path}: column {text_field!r} must hold strings, found {type_}")


def _decode(data: bytes) -> tuple[str, bool]:
    """UTF-8 text and whether undecodable bytes were replaced by U+FFFD (deterministic)."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _iter_documents(src: _Source, text_field: str) -> Iterator[tuple[str, str, bool]]:
    """Yields ``(key, text, had_undecodable_bytes)`` for every record of one file."""
    if src.kind == "text":
        text, replaced = _decode(Path(src.path).read_bytes())
        yield src.key, text, replaced
    elif src.kind == "jsonl":
        with open(src.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line, replaced = _decode(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{src.path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    found = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{src.path}:{lineno}: no field text_field={text_field!r}; found {found}")
                text = record[text_field]
                if text is None:
                    text = ""
                if not isinstance(text, str):
                    raise ValueError(
                        f"{src.path}:{lineno}: field {text_field!r} must be a string, got {type(text).__name__}"
                    )
                yield f"{src.key}:{lineno}", text, replaced
    else:
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(src.path).iter_batches(batch_size=4096, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                yield f"{src.key}:{row}", text or "", False
                row += 1


# ----------------------------------------------------------------------------- split


def _split_score(key: str) -> float:
    """A stable pseudo-random number in [0, 1] per document key (64-bit BLAKE2b / 2**64)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") / 2**64


def _split_of(key: str, val_fraction: float, overrides: dict[str, str]) -> str:
    return overrides.get(key) or ("val" if _split_score(key) < val_fraction else "train")


def _iter_split(
    sources: list[_Source], text_field: str, split: str, val_fraction: float, overrides: dict[str, str]
) -> Iterator[str]:
    """Texts of the non-empty documents of one split, in source order."""
    for src in sources:
        for key, text, _ in _iter_documents(src, text_field):
            if text.strip() and _split_of(key, val_fraction, overrides) == split:
                yield text


@dataclass
class _Scan:
    documents: dict[str, int]
    characters: dict[str, int]
    sources: dict[str, list[_Source]]  # files with at least one document in the split
    overrides: dict[str, str]  # document key -> split, where the hash split left a split empty
    empty: int
    undecodable: int


def _scan(sources: list[_Source], text_field: str, val_fraction: float) -> _Scan:
    """Reads every document once: validates records, counts per split, guarantees both splits.

    Raises:
        ValueError: a record lacks the text field, or there are fewer than two non-empty documents.
    """
    docs = {s: 0 for s in SPLITS}
    chars = {s: 0 for s in SPLITS}
    per_file = [{s: 0 for s in SPLITS} for _ in sources]
    empty = undecodable = 0
    lowest_train: tuple[float, str, int, int] | None = None  # (score, key, file index, characters)
    highest_val: tuple[float, str, int, int] | None = None
    for i, src in enumerate(sources):
        for key, text, replaced in _iter_documents(src, text_field):
            undecodable += replaced
            if not text.strip():
                empty += 1
                continue
            score = _split_score(key)
            split = "val" if score < val_fraction else "train"
            docs[split] += 1
            chars[split] += len(text)
            per_file[i][split] += 1
            if split == "train" and (lowest_train is None or score < lowest_train[0]):
                lowest_train = (score, key, i, len(text))
            if split == "val" and (highest_val is None or score > highest_val[0]):
                highest_val = (score, key, i, len(text))
    if docs["train"] + docs["val"] < 2:
        raise ValueError(
            f"need at least 2 non-empty documents to make a train and a val split, found "
            f"{docs['train'] + docs['val']} (a plain-text file is one document: pass several files, "
            "or JSONL / Parquet with one record per document)"
        )
    # A tiny corpus can hash every document to one side: move the nearest one across.
    overrides: dict[str, str] = {}
    for empty_split, moved in (("val", lowest_train), ("train", highest_val)):
        if docs[empty_split] == 0 and moved is not None:
            other = "train" if empty_split == "val" else "val"
            _, key, i, n_chars = moved
            overrides[key] = empty_split
            docs[empty_split], docs[other] = docs[empty_split] + 1, docs[other] - 1
            chars[empty_split], chars[other] = chars[empty_split] + n_chars, chars[other] - n_chars
            per_file[i][empty_split] += 1
            per_file[i][other] -= 1
    return _Scan(
        documents=docs,
        characters=chars,
        sources={s: [src for src, n in zip(sources, per_file) if n[s] > 0] for s in SPLITS},
        overrides=overrides,
        empty=empty,
        undecodable=undecodable,
    )


def _groups(sources: list[_Source]) -> list[list[_Source]]:
    """optimize() inputs: plain-text files batched to ~_GROUP_BYTES, every JSONL / Parquet file alone."""
    groups: list[list[_Source]] = []
    current: list[_Source] = []
    size = 0
    for src in sources:
        if src.kind != "text":
            groups.append([src])
            continue
        current.append(src)
        size += src.size
        if size >= _GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


# ----------------------------------------------------------------------------- tokenizer


def _train_tokenizer(texts: Iterator[str], vocab_size: int, length: int) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenisation, all 256 bytes in the base alphabet) + EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Keep tokenizers' thread pool unused in this process: after a fork from a process that used
    # it, tokenizers runs single-threaded in the child (the optimize() workers that encode).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    return tokenizer


def _load_tokenizer(path: str) -> Any:
    """Loads a user's ``tokenizer.json`` and checks that it has the EOS token.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a `tokenizers` tokenizer, or it has no ``<|endoftext|>`` token.
    """
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer: no file {path!r} (expected a `tokenizers` tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ValueError(f"tokenizer: {path!r} is not a `tokenizers` tokenizer.json ({e})") from None
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"tokenizer: {path!r} has no {EOS_TOKEN!r} token, which prepare appends after each document")
    return tokenizer


def _vocab_size(tokenizer: Any) -> int:
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab().values()) + 1)


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _tokenize_group(
    group: list[_Source],
    *,
    tokenizer_path: str,
    text_field: str,
    split: str,
    val_fraction: float,
    overrides: dict[str, str],
    eos_id: int,
    dtype: str,
    max_item_tokens: int,
) -> Iterator[np.ndarray]:
    """optimize() fn: the token ids of one input group's documents in ``split``, each + EOS.

    Yields 1-D ``dtype`` arrays of at most ``max_item_tokens`` ids, so no item outgrows a chunk.
    """
    tokenizer = _worker_tokenizer(tokenizer_path)
    eos = np.array([eos_id], dtype=dtype)

    def encode(texts: list[str]) -> Iterator[np.ndarray]:
        parts = []
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            parts += [np.asarray(enc.ids, dtype=dtype), eos]
        ids = np.concatenate(parts)
        for start in range(0, len(ids), max_item_tokens):
            yield ids[start : start + max_item_tokens]

    batch: list[str] = []
    chars = 0
    for text in _iter_split(group, text_field, split, val_fraction, overrides):
        batch.append(text)
        chars += len(text)
        if chars >= _ENCODE_BATCH_CHARS:
            yield from encode(batch)
            batch, chars = [], 0
    if batch:
        yield from encode(batch)


# ----------------------------------------------------------------------------- prepare


@contextlib.contextmanager
def _contained_optimize(cache_root: Path) -> Iterator[None]:
    """Undoes optimize()'s process-wide side effects.

    litdata's optimize() wipes and reuses fixed scratch folders (``$TMPDIR/chunks``, ``$TMPDIR/data``:
    a concurrent run would lose its files), forces the multiprocessing start method, and installs
    a SIGINT handler that calls ``os._exit(0)``. Point the scratch folders into our build directory
    and restore the rest afterwards.
    """
    env = {
        "DATA_OPTIMIZER_CACHE_FOLDER": cache_root / "chunks",
        "DATA_OPTIMIZER_DATA_CACHE_FOLDER": cache_root / "data",
    }
    saved_env = {k: os.environ.get(k) for k in env}
    saved_method = multiprocessing.get_start_method(allow_none=True)
    saved_sigint = signal.getsignal(signal.SIGINT)
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        multiprocessing.set_start_method(saved_method, force=True)
        with contextlib.suppress(ValueError):  # not in the main thread: nothing was installed
            signal.signal(signal.SIGINT, saved_sigint)


def _split_chunks(split_dir: Path) -> tuple[int, int]:
    """(tokens, chunks) of one written split, from litdata's index.json."""
    chunks = json.loads((split_dir / "index.json").read_text())["chunks"]
    return sum(int(c["dim"]) for c in chunks), len(chunks)


def _log(message: str) -> None:
    print(f"[lit-mhar prepare] {message}", file=sys.stderr, flush=True)


def _check_output_dir(out: Path, overwrite: bool) -> None:
    """Raises unless ``out`` is absent, empty, or (with overwrite) a dataset prepare wrote."""
    check_output_dir(out, overwrite, (*SPLITS, TOKENIZER_NAME, MANIFEST_NAME), "prepare")


def _check_arguments(
    source: str,
    files: Optional[list[str]],
    text_field: str,
    vocab_size: int,
    val_fraction: float,
    chunk_bytes: str,
    num_workers: int,
) -> int:
    """Validates prepare()'s arguments; returns chunk_bytes in bytes."""
    if source not in ("stdlib", "files"):
        raise ValueError(f"source must be 'stdlib' or 'files', got {source!r}")
    if source == "stdlib" and files:
        raise ValueError("files is only read with source='files'")
    if source == "files" and not files:
        raise ValueError("source='files' needs files (a list of .txt/.md/..., .jsonl or .parquet paths)")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size < 2**31:
        raise ValueError(f"vocab_size must be an int in [257, 2**31) (256 bytes + EOS at least), got {vocab_size!r}")
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    try:
        n_bytes = _convert_bytes_to_int(chunk_bytes) if isinstance(chunk_bytes, str) else int(chunk_bytes)
    except ValueError as e:
        raise ValueError(f"chunk_bytes must look like '16MB' or '64KB', got {chunk_bytes!r} ({e})") from None
    if n_bytes < _MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be at least 4KB, got {chunk_bytes!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    return n_bytes


def _optimize(
    fn: Any, groups: list[list[_Source]], split_dir: Path, chunk_bytes: int, num_workers: int
) -> tuple[int, int]:
    """Runs litdata.optimize into ``split_dir``; returns (tokens, chunks) from its index.json."""
    # its workers die with this process, however it ends (their output is a staging folder)
    with _contained_optimize(split_dir.parent / _OPTIMIZE_SCRATCH), forked_children_die_with_parent():
        litdata.optimize(
            fn=fn,
            inputs=groups,
            output_dir=str(split_dir),
            chunk_bytes=chunk_bytes,
            item_loader=TokensLoader(),
            num_workers=min(num_workers, len(groups)),
            keep_data_ordered=True,  # same chunks for the same inputs and num_workers
            # spawn would re-import torch + lightning in every worker (~14 s per split here)
            start_method="fork" if sys.platform == "linux" else "spawn",
            verbose=False,
        )
    return _split_chunks(split_dir)


def _versions() -> dict[str, str]:
    import tokenizers

    from lit_mhar import __version__

    return {
        "lit_mhar": __version__,
        "litdata": litdata.__version__,
        "tokenizers": tokenizers.__version__,
        "python": sys.version.split()[0],
    }


def prepare(
    output_dir: str = DEFAULT_DATA_DIR,
    source: Literal["stdlib", "files"] = "stdlib",
    files: Union[list[str], str, None] = None,
    text_field: str = "text",
    tokenizer: Optional[str] = None,
    vocab_size: int = 8192,
    val_fraction: float = 0.02,
    chunk_bytes: str = "16MB",
    num_workers: int = 1,
    overwrite: bool = False,
) -> Path:
    """Tokenize a text corpus into litdata token chunks with a tokenizer and a manifest.

    Writes ``output_dir/{train,val}/`` (litdata ``TokensLoader`` chunks: each document's ids followed
    by the ``<|endoftext|>`` id, uint16 when the vocabulary fits, else int32), ``tokenizer.json``
    and, last, ``manifest.json``. Everything is built in a hidden sibling directory and renamed
    into place, so an interrupted run leaves no dataset behind. All arguments and input files are
    checked before any work starts.

    Args:
        output_dir: Directory to create. Must not exist or be empty (see overwrite).
        source: ``stdlib``: every .py file of the running Python's standard library (~30 MB of
            code), split by file. ``files``: the paths in ``files``.
        files: Input files for source=files (globs allowed; one path or pattern, or a list). ``.jsonl``: one document per line, in
            ``text_field``; ``.parquet``: one document per row of column ``text_field``; any other
            file: plain UTF-8 text, one document per file.
        text_field: JSONL field / Parquet column holding the text.
        tokenizer: Path to a `tokenizers` tokenizer.json to use (copied beside the chunks; must
            contain ``<|endoftext|>``). Default: train a byte-level BPE on the train split.
        vocab_size: Vocabulary size of the trained BPE, ``<|endoftext|>`` included (>= 257;
            ignored with tokenizer). A small corpus may yield fewer tokens; the manifest has the
            actual size.
        val_fraction: Expected fraction of documents in the validation split, in (0, 1). Each
            document goes to val iff a 64-bit BLAKE2b hash of its key, scaled to [0, 1), is below it.
        chunk_bytes: Target size of one litdata chunk, e.g. ``16MB`` or ``64KB`` (>= 4KB). Training
            blocks never span chunks: each chunk loses its last < seq_len + 1 tokens when read.
        num_workers: Processes that tokenize (litdata optimize workers).
        overwrite: Replace an existing dataset at output_dir (only one that prepare wrote).

    Returns:
        The dataset directory.

    Raises:
        ValueError: an invalid argument, input file, record or tokenizer.
        FileNotFoundError: a missing input file or tokenizer.
        FileExistsError: output_dir is not empty and overwrite is false.
    """
    started = time.perf_counter()
    if isinstance(files, (str, os.PathLike)):
        files = [os.fspath(files)]
    chunk_bytes_int = _check_arguments(source, files, text_field, vocab_size, val_fraction, chunk_bytes, num_workers)
    out = Path(output_dir).expanduser().absolute()
    _check_output_dir(out, overwrite)
    user_tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
    root, sources = _stdlib_sources() if source == "stdlib" else _file_sources(list(files or []), text_field)
    scan = _scan(sources, text_field, val_fraction)
    _log(
        f"{source}: {len(sources)} files, {scan.documents['train']} train / {scan.documents['val']} val "
        f"documents ({scan.empty} empty skipped, {scan.undecodable} with undecodable bytes replaced)"
    )

    # re-check before replacing: the folder may have changed while we worked
    with staged_directory(out, before_replace=lambda: _check_output_dir(out, overwrite)) as tmp:
        tokenizer_path = tmp / TOKENIZER_NAME
        if user_tokenizer is None:
            t0 = time.perf_counter()
            texts = _iter_split(sources, text_field, "train", val_fraction, scan.overrides)
            tok = _train_tokenizer(texts, vocab_size, length=scan.documents["train"])
            tok.save(str(tokenizer_path))
            _log(f"trained byte-level BPE, {_vocab_size(tok)} tokens, in {time.perf_counter() - t0:.1f}s")
        else:
            tok = user_tokenizer
            shutil.copyfile(tokenizer, tokenizer_path)
        eos_id = tok.token_to_id(EOS_TOKEN)
        dtype = "uint16" if _vocab_size(tok) <= 2**16 else "int32"
        counts = {}
        for split in SPLITS:
            t0 = time.perf_counter()
            fn = functools.partial(
                _tokenize_group,
                tokenizer_path=str(tokenizer_path),
                text_field=text_field,
                split=split,
                val_fraction=val_fraction,
                overrides=scan.overrides,
                eos_id=eos_id,
                dtype=dtype,
                max_item_tokens=chunk_bytes_int // np.dtype(dtype).itemsize // 2,
            )
            counts[split] = _optimize(fn, _groups(scan.sources[split]), tmp / split, chunk_bytes_int, num_workers)
            _log(f"{split}: {counts[split][0]:,} tokens in {counts[split][1]} chunks, {time.perf_counter() - t0:.1f}s")
        shutil.rmtree(tmp / _OPTIMIZE_SCRATCH, ignore_errors=True)
        manifest = {
            "format": FORMAT,
            "source": source,
            "source_root": str(root),
            "text_field": text_field if source == "files" else None,
            "inputs": [s.key for s in sources] if source == "files" else None,
            "val_fraction": val_fraction,
            "split_rule": "val iff blake2b(key, 8 bytes) / 2**64 < val_fraction; key = relative path[:line|:row]",
            "split_overrides": scan.overrides,
            "splits": {
                s: {
                    "files": len(scan.sources[s]),
                    "documents": scan.documents[s],
                    "characters": scan.characters[s],
                    "tokens": counts[s][0],
                    "chunks": counts[s][1],
                }
                for s in SPLITS
            },
            "empty_documents_skipped": scan.empty,
            "documents_with_undecodable_bytes": scan.undecodable,
            "vocab_size": _vocab_size(tok),
            "tokenizer": {
                "origin": "trained" if user_tokenizer is None else "file",
                "path": TOKENIZER_NAME,
                "source_path": None if tokenizer is None else str(Path(tokenizer).absolute()),
                "requested_vocab_size": vocab_size if user_tokenizer is None else None,
            },
            "eos_token": EOS_TOKEN,
            "eos_id": eos_id,
            "dtype": dtype,
            "chunk_bytes": chunk_bytes,
            "versions": _versions(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "prepare_seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks completeness
    _log(f"wrote {out} in {time.perf_counter() - started:.1f}s")
    return out


def prepares_by_itself(data_dir: str | os.PathLike, prepare_if_missing: Optional[bool]) -> bool:
    """Whether a missing dataset at ``data_dir`` is built as the stdlib corpus without asking (see
    :class:`TokenDataModule`): ``prepare_if_missing`` when given, else only at the default ``data/stdlib``."""
    if prepare_if_missing is not None:
        return bool(prepare_if_missing)
    return Path(data_dir).expanduser().absolute() == Path(DEFAULT_DATA_DIR).absolute()


def read_manifest(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete dataset.

    Raises:
        FileNotFoundError: ``data_dir/manifest.json`` does not exist (no dataset, or an incomplete one).
        ValueError: the manifest is of another format version.
    """
    path = Path(data_dir) / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}; prepare it again")
    return manifest


def longest_block(data_dir: str | os.PathLike, split: str) -> int:
    """The longest ``seq_len`` the ``split`` of the dataset at ``data_dir`` can serve: the tokens of
    its largest chunk, minus 1 (a block is ``seq_len + 1`` tokens and never spans chunks)."""
    chunks = json.loads((Path(data_dir) / split / "index.json").read_text())["chunks"]
    return max((int(c["dim"]) for c in chunks), default=0) - 1


# ----------------------------------------------------------------------------- DataModule


class _ResumableLoader(StreamingDataLoader):
    """A StreamingDataLoader whose resumed epoch ends after its last batch.

    ``load_state_dict`` sets ``restore``, which makes the next ``__iter__`` continue the saved epoch
    instead of starting a new one; litdata clears it only when an iterator runs into StopIteration.
    Lightning stops after ``len(loader)`` batches without that last ``next()``, so every later epoch
    would replay the resumed one (same order, same skip). Clear the flag once the resumed epoch has
    yielded all its batches. Same pattern as litdata issue #770 (ParallelStreamingDataset).
    """

    def __iter__(self) -> Any:
        if self.restore and self._num_samples_yielded_streaming >= len(self) * self.batch_size:
            self.restore = False
        return super().__iter__()


# Recent litdata shuffles items in windows of 256 by default (read locality for remote data): on
# the stdlib corpus the 16 sequences of a batch then span ~230 neighbouring blocks, a few adjacent
# files, instead of the whole chunk (measured). The chunks are local, so permute whole chunks.
_FULL_CHUNK_SHUFFLE = (
    {"item_shuffle_window": "full"} if "item_shuffle_window" in inspect.signature(StreamingDataset).parameters else {}
)


def _collate_tokens(items: list[np.ndarray]) -> torch.Tensor:
    """Stacks token blocks into an int64 ``[B, seq_len + 1]`` tensor."""
    return torch.from_numpy(np.stack(items).astype(np.int64))


class TokenDataModule(L.LightningDataModule):
    """Streams fixed-length token blocks from a dataset written by :func:`prepare`.

    Each batch is an int64 tensor ``[batch_size, seq_len + 1]``: consecutive, non-overlapping
    blocks of the token stream (documents separated by EOS); the model predicts ``x[:, 1:]``
    from ``x[:, :-1]``. The train loader shuffles (chunk order and all blocks within each chunk,
    reseeded every epoch) and drops the last partial batch; val is read in order.

    The train loader is a litdata ``StreamingDataLoader``, which has ``state_dict()``: Lightning's
    fit loop stores it in every checkpoint (``loops.fit_loop.state_dict.combined_loader``) and loads
    it into the new loader on resume, so a resumed run continues with the next unseen batch and
    later epochs reshuffle as in an uninterrupted run. Resuming needs the same seed, seq_len,
    batch_size, num_workers and world size (litdata checks). Reading a local dataset creates no
    cache: litdata reads the chunk files in place.

    Attributes:
        vocab_size: Vocabulary size of the dataset's tokenizer (from the manifest), set in __init__.
        seq_len: Tokens the model sees per sequence.
        eos_id: Id of ``<|endoftext|>``, which follows every document.
        manifest: The dataset's manifest.json.
    """

    def __init__(
        self,
        data_dir: str = DEFAULT_DATA_DIR,
        seq_len: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 42,
        prepare_if_missing: Optional[bool] = None,
    ) -> None:
        """Reads the manifest (preparing the stdlib corpus first if allowed and needed).

        Args:
            data_dir: Dataset directory written by ``lit-mhar prepare``.
            seq_len: Tokens the model sees per sequence; blocks are seq_len + 1 tokens long.
            batch_size: Sequences per batch (per device).
            num_workers: DataLoader worker processes; 0 reads in the main process.
            seed: Seed of the train shuffle.
            prepare_if_missing: If data_dir does not exist, build the default stdlib corpus there
                (``lit-mhar prepare --output_dir DATA_DIR``), under a file lock so concurrent
                processes prepare it once. None (the default): only when data_dir is the default
                ``data/stdlib`` of the current folder, so a mistyped path is an error rather than a
                new stdlib corpus; True: at any data_dir; False: never. Other corpora must be
                prepared explicitly. The data_dir stored in the hyperparameters (and so in
                checkpoints) is absolute, so tools that read it (generate, probe) work from any folder.

        Raises:
            ValueError: a non-positive seq_len / batch_size, or a negative num_workers.
            FileNotFoundError: no dataset at data_dir and it may not (or cannot) be prepared; the
                message gives the command to run.
        """
        super().__init__()
        sizes = (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0))
        for name, value, low in sizes:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        data_dir = str(Path(data_dir).expanduser().absolute())  # recorded absolute by save_hyperparameters
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.manifest = self._ensure_dataset(prepare_if_missing)
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.eos_id: int = int(self.manifest["eos_id"])

    def _ensure_dataset(self, prepare_if_missing: Optional[bool]) -> dict[str, Any]:
        if (self.data_dir / MANIFEST_NAME).is_file():
            return read_manifest(self.data_dir)
        if prepare_if_missing is None:
            prepare_if_missing = prepares_by_itself(self.data_dir, None)
            if not prepare_if_missing:
                self._raise_missing(
                    f"\n(fit builds the default corpus by itself only at {DEFAULT_DATA_DIR}; "
                    "--data.prepare_if_missing true builds it at this path)"
                )
        if not prepare_if_missing:
            self._raise_missing()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # Every DDP rank builds the DataModule; the first to take the lock prepares, the rest wait.
        # prepare() renames a finished dataset into place, so the manifest shows up with the dir.
        with FileLock(f"{self.data_dir}.lock"):
            if not (self.data_dir / MANIFEST_NAME).is_file():
                if self.data_dir.exists():
                    self._raise_missing()
                prepare(output_dir=str(self.data_dir))
        return read_manifest(self.data_dir)

    def _raise_missing(self, note: str = "") -> None:
        command = f"lit-mhar prepare --output_dir {self.data_dir}"
        if self.data_dir.exists():
            raise FileNotFoundError(
                f"{self.data_dir} exists but has no {MANIFEST_NAME}, so it is not a dataset written by lit-mhar prepare. "
                f"If it holds your text, prepare a dataset from it into a new folder:\n"
                f"  lit-mhar prepare --output_dir {self.data_dir}_data --source files --files '[\"{self.data_dir}/*.txt\"]'\n"
                f"If it is a dataset whose preparation was interrupted, rebuild it:\n  {command} --overwrite true"
            )
        raise FileNotFoundError(
            f"No dataset at {self.data_dir}. Create it with:\n  {command}\n"
            f"or, from your own text:\n  {command} --source files --files '[\"corpus/*.jsonl\"]'{note}"
        )

    def _dataset(self, split: str, shuffle: bool, drop_last: Optional[bool]) -> StreamingDataset:
        dataset = StreamingDataset(
            input_dir=str(self.data_dir / split),
            item_loader=TokensLoader(block_size=self.seq_len + 1),
            shuffle=shuffle,
            drop_last=drop_last,
            seed=self.seed,
            **_FULL_CHUNK_SHUFFLE,
        )
        if len(dataset) == 0:
            raise ValueError(
                f"{self.data_dir / split} holds no block of seq_len + 1 = {self.seq_len + 1} tokens "
                f"({self.manifest['splits'][split]['tokens']} tokens in {self.manifest['splits'][split]['chunks']} "
                "chunks; blocks never span chunks): lower seq_len or prepare with larger chunk_bytes / more text"
            )
        return dataset

    def _loader(self, dataset: StreamingDataset, drop_last: bool) -> StreamingDataLoader:
        return _ResumableLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            drop_last=drop_last,
            collate_fn=_collate_tokens,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> StreamingDataLoader:
        """Shuffled int64 ``[batch_size, seq_len + 1]`` batches of the train split, last partial dropped.

        Raises:
            ValueError: the split has fewer than batch_size blocks.
        """
        dataset = self._dataset("train", shuffle=True, drop_last=True)
        if len(dataset) < self.batch_size:
            raise ValueError(
                f"train split has {len(dataset)} blocks of {self.seq_len + 1} tokens, fewer than "
                f"batch_size={self.batch_size}: lower batch_size or seq_len, or prepare more text"
            )
        return self._loader(dataset, drop_last=True)

    def val_dataloader(self) -> StreamingDataLoader:
        """int64 ``[<= batch_size, seq_len + 1]`` batches of the val split, in order."""
        return self._loader(self._dataset("val", shuffle=False, drop_last=None), drop_last=False)

    def test_dataloader(self) -> StreamingDataLoader:
        """The val split: prepare writes no separate test split."""
        return self.val_dataloader()
