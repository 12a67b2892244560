"""Child processes that end with the process that started them, however it ends (``kill -9`` too).

On Linux a process can ask the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
elsewhere these functions do nothing. ``prepare``'s litdata workers get ``SIGKILL`` (their output is
a staging folder the next ``prepare`` removes), a sweep's trial processes :data:`RUNNER_DIED` (the
trial records that its runner died and closes its MLflow run as KILLED), ``--workers`` processes
``SIGTERM`` (they stop their trial as on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Iterator, Optional

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The signal a sweep's trial process gets when its runner dies: one it receives for nothing else, so
# that it knows (its parent pid may still read as the runner's when the signal comes: a killed
# runner's threads die one by one, and the kernel signals the child when the thread that started it
# dies).
RUNNER_DIED = signal.SIGUSR2
# Looked up once, here: a child between fork and exec must not load libraries (another thread of
# the parent may have held the loader's lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGKILL, parent: Optional[int] = None) -> None:
    """In a child process: have the kernel send it ``sig`` when its parent dies; if the parent
    ``parent`` (a pid) has died already, send it now. A no-op off Linux.

    Usable as ``subprocess.Popen(preexec_fn=functools.partial(die_with_parent, sig, os.getpid()))``.
    """
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # the parent died before the request
        os.kill(os.getpid(), sig)


_forked_children_die = 0  # > 0 inside forked_children_die_with_parent(): inherited by every forked child
_forking_parent: Optional[int] = None


def _before_fork() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def _after_fork_in_child() -> None:
    if _forked_children_die:
        die_with_parent(signal.SIGKILL, _forking_parent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forked_children_die_with_parent() -> Iterator[None]:
    """Inside the block, every process this one forks (``multiprocessing``'s fork start method, as
    litdata's ``optimize`` uses it) gets ``SIGKILL`` when its parent dies; so do the processes those
    fork in turn, when theirs dies."""
    global _forked_children_die
    _forked_children_die += 1
    try:
        yield
    finally:
        _forked_children_die -= 1
