"""Decoding: routing fused with the next RMSNorm, one kernel per routing site (no backward).

:func:`route_norm_decode`: one program per token loops over the slots of one ``[slots, tokens, d]``
buffer in tiles of a few slots (all loads of a tile in flight at once), adds the newest sublayer
output into its slot, routes (online softmax per head, AttnRes eqs. 2-6) and applies the next
sublayer's RMSNorm. Full routing's long histories take a phase one per group of sites
(:func:`route_sites_decode`: one program per token and site over the slots complete at the group's
start), whose output and lse each site's kernel then merges as a prior; without a prior, a long
history is split over programs whose float32 partials a second launch merges. Tiles:
:func:`lit_mhar.kernels.dispatch.plan`'s ``decode`` forms.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lit_mhar.kernels.common import ADD, MAX
from lit_mhar.kernels.dispatch import Call, plan
from lit_mhar.kernels.launch import SUPPORTED_DTYPES, check_dtypes, kernel, new
from lit_mhar.kernels.reference import check_decode_args, check_sites_decode_args


@triton.jit
def _decode_route_norm(
    hist_ptr, n_buf, slot_stride, pend_ptr,
    q_ptr, g_ptr, nw_ptr, stream_ptr, gate_ptr, out_ptr,
    part_ptr, part_ml_ptr, M, n_split,
    prior_out_ptr, prior_lse_ptr, start,
    eps, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr,
    CH: tl.constexpr, NSP: tl.constexpr, PHASE: tl.constexpr,
    HAS_PENDING: tl.constexpr, ACCUMULATE: tl.constexpr, ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr,
):
    """Decode-time routing of one token per program (PHASE 0: with the next RMSNorm; 1 and 2: a
    long history split over programs, then merged; 3: phase one of a group of sites). Layout
    constexprs: :func:`lit_mhar.kernels.dispatch.plan` (``decode`` forms)."""
    # PHASE 0: one program per token: CH slots per iteration ([CH, head, lane] tiles, all loads of
    # an iteration in flight at once), online softmax per head, then the pending sublayer output
    # as the newest source (added into its slot on the way), then finishing. With a prior (the
    # site's routing over slots 0 .. start - 1 from PHASE 3, as out and lse per head) the softmax
    # starts from it and the loop from slot start.
    # PHASE 3 (phase one of a group of sites): program (token, site) routes slots 0 .. n_buf - 1
    # with its site's query (row site of q_ptr, g_ptr) like PHASE 0, and writes out (float32) and
    # lse per head instead of finishing.
    # PHASE 1 (long histories): program (token, k) routes slots k*CH .. k*CH + CH - 1, the pending
    # output among them in the last tile, and writes its partial (acc, max, sum per head, float32);
    # PHASE 2: program (token) merges the n_split partials in order and finishes.
    # Finishing: the additive form, the next RMSNorm, the store. The pending output is routed as
    # stored, like the training path's partial sum.
    tok = tl.program_id(0)
    row = tl.cast(tok, tl.int64) * D
    h_i = tl.arange(0, BH)[None, :, None]
    j_i = tl.arange(0, BDH)[None, None, :]
    col = h_i * DH + j_i  # [1, BH, BDH]
    cmask = (h_i < H) & (j_i < DH)
    if PHASE == 0 or PHASE == 2:  # what finishing reads, loaded first so that its latency overlaps the routing
        nw = tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if ADDITIVE:
            x_stream = tl.load(stream_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
            x_gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    if PHASE == 2:
        k_i = tl.arange(0, NSP)[:, None, None]
        kmask = k_i < n_split
        pk = tl.cast(k_i * M + tok, tl.int64)
        acc_k = tl.load(part_ptr + pk * D + col, mask=kmask & cmask, other=0.0)  # [NSP, BH, BDH]
        ml_off = (pk * H + h_i) * 2
        m_k = tl.load(part_ml_ptr + ml_off, mask=kmask & (h_i < H), other=float("-inf"))  # [NSP, BH, 1]
        l_k = tl.load(part_ml_ptr + ml_off + 1, mask=kmask & (h_i < H), other=0.0)
        # padding heads (H not a power of two) merge as max 0, sum 1: their r is 0, not 0 / 0
        pad = kmask & (h_i >= H)
        m_k = tl.where(pad, 0.0, m_k)
        l_k = tl.where(pad, 1.0, l_k)
        m = tl.reduce(m_k, 0, MAX, keep_dims=True)
        scale = tl.where(kmask, tl.exp(m_k - m), 0.0)
        r = tl.reduce(acc_k * scale, 0, ADD, keep_dims=True) / tl.reduce(l_k * scale, 0, ADD, keep_dims=True)
    elif PHASE == 0 or PHASE == 3:
        c_i = tl.arange(0, CH)[:, None, None]
        site = tl.program_id(1)  # 0 in PHASE 0 (one program per token)
        w = tl.load(q_ptr + site * D + col, mask=cmask, other=0.0).to(tl.float32)
        w *= tl.load(g_ptr + site * D + col, mask=cmask, other=0.0).to(tl.float32)
        if HAS_PRIOR:  # the prior enters as one more source whose score is its lse (padding heads: 0, sum 1)
            m_run = tl.load(prior_lse_ptr + tl.cast(tok, tl.int64) * H + h_i, mask=h_i < H, other=0.0)
            l_run = tl.full([1, BH, 1], 1.0, tl.float32)
            acc = tl.load(prior_out_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
        else:
            m_run = tl.full([1, BH, 1], float("-inf"), tl.float32)
            l_run = tl.full([1, BH, 1], 0.0, tl.float32)
            acc = tl.full([1, BH, BDH], 0.0, tl.float32)
        if HAS_PENDING:  # loaded before the loop (its latency overlaps it), stored after
            slot_ptr = hist_ptr + tl.cast(n_buf, tl.int64) * slot_stride + row + col
            o = tl.load(pend_ptr + row + col, mask=cmask, other=0.0).to(tl.float32)
            if ACCUMULATE:
                o += tl.load(slot_ptr, mask=cmask, other=0.0).to(tl.float32)
        for c0 in range(start, n_buf, CH):
            slot = c0 + c_i
            smask = slot < n_buf
            v = tl.load(hist_ptr + tl.cast(slot, tl.int64) * slot_stride + row + col, mask=smask & cmask, other=0.0).to(tl.float32)
            sq = tl.reduce(tl.reduce(v * v, 2, ADD, keep_dims=True), 1, ADD, keep_dims=True)  # [CH, 1, 1]
            sc = tl.reduce(w * v, 2, ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [CH, BH, 1]
            sc = tl.where(smask, sc, float("-inf"))
            m_new = tl.maximum(m_run, tl.reduce(sc, 0, MAX, keep_dims=True))
            p = tl.exp(sc - m_new)
            scale = tl.exp(m_run - m_new)
            l_run = l_run * scale + tl.reduce(p, 0, ADD, keep_dims=True)
            acc = acc * scale + tl.reduce(p * v, 0, ADD, keep_dims=True)
            m_run = m_new
        if HAS_PENDING:
            if ACCUMULATE:
                # threads holding copies of one element (narrow d) must all have read it before any writes
                tl.debug_barrier()
            o = o.to(hist_ptr.dtype.element_ty)
            tl.store(slot_ptr, o, mask=cmask)
            o = o.to(tl.float32)  # routed as stored, like the training path's partial sum
            sq = tl.reduce(tl.reduce(o * o, 2, ADD, keep_dims=True), 1, ADD, keep_dims=True)
            sc = tl.reduce(w * o, 2, ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [1, BH, 1]
            m_new = tl.maximum(m_run, sc)
            p = tl.exp(sc - m_new)
            scale = tl.exp(m_run - m_new)
            l_run = l_run * scale + p
            acc = acc * scale + p * o
        r = acc / l_run
        if PHASE == 3:
            site_tok = tl.cast(site * M + tok, tl.int64)
            tl.store(part_ptr + site_tok * D + col, r, mask=cmask)
            tl.store(part_ml_ptr + site_tok * H + h_i, m_run + tl.log(l_run), mask=h_i < H)
    else:
        slot = tl.program_id(1) * CH + tl.arange(0, CH)[:, None, None]  # [CH, 1, 1]
        slot_off = tl.cast(slot, tl.int64) * slot_stride + row + col
        w = tl.load(q_ptr + col, mask=cmask, other=0.0).to(tl.float32) * tl.load(g_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        n_read = n_buf + 1 if ACCUMULATE else n_buf
        v = tl.load(hist_ptr + slot_off, mask=(slot < n_read) & cmask, other=0.0).to(tl.float32)
        if HAS_PENDING:
            is_new = slot == n_buf
            v += tl.load(pend_ptr + row + col + 0 * slot, mask=is_new & cmask, other=0.0).to(tl.float32)
            v = v.to(hist_ptr.dtype.element_ty)
            if ACCUMULATE:
                # threads holding copies of one element (narrow d) must all have read it before any writes
                tl.debug_barrier()
            tl.store(hist_ptr + slot_off, v, mask=is_new & cmask)
            v = v.to(tl.float32)
            valid = slot <= n_buf
        else:
            valid = slot < n_buf
        sq = tl.reduce(tl.reduce(v * v, 2, ADD, keep_dims=True), 1, ADD, keep_dims=True)  # [CH, 1, 1]
        sc = tl.reduce(w * v, 2, ADD, keep_dims=True) / tl.sqrt(sq / D + eps)  # [CH, BH, 1]
        sc = tl.where(valid, sc, float("-inf"))
        m = tl.reduce(sc, 0, MAX, keep_dims=True)  # [1, BH, 1]
        p = tl.exp(sc - m)
        l = tl.reduce(p, 0, ADD, keep_dims=True)
        acc = tl.reduce(p * v, 0, ADD, keep_dims=True)  # [1, BH, BDH]
        pk = tl.cast(tl.program_id(1) * M + tok, tl.int64)
        tl.store(part_ptr + pk * D + col, acc, mask=cmask)
        ml_off = (pk * H + h_i) * 2
        tl.store(part_ml_ptr + ml_off, m, mask=h_i < H)
        tl.store(part_ml_ptr + ml_off + 1, l, mask=h_i < H)
    if PHASE == 0 or PHASE == 2:
        if ADDITIVE:
            x = (x_stream + x_gate * r).to(stream_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = r.to(hist_ptr.dtype.element_ty).to(tl.float32)
        ms = tl.reduce(tl.reduce(x * x, 2, ADD, keep_dims=True), 1, ADD, keep_dims=True) / D
        y = x / tl.sqrt(ms + norm_eps) * nw
        tl.store(out_ptr + row + col, y.to(out_ptr.dtype.element_ty), mask=cmask)


@torch.library.custom_op("lit_mhar::route_norm_decode", mutates_args=("history",))
def _route_norm_decode_op(
    history: Tensor, n_sources: int, pending: Optional[Tensor], accumulate: bool, query: Tensor, gain: Tensor,
    heads: int, norm_weight: Tensor, norm_eps: float, stream: Optional[Tensor], gate: Optional[Tensor], eps: float,
    prior_out: Optional[Tensor], prior_lse: Optional[Tensor], n_prior: int,
) -> Tensor:
    d = history.shape[-1]
    routed_dtype = stream.dtype if stream is not None else history.dtype
    out = new(history.shape[1:], torch.promote_types(routed_dtype, norm_weight.dtype), history.device)
    M = out.numel() // d
    if M == 0:
        return out
    interpret = history.device.type != "cuda"
    has_prior = prior_out is not None
    # one program looping over the slots (after the prior, if any) in tiles, or, for a long history
    # without a prior, split over programs whose partials a second launch merges
    call = Call("decode-merge" if has_prior else "decode", n_sources - n_prior, 1, d, heads, history.dtype, pending=pending is not None)
    launches = plan(call, interpret).forward
    n_split = launches[0].count
    dummy = query
    if n_split > 1:
        part = torch.empty((n_split, M, d), dtype=torch.float32, device=history.device)
        part_ml = torch.empty((n_split, M, heads, 2), dtype=torch.float32, device=history.device)
    else:
        part = part_ml = dummy
    args = (
        history, n_sources, history[0].numel(), pending.contiguous() if pending is not None else dummy,
        query.contiguous(), gain.contiguous(), norm_weight.contiguous(), stream.contiguous() if stream is not None else dummy,
        gate.contiguous() if gate is not None else dummy, out,
        part, part_ml, M, n_split,
        prior_out.contiguous() if has_prior else dummy, prior_lse.contiguous() if has_prior else dummy, n_prior if has_prior else 0,
        eps, norm_eps,
    )
    flags = dict(
        D=d, H=heads, DH=d // heads, HAS_PENDING=pending is not None, ACCUMULATE=bool(accumulate) and pending is not None,
        ADDITIVE=stream is not None, HAS_PRIOR=has_prior,
    )
    decode = kernel("decode", interpret)
    for launch in launches:  # PHASE 0, or 1 then 2 (the merge of the partials: one program per token)
        decode[(M, n_split) if launch.meta["PHASE"] != 2 else (M,)](*args, **flags, **launch.meta)
    return out


@_route_norm_decode_op.register_fake
def _(history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream, gate, eps, prior_out, prior_lse, n_prior):
    routed_dtype = stream.dtype if stream is not None else history.dtype
    return history.new_empty(history.shape[1:], dtype=torch.promote_types(routed_dtype, norm_weight.dtype))


@torch.library.custom_op("lit_mhar::route_sites_decode", mutates_args=())
def _route_sites_decode_op(history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float) -> tuple[Tensor, Tensor]:
    G, d = queries.shape
    out = new((G, *history.shape[1:]), torch.float32, history.device)
    lse = new((G, *history.shape[1:-1], heads), torch.float32, history.device)
    M = history[0].numel() // d
    if M == 0:
        return out, lse
    interpret = history.device.type != "cuda"
    (launch,) = plan(Call("decode-sites", n_sources, G, d, heads, history.dtype), interpret).forward
    q, g = queries.contiguous(), gains.contiguous()
    kernel("decode", interpret)[(M, G)](
        history, n_sources, history[0].numel(), q,
        q, g, q, q, q, q,
        out, lse, M, 1,
        q, q, 0,
        eps, 0.0,
        D=d, H=heads, DH=d // heads, **launch.meta, HAS_PENDING=False, ACCUMULATE=False, ADDITIVE=False, HAS_PRIOR=False,
    )
    return out, lse


@_route_sites_decode_op.register_fake
def _(history, n_sources, queries, gains, heads, eps):
    G = queries.shape[0]
    return (
        history.new_empty((G, *history.shape[1:]), dtype=torch.float32),
        history.new_empty((G, *history.shape[1:-1], heads), dtype=torch.float32),
    )


def route_norm_decode(
    history: Tensor,
    n_sources: int,
    pending: Optional[Tensor],
    accumulate: bool,
    query: Tensor,
    gain: Tensor,
    heads: int,
    norm_weight: Tensor,
    norm_eps: float,
    stream: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    eps: float = 1e-6,
    prior_out: Optional[Tensor] = None,
    prior_lse: Optional[Tensor] = None,
    n_prior: int = 0,
) -> Tensor:
    """Fused decode-time routing + RMSNorm; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.route_norm_decode` (one kernel per routing site).

    ``history`` float32 / bfloat16 / float16; a prior is float32. Raises ValueError for the
    reference's argument errors, another dtype or too wide a d, before anything is written.
    """
    check_decode_args(
        history, n_sources, pending, accumulate, norm_weight, norm_eps, query, gain, heads, stream, gate, eps,
        prior_out, prior_lse, n_prior,
    )
    check_dtypes([history])
    if pending is not None and pending.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"route_norm_decode: pending has dtype {pending.dtype}; supported: {list(SUPPORTED_DTYPES)}")
    if prior_out is not None and (prior_out.dtype != torch.float32 or prior_lse.dtype != torch.float32):
        raise ValueError(
            f"route_norm_decode: prior_out / prior_lse have dtypes {prior_out.dtype} / {prior_lse.dtype}; "
            "the Triton kernel takes float32 (as route_sites_decode returns them)"
        )
    return torch.ops.lit_mhar.route_norm_decode(
        history, n_sources, pending, accumulate, query, gain, heads, norm_weight, float(norm_eps), stream, gate, eps,
        prior_out, prior_lse, int(n_prior),
    )


def route_sites_decode(
    history: Tensor, n_sources: int, queries: Tensor, gains: Tensor, heads: int, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Phase one of a group of decode-time routing sites; same signature, math and docstring as
    :func:`lit_mhar.kernels.reference.route_sites_decode` (one kernel, one program per token and site).

    ``history`` float32 / bfloat16 / float16; returns float32. Raises ValueError for the
    reference's argument errors, another dtype or too wide a d, before any work.
    """
    check_sites_decode_args(history, n_sources, queries, gains, heads, eps)
    check_dtypes([history])
    return torch.ops.lit_mhar.route_sites_decode(history, n_sources, queries, gains, heads, float(eps))
