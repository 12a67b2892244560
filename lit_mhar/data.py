"""Token data: ``TokenDataModule`` streams the chunks ``lit-mhar prepare`` (:mod:`lit_mhar.corpus`) writes.

Training batches are shuffled blocks of the train split, read by litdata; validation scores a fixed
set of tokens (the whole val split, or its first ``val_tokens``) held in memory, the same for every
batch size and device count.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

# Older litdata releases ask PyPI for a newer version on every optimize() / StreamingDataset()
# (offline: up to a 30 s timeout). Read when litdata is imported.
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import inspect  # noqa: E402

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402
from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from litdata.streaming.item_loader import TokensLoader  # noqa: E402

from lit_mhar.corpus import EOS_TOKEN, FORMAT, MANIFEST_NAME, SPLITS, TOKENIZER_NAME, data_digest, prepare  # noqa: E402

__all__ = ["EOS_TOKEN", "MANIFEST_NAME", "TOKENIZER_NAME", "TokenDataModule", "prepare", "read_manifest", "verify_dataset"]

# The corpora fit builds by itself when missing, at these folders (relative to the current folder):
# the small standard library for CPU configs, every importable .py file for the GPU configs.
DEFAULT_CORPORA = {"data/stdlib": "stdlib", "data/python": "python"}
DEFAULT_DATA_DIR = "data/stdlib"
SMALL_VAL_TOKENS = 100_000  # a validation split below this is a warning: its loss is noisy


def default_source(data_dir: str | os.PathLike, prepare_if_missing: Optional[bool]) -> Optional[str]:
    """The source a missing dataset at ``data_dir`` is built from without asking (see :class:`TokenDataModule`),
    or None: ``stdlib`` / ``python`` at the default ``data/stdlib`` / ``data/python``; ``stdlib``
    anywhere with ``prepare_if_missing`` true; nothing with it false."""
    if prepare_if_missing is False:
        return None
    here = Path(data_dir).expanduser().absolute()
    for folder, source in DEFAULT_CORPORA.items():
        if here == Path(folder).absolute():
            return source
    return "stdlib" if prepare_if_missing else None


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Restores Python's, NumPy's and torch's global random states (CPU and CUDA) on exit, so work done
    inside (preparing a corpus) leaves a seeded fit's initialisation and data order as they would be."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def read_manifest(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete dataset.

    Raises:
        FileNotFoundError: ``data_dir/manifest.json`` does not exist (no dataset, or an incomplete one).
        ValueError: the manifest is of another format version.
    """
    path = Path(data_dir) / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r} (this version keys, splits and orders "
            f"documents differently); prepare it again: lit-mhar prepare --output_dir {Path(data_dir)} --overwrite true ..."
        )
    return manifest


def _rebuild_hint(data_dir: Path, manifest: dict[str, Any]) -> str:
    return f"rebuild it: lit-mhar prepare --output_dir {data_dir} --source {manifest.get('source', 'stdlib')} --overwrite true"


def longest_block(data_dir: str | os.PathLike, split: str) -> int:
    """The longest ``seq_len`` the ``split`` of the dataset at ``data_dir`` can serve: the tokens of
    its largest chunk, minus 1 (a block is ``seq_len + 1`` tokens and never spans chunks)."""
    chunks = json.loads((Path(data_dir) / split / "index.json").read_text())["chunks"]
    return max((int(c["dim"]) for c in chunks), default=0) - 1


def check_chunks(data_dir: str | os.PathLike, manifest: Optional[dict[str, Any]] = None) -> None:
    """Checks that every chunk each split's ``index.json`` lists exists with the size it records (cheap: no reading).

    Raises:
        ValueError: a missing or truncated chunk, named with its size and the command that rebuilds the dataset.
    """
    data_dir = Path(data_dir)
    manifest = manifest or read_manifest(data_dir)
    for split in SPLITS:
        index = data_dir / split / "index.json"
        if not index.is_file():
            raise ValueError(f"{index} is missing: the dataset is damaged; {_rebuild_hint(data_dir, manifest)}")
        for chunk in json.loads(index.read_text())["chunks"]:
            path = data_dir / split / chunk["filename"]
            expected = int(chunk["chunk_bytes"])
            actual = path.stat().st_size if path.is_file() else None
            if actual is None or actual < expected:
                found = "missing" if actual is None else f"{actual:,} bytes, index.json says {expected:,}"
                raise ValueError(f"chunk {path} is damaged ({found}); {_rebuild_hint(data_dir, manifest)}")


def verify_dataset(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads every chunk and compares the dataset's digest with its manifest's ``data_digest``; returns the manifest.

    Raises:
        ValueError: a damaged chunk, or a digest that differs from the manifest's (the data changed
            after prepare wrote it), naming both digests and the command that rebuilds it.
    """
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    check_chunks(data_dir, manifest)
    actual = data_digest(data_dir)
    if actual != manifest["data_digest"]:
        raise ValueError(
            f"{data_dir}: its token data has digest {actual}, but its manifest says {manifest['data_digest']}: the chunks "
            f"changed after prepare wrote them; {_rebuild_hint(data_dir, manifest)}"
        )
    return manifest


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


class ValBlocks(torch.utils.data.IterableDataset):
    """The fixed validation set: ``[n, seq_len + 1]`` token blocks in stream order, this rank's share.

    Rank r of w reads blocks r, r + w, r + 2w, ...: every block is scored exactly once whatever the
    number of devices, with no padding or repeated block (Lightning adds no sampler to an iterable
    dataset). The loss is then a sum over tokens divided by their count, the same at any batch size.
    """

    def __init__(self, blocks: np.ndarray) -> None:
        super().__init__()
        self.blocks = blocks

    def __iter__(self) -> Iterator[np.ndarray]:
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        info = torch.utils.data.get_worker_info()
        step, offset = world, rank
        if info is not None:  # worker processes split this rank's share again
            step, offset = world * info.num_workers, rank + world * info.id
        for i in range(offset, len(self.blocks), step):
            yield self.blocks[i]


class TokenDataModule(L.LightningDataModule):
    """Streams fixed-length token blocks from a dataset written by :func:`lit_mhar.corpus.prepare`.

    Each batch is an int64 tensor ``[batch_size, seq_len + 1]``: consecutive, non-overlapping
    blocks of the token stream (documents separated by EOS); the model predicts ``x[:, 1:]``
    from ``x[:, :-1]``. The train loader shuffles (chunk order and all blocks within each chunk,
    reseeded every epoch) and drops the last partial batch.

    Validation (and test) score a fixed set: the val split's blocks in stream order, all of them or
    the first ``val_tokens // seq_len`` (:class:`ValBlocks`). It does not depend on batch_size or
    the number of devices, so one checkpoint gets one ``val/loss``.

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
        val_tokens: Optional[int] = None,
        prepare_if_missing: Optional[bool] = None,
    ) -> None:
        """Reads the manifest (preparing a default corpus first if allowed and needed) and checks the chunks.

        Args:
            data_dir: Dataset directory written by ``lit-mhar prepare``.
            seq_len: Tokens the model sees per sequence; blocks are seq_len + 1 tokens long.
            batch_size: Sequences per batch (per device).
            num_workers: DataLoader worker processes of the train loader; 0 reads in the main process.
            seed: Seed of the train shuffle.
            val_tokens: Tokens each validation scores: the first ``val_tokens // seq_len`` blocks of
                the val split. None: the whole split. Never a number of batches, so the score does
                not depend on batch_size or the device count.
            prepare_if_missing: If data_dir does not exist, build a corpus there, under a file lock
                so concurrent processes prepare it once. None (the default): only at the default
                folders ``data/stdlib`` (the ``stdlib`` source) and ``data/python`` (the ``python``
                source) of the current folder, so a mistyped path is an error rather than a new
                corpus; True: the stdlib corpus at any other data_dir; False: never. The data_dir
                stored in the hyperparameters (and so in checkpoints) is absolute, so tools that read
                it (generate, probe) work from any folder.

        Raises:
            ValueError: a non-positive seq_len / batch_size / val_tokens, a negative num_workers,
                a damaged chunk (named, with the command that rebuilds the dataset), a split with no
                block of seq_len + 1 tokens (train: fewer than batch_size), or val_tokens more than
                the val split holds.
            FileNotFoundError: no dataset at data_dir and it may not (or cannot) be prepared; the
                message gives the command to run.
        """
        super().__init__()
        sizes = (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0))
        for name, value, low in sizes + ((("val_tokens", val_tokens, 1),) if val_tokens is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if val_tokens is not None and val_tokens < seq_len:
            raise ValueError(f"val_tokens={val_tokens} is less than one block of seq_len={seq_len} tokens; raise it or leave it unset (the whole val split)")
        data_dir = str(Path(data_dir).expanduser().absolute())  # recorded absolute by save_hyperparameters
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_tokens = val_tokens
        self.manifest = self._ensure_dataset(prepare_if_missing)
        check_chunks(self.data_dir, self.manifest)
        for split in SPLITS:  # before any run or folder exists (the loaders are built inside the fit)
            blocks = self.blocks(split)
            if blocks == 0 or (split == "train" and blocks < batch_size):
                raise ValueError(
                    f"the {split} split of {self.data_dir} holds {blocks} blocks of seq_len + 1 = {seq_len + 1} tokens "
                    f"({self.manifest['splits'][split]['tokens']:,} tokens in {self.manifest['splits'][split]['chunks']} chunks; "
                    f"blocks never span chunks){', fewer than batch_size=' + str(batch_size) if blocks else ''}: lower seq_len"
                    f"{' or batch_size' if blocks else ''}, or prepare more text (or larger chunk_bytes)"
                )
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.eos_id: int = int(self.manifest["eos_id"])
        val = int(self.manifest["splits"]["val"]["tokens"])
        if val_tokens is not None and val_tokens > val:
            raise ValueError(f"val_tokens={val_tokens:,} is more than the {val:,} tokens of the val split of {self.data_dir}; lower it or leave it unset (the whole split)")
        if val < SMALL_VAL_TOKENS:
            warnings.warn(
                f"the val split of {self.data_dir} ({self.manifest.get('source')!r} corpus) holds {val:,} tokens, under "
                f"{SMALL_VAL_TOKENS:,}: its validation loss is noisy. A larger corpus (lit-mhar prepare --source python) gets about 2M.",
                stacklevel=2,
            )
        self._val_blocks: Optional[np.ndarray] = None

    def blocks(self, split: str) -> int:
        """Blocks of ``seq_len + 1`` tokens the split holds (each chunk's tail shorter than a block is not read)."""
        chunks = json.loads((self.data_dir / split / "index.json").read_text())["chunks"]
        return sum(int(c["dim"]) // (self.seq_len + 1) for c in chunks)

    @property
    def train_tokens(self) -> int:
        """Tokens in the train split (from the manifest)."""
        return int(self.manifest["splits"]["train"]["tokens"])

    def _ensure_dataset(self, prepare_if_missing: Optional[bool]) -> dict[str, Any]:
        if (self.data_dir / MANIFEST_NAME).is_file():
            return read_manifest(self.data_dir)
        source = default_source(self.data_dir, prepare_if_missing)
        if source is None:
            self._raise_missing(
                ""
                if prepare_if_missing is False
                else f"\n(fit builds a corpus by itself only at {' or '.join(DEFAULT_CORPORA)}; "
                "--data.prepare_if_missing true builds the stdlib corpus at this path)"
            )
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # Every DDP rank builds the DataModule; the first to take the lock prepares, the rest wait.
        # prepare() renames a finished dataset into place, so the manifest shows up with the dir.
        with FileLock(f"{self.data_dir}.lock"):
            if not (self.data_dir / MANIFEST_NAME).is_file():
                if self.data_dir.exists():
                    self._raise_missing()
                with rng_preserved():  # the first fit (which prepares) trains exactly as every later one
                    prepare(output_dir=str(self.data_dir), source=source)
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
            f"No dataset at {self.data_dir}. Create it with:\n  {command} --source python   (or --source stdlib: small, for a CPU)\n"
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
        return dataset

    def train_dataloader(self) -> StreamingDataLoader:
        """Shuffled int64 ``[batch_size, seq_len + 1]`` batches of the train split, last partial dropped."""
        dataset = self._dataset("train", shuffle=True, drop_last=True)
        return _ResumableLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            drop_last=True,
            collate_fn=_collate_tokens,
            pin_memory=torch.cuda.is_available(),
        )

    def val_blocks(self) -> np.ndarray:
        """The fixed validation set, ``[n, seq_len + 1]`` token ids (the split's dtype), read once.

        Raises:
            ValueError: the val split holds fewer blocks than val_tokens asks for.
        """
        if self._val_blocks is None:
            dataset = self._dataset("val", shuffle=False, drop_last=None)
            wanted = len(dataset) if self.val_tokens is None else self.val_tokens // self.seq_len
            if wanted > len(dataset):
                raise ValueError(
                    f"val_tokens={self.val_tokens:,} needs {wanted} blocks of {self.seq_len + 1} tokens, but the val split of "
                    f"{self.data_dir} holds {len(dataset)} (blocks never span chunks); lower val_tokens or seq_len"
                )
            blocks = [dataset[i] for i in range(wanted)]
            self._val_blocks = np.stack([np.asarray(b) for b in blocks])
        return self._val_blocks

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        """int64 ``[<= batch_size, seq_len + 1]`` batches of the fixed validation set, in order (this rank's share)."""
        # a generator of its own: a DataLoader iterator otherwise draws its base seed from the global
        # torch RNG, so how often validation runs would shift the random stream training uses
        return torch.utils.data.DataLoader(
            ValBlocks(self.val_blocks()), batch_size=self.batch_size, collate_fn=_collate_tokens, pin_memory=torch.cuda.is_available(),
            generator=torch.Generator(),
        )

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        """The validation set: prepare writes no separate test split."""
        return self.val_dataloader()
