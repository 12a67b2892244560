"""The vector forward (``fwd``): phase one, single sites and merges, one pass over the sources.

Per tile of ``BM`` tokens and a group of ``BS`` sites, one loop over the sources (AttnRes eqs.
2-6, MHAR's heads): each source's key rstd ``rstd_i = 1 / sqrt(mean_c v_i^2 + eps)``, the per-head
score ``s_i = rstd_i <q * g, v_i>_h`` and an online softmax in float32; normalised keys are never
written. A prior (a routed value ``o`` with its log-sum-exp) enters as one more source whose score
is its lse: the second, online-softmax phase of two-phase routing, exact. Saved for the backward:
the lse ``[S, M, H]`` float32; where the plan says so each source's key rstd ``[N, M]`` float32
(the site loop's backward) or the routed value r float32 (a fused-norm merge's one-pass backward).

Each token's width is ``[heads, lanes]`` tiles; a head width that is a sum of two powers of two
(160 = 128 + 32) is two tiles, every lane tensor with a twin ``*_t`` over the head's last ``DT``
channels (sums over a head add the two).
"""

import triton
import triton.language as tl

from lit_mhar.kernels.common import ADD


@triton.jit
def _route_fwd(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    out_base, out_offs,
    lse_ptr,
    stream_ptr, gate_ptr,
    prior_ptr, prior_lse_ptr,
    scores_ptr, rstd_ptr,
    nw_ptr, routed_ptr,
    M, eps, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr, STORE_SCORES: tl.constexpr, STORE_RSTD: tl.constexpr, NORM: tl.constexpr,
    STORE_ROUTED: tl.constexpr,
):
    """Route ``n_sites`` sites over ``n_src`` sources (and a prior), one pass over the sources.

    Program (token tile, group of BS sites). Sources: ``src_base + src_offs[i]`` ``[M, D]``; ``w_ptr``
    ``[S, D]`` float32 ``q * g``; outputs ``out_base + out_offs[s]``; ``lse_ptr`` ``[S, M, H]``
    float32. With HAS_PRIOR (S = 1) ``prior_ptr`` ``[M, D]`` and ``prior_lse_ptr`` ``[M, H]`` enter as
    one more source; ADDITIVE writes ``stream + gate * r``; NORM writes ``RMSNorm(x) * nw``;
    STORE_SCORES the scores ``[N, M, H]``, STORE_RSTD each source's key rstd ``[N, M]``, STORE_ROUTED
    ``r`` into ``routed_ptr``. Layout constexprs: :func:`lit_mhar.kernels.dispatch.vector_tile`.
    """
    # Every tensor is 4-D (site, token, head, lane) and every sum keeps its axis, so that all of
    # them share one register layout: no tile is ever shuffled through shared memory.
    # One program per (token tile, group of BS sites), the group varying fastest: the programs of
    # one tile run together, so each source tile comes from HBM once and from L2 for the other
    # groups; within a group a source tile is loaded, converted and normalised once for BS sites.
    pid = tl.program_id(0)
    n_groups = (n_sites + BS - 1) // BS
    s_i = tl.arange(0, BS)[:, None, None, None] + (pid % n_groups) * BS
    rows = tl.cast(pid // n_groups, tl.int64) * BM + tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i  # [1, 1, BH, BDH] channel of (head, lane)
    cmask = (h_i < H) & (j_i < DH)
    smask = s_i < n_sites
    x_off = rows * D + col  # [1, BM, BH, BDH] int64
    xmask = (rows < M) & cmask
    hm_off = rows * H + h_i  # [1, BM, BH, 1]
    hmask = (rows < M) & (h_i < H)
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [BS, 1, BH, BDH] q * g
    if DT > 0:  # a second tile for each head's last DT channels (DH = BDH + DT): no padding lanes
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        x_off_t = rows * D + col_t
        xmask_t = hmask
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)  # [BS, 1, BH, DT]

    if HAS_PRIOR:  # the prior enters as a source with score lse_prior and value o (BS == 1)
        m_i = tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0)
        l_i = tl.full([BS, BM, BH, 1], 1.0, tl.float32)
        acc = tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
        if DT > 0:
            acc_t = tl.load(prior_ptr + x_off_t, mask=xmask_t, other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BS, BM, BH, 1], float("-inf"), tl.float32)
        l_i = tl.full([BS, BM, BH, 1], 0.0, tl.float32)
        acc = tl.full([BS, BM, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            acc_t = tl.full([BS, BM, BH, DT], 0.0, tl.float32)

    # The next source is loaded while this one is worked on (the offset table has a spare entry; a
    # load past the last source is masked off by rows).
    off = tl.multiple_of(tl.load(src_offs), ALIGN)
    v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
    if DT > 0:
        v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
    for i in range(n_src):
        v = v_next.to(tl.float32)  # [1, BM, BH, BDH]
        off = tl.multiple_of(tl.load(src_offs + i + 1), ALIGN)
        v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
        sq = tl.reduce(tl.reduce(v * v, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)  # [1, BM, 1, 1]
        s = tl.reduce(w * v, 3, ADD, keep_dims=True)  # [BS, BM, BH, 1]
        if DT > 0:
            v_t = v_next_t.to(tl.float32)  # [1, BM, BH, DT]
            v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
            sq += tl.reduce(tl.reduce(v_t * v_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            s += tl.reduce(w_t * v_t, 3, ADD, keep_dims=True)
        rstd = 1.0 / tl.sqrt(sq / D + eps)
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward, written by the first group's programs
            tl.store(rstd_ptr + tl.cast(i, tl.int64) * M + rows, rstd, mask=rows < tl.where(pid % n_groups == 0, M, 0))
        s = s * rstd
        if STORE_SCORES:
            tl.store(scores_ptr + tl.cast(i, tl.int64) * M * H + hm_off, s, mask=hmask)
        m_new = tl.maximum(m_i, s)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * scale + p
        acc = acc * scale + p * v
        if DT > 0:
            acc_t = acc_t * scale + p * v_t
        m_i = m_new

    routed = acc / l_i
    if DT > 0:
        routed_t = acc_t / l_i
    tl.store(lse_ptr + s_i.to(tl.int64) * M * H + hm_off, m_i + tl.log(l_i), mask=smask & hmask)
    if STORE_ROUTED:  # r as well (fused norm, BS == 1; before the additive form's stream and gate), for a one-pass backward
        tl.store(routed_ptr + x_off, routed.to(routed_ptr.dtype.element_ty), mask=xmask)
        if DT > 0:
            tl.store(routed_ptr + x_off_t, routed_t.to(routed_ptr.dtype.element_ty), mask=xmask_t)
    if ADDITIVE:  # Delta AttnRes: out = stream + gate * r (BS == 1)
        routed = (
            tl.load(stream_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            + tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32) * routed
        )
        if DT > 0:
            routed_t = (
                tl.load(stream_ptr + x_off_t, mask=xmask_t, other=0.0).to(tl.float32)
                + tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32) * routed_t
            )
    if NORM:  # the next sublayer's RMSNorm over the whole width (BS == 1): y = out * rstd(out) * weight
        sq_n = tl.reduce(tl.reduce(routed * routed, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
        if DT > 0:
            sq_n += tl.reduce(tl.reduce(routed_t * routed_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
        n_rstd = 1.0 / tl.sqrt(sq_n / D + norm_eps)  # [1, BM, 1, 1]
        routed = routed * n_rstd * tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if DT > 0:
            routed_t = routed_t * n_rstd * tl.load(nw_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
    o_off = tl.load(out_offs + s_i, mask=smask, other=0)  # [BS, 1, 1, 1]
    tl.store(out_base + o_off + x_off, routed.to(out_base.dtype.element_ty), mask=smask & xmask)
    if DT > 0:
        tl.store(out_base + o_off + x_off_t, routed_t.to(out_base.dtype.element_ty), mask=smask & xmask_t)


