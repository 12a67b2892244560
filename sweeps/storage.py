"""Where a sweep's study lives (Optuna storages, the lock beside a file storage) and whether a worker process is alive."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Optional

from lit_mhar.tracking import redact

ATTR = "lit_mhar."  # prefix of every user attribute the sweep stores in Optuna
HOST = socket.gethostname()


class TrialFailed(Exception):
    """A trial that ended without a result; its message is the reason stored with the trial."""


def say(study: str, message: str) -> None:
    """One line of sweep progress on stdout."""
    print(f"[sweep {study}] {message}", flush=True)


def absolute_sqlite(url: str) -> str:
    """``url`` with a relative sqlite path made absolute (so subprocesses and locks agree); other URLs unchanged."""
    from sqlalchemy.engine import make_url

    if not url.startswith("sqlite"):
        return url
    parsed = make_url(url)
    if not parsed.database or parsed.database == ":memory:":
        raise ValueError(f"storage {url!r} is an in-memory database, which cannot be shared by workers or resumed; use sqlite:///sweeps.db")
    return str(parsed.set(database=str(Path(parsed.database).expanduser().absolute())))


def open_storage(url: str, heartbeat_interval: Optional[int] = None, grace_period: Optional[int] = None) -> Any:
    """The Optuna storage for ``url``.

    Args:
        url: An RDB URL for SQLAlchemy (``sqlite:///sweeps.db``, ``postgresql://user:pw@host/db``,
            ``mysql+pymysql://...``) or ``journal:PATH`` for an Optuna journal file (a shared file
            system without a database server).
        heartbeat_interval: RDB only: seconds between a running trial's heartbeats; a trial
            silent for ``grace_period`` seconds is marked FAIL by the next worker.
        grace_period: RDB only; default 4 x heartbeat_interval.

    Raises:
        ValueError: the URL is neither form, or the storage cannot be opened (the message has the
            URL, password hidden, and the underlying error).
    """
    import warnings

    import optuna

    # Heartbeats are marked experimental in Optuna; they are how a dead worker's trial is found.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        path = journal_path(url)
        if path is not None:
            if not path.parent.is_dir():
                raise FileNotFoundError(f"folder {path.parent} does not exist")
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(str(path)))
        if "://" not in url:
            raise ValueError("not a URL")
        url = absolute_sqlite(url)
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        if url.startswith("sqlite") and not Path(url.split(":///", 1)[1]).parent.is_dir():
            raise FileNotFoundError(f"folder {Path(url.split(':///', 1)[1]).parent} does not exist")
        grace = None if heartbeat_interval is None else (grace_period or 4 * heartbeat_interval)
        lock = StorageLock(url)  # two processes creating a new sqlite schema at once collide ("table trials already exists")
        lock.acquire()
        try:
            return _create_rdb_storage(url, engine_kwargs, heartbeat_interval, grace)
        finally:
            lock.release()
    except Exception as e:  # noqa: BLE001 - any failure to open is reported with the URL
        detail = " ".join(str(e).split())  # drivers' messages span lines: one line for the CLI's error
        raise ValueError(
            f"storage {redact(url)!r} is unreachable ({type(e).__name__}: {detail}). Valid: an RDB URL such as "
            "sqlite:///sweeps.db or postgresql://user:password@host/db (with its driver installed), or journal:PATH"
        ) from None


def _create_rdb_storage(url: str, engine_kwargs: Optional[dict], heartbeat_interval: Optional[int], grace: Optional[int],
                        attempts: int = 20) -> Any:
    """``optuna.storages.RDBStorage``, retried while another process creates the same schema.

    Workers on several machines that open a new database server study at the same moment all
    issue Optuna's ``CREATE TYPE`` / ``CREATE TABLE``; the losers get an ``IntegrityError`` or
    ``ProgrammingError`` ("already exists") and succeed once the winner has committed. Other
    errors (a refused connection, bad credentials: ``OperationalError``) are raised at once.
    """
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval, grace_period=grace)
        except (IntegrityError, ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.25 * (attempt + 1))


def journal_path(url: str) -> Optional[Path]:
    """The absolute file of a ``journal:PATH`` storage URL; None for any other storage."""
    return Path(url[len("journal:"):]).expanduser().absolute() if url.startswith("journal:") else None


class StorageLock:
    """An inter-process lock beside a file storage (sqlite, journal); a no-op for database servers.

    Workers hold it while they enqueue grid points, take a trial and store its parameters, so
    workers on one machine never take the same point; it is released before the trial trains.
    """

    def __init__(self, url: str) -> None:
        from filelock import FileLock

        journal, path = journal_path(url), None
        if journal is not None:
            path = str(journal)
        elif url.startswith("sqlite"):
            path = absolute_sqlite(url).split(":///", 1)[1]
        self._lock = FileLock(path + ".sweep-lock") if path else None

    def acquire(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def release(self) -> None:
        """Releases the lock if this process holds it (safe to call twice)."""
        if self._lock is not None and self._lock.is_locked:
            self._lock.release(force=True)


# ----------------------------------------------------------------------------- process liveness


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` from /proc (Linux), to tell a reused pid apart; None elsewhere."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _process_start(pid) in (None, start)
