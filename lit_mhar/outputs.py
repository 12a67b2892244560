"""Output folders that appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
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


@contextlib.contextmanager
def staged_directory(out: Path, before_replace: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """Build a folder in a hidden sibling of ``out`` and move it to ``out`` when the block succeeds.

    An exception (or Ctrl-C) inside the block deletes the staging folder and leaves ``out`` as it
    was. On success an existing ``out`` is replaced: it is renamed aside first and deleted only
    after the new folder is in place. Whether replacing is allowed is the caller's decision, made
    before any work; ``before_replace`` runs just before an existing ``out`` is replaced, to check
    again (it may raise to keep ``out``).

    Yields:
        The staging folder (empty, on the same file system as ``out``).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            if before_replace is not None:
                before_replace()
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
