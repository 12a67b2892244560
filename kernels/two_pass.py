"""The two-pass backward (``bwd``): merges, the fused RMSNorm, and one site over few sources.

Per tile of tokens the kernel recomputes each source's key rstd, score ``s_i`` and weight
``alpha_i = exp(s_i - lse)`` from the sources (nothing of size ``[N, tokens, d]`` was saved) in two
passes: the first forms ``D = sum_i alpha_i <dr, v_i>_h`` (with a fused norm: r itself, then the
norm's backward, then ``D = <dr, r>_h``), the second writes every source gradient

    ds_i = alpha_i * (<dr, v_i>_h - D + dlse)
    dv_i = alpha_i * dr + rstd_i * (ds_i * w - rstd_i * v_i * sum_h ds_i s_i / d)
    dw  += sum_tokens ds_i * rstd_i * v_i        (w = q * g; dq = dw * g, dg = dw * q)

(AttnRes eqs. 2-6 differentiated; Delta AttnRes: ``dr = gate * dout``, ``d gate = sum dout * r``).
A prior enters like a source whose score is its lse. ``dw`` and the other parameter gradients are
summed per persistent program in registers and written as partials a fixed-order ``sum`` reduces:
no atomics, bit-identical gradients run to run. Every row offset is int64.
"""

import triton
import triton.language as tl

from lit_mhar.kernels.common import ADD, round_bf16


@triton.jit
def _merge_tile(
    rows, col, cmask, s_i, smask, h_i, g_base, g_off, lse_ptr, prior_ptr, prior_lse_ptr, src_base, src1, M, D: tl.constexpr, H: tl.constexpr,
):
    """Offsets and loads of one tile of a one-source merge (``PREFETCH_TILE``): ``(x_off, hm_off,
    hmask, dout, lse, prior, prior_lse, source)``, the values in their stored dtypes."""
    x = rows * D + col
    hm = rows * H + h_i
    hmask = (rows < M) & (h_i < H)
    dout = tl.load(g_base + g_off + x, mask=smask & (rows < M) & cmask, other=0.0)
    lse = tl.load(lse_ptr + s_i.to(tl.int64) * M * H + hm, mask=smask & hmask, other=0.0)
    po = tl.load(prior_ptr + x, mask=(rows < M) & cmask, other=0.0)
    plse = tl.load(prior_lse_ptr + hm, mask=hmask, other=0.0)
    v = tl.load(src_base + src1 + x, mask=(rows < M) & cmask, other=0.0)
    return x, hm, hmask, dout, lse, po, plse, v


@triton.jit
def _route_bwd(
    src_base, src_offs, n_src, n_rep, pre_offs,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    gate_ptr,
    prior_ptr, prior_lse_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc,
    dw_ptr, dgate_ptr, dprior_ptr, dprior_lse_ptr,
    nw_ptr, dnw_ptr, stream_ptr, dstream_ptr, dstream_acc_ptr,
    M, eps, num_tiles, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_DLSE: tl.constexpr, NORM: tl.constexpr, ACC: tl.constexpr,
    STREAM_ACC: tl.constexpr, REPLAY: tl.constexpr, REBUILD: tl.constexpr, SAVED_ROUTED: tl.constexpr, N_EARLIER: tl.constexpr,
    KEEP_SOURCE: tl.constexpr, PREFETCH_TILE: tl.constexpr, LONE_SOURCE: tl.constexpr,
):
    """Backward of one site (or a short pass) over ``n_src`` sources: merges, the fused norm, one
    site over fewer sources than the site loop takes. Persistent programs over tiles of ``BM``
    tokens, two passes over the sources per tile (pass one: ``D``, or r for the norm's backward;
    pass two: every source gradient); ``dw``, the gate's and the norm weight's gradients are
    written as per-program partials ``[programs, ..., D]`` the host sums in a fixed order.
    """
    # Source i's gradient goes to dsrc_base + dsrc_offs[i]; with ACC, sources i < n_acc add to it
    # acc_base + acc_offs[i] (a gradient sink's sum so far, see _route_bwd_sources). With
    # STREAM_ACC the stream's gradient (fused norm, additive form) adds dstream_acc_ptr's likewise.
    # With REPLAY (fused norm, additive form, a float32 stream) stream_ptr holds the stream at the
    # group's start and the stream is that plus the sources, added in order in float32 as the
    # forward's torch additions did (bit-identical), while pass one reads the sources anyway;
    # N_EARLIER > 0 earlier outputs (src_base + pre_offs[k], the sublayers between that start and the
    # group's, in order) are added to it first (unrolled: their loads do not wait on each other).
    # With REBUILD too (block routing, n_src == 1) the table holds n_rep tensors, a block's outputs:
    # the one source is their running sum, rebuilt in both passes and rounded to the sources' dtype
    # after each addition as torch's additions round (bf16: to nearest even, on the bits, since
    # the interpreter's cast truncates), and the stream adds the outputs, not the running sum.
    # With SAVED_ROUTED (fused norm, BS == 1, not REBUILD) prior_ptr holds the routed value r the
    # forward stored (STORE_ROUTED), not the prior: the norm's backward and D = <dr, r>_h need no
    # pass over the sources with scores (with REPLAY, one that only adds them to the stream), so
    # one pass writes the source gradients, and the prior's lse gradient p_alpha (<dr, o>_h - D)
    # is formed as D - sum_i alpha_i <dr, v_i>_h - p_alpha D after it.
    # With KEEP_SOURCE (exactly one source, DT == 0, neither REBUILD nor SAVED_ROUTED: block
    # routing's merges) pass one keeps the source, its rstd, scores and weights in registers for
    # pass two, which then neither reloads the source nor reduces its squares and scores over the
    # width again. With PREFETCH_TILE too (the replacement form's fused-norm merge) each program
    # loads its next tile's inputs (output gradient, lse, prior and its lse, the source, the sink's
    # addend) while it computes on this one's. With LONE_SOURCE (one source, no prior) the softmax
    # runs over one element: its weight is exactly 1, so the score's gradient is the lse's alone
    # (exactly 0 without one), where exp(s - lse) of a recomputed score would leave rounding.
    # Every lane tensor has a twin ``*_t`` over each head's last DT channels when DT > 0 (see
    # forward.py); sums over a head add the two.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s_i = tl.arange(0, BS)[:, None, None, None]
    m_i = tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    smask = s_i < n_sites
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [BS, 1, BH, BDH]
    s_1d = tl.arange(0, BS)
    g_off = tl.multiple_of(tl.load(g_offs + s_1d, mask=s_1d < n_sites, other=0), G_ALIGN)[:, None, None, None]
    dw_acc = tl.full([BS, 1, BH, BDH], 0.0, tl.float32)
    if DT > 0:
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)
        dw_acc_t = tl.full([BS, 1, BH, DT], 0.0, tl.float32)
    if ADDITIVE:
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dgate_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dgate_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)
    if NORM:  # the fused RMSNorm's weight (BS == 1, a prior; either form)
        nw = tl.load(nw_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dnw_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            nw_t = tl.load(nw_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dnw_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)

    if PREFETCH_TILE:  # this program's first tile (the loop loads each next one)
        src1 = tl.multiple_of(tl.load(src_offs), ALIGN)
        if ACC:
            acc1 = tl.multiple_of(tl.load(acc_offs), ALIGN)
        rows_n = tl.cast(pid, tl.int64) * BM + m_i
        x_n, hm_n, hmask_n, dout_n, lse_n, po_n, plse_n, v1_n = _merge_tile(
            rows_n, col, cmask, s_i, smask, h_i, g_base, g_off, lse_ptr, prior_ptr, prior_lse_ptr, src_base, src1, M, D, H,
        )
        if ACC:
            acc_n = tl.load(acc_base + acc1 + x_n, mask=(rows_n < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
        if HAS_DLSE:
            dlse_n = tl.load(dlse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)

    # Persistent programs: tile pid, pid + nprog, ... so that dw is summed in registers over many
    # tiles and each program writes one partial; the order is fixed, hence deterministic.
    for tile in range(pid, num_tiles, nprog):
        rows = tl.cast(tile, tl.int64) * BM + m_i
        x_off = rows * D + col
        xmask = (rows < M) & cmask
        hm_off = rows * H + h_i
        hmask = (rows < M) & (h_i < H)
        sh_off = s_i.to(tl.int64) * M * H + hm_off  # [BS, BM, BH, 1]
        shmask = smask & hmask
        if PREFETCH_TILE:  # this tile's inputs, loaded during the last one; the next tile's issued now
            dout = dout_n.to(tl.float32)
            lse = lse_n
            po = po_n.to(tl.float32)
            p_alpha = tl.exp(plse_n - lse)
            v1 = v1_n.to(tl.float32)
            if ACC:
                acc = acc_n
            if HAS_DLSE:
                dlse = dlse_n
            rows_n = rows + tl.cast(nprog, tl.int64) * BM
            x_n, hm_n, hmask_n, dout_n, lse_n, po_n, plse_n, v1_n = _merge_tile(
                rows_n, col, cmask, s_i, smask, h_i, g_base, g_off, lse_ptr, prior_ptr, prior_lse_ptr, src_base, src1, M, D, H,
            )
            if ACC:
                acc_n = tl.load(acc_base + acc1 + x_n, mask=(rows_n < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
            if HAS_DLSE:
                dlse_n = tl.load(dlse_ptr + s_i.to(tl.int64) * M * H + hm_n, mask=smask & hmask_n, other=0.0)
        else:
            dout = tl.load(g_base + g_off + x_off, mask=smask & xmask, other=0.0).to(tl.float32)  # [BS, BM, BH, BDH]
        if ADDITIVE:
            dr = dout * gate
        else:
            dr = dout
        if DT > 0:
            x_off_t = rows * D + col_t
            dout_t = tl.load(g_base + g_off + x_off_t, mask=shmask, other=0.0).to(tl.float32)  # [BS, BM, BH, DT]
            if ADDITIVE:
                dr_t = dout_t * gate_t
            else:
                dr_t = dout_t
        if not PREFETCH_TILE:
            lse = tl.load(lse_ptr + sh_off, mask=shmask, other=0.0)

        # pass 1: D = sum_i alpha_i <dr, v_i>_h (and r itself for the gate's gradient); with NORM
        # r itself, from which dr (the norm's backward) and then D = <dr, r>_h follow
        dsum = tl.full([BS, BM, BH, 1], 0.0, tl.float32)
        if ADDITIVE or NORM:
            racc = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
            if DT > 0:
                racc_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
        if NORM and ADDITIVE:  # the stream (REPLAY: at the group's start, the sources added below)
            hs = tl.load(stream_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            if DT > 0:
                hs_t = tl.load(stream_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if REPLAY:  # from an earlier group's start: the outputs in between first, in order
                for k in tl.static_range(N_EARLIER):
                    p_off = tl.multiple_of(tl.load(pre_offs + k), ALIGN)
                    hs = hs + tl.load(src_base + p_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    if DT > 0:
                        hs_t = hs_t + tl.load(src_base + p_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
        if SAVED_ROUTED:  # r itself: no pass over the sources with scores before the norm's backward
            p_alpha = tl.exp(tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0) - lse)
            racc += tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
            if DT > 0:
                racc_t += tl.load(prior_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if REPLAY:  # the additive form's stream: its group's start plus the sources, in order, as pass one adds them
                for i in range(n_src):
                    r_off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
                    hs = hs + tl.load(src_base + r_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    if DT > 0:
                        hs_t = hs_t + tl.load(src_base + r_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
        elif HAS_PRIOR:
            if not PREFETCH_TILE:
                po = tl.load(prior_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
                p_alpha = tl.exp(tl.load(prior_lse_ptr + hm_off, mask=hmask, other=0.0) - lse)
            if DT > 0:
                po_t = tl.load(prior_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
            if not NORM:
                p_a = tl.reduce(dr * po, 3, ADD, keep_dims=True)
                if DT > 0:
                    p_a += tl.reduce(dr_t * po_t, 3, ADD, keep_dims=True)
                dsum += p_alpha * p_a
            if ADDITIVE or NORM:
                racc += tl.reduce(p_alpha * po, 0, ADD, keep_dims=True)
                if DT > 0:
                    racc_t += tl.reduce(p_alpha * po_t, 0, ADD, keep_dims=True)
        if KEEP_SOURCE:  # pass one over the one source, whose values pass two reuses
            if not PREFETCH_TILE:
                off = tl.multiple_of(tl.load(src_offs), ALIGN)
                v1 = tl.load(src_base + off + x_off, mask=xmask, other=0.0).to(tl.float32)
            sq1 = tl.reduce(tl.reduce(v1 * v1, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            rstd1 = 1.0 / tl.sqrt(sq1 / D + eps)  # [1, BM, 1, 1]
            s1 = tl.reduce(w * v1, 3, ADD, keep_dims=True) * rstd1  # [BS, BM, BH, 1]
            if LONE_SOURCE:
                alpha1 = tl.where(shmask, 1.0, 0.0)
            else:
                alpha1 = tl.where(shmask, tl.exp(s1 - lse), 0.0)
            if not NORM:
                dsum += alpha1 * tl.reduce(dr * v1, 3, ADD, keep_dims=True)
            if ADDITIVE or NORM:
                racc += tl.reduce(alpha1 * v1, 0, ADD, keep_dims=True)
            if REPLAY:
                hs = hs + v1
        elif not SAVED_ROUTED:  # pass one proper
            off = tl.multiple_of(tl.load(src_offs), ALIGN)
            v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
            if DT > 0:
                v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
            if REBUILD:  # source 0: the running sum of the table's n_rep outputs; the stream adds each
                hs = hs + v_next.to(tl.float32)
                if DT > 0:
                    hs_t = hs_t + v_next_t.to(tl.float32)
                for k in range(1, n_rep):
                    o_off = tl.multiple_of(tl.load(src_offs + k), ALIGN)
                    o = tl.load(src_base + o_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                    hs = hs + o
                    run_s = v_next.to(tl.float32) + o
                    if src_base.dtype.element_ty == tl.bfloat16:  # round to nearest even, as torch's addition
                        run_s = round_bf16(run_s)
                    v_next = run_s.to(src_base.dtype.element_ty)
                    if DT > 0:
                        o_t = tl.load(src_base + o_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                        hs_t = hs_t + o_t
                        run_t = v_next_t.to(tl.float32) + o_t
                        if src_base.dtype.element_ty == tl.bfloat16:
                            run_t = round_bf16(run_t)
                        v_next_t = run_t.to(src_base.dtype.element_ty)
            for i in range(n_src):
                v = v_next.to(tl.float32)
                off = tl.multiple_of(tl.load(src_offs + i + 1), ALIGN)
                v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
                sq = tl.reduce(tl.reduce(v * v, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                sc = tl.reduce(w * v, 3, ADD, keep_dims=True)
                if not NORM:
                    a = tl.reduce(dr * v, 3, ADD, keep_dims=True)
                if DT > 0:
                    v_t = v_next_t.to(tl.float32)
                    v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                    sq += tl.reduce(tl.reduce(v_t * v_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                    sc += tl.reduce(w_t * v_t, 3, ADD, keep_dims=True)
                    if not NORM:
                        a += tl.reduce(dr_t * v_t, 3, ADD, keep_dims=True)
                rstd = 1.0 / tl.sqrt(sq / D + eps)
                if LONE_SOURCE:
                    alpha = tl.full([BS, BM, BH, 1], 1.0, tl.float32)
                else:
                    alpha = tl.exp(sc * rstd - lse)
                if not NORM:
                    dsum += alpha * a
                if ADDITIVE or NORM:
                    racc += tl.reduce(alpha * v, 0, ADD, keep_dims=True)
                    if DT > 0:
                        racc_t += tl.reduce(alpha * v_t, 0, ADD, keep_dims=True)
                if REPLAY:
                    if not REBUILD:  # (REBUILD: the stream added the outputs above)
                        hs = hs + v
                        if DT > 0:
                            hs_t = hs_t + v_t
        if NORM:
            # the norm's backward: dx = rstd_n * (weight * dy - x^ <weight * dy, x^> / d), x^ = rstd_n * x
            # over the whole width, x = r (or stream + gate * r); then dout = dx stands for the
            # gradient of the op's output before the norm, dr = dx (or gate * dx), D = <dr, r>_h
            # and the prior's <dr, o>_h
            if ADDITIVE:
                xn = hs + gate * racc
                if DT > 0:
                    xn_t = hs_t + gate_t * racc_t
            else:
                xn = racc
                if DT > 0:
                    xn_t = racc_t
            sq_n = tl.reduce(tl.reduce(xn * xn, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            if DT > 0:
                sq_n += tl.reduce(tl.reduce(xn_t * xn_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            n_rstd = 1.0 / tl.sqrt(sq_n / D + norm_eps)  # [1, BM, 1, 1]
            gy = dout * nw
            c_n = tl.reduce(tl.reduce(gy * xn, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            dnw_acc += tl.reduce(dout * (xn * n_rstd), 1, ADD, keep_dims=True)
            if DT > 0:
                gy_t = dout_t * nw_t
                c_n += tl.reduce(tl.reduce(gy_t * xn_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                dnw_acc_t += tl.reduce(dout_t * (xn_t * n_rstd), 1, ADD, keep_dims=True)
            c_n = c_n * (n_rstd * n_rstd / D)
            dout = n_rstd * (gy - xn * c_n)
            if DT > 0:
                dout_t = n_rstd * (gy_t - xn_t * c_n)
            if ADDITIVE:
                if STREAM_ACC:
                    ds_sum = dout + tl.load(dstream_acc_ptr + x_off, mask=xmask, other=0.0).to(tl.float32)
                    tl.store(dstream_ptr + x_off, ds_sum.to(dstream_ptr.dtype.element_ty), mask=xmask)
                else:
                    tl.store(dstream_ptr + x_off, dout.to(dstream_ptr.dtype.element_ty), mask=xmask)
                dr = dout * gate
                if DT > 0:
                    if STREAM_ACC:
                        ds_sum_t = dout_t + tl.load(dstream_acc_ptr + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                        tl.store(dstream_ptr + x_off_t, ds_sum_t.to(dstream_ptr.dtype.element_ty), mask=hmask)
                    else:
                        tl.store(dstream_ptr + x_off_t, dout_t.to(dstream_ptr.dtype.element_ty), mask=hmask)
                    dr_t = dout_t * gate_t
            else:
                dr = dout
                if DT > 0:
                    dr_t = dout_t
            dsum += tl.reduce(dr * racc, 3, ADD, keep_dims=True)
            if DT > 0:
                dsum += tl.reduce(dr_t * racc_t, 3, ADD, keep_dims=True)
            if SAVED_ROUTED:
                d_r = dsum  # D = <dr, r>_h, before the lse's gradient enters
                a_sum = tl.full([BS, BM, BH, 1], 0.0, tl.float32)  # sum_i alpha_i <dr, v_i>_h, from pass two
            elif HAS_PRIOR:  # (route_norm: a fused norm over sources alone)
                p_a = tl.reduce(dr * po, 3, ADD, keep_dims=True)
                if DT > 0:
                    p_a += tl.reduce(dr_t * po_t, 3, ADD, keep_dims=True)
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            if PREFETCH_TILE:
                dsum -= dlse
            else:
                dsum -= tl.load(dlse_ptr + sh_off, mask=shmask, other=0.0)
        if ADDITIVE:
            dgate_acc += tl.reduce(tl.reduce(dout, 0, ADD, keep_dims=True) * racc, 1, ADD, keep_dims=True)
            if DT > 0:
                dgate_acc_t += tl.reduce(tl.reduce(dout_t, 0, ADD, keep_dims=True) * racc_t, 1, ADD, keep_dims=True)
        if HAS_PRIOR:
            tl.store(dprior_ptr + x_off, (p_alpha * dr).to(dprior_ptr.dtype.element_ty), mask=xmask)
            if DT > 0:
                tl.store(dprior_ptr + x_off_t, (p_alpha * dr_t).to(dprior_ptr.dtype.element_ty), mask=hmask)
            if not SAVED_ROUTED:
                tl.store(dprior_lse_ptr + hm_off, p_alpha * (p_a - dsum), mask=hmask)

        # pass 2: every source gradient, and dw summed over this program's tokens
        if KEEP_SOURCE:
            if ACC and not PREFETCH_TILE:
                a_off = tl.multiple_of(tl.load(acc_offs), ALIGN)
                acc = tl.load(acc_base + a_off + x_off, mask=(rows < tl.where(n_acc > 0, M, 0)) & cmask, other=0.0)
            ds = alpha1 * (tl.reduce(dr * v1, 3, ADD, keep_dims=True) - dsum)
            t = tl.reduce(tl.reduce(ds * s1, 2, ADD, keep_dims=True), 0, ADD, keep_dims=True) / D  # [1, BM, 1, 1]
            dv = tl.reduce(alpha1 * dr, 0, ADD, keep_dims=True)  # through the weighted sum
            dv += rstd1 * tl.reduce(ds * w, 0, ADD, keep_dims=True)  # through the score
            dv -= v1 * (rstd1 * rstd1 * t)  # through the key's rstd
            if ACC:
                dv += acc.to(tl.float32)
            d_off = tl.multiple_of(tl.load(dsrc_offs), ALIGN)
            tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
            dw_acc += tl.reduce(ds * (v1 * rstd1), 1, ADD, keep_dims=True)
        n_two = n_src  # pass two's loop: none after KEEP_SOURCE's
        if KEEP_SOURCE:
            n_two = 0
        off = tl.multiple_of(tl.load(src_offs), ALIGN)
        v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_two > 0, M, 0)) & cmask, other=0.0)
        if DT > 0:
            v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_two > 0, M, 0)) & (h_i < H), other=0.0)
        if REBUILD:  # the running sum again, as in pass one
            for k in range(1, n_rep):
                o_off = tl.multiple_of(tl.load(src_offs + k), ALIGN)
                run_s = v_next.to(tl.float32) + tl.load(src_base + o_off + x_off, mask=xmask, other=0.0).to(tl.float32)
                if src_base.dtype.element_ty == tl.bfloat16:
                    run_s = round_bf16(run_s)
                v_next = run_s.to(src_base.dtype.element_ty)
                if DT > 0:
                    run_t = v_next_t.to(tl.float32) + tl.load(src_base + o_off + x_off_t, mask=hmask, other=0.0).to(tl.float32)
                    if src_base.dtype.element_ty == tl.bfloat16:
                        run_t = round_bf16(run_t)
                    v_next_t = run_t.to(src_base.dtype.element_ty)
        for i in range(n_two):
            v = v_next.to(tl.float32)
            if ACC:  # the sink's addend, issued before the products: its latency overlaps them
                a_off = tl.multiple_of(tl.load(acc_offs + i), ALIGN)
                acc_rows = rows < tl.where(i < n_acc, M, 0)
                acc = tl.load(acc_base + a_off + x_off, mask=acc_rows & cmask, other=0.0)
                if DT > 0:
                    acc_t = tl.load(acc_base + a_off + x_off_t, mask=acc_rows & (h_i < H), other=0.0)
            off = tl.multiple_of(tl.load(src_offs + i + 1), ALIGN)
            v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
            sq = tl.reduce(tl.reduce(v * v, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
            sc = tl.reduce(w * v, 3, ADD, keep_dims=True)
            a = tl.reduce(dr * v, 3, ADD, keep_dims=True)
            if DT > 0:
                v_t = v_next_t.to(tl.float32)
                v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                sq += tl.reduce(tl.reduce(v_t * v_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                sc += tl.reduce(w_t * v_t, 3, ADD, keep_dims=True)
                a += tl.reduce(dr_t * v_t, 3, ADD, keep_dims=True)
            rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
            s = sc * rstd  # [BS, BM, BH, 1]
            if LONE_SOURCE:
                alpha = tl.where(shmask, 1.0, 0.0)
            else:
                alpha = tl.where(shmask, tl.exp(s - lse), 0.0)
            ds = alpha * (a - dsum)
            if SAVED_ROUTED:
                a_sum += alpha * a
            t = tl.reduce(tl.reduce(ds * s, 2, ADD, keep_dims=True), 0, ADD, keep_dims=True) / D  # [1, BM, 1, 1]
            dv = tl.reduce(alpha * dr, 0, ADD, keep_dims=True)  # through the weighted sum
            dv += rstd * tl.reduce(ds * w, 0, ADD, keep_dims=True)  # through the score
            dv -= v * (rstd * rstd * t)  # through the key's rstd
            d_off = tl.multiple_of(tl.load(dsrc_offs + i), ALIGN)
            if ACC:
                dv += acc.to(tl.float32)
            tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
            dw_acc += tl.reduce(ds * (v * rstd), 1, ADD, keep_dims=True)
            if DT > 0:
                dv_t = tl.reduce(alpha * dr_t, 0, ADD, keep_dims=True)
                dv_t += rstd * tl.reduce(ds * w_t, 0, ADD, keep_dims=True)
                dv_t -= v_t * (rstd * rstd * t)
                if ACC:
                    dv_t += acc_t.to(tl.float32)
                tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=hmask)
                dw_acc_t += tl.reduce(ds * (v_t * rstd), 1, ADD, keep_dims=True)
        if SAVED_ROUTED:  # p_alpha <dr, o>_h = D - sum_i alpha_i <dr, v_i>_h, since r = p_alpha o + sum_i alpha_i v_i
            tl.store(dprior_lse_ptr + hm_off, d_r - a_sum - p_alpha * dsum, mask=hmask)

    tl.store(dw_ptr + (pid * n_sites + s_i).to(tl.int64) * D + col, dw_acc, mask=smask & cmask)
    if DT > 0:
        tl.store(dw_ptr + (pid * n_sites + s_i).to(tl.int64) * D + col_t, dw_acc_t, mask=smask & (h_i < H))
    if ADDITIVE:
        tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col, dgate_acc, mask=cmask)
        if DT > 0:
            tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col_t, dgate_acc_t, mask=h_i < H)
    if NORM:
        tl.store(dnw_ptr + tl.cast(pid, tl.int64) * D + col, dnw_acc, mask=cmask)
        if DT > 0:
            tl.store(dnw_ptr + tl.cast(pid, tl.int64) * D + col_t, dnw_acc_t, mask=h_i < H)
