"""Depth-routing kernels and their dispatcher.

``depth_route`` (and the two phases of Block AttnRes, ``route_sites`` and ``merge_route``, or
``merge_route_norm``, the second phase fused with the next RMSNorm; ``route_norm``, one site fused
with the next RMSNorm without a prior;
``route_norm_decode``, decoding's routing fused with the next RMSNorm, and ``route_sites_decode``,
the phase one of a group of decoding sites) run the fused Triton kernels
for CUDA tensors and the plain PyTorch reference otherwise. ``use_backend``
forces one path: ``use_backend("triton")`` runs the Triton kernels on CPU tensors too, in Triton's
interpreter (tests). The environment variable ``LIT_MHAR_ROUTING_BACKEND`` sets the default.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from torch import Tensor

from lit_mhar.kernels import reference
from lit_mhar.kernels.reference import check_route_args
from lit_mhar.kernels.reference import depth_route as reference_depth_route
from lit_mhar.kernels.sink import GradientSink

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


def resolve_backend(like: Tensor) -> str:
    """``"triton"`` or ``"reference"``: the path a call with tensors like ``like`` takes now."""
    if _backend == "triton" or (_backend == "auto" and like.is_cuda):
        return "triton"
    return "reference"


def _impl(like: Tensor, name: str = "depth routing"):
    if not isinstance(like, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(like).__name__}")
    if resolve_backend(like) == "triton":
        from lit_mhar.kernels import triton_routing  # imported on first use: Triton is not needed otherwise

        return triton_routing
    return reference


def depth_route(sources, query, gain, heads=1, stream=None, gate=None, eps=1e-6, return_weights=False):
    """Dispatching depth routing; same signature and semantics as :func:`lit_mhar.kernels.reference.depth_route`."""
    if len(sources) == 0:
        check_route_args(sources, query, gain, heads, stream, gate)
    return _impl(sources[0]).depth_route(sources, query, gain, heads, stream, gate, eps, return_weights)


def route_sites(sources, queries, gains, heads=1, eps=1e-6, grad_sink=None):
    """Dispatching first phase of two-phase Block AttnRes; see :func:`lit_mhar.kernels.reference.route_sites`."""
    if len(sources) == 0:
        check_route_args(sources, queries[0], gains[0], heads, None, None)
    return _impl(sources[0]).route_sites(sources, queries, gains, heads, eps, grad_sink)


def merge_route(sources, query, gain, heads, prior_out, prior_lse, stream=None, gate=None, eps=1e-6, grad_sink=None):
    """Dispatching second phase (online-softmax merge); see :func:`lit_mhar.kernels.reference.merge_route`."""
    return _impl(prior_out).merge_route(sources, query, gain, heads, prior_out, prior_lse, stream, gate, eps, grad_sink)


def merge_route_norm(
    sources, query, gain, heads, prior_out, prior_lse, norm_weight, norm_eps, stream=None, gate=None, eps=1e-6, grad_sink=None,
    stream_start=None, block_outputs=None, earlier_outputs=None,
):
    """Dispatching second phase fused with the next RMSNorm (training); see :func:`lit_mhar.kernels.reference.merge_route_norm`."""
    return _impl(prior_out, "merge_route_norm: prior_out").merge_route_norm(
        sources, query, gain, heads, prior_out, prior_lse, norm_weight, norm_eps, stream, gate, eps, grad_sink, stream_start, block_outputs,
        earlier_outputs,
    )


def route_norm(sources, query, gain, heads, norm_weight, norm_eps, eps=1e-6, grad_sink=None):
    """Dispatching routing fused with the next RMSNorm, without a prior (training); see :func:`lit_mhar.kernels.reference.route_norm`."""
    if len(sources) == 0:
        reference.check_route_norm_args(sources, query, gain, heads, norm_weight, norm_eps, eps)
    return _impl(sources[0], "route_norm: sources[0]").route_norm(sources, query, gain, heads, norm_weight, norm_eps, eps, grad_sink)


def route_norm_decode(
    history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream=None, gate=None, eps=1e-6,
    prior_out=None, prior_lse=None, n_prior=0,
):
    """Dispatching decode-time routing fused with the next RMSNorm; see :func:`lit_mhar.kernels.reference.route_norm_decode`."""
    return _impl(history, "route_norm_decode: history").route_norm_decode(
        history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream, gate, eps,
        prior_out, prior_lse, n_prior,
    )


def route_sites_decode(history, n_sources, queries, gains, heads=1, eps=1e-6):
    """Dispatching phase one of a group of decode-time sites; see :func:`lit_mhar.kernels.reference.route_sites_decode`."""
    return _impl(history, "route_sites_decode: history").route_sites_decode(history, n_sources, queries, gains, heads, eps)


__all__ = [
    "depth_route",
    "route_sites",
    "merge_route",
    "merge_route_norm",
    "route_norm",
    "route_norm_decode",
    "route_sites_decode",
    "reference_depth_route",
    "check_route_args",
    "GradientSink",
    "use_backend",
    "get_backend",
    "resolve_backend",
    "BACKENDS",
]
