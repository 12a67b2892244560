"""Output folders that appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Collection, Iterator, Optional


def check_output_dir(out: Path, overwrite: bool, owned: Collection[str], command: str) -> None:
    """Refuse an output folder the user could lose, before any work starts.

    ``out`` may be absent or empty. A non-empty ``out`` is replaced only with ``overwrite`` and only
    if every entry in it is one ``command`` writes (``owned``): a wrong ``--output_dir`` never
    deletes the user's other files.

    Raises:
        FileExistsError: ``out`` is a file, or is not empty and ``overwrite`` is false.
        ValueError: ``overwrite`` is true but ``out`` holds entries ``command`` did not write.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"output_dir={str(out)!r} exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(
            f"output_dir={str(out)!r} is not empty; {command} never writes into an existing folder. "
            "Choose another output_dir or pass --overwrite true to replace it."
        )
    foreign = [e for e in entries if e not in owned]
    if foreign:
        raise ValueError(
            f"overwrite: refusing to delete {str(out)!r}: it holds files {command} did not write ({foreign[:5]}); "
            "choose another output_dir"
        )


_STAGING_LOCK = ".staging.lock"  # held inside a staging folder while its run builds it
_STAGING_GRACE_S = 60  # a staging folder without its lock yet is this young at most


def remove_abandoned_staging(out: Path) -> list[Path]:
    """Removes the staging folders of ``out`` (``.NAME.tmp-*`` beside it) that a killed run left.

    A run holds a lock (``filelock``) inside its staging folder while it builds it; the operating
    system frees the lock when that process dies, however it dies. A folder whose lock is free is
    abandoned; one whose lock is held belongs to a run in progress and is left alone. Each removal
    is said on stderr.

    Returns:
        The folders removed.
    """
    from filelock import FileLock, Timeout

    removed = []
    for tmp in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        lock_file = tmp / _STAGING_LOCK
        if not tmp.is_dir() or (not lock_file.exists() and time.time() - tmp.stat().st_mtime < _STAGING_GRACE_S):
            continue  # (just created: its lock comes next)
        lock = FileLock(str(lock_file))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            lock.release()
        removed.append(tmp)
        print(f"[lit-mhar] removed {tmp}: the unfinished folder of an earlier run into {out} that was killed", file=sys.stderr, flush=True)
    return removed


@contextlib.contextmanager
def staged_directory(out: Path, before_replace: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """Build a folder in a hidden sibling of ``out`` and move it to ``out`` when the block succeeds.

    An exception (or Ctrl-C) inside the block deletes the staging folder and leaves ``out`` as it
    was. On success an existing ``out`` is replaced: it is renamed aside first and deleted only
    after the new folder is in place. Whether replacing is allowed is the caller's decision, made
    before any work; ``before_replace`` runs just before an existing ``out`` is replaced, to check
    again (it may raise to keep ``out``). Staging folders of ``out`` that killed runs left are
    removed first (:func:`remove_abandoned_staging`).

    Yields:
        The staging folder (empty but for its hidden lock file, on the same file system as ``out``).
    """
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    lock = FileLock(str(tmp / _STAGING_LOCK))
    lock.acquire()
    try:
        yield tmp
        lock.release()
        (tmp / _STAGING_LOCK).unlink(missing_ok=True)
        old = None
        if out.exists():
            if before_replace is not None:
                before_replace()
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.release()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
