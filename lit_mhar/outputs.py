"""Output folders that appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional


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
