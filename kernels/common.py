"""What the Triton kernels share: ``@triton.jit`` helpers, and each kernel's build for Triton's interpreter.

Sums are written ``tl.reduce(x, axis, ADD)`` and zeros ``tl.full``: ``tl.sum`` and ``tl.zeros`` are
Triton's own jitted functions, which its interpreter calls only when ``TRITON_INTERPRET`` was set
before Triton was imported; ``ADD`` (the combine function the interpreter maps to ``numpy.sum``) and
builtins work either way. The project's helpers below work either way too: :func:`interpreted`
builds a kernel's interpreted version with its helpers interpreted as well, so one process runs
the compiled kernels on CUDA tensors and the interpreted ones on CPU tensors (the tests), whatever
was imported first.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

ADD = tl.standard._sum_combine
MAX = tl.standard._elementwise_max


@triton.jit
def round_bf16(x):
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, on the bits, as torch's bf16
    additions round (the interpreter's cast truncates); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """``acc + a @ b`` (``acc`` None: ``a @ b``) on tensor cores, float32 accumulation; with ``F32``
    (the interpreter, whose bf16 ``tl.dot`` is wrong) the same values multiplied in float32."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def split(x):
    """A float32 tensor as a bf16x2 split ``(hi, lo)``, ``hi + lo`` within about 2^-17 of ``x``."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def split_dot(hi, lo, b, acc, F32: tl.constexpr):
    """``acc + (hi + lo) @ b``: a float32 factor split in two bf16 halves (:func:`split`) against a
    bf16 ``b``, each product exact to about 2^-17 relative, the sums float32."""
    acc = dot(hi, b, acc, F32)
    return dot(lo, b, acc, F32)


@triton.jit
def dot_scores(w, w_lo, dr, v, sc, a, F32: tl.constexpr):
    """One column tile's share of the tensor-core kernels' score and output-gradient products over
    rows (token, site) ``[R, C]`` and (token, source) ``[Q, C]``: ``sc + W V^T`` (W = q * g as
    ``w + w_lo``, :func:`split`) and ``a + dR V^T``, both ``[R, Q]`` float32 (``sc``, ``a`` None: no
    addend); a head held as two column tiles (``DT``) adds the second tile's with a second call."""
    vt = tl.trans(v)
    sc = split_dot(w, w_lo, vt, sc, F32)
    a = dot(dr, vt, a, F32)
    return sc, a


@triton.jit
def source_grad_dot(p_hi, p_lo, c_hi, c_lo, dr, w, w_lo, F32: tl.constexpr):
    """``alpha^T dR + (ds * rstd)^T W`` over one column tile, the source gradient's products on
    tensor cores: ``alpha`` and the coefficients as bf16x2 splits, W as ``w + w_lo``; the term
    ``lo * lo`` (about 2^-34 relative) is left out."""
    dv = split_dot(p_hi, p_lo, dr, None, F32)
    dv = dot(c_hi, w, dv, F32)
    dv = dot(c_hi, w_lo, dv, F32)
    return dot(c_lo, w, dv, F32)


_INTERPRETED: dict = {}


def interpreted(kernel):
    """``kernel`` (a ``@triton.jit`` function of this package) built for Triton's interpreter, with
    every helper of this package that it calls interpreted too (on a copy of its module's globals:
    the compiled kernels keep theirs). A kernel that is already interpreted (``TRITON_INTERPRET``
    set at import) is returned as it is."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, JITFunction):
        return kernel
    if kernel not in _INTERPRETED:
        fn = kernel.fn
        scope = dict(fn.__globals__)
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        clone.__qualname__, clone.__doc__ = fn.__qualname__, fn.__doc__
        _INTERPRETED[kernel] = InterpretedFunction(clone)
        for name, value in scope.items():  # (cached first: helpers calling each other terminate)
            if isinstance(value, JITFunction) and value.fn.__module__.startswith("lit_mhar."):
                scope[name] = interpreted(value)
    return _INTERPRETED[kernel]
