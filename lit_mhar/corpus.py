"""``lit-mhar prepare``: text corpus -> BPE tokenizer -> litdata token chunks and a manifest.

A prepared dataset is a directory::

    output_dir/
        train/           litdata chunks (index.json, chunk-*.bin): one flat token stream,
        val/             documents concatenated, each followed by the EOS token
        tokenizer.json   the `tokenizers` tokenizer that produced the ids
        manifest.json    source, counts, digests, vocabulary; written last, so it marks a complete dataset

How documents are chosen and ordered (every choice a hash, so nothing depends on file order,
worker count or Python's salted ``hash``):

* **Keys.** A plain-text file is one document whose key is its content digest (BLAKE2b-128), so
  exact duplicates (vendored copies of a package) are one document and the split does not depend
  on where the corpus lies. A JSONL line or a Parquet row is one document keyed ``path:line`` /
  ``path:row`` (path relative to the corpus root).
* **Validation split.** Document ``k`` is in ``val`` iff ``score(k) < v``, with ``score`` a 64-bit
  BLAKE2b of the key scaled to [0, 1) and ``v = min(val_fraction, val_tokens * bytes_per_token /
  corpus_bytes)``: about ``val_tokens`` tokens where the corpus allows, never more than a
  ``val_fraction`` of the documents.
* **Tokenizer sample.** The byte-level BPE is trained on documents with ``score >= val_fraction``
  (never a validation document) drawn by a second hash, about ``tokenizer_sample_bytes`` of text.
* **Order.** Documents are shuffled by a hash of ``shuffle_seed`` and their key before they are
  chunked, so every chunk is a sample of the whole corpus and a partial pass over the training
  split sees all of it, not a few packages. JSONL / Parquet shards are split into parts of about
  ``_PART_BYTES`` and the parts shuffled; records within a part keep their order.

Tokenization runs in ``num_workers`` processes (all cores by default); one writer in this process
writes the chunks in that order, so the chunks do not depend on the number of workers and a corpus
rebuilt elsewhere from the same files has the same ``data_digest``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import site
import sys
import sysconfig
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Union

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # offline: older litdata asks PyPI on import

import numpy as np  # noqa: E402

from lit_mhar.outputs import check_output_dir, staged_directory  # noqa: E402
from lit_mhar.processes import forked_children_die_with_parent  # noqa: E402

__all__ = ["EOS_TOKEN", "MANIFEST_NAME", "TOKENIZER_NAME", "SOURCES", "data_digest", "prepare"]

EOS_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = "lit-mhar-tokens/2"
SOURCES = ("stdlib", "python", "files")
Source = Literal["stdlib", "python", "files"]

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
_PART_BYTES = 4_000_000  # text handed to one worker task: plain-text files batched, shards split, to about this
_ENCODE_BATCH_CHARS = 1_000_000  # characters per encode_batch call inside a task
_RATE_SAMPLE_CHARS = 4_000_000  # sample text tokenized to measure bytes per token


def _log(message: str) -> None:
    print(f"[lit-mhar prepare] {message}", file=sys.stderr, flush=True)


def _progress(total: float, desc: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr for one phase (bytes by default)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"[lit-mhar prepare] {desc}", unit=unit, unit_scale=True, file=sys.stderr,
                dynamic_ncols=True, mininterval=1.0, disable=None)  # no bar when stderr is not a terminal


def score(key: str, salt: str = "") -> float:
    """A stable pseudo-random number in [0, 1) per document key: 64-bit BLAKE2b of ``salt + key`` / 2**64."""
    return int.from_bytes(hashlib.blake2b((salt + key).encode("utf-8"), digest_size=8).digest(), "big") / 2**64


_SAMPLE_SALT = "tokenizer-sample:"


def _shuffle_salt(seed: int) -> str:
    return f"shuffle-{seed}:"


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class _File:
    """One input file; ``name`` (POSIX path relative to its root, with the root's label for the python source) names it."""

    path: str
    name: str
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


def _walk_py(root: Path, label: str, skip_dirs: Iterable[str] = ()) -> list[_File]:
    skip = {"__pycache__", *skip_dirs}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    if path.is_file():
                        files.append(_File(str(path), f"{label}/{path.relative_to(root).as_posix()}", "text", path.stat().st_size))
    return files


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def python_roots() -> list[tuple[str, Path]]:
    """``(label, folder)`` of every folder the ``python`` source reads: the standard library, then every
    site-packages / dist-packages folder the running interpreter imports from (``site``, ``sysconfig``
    and ``sys.path``), each once, in sorted order."""
    candidates: set[str] = set()
    with contextlib.suppress(AttributeError):  # virtualenv's old site.py lacks these
        candidates.update(site.getsitepackages())
        candidates.add(site.getusersitepackages())
    paths = sysconfig.get_paths()
    candidates.update(p for p in (paths.get("purelib"), paths.get("platlib")) if p)
    candidates.update(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))
    stdlib = stdlib_root()
    sites = sorted({Path(c).resolve() for c in candidates if c and Path(c).is_dir()} - {stdlib})
    return [("stdlib", stdlib)] + [(f"site-{i}", p) for i, p in enumerate(sites)]


def _stdlib_files() -> tuple[list[Path], list[_File]]:
    """Every ``.py`` file of the running Python's standard library (site-packages excluded), sorted."""
    root = stdlib_root()
    files = sorted(_walk_py(root, "stdlib", ("site-packages", "dist-packages")), key=lambda f: f.name)
    if not files:
        raise FileNotFoundError(f"source='stdlib': no .py file under {root}")
    return [root], files


def _python_files() -> tuple[list[Path], list[_File]]:
    """Every ``.py`` file the running interpreter can import: the standard library and every site folder."""
    roots = python_roots()
    files: list[_File] = []
    seen: set[str] = set()
    for label, root in roots:
        skip = ("site-packages", "dist-packages") if label == "stdlib" else ()
        for f in _walk_py(root, label, skip):
            real = os.path.realpath(f.path)
            if real not in seen:  # a site folder nested in another, or a symlinked file
                seen.add(real)
                files.append(f)
    if not files:
        raise FileNotFoundError(
            f"source='python': no .py file in the standard library or any site-packages folder ({[str(r) for _, r in roots]})"
        )
    return [r for _, r in roots], sorted(files, key=lambda f: f.name)


def _user_files(files: list[str], text_field: str) -> tuple[list[Path], list[_File]]:
    """Expands globs, checks existence, extension and (for Parquet) the text column."""
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
    out = [_File(str(r), r.relative_to(root).as_posix(), _kind_of(str(r)), r.stat().st_size) for r in resolved]
    for f in out:
        if f.kind == "parquet":
            _check_parquet_field(f.path, text_field)
    return [root], out


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


# ----------------------------------------------------------------------------- scan (parallel, read-only)


@dataclass(frozen=True)
class _Part:
    """One worker task: plain-text documents ``(path, key)``, or a part of one JSONL / Parquet shard.

    JSONL parts are byte ranges ``[start, stop)`` on line boundaries whose first line is ``first``;
    Parquet parts are row groups ``[start, stop)`` whose first row is ``first``.
    """

    kind: Literal["text", "jsonl", "parquet"]
    docs: tuple[tuple[str, str], ...] = ()
    path: str = ""
    name: str = ""
    start: int = 0
    stop: int = 0
    first: int = 0
    size: int = 0  # text bytes (estimated for shards), for progress bars and the sample rate

    @property
    def ident(self) -> str:
        return self.docs[0][1] if self.kind == "text" else f"{self.name}@{self.start}"


@dataclass
class _Scanned:
    """What one input file holds, read once: its digest and, for shards, its parts and record count."""

    digest: str
    records: int = 0
    empty: int = 0
    undecodable: int = 0
    parts: tuple[_Part, ...] = ()
    extremes: tuple[tuple[float, str], ...] = ()  # (score, key) of the lowest and highest scoring record of a shard


def _extremes(keys: Iterable[str]) -> tuple[tuple[float, str], ...]:
    ranked = [(score(k), k) for k in keys]
    return (min(ranked), max(ranked)) if ranked else ()


_EXTREME_ROWS = 100_000  # Parquet rows whose keys are all scored in the scan (a larger shard cannot leave a split empty)


def _scan_file(f: _File, text_field: str) -> _Scanned:
    """Reads one input once: content digest, and for JSONL every record checked and the part boundaries.

    Raises:
        ValueError: a JSONL line that is not a JSON object with a string (or null) ``text_field``.
    """
    h = hashlib.blake2b(digest_size=16)
    if f.kind == "text":
        data = Path(f.path).read_bytes()
        h.update(data)
        text, replaced = _decode(data)
        return _Scanned(h.hexdigest(), records=1, empty=int(not text.strip()), undecodable=int(replaced))
    if f.kind == "jsonl":
        parts, records, empty, undecodable, keys = [], 0, 0, 0, []
        start = offset = 0
        first = 1
        with open(f.path, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                h.update(raw)
                if offset - start >= _PART_BYTES:
                    parts.append(_Part("jsonl", path=f.path, name=f.name, start=start, stop=offset, first=first, size=offset - start))
                    start, first = offset, lineno
                offset += len(raw)
                line, replaced = _decode(raw)
                undecodable += replaced
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f.path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    found = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{f.path}:{lineno}: no field text_field={text_field!r}; found {found}")
                text = record[text_field]
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{f.path}:{lineno}: field {text_field!r} must be a string, got {type(text).__name__}")
                records += 1
                if (text or "").strip():
                    keys.append(f"{f.name}:{lineno}")
                else:
                    empty += 1
        if offset > start:
            parts.append(_Part("jsonl", path=f.path, name=f.name, start=start, stop=offset, first=first, size=offset - start))
        return _Scanned(h.hexdigest(), records=records, empty=empty, undecodable=undecodable, parts=tuple(parts),
                        extremes=_extremes(keys))
    import pyarrow.parquet as pq

    with open(f.path, "rb") as fh:
        for block in iter(functools.partial(fh.read, 1 << 22), b""):
            h.update(block)
    meta = pq.ParquetFile(f.path).metadata
    column = meta.schema.names.index(text_field)
    parts, start, first, row, size = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size += group.column(column).total_uncompressed_size
        row += group.num_rows
        if size >= _PART_BYTES or g == meta.num_row_groups - 1:
            parts.append(_Part("parquet", path=f.path, name=f.name, start=start, stop=g + 1, first=first, size=size))
            start, first, size = g + 1, row, 0
    keys = (f"{f.name}:{r}" for r in range(meta.num_rows)) if meta.num_rows <= _EXTREME_ROWS else ()
    return _Scanned(h.hexdigest(), records=meta.num_rows, parts=tuple(parts), extremes=_extremes(keys))


def _map(fn: Callable[[Any], Any], items: list[Any], workers: int, sizes: Optional[list[float]] = None, desc: str = "") -> Iterator[Any]:
    """``fn`` over ``items`` in order, in ``workers`` forked processes (inline for one), with a progress bar.

    The pool's children are forked from this process; they read ``TOKENIZERS_PARALLELISM=false`` so
    a tokenizer used here before the fork does not make each of them warn.
    """
    bar = _progress(sum(sizes) if sizes else len(items), desc, "B" if sizes else "it") if desc else None
    try:
        if workers <= 1 or len(items) <= 1:
            for i, item in enumerate(items):
                yield fn(item)
                if bar is not None:
                    bar.update(sizes[i] if sizes else 1)
            return
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        method = "fork" if sys.platform == "linux" else "spawn"
        try:
            # the workers die with this process, however it ends (their output is a staging folder)
            with forked_children_die_with_parent(), multiprocessing.get_context(method).Pool(min(workers, len(items))) as pool:
                for i, result in enumerate(pool.imap(fn, items, chunksize=1)):
                    yield result
                    if bar is not None:
                        bar.update(sizes[i] if sizes else 1)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    finally:
        if bar is not None:
            bar.close()


# ----------------------------------------------------------------------------- documents of a part


def _iter_part(part: _Part, text_field: str) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every non-empty document of one part."""
    if part.kind == "text":
        for path, key in part.docs:
            text, _ = _decode(Path(path).read_bytes())
            if text.strip():
                yield key, text
    elif part.kind == "jsonl":
        with open(part.path, "rb") as fh:
            fh.seek(part.start)
            data = fh.read(part.stop - part.start)
        for lineno, raw in enumerate(data.split(b"\n"), start=part.first):
            line, _ = _decode(raw)
            if line.strip():
                text = json.loads(line)[text_field] or ""
                if text.strip():
                    yield f"{part.name}:{lineno}", text
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(part.path)
        row = part.first
        for batch in pf.iter_batches(batch_size=4096, row_groups=list(range(part.start, part.stop)), columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text and text.strip():
                    yield f"{part.name}:{row}", text
                row += 1


@dataclass(frozen=True)
class _Split:
    """Which documents are in val: ``score(key) < threshold``, except keys moved by ``overrides``."""

    threshold: float
    overrides: tuple[tuple[str, str], ...] = ()

    def of(self, key: str) -> str:
        moved = dict(self.overrides).get(key)
        return moved or ("val" if score(key) < self.threshold else "train")


def _sample_part(part: _Part, text_field: str, reserved: float, rate: float) -> list[str]:
    """Texts of a part's documents in the tokenizer sample: never a possible validation document.

    Plain-text parts hold only sampled documents already; a shard's records are drawn at ``rate``.
    """
    if part.kind == "text":
        return [t for _, t in _iter_part(part, text_field)]
    return [t for k, t in _iter_part(part, text_field) if score(k) >= reserved and score(k, _SAMPLE_SALT) < rate]


def _tokenize_part(
    part: _Part, *, tokenizer_path: str, text_field: str, split: str, rule: _Split, eos_id: int, dtype: str
) -> tuple[np.ndarray, int]:
    """The token ids (1-D ``dtype``) of a part's documents in ``split``, each followed by EOS, and how many documents."""
    tokenizer = _worker_tokenizer(tokenizer_path)
    eos = np.array([eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    batch: list[str] = []
    chars = documents = 0

    def flush() -> None:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            pieces.extend((np.asarray(enc.ids, dtype=dtype), eos))
        batch.clear()

    for key, text in _iter_part(part, text_field):
        if rule.of(key) != split:
            continue
        batch.append(text)
        documents += 1
        chars += len(text)
        if chars >= _ENCODE_BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)), documents


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


# ----------------------------------------------------------------------------- tokenizer


def _train_tokenizer(texts: Iterator[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenisation, all 256 bytes in the base alphabet) + EOS.

    Counting runs on every core (``tokenizers``' own threads) unless ``TOKENIZERS_PARALLELISM`` says
    otherwise; the merges it learns do not depend on the number of threads or the order of the texts.
    """
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
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str) -> Any:
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


def vocab_size_of(tokenizer: Any) -> int:
    """The number of ids a tokenizer can produce (its largest id + 1)."""
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab().values()) + 1)


# ----------------------------------------------------------------------------- digests


def data_digest(data_dir: Union[str, os.PathLike]) -> str:
    """BLAKE2b-128 of a dataset's token data: each split's ``index.json`` chunk list and every chunk file's bytes.

    Two datasets with the same digest feed a model the same tokens in the same chunks, so a study
    resumed on another machine trains on what it trained on before.

    Raises:
        FileNotFoundError: a split's index or a chunk it lists is missing.
    """
    h = hashlib.blake2b(digest_size=16)
    for split in SPLITS:
        folder = Path(data_dir) / split
        chunks = json.loads((folder / "index.json").read_text())["chunks"]
        for chunk in chunks:
            h.update(json.dumps([split, chunk["filename"], chunk["dim"], chunk["chunk_size"]]).encode())
            with open(folder / chunk["filename"], "rb") as fh:
                for block in iter(functools.partial(fh.read, 1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- prepare


def _check_output_dir(out: Path, overwrite: bool) -> None:
    """Raises unless ``out`` is absent, empty, or (with overwrite) a dataset prepare wrote."""
    check_output_dir(out, overwrite, (*SPLITS, TOKENIZER_NAME, MANIFEST_NAME), "prepare")


def _positive_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_arguments(
    source: str, files: Optional[list[str]], text_field: str, vocab_size: int, val_tokens: int, val_fraction: float,
    tokenizer_sample_bytes: int, shuffle_seed: int, chunk_bytes: str, num_workers: Optional[int],
) -> int:
    """Validates prepare()'s arguments; returns chunk_bytes in bytes."""
    from litdata.utilities.format import _convert_bytes_to_int

    if source not in SOURCES:
        raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}")
    if source != "files" and files:
        raise ValueError(f"files is only read with source='files' (source={source!r} lists its own files)")
    if source == "files" and not files:
        raise ValueError("source='files' needs files (a list of .txt/.md/..., .jsonl or .parquet paths)")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size < 2**31:
        raise ValueError(f"vocab_size must be an int in [257, 2**31) (256 bytes + EOS at least), got {vocab_size!r}")
    _positive_int("val_tokens", val_tokens, 1)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    _positive_int("tokenizer_sample_bytes", tokenizer_sample_bytes, 1)
    _positive_int("shuffle_seed", shuffle_seed, 0)
    try:
        n_bytes = _convert_bytes_to_int(chunk_bytes) if isinstance(chunk_bytes, str) else int(chunk_bytes)
    except ValueError as e:
        raise ValueError(f"chunk_bytes must look like '16MB' or '64KB', got {chunk_bytes!r} ({e})") from None
    if n_bytes < _MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be at least 4KB, got {chunk_bytes!r}")
    if num_workers is not None:
        _positive_int("num_workers", num_workers, 1)
    return n_bytes


def default_workers() -> int:
    """Every core this process may run on."""
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _versions() -> dict[str, str]:
    import litdata
    import tokenizers

    from lit_mhar import __version__

    return {"lit_mhar": __version__, "litdata": litdata.__version__, "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0]}


def _text_parts(docs: list[tuple[str, str, int]], salt: str) -> list[_Part]:
    """Plain-text documents ``(path, key, size)`` in shuffled order, batched into parts of about _PART_BYTES."""
    parts, current, size = [], [], 0
    for path, key, n in sorted(docs, key=lambda d: score(d[1], salt)):
        current.append((path, key))
        size += n
        if size >= _PART_BYTES:
            parts.append(_Part("text", docs=tuple(current), size=size))
            current, size = [], 0
    if current:
        parts.append(_Part("text", docs=tuple(current), size=size))
    return parts


def _write_split(
    split_dir: Path, parts: list[_Part], chunk_bytes: int, dtype: str, workers: int, **tokenize: Any
) -> tuple[int, int, int]:
    """Tokenizes ``parts`` in order into litdata chunks at ``split_dir``; returns (tokens, chunks, documents).

    One ``BinaryWriter`` in this process writes every item in part order, so the chunks are the
    same for any number of workers. Items are at most half a chunk, so none outgrows one.
    """
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    split_dir.mkdir(parents=True)
    writer = BinaryWriter(str(split_dir), chunk_bytes=chunk_bytes, item_loader=TokensLoader())
    max_item = chunk_bytes // np.dtype(dtype).itemsize // 2
    index = tokens = documents = 0
    fn = functools.partial(_tokenize_part, dtype=dtype, **tokenize)
    for ids, n_docs in _map(fn, parts, workers, [p.size for p in parts], f"tokenize {split_dir.name}"):
        documents += n_docs
        tokens += len(ids)
        for start in range(0, len(ids), max_item):
            writer.add_item(index, ids[start : start + max_item])
            index += 1
    writer.done()
    writer.merge(1)
    chunks = json.loads((split_dir / "index.json").read_text())["chunks"] if index else []
    return tokens, len(chunks), documents


def prepare(
    output_dir: str = "data/stdlib",
    source: Source = "stdlib",
    files: Union[list[str], str, None] = None,
    text_field: str = "text",
    tokenizer: Optional[str] = None,
    vocab_size: int = 8192,
    val_tokens: int = 2_000_000,
    val_fraction: float = 0.1,
    tokenizer_sample_bytes: int = 100_000_000,
    shuffle_seed: int = 0,
    chunk_bytes: str = "16MB",
    num_workers: Optional[int] = None,
    overwrite: bool = False,
) -> Path:
    """Tokenize a text corpus into litdata token chunks with a tokenizer and a manifest.

    Writes ``output_dir/{train,val}/`` (litdata ``TokensLoader`` chunks: each document's ids followed
    by the ``<|endoftext|>`` id, uint16 when the vocabulary fits, else int32), ``tokenizer.json``
    and, last, ``manifest.json``. Everything is built in a hidden sibling directory and renamed
    into place, so an interrupted run leaves no dataset behind. All arguments and input files are
    checked before any work starts. The module docstring says how documents are keyed, split,
    sampled for the tokenizer and ordered.

    Args:
        output_dir: Directory to create. Must not exist or be empty (see overwrite).
        source: ``stdlib``: every .py file of the running Python's standard library (small: a few
            million tokens; for a CPU). ``python``: every .py file the running interpreter can
            import, the standard library and every site-packages / dist-packages folder (often
            100M tokens or more; the GPU configs' corpus), exact duplicates removed. ``files``:
            the paths in ``files``.
        files: Input files for source=files (globs allowed; one path or pattern, or a list).
            ``.jsonl``: one document per line, in ``text_field``; ``.parquet``: one document per row
            of column ``text_field``; any other file: plain UTF-8 text, one document per file.
        text_field: JSONL field / Parquet column holding the text.
        tokenizer: Path to a `tokenizers` tokenizer.json to use (copied beside the chunks; must
            contain ``<|endoftext|>``). Default: train a byte-level BPE on the tokenizer sample.
        vocab_size: Vocabulary size of the trained BPE, ``<|endoftext|>`` included (>= 257;
            ignored with tokenizer). A small corpus may yield fewer tokens; the manifest has the
            actual size.
        val_tokens: Target size of the validation split in tokens (about; whole documents).
        val_fraction: The largest fraction of documents the validation split may take, in (0, 1):
            a small corpus gets a smaller split than val_tokens. Documents below it in hash order
            are never in the tokenizer sample.
        tokenizer_sample_bytes: Text the BPE is trained on, drawn by hash from the documents that
            cannot be validation documents (about; the whole rest when the corpus is smaller).
        shuffle_seed: Seed of the document order in the chunks.
        chunk_bytes: Target size of one litdata chunk, e.g. ``16MB`` or ``64KB`` (>= 4KB). Training
            blocks never span chunks: each chunk loses its last < seq_len + 1 tokens when read.
        num_workers: Processes that read and tokenize; default every core this process may use.
        overwrite: Replace an existing dataset at output_dir (only one that prepare wrote).

    Returns:
        The dataset directory.

    Raises:
        ValueError: an invalid argument, input file, record or tokenizer; fewer than two
            non-empty documents.
        FileNotFoundError: a missing input file or tokenizer, or a source with no file.
        FileExistsError: output_dir is not empty and overwrite is false.
    """
    started = time.perf_counter()
    phases: dict[str, float] = {}
    if isinstance(files, (str, os.PathLike)):
        files = [os.fspath(files)]
    chunk_bytes_int = _check_arguments(source, files, text_field, vocab_size, val_tokens, val_fraction,
                                       tokenizer_sample_bytes, shuffle_seed, chunk_bytes, num_workers)
    workers = num_workers or default_workers()
    out = Path(output_dir).expanduser().absolute()
    _check_output_dir(out, overwrite)
    user_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    roots, inputs = {"stdlib": _stdlib_files, "python": _python_files}.get(source, lambda: _user_files(list(files or []), text_field))()

    # ---- scan: digests (duplicates), records checked, shard parts
    t0 = time.perf_counter()
    scanned = list(_map(functools.partial(_scan_file, text_field=text_field), inputs, workers, [f.size for f in inputs], "scan"))
    text_docs: list[tuple[str, str, int]] = []  # (path, key, size) of the non-empty, unique plain-text documents
    shard_parts: list[_Part] = []
    extremes: list[tuple[float, str]] = []  # lowest and highest scoring shard records, for a tiny corpus's split
    seen: set[str] = set()
    duplicates = empty = undecodable = shard_documents = 0
    for f, s in zip(inputs, scanned):
        empty, undecodable = empty + s.empty, undecodable + s.undecodable
        if f.kind != "text":
            shard_parts.extend(s.parts)
            shard_documents += s.records - s.empty
            extremes.extend(s.extremes)
        elif s.digest in seen:
            duplicates += 1
        else:
            seen.add(s.digest)
            if not s.empty:
                text_docs.append((f.path, s.digest, f.size))
    documents = len(text_docs) + shard_documents
    input_digest = hashlib.blake2b(digest_size=16)
    for f, s in sorted(zip(inputs, scanned), key=lambda fs: fs[1].digest):
        input_digest.update(f"{f.kind}:{s.digest}\n".encode())
    if documents < 2:
        raise ValueError(
            f"need at least 2 non-empty documents to make a train and a val split, found {documents} "
            "(a plain-text file is one document: pass several files, or JSONL / Parquet with one record per document)"
        )
    corpus_bytes = sum(d[2] for d in text_docs) + sum(p.size for p in shard_parts)
    phases["scan"] = time.perf_counter() - t0
    _log(f"{source}: {len(inputs):,} files, {corpus_bytes / 1e6:,.1f} MB of text, {documents:,} documents "
         f"({duplicates:,} duplicate files removed, {empty:,} empty skipped, {undecodable:,} with undecodable bytes replaced)")

    # ---- tokenizer sample: documents that can never be validation documents, drawn by a second hash
    t0 = time.perf_counter()
    candidates = sorted((d for d in text_docs if score(d[1]) >= val_fraction), key=lambda d: score(d[1], _SAMPLE_SALT))
    picked, size = [], 0
    for d in candidates:
        if size >= tokenizer_sample_bytes:
            break
        picked.append(d)
        size += d[2]
    shard_bytes = sum(p.size for p in shard_parts)
    rate = min(1.0, max(0.0, tokenizer_sample_bytes - size) / max(1.0, shard_bytes * (1 - val_fraction)))
    sample_parts = _text_parts(picked, _SAMPLE_SALT) + (shard_parts if rate > 0 else [])
    rate_texts: list[str] = []  # the first few MB of the sample, to measure bytes per token
    sample_bytes = 0

    def sample_stream(texts_per_part: Iterator[list[str]]) -> Iterator[str]:
        nonlocal sample_bytes
        chars = 0
        for texts in texts_per_part:
            for t in texts:
                sample_bytes += len(t.encode("utf-8"))
                if chars < _RATE_SAMPLE_CHARS:
                    rate_texts.append(t)
                    chars += len(t)
                yield t

    sample = functools.partial(_sample_part, text_field=text_field, reserved=val_fraction, rate=rate)
    # re-check before replacing: the folder may have changed while we worked
    with staged_directory(out, before_replace=lambda: _check_output_dir(out, overwrite)) as tmp:
        tokenizer_path = tmp / TOKENIZER_NAME
        if user_tokenizer is None:
            texts = sample_stream(_map(sample, sample_parts, workers, [p.size for p in sample_parts], "tokenizer sample"))
            tok = _train_tokenizer(texts, vocab_size)
            tok.save(str(tokenizer_path))
            _log(f"trained byte-level BPE, {vocab_size_of(tok)} tokens, on {sample_bytes / 1e6:,.1f} MB in {time.perf_counter() - t0:.1f}s")
        else:
            for _ in sample_stream(map(sample, sample_parts)):  # a few parts suffice to measure bytes per token
                if len(rate_texts) and sum(map(len, rate_texts)) >= _RATE_SAMPLE_CHARS:
                    break
            tok = user_tokenizer
            shutil.copyfile(tokenizer, tokenizer_path)
        if not rate_texts:  # a tiny corpus: every document may be a validation document
            rate_texts = [t for part in _text_parts(text_docs, "")[:1] + shard_parts[:1] for _, t in _iter_part(part, text_field)][:50]
        phases["tokenizer"] = time.perf_counter() - t0
        rate_tokens = sum(len(e.ids) for e in tok.encode_batch(rate_texts, add_special_tokens=False))
        bytes_per_token = sum(len(t.encode("utf-8")) for t in rate_texts) / max(1, rate_tokens)
        threshold = min(val_fraction, val_tokens * bytes_per_token / max(1.0, corpus_bytes))

        # ---- the split: both sides non-empty even for a tiny corpus
        overrides: list[tuple[str, str]] = []
        ranked = sorted([(score(k), k) for _, k, _ in text_docs] + extremes)
        if ranked and ranked[0][0] >= threshold:
            overrides.append((ranked[0][1], "val"))
        elif ranked and ranked[-1][0] < threshold:
            overrides.append((ranked[-1][1], "train"))
        rule = _Split(threshold, tuple(overrides))
        eos_id = tok.token_to_id(EOS_TOKEN)
        dtype = "uint16" if vocab_size_of(tok) <= 2**16 else "int32"
        salt = _shuffle_salt(shuffle_seed)
        counts = {}
        for split in SPLITS:
            t0 = time.perf_counter()
            docs = [d for d in text_docs if rule.of(d[1]) == split]
            parts = _text_parts(docs, salt) + sorted(shard_parts, key=lambda p: score(p.ident, salt))
            counts[split] = _write_split(tmp / split, parts, chunk_bytes_int, dtype, workers, tokenizer_path=str(tokenizer_path),
                                         text_field=text_field, split=split, rule=rule, eos_id=eos_id)
            phases[f"tokenize_{split}"] = time.perf_counter() - t0
            if counts[split][0] == 0:
                raise ValueError(f"the {split} split has no tokens (every document there is empty); give more documents")
            _log(f"{split}: {counts[split][0]:,} tokens in {counts[split][1]} chunks, {counts[split][2]:,} documents, "
                 f"{phases[f'tokenize_{split}']:.1f}s")
        if counts["val"][0] < 100_000:
            _log(f"warning: the val split of {source!r} is {counts['val'][0]:,} tokens (under 100k): validation loss will be noisy")
        t0 = time.perf_counter()
        digest = data_digest(tmp)
        phases["digest"] = time.perf_counter() - t0
        manifest = {
            "format": FORMAT,
            "source": source,
            "source_roots": [str(r) for r in roots],
            "text_field": text_field if source == "files" else None,
            "inputs": {
                "files": len(inputs), "bytes": sum(f.size for f in inputs), "text_bytes": corpus_bytes, "documents": documents,
                "duplicate_files_removed": duplicates, "empty_documents_skipped": empty,
                "documents_with_undecodable_bytes": undecodable,
            },
            "input_digest": input_digest.hexdigest(),
            "data_digest": digest,
            "split_rule": {
                "rule": "val iff blake2b(key, 8 bytes) / 2**64 < threshold; key = content digest of a file, or path:line / path:row",
                "threshold": threshold, "val_tokens": val_tokens, "val_fraction": val_fraction,
                "bytes_per_token": round(bytes_per_token, 4), "overrides": dict(overrides),
            },
            "shuffle_seed": shuffle_seed,
            "tokenizer_sample": {"bytes": sample_bytes, "requested_bytes": tokenizer_sample_bytes},
            "splits": {s: {"documents": counts[s][2], "tokens": counts[s][0], "chunks": counts[s][1]} for s in SPLITS},
            "vocab_size": vocab_size_of(tok),
            "tokenizer": {
                "origin": "trained" if user_tokenizer is None else "file",
                "path": TOKENIZER_NAME,
                "source_path": None if tokenizer is None else str(Path(tokenizer).absolute()),
                "requested_vocab_size": vocab_size if user_tokenizer is None else None,
                "digest": hashlib.blake2b(tokenizer_path.read_bytes(), digest_size=16).hexdigest(),
            },
            "eos_token": EOS_TOKEN,
            "eos_id": eos_id,
            "dtype": dtype,
            "chunk_bytes": chunk_bytes,
            "num_workers": workers,
            "versions": _versions(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "prepare_seconds": round(time.perf_counter() - started, 2),
            "phase_seconds": {k: round(v, 2) for k, v in phases.items()},
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks completeness
    _log(f"wrote {out} in {time.perf_counter() - started:.1f}s ({corpus_bytes / 1e6 / (time.perf_counter() - started):.1f} MB/s)")
    return out
