"""The tensor-core kernels of phase one (bf16): its forward (``fwd_sites_mix``, ``fwd_sites_dot``)
and both passes of its site loop (``bwd_stats_dot``, ``bwd_sources_dot``).

A tile of ``BM`` tokens is held as rows (token, site) ``[BM*BS, DHP]`` (the sites' weights
``W = q * g`` repeated per token, or their output gradients dR) and rows (token, source)
``[BM*BN, DHP]`` (V), every source of a token in one tile, so the scores and the gradient's
products are plain ``tl.dot`` products per head,

    sc = rstd * W V^T,   a = dR V^T,   out = alpha V,   dw = (ds * rstd) V,   dv = alpha^T dR + (ds * rstd)^T W

of which only the blocks where both rows' tokens agree are used (``where``, not a product with a
zero weight: a non-finite value of one token stays in its rows). Float32 factors (W, the weights,
the coefficients) enter as bf16x2 splits, hi + lo (:func:`lit_mhar.kernels.common.split`): each
product exact to about 2^-17 relative, the sums float32. A head width that is a power of two plus
a smaller one of at least 16 (160 = 128 + 32) is two column tiles, DHP + DT; another is padded to a
power of two (masked columns). ``DOT_F32`` (the interpreter, whose bf16 ``tl.dot`` is wrong)
multiplies the same bf16 values in float32. Programs stride over the token tiles (one wave).
"""

import triton
import triton.language as tl

from lit_mhar.kernels.common import ADD, MAX, dot_scores, source_grad_dot, split, split_dot


@triton.jit
def _route_fwd_sites_mix(
    src_base, src_offs, n_src, w_ptr, wlo_ptr, n_sites, out_base, out_offs, lse_ptr, rstd_ptr, M, eps, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, STORE_RSTD: tl.constexpr, DOT_F32: tl.constexpr,
):
    # What ``_route_fwd_sites_dot`` computes (a head width that is one power-of-two tile): the
    # scores on tensor cores without repeating the weights per token, the weighted sum on the vector
    # units. Per tile of BM tokens, after the key rstd (each (token, source) row's squares summed
    # over the width), per head h:
    #   sc = rstd * W V^T                          [BS, BM*BN]: W [BS, DH] (sites padded to BS >= 16
    #                                              rows, bf16x2 split), V [BM*BN, DH] rows (token, source)
    #   alpha = softmax over each token's BN columns  [BS, BM, BN], the padding sites zeroed, then
    #                                              folded to BSO = pow2(sites) rows and laid out [BM, BSO, BN]
    #   out[t, s] = sum_i alpha[t, s, i] v_i[t]    [BM, BSO, DH] float32, source by source
    # Every product of the score dot is used (the block-diagonal form wastes BM - 1 of every BM), the
    # weighted sum is float32 products and sums (alpha not split into bf16 halves) and mixes no
    # tokens, so a non-finite value stays in its token's outputs without masking. Each source tile
    # is read three times per tile (the rstd, the score dot, the weighted sum): once from memory,
    # then mostly from cache.
    pid = tl.program_id(0)
    q = tl.arange(0, BM * BN)  # rows (token, source) of the score dot
    j_q = q % BN
    m_q = q // BN
    jmask = j_q < n_src
    c = tl.arange(0, DH)
    s_w = tl.arange(0, BS)
    wmask = s_w[:, None] < n_sites
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    m_1 = tl.arange(0, BM)
    s_o = tl.arange(0, BSO)[None, :, None]  # [1, BSO, 1]
    o_off = tl.load(out_offs + s_o, mask=s_o < n_sites, other=0)  # [1, BSO, 1]
    j3 = tl.arange(0, BN)[None, None, :]  # [1, 1, BN]
    for tile in range(pid, num_tiles, progs):
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        qmask = jmask & (rows_q < M)
        rows_1 = tl.cast(tile, tl.int64) * BM + m_1  # [BM]
        tmask = rows_1 < M
        sq = tl.full([BM * BN], 0.0, tl.float32)
        for h in range(H):
            v = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
            sq += tl.reduce(v * v, 1, ADD)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [BM*BN]
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward
            tl.store(rstd_ptr + j_q.to(tl.int64) * M + rows_q, rstd, mask=qmask)
        rstd3 = tl.reshape(rstd, [BM, BN])[None, :, :]  # [1, BM, BN]
        live = (j3 < n_src) & tmask[None, :, None]  # [1, BM, BN]
        for h in range(H):
            col = h * DH + c  # [DH]
            w = tl.load(w_ptr + s_w[:, None] * D + col[None, :], mask=wmask, other=0.0)  # [BS, DH] bf16: W's hi half
            w_lo = tl.load(wlo_ptr + s_w[:, None] * D + col[None, :], mask=wmask, other=0.0)
            v = tl.load(src_base + off + rows_q[:, None] * D + col[None, :], mask=qmask[:, None], other=0.0)  # [BM*BN, DH]
            sc = split_dot(w, w_lo, tl.trans(v), None, DOT_F32)
            sc3 = tl.reshape(sc, [BS, BM, BN]) * rstd3
            mx = tl.reduce(tl.where(live, sc3, float("-inf")), 2, MAX)  # [BS, BM]
            p = tl.where(live, tl.exp(sc3 - mx[:, :, None]), 0.0)
            l = tl.reduce(p, 2, ADD)  # [BS, BM]
            tl.store(lse_ptr + (s_w[:, None].to(tl.int64) * M + rows_1[None, :]) * H + h, mx + tl.log(tl.where(l > 0, l, 1.0)),
                     mask=(s_w[:, None] < n_sites) & tmask[None, :])
            alpha = tl.where(s_w[:, None, None] < n_sites, p / tl.where(l > 0, l, 1.0)[:, :, None], 0.0)  # [BS, BM, BN]
            if BS > BSO:  # the padding rows are zero: fold them away
                alpha = tl.reduce(tl.reshape(alpha, [BS // BSO, BSO, BM, BN]), 0, ADD)
            alpha = tl.permute(alpha, (1, 0, 2))  # [BM, BSO, BN]
            acc = tl.full([BM, BSO, DH], 0.0, tl.float32)
            for i in range(n_src):
                a_i = tl.reduce(tl.where(j3 == i, alpha, 0.0), 2, ADD)  # [BM, BSO]
                i_off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
                v_i = tl.load(src_base + i_off + rows_1[:, None] * D + col[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)  # [BM, DH]
                acc += a_i[:, :, None] * v_i[:, None, :]
            tl.store(out_base + o_off + rows_1[:, None, None] * D + col[None, None, :], acc.to(out_base.dtype.element_ty),
                     mask=(s_o < n_sites) & tmask[:, None, None])


@triton.jit
def _route_fwd_sites_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    out_base, out_offs,
    lse_ptr, rstd_ptr,
    M, eps, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, STORE_RSTD: tl.constexpr, DOT_F32: tl.constexpr,
):
    # Phase one forward on tensor cores (bf16 sources, replacement form, no prior): the outputs of
    # ``_route_fwd`` for all S <= BS sites of a pass, with every N <= BN source of a token in one
    # tile (``dispatch.dot_tile``'s tiles, as in ``_route_bwd_stats_dot``). Program p takes token tiles p,
    # p + progs, ... and, per tile, first sums each (token, source) row's squares over the whole
    # width (the key rstd), then per head h forms
    #   sc = rstd * W V^T,  alpha = softmax over the row's own token,  out = alpha V     [BM*BS, DHP]
    # with W = q * g and alpha as bf16x2 splits (hi + lo). Each source is read once per pass for all
    # sites (twice per tile: the second read, per head, mostly from L2), where the vector kernel
    # reads it once per group of sites. Products across tokens are masked with where, and the
    # values enter alpha V with non-finite entries zeroed: alpha is 0 for other tokens' rows, and
    # 0 * inf would spread an inf to every token of the tile; a token whose own source holds one gets
    # a non-finite score, so its outputs are non-finite as on the vector kernel. With DT > 0 a head's
    # DH = DHP + DT columns are two tiles (``dispatch.dot_lanes``): every product gains its twin over the last
    # DT columns, and no column is padding.
    pid = tl.program_id(0)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # rows (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    if DT > 0:
        c_t = DHP + tl.arange(0, DT)[None, :]  # [1, DT] a head's last DT columns
    smask = s_r < n_sites
    jmask = j_q < n_src
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    o_off = tl.load(out_offs + s_r, mask=smask, other=0)[:, None]  # [BM*BS, 1]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        sq = tl.full([BM * BN], 0.0, tl.float32)
        for h in range(H):
            v = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c_1[None, :], mask=qmask[:, None] & cmask, other=0.0).to(tl.float32)
            sq += tl.reduce(v * v, 1, ADD)
            if DT > 0:
                v_t = tl.load(src_base + off + rows_q[:, None] * D + h * DH + c_t, mask=qmask[:, None], other=0.0).to(tl.float32)
                sq += tl.reduce(v_t * v_t, 1, ADD)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [BM*BN]
        if STORE_RSTD:  # [N, M] float32 for the site loop's backward
            tl.store(rstd_ptr + j_q.to(tl.int64) * M + rows_q, rstd, mask=qmask)
        live = same & rmask[:, None] & qmask[None, :]
        for h in range(H):
            col = h * DH + c_1[None, :]  # [1, DHP]
            w_off = s_r[:, None] * D + col
            w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16: W's hi half
            w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
            v = tl.load(src_base + off + rows_q[:, None] * D + col, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
            sc = split_dot(w, w_lo, tl.trans(v), None, DOT_F32)
            if DT > 0:
                col_t = h * DH + c_t  # [1, DT]
                w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
                w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
                v_t = tl.load(src_base + off + rows_q[:, None] * D + col_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
                sc = split_dot(w_t, w_lo_t, tl.trans(v_t), sc, DOT_F32)
            sc = sc * rstd[None, :]
            m = tl.reduce(tl.where(live, sc, float("-inf")), 1, MAX)  # [BM*BS]
            p = tl.where(live, tl.exp(sc - m[:, None]), 0.0)
            l = tl.reduce(p, 1, ADD)
            tl.store(lse_ptr + (s_r.to(tl.int64) * M + rows_r) * H + h, m + tl.log(l), mask=rmask)
            alpha = p / tl.where(l > 0, l, 1.0)[:, None]
            a_hi, a_lo = split(alpha)
            v = tl.where(tl.abs(v) < float("inf"), v, 0.0)  # other tokens' rows meet alpha = 0
            out = split_dot(a_hi, a_lo, v, None, DOT_F32)
            tl.store(out_base + o_off + rows_r[:, None] * D + col, out.to(out_base.dtype.element_ty), mask=rmask[:, None] & cmask)
            if DT > 0:
                v_t = tl.where(tl.abs(v_t) < float("inf"), v_t, 0.0)
                out_t = split_dot(a_hi, a_lo, v_t, None, DOT_F32)
                tl.store(out_base + o_off + rows_r[:, None] * D + col_t, out_t.to(out_base.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _route_bwd_stats_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    dsum_ptr, dw_ptr, sa_ptr, rstd_ptr, t_ptr,
    M, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, HAS_DLSE: tl.constexpr, DOT_F32: tl.constexpr,
    STORE_SA: tl.constexpr, STORE_T: tl.constexpr,
):
    # Site-loop backward, pass one, on tensor cores (bf16 sources and gradients): the outputs of
    # ``_route_bwd_stats`` (replacement form, saved key rstd, all N <= BN sources in one tile, head
    # width DH padded to DHP, a power of two >= 16, by masked columns). Program (p, h) serves head h
    # of token tiles p, p + progs, ... A tile of BM tokens is held as rows (token, site) [BM*BS, DHP]
    # (the sites' output gradients dR; the weights W = q * g repeated per token) and rows
    # (token, source) [BM*BN, DHP] (V), so
    #   sc = rstd * W V^T,  a = dR V^T                                        [BM*BS, BM*BN]
    # are plain products, of which only the blocks where both rows' tokens agree are used (the
    # rest, BM - 1 of every BM products, is masked off). With every source of a token in the
    # tile, D = sum_i alpha_i a_i - dlse is complete before the weight gradient's product
    #   dw += (ds * rstd) V,  ds = alpha * (a - D)                            [BM*BS, DHP]
    # (rows summed per site at the end): no second pass, no X - D * Y cancellation.
    # The float32 factors (W, the coefficients) enter as a bf16x2 split, hi + lo: each product is
    # exact to about 2^-17 relative, sums are float32; V and dR are bf16 already. The scores are
    # thus within about 2^-17 |<w, v>| rstd of float32 ones (an absolute error in the exponent:
    # harmless next to bf16 outputs, though the query gradient is less exact than the vector
    # kernel's at large score spreads). DOT_F32 (the interpreter, whose bf16 ``tl.dot`` is wrong)
    # multiplies the same bf16 values in float32. STORE_SA writes the scores and a for the vector
    # pass two; STORE_T instead writes this head's share of the key norm's term
    # t = sum_s ds_s * sc_s per (source, token) ([N, M, H] float32) for ``_route_bwd_sources_dot``.
    # DT > 0: a head's last DT columns are a second tile (``_route_fwd_sites_dot``).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # columns (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    col = h * DH + c_1[None, :]  # [1, DHP]
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    smask = s_r < n_sites
    jmask = j_q < n_src
    w_off = s_r[:, None] * D + col
    w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16: W's hi half
    w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
    g_off = tl.multiple_of(tl.load(g_offs + s_r, mask=smask, other=0), G_ALIGN)[:, None]  # [BM*BS, 1]
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    dw_acc = tl.full([BM * BS, DHP], 0.0, tl.float32)
    if DT > 0:
        col_t = h * DH + DHP + tl.arange(0, DT)[None, :]  # [1, DT]
        w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
        w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
        dw_acc_t = tl.full([BM * BS, DT], 0.0, tl.float32)
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r  # token of each row
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        dr = tl.load(g_base + g_off + rows_r[:, None] * D + col, mask=rmask[:, None] & cmask, other=0.0)  # [BM*BS, DHP]
        v = tl.load(src_base + off + rows_q[:, None] * D + col, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
        if DT > 0:
            dr_t = tl.load(g_base + g_off + rows_r[:, None] * D + col_t, mask=rmask[:, None], other=0.0)  # [BM*BS, DT]
            v_t = tl.load(src_base + off + rows_q[:, None] * D + col_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
        sh_r = (s_r.to(tl.int64) * M + rows_r) * H + h  # (site, token, head) of each row
        lse = tl.load(lse_ptr + sh_r, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + j_q.to(tl.int64) * M + rows_q, mask=qmask, other=1.0)[None, :]  # [1, BM*BN]
        sc, a = dot_scores(w, w_lo, dr, v, None, None, DOT_F32)
        if DT > 0:
            sc, a = dot_scores(w_t, w_lo_t, dr_t, v_t, sc, a, DOT_F32)
        sc = sc * rstd
        # where, not a product with a zero weight: a non-finite value of one token stays in its rows
        live = same & rmask[:, None] & qmask[None, :]
        alpha = tl.where(live, tl.exp(sc - lse[:, None]), 0.0)
        if STORE_SA:
            sa_off = ((s_r[:, None].to(tl.int64) * n_src + j_q[None, :]) * M + rows_r[:, None]) * (H * 2) + h * 2
            tl.store(sa_ptr + sa_off, sc, mask=live)
            tl.store(sa_ptr + sa_off + 1, a, mask=live)
        dsum = tl.reduce(tl.where(live, alpha * a, 0.0), 1, ADD)  # [BM*BS]
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            dsum -= tl.load(dlse_ptr + sh_r, mask=rmask, other=0.0)
        tl.store(dsum_ptr + sh_r, dsum, mask=rmask)
        ds = tl.where(live, alpha * (a - dsum[:, None]), 0.0)
        if STORE_T:
            t = tl.reduce(tl.where(live, ds * sc, 0.0), 0, ADD)  # [BM*BN]: this head's share, summed over the sites
            tl.store(t_ptr + (j_q.to(tl.int64) * M + rows_q) * H + h, t, mask=qmask)
        c_hi, c_lo = split(ds * rstd)
        dw_acc = split_dot(c_hi, c_lo, v, dw_acc, DOT_F32)
        if DT > 0:
            dw_acc_t = split_dot(c_hi, c_lo, v_t, dw_acc_t, DOT_F32)
    # rows (token, site) summed per site; partial row of (site, this program's share):
    # [progs, n_sites, d], summed by the host
    dw = tl.reduce(tl.reshape(dw_acc, [BM, BS, DHP]), 0, ADD)  # [BS, DHP]
    s_1 = tl.arange(0, BS)[:, None]
    tl.store(dw_ptr + (tl.cast(pid, tl.int64) * n_sites + s_1) * D + col, dw, mask=(s_1 < n_sites) & cmask)
    if DT > 0:
        dw_t = tl.reduce(tl.reshape(dw_acc_t, [BM, BS, DT]), 0, ADD)  # [BS, DT]
        tl.store(dw_ptr + (tl.cast(pid, tl.int64) * n_sites + s_1) * D + col_t, dw_t, mask=s_1 < n_sites)


@triton.jit
def _route_bwd_sources_dot(
    src_base, src_offs, n_src,
    w_ptr, wlo_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dsum_ptr, rstd_ptr, t_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc,
    M, num_tiles, progs,
    D: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, DT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, DOT_F32: tl.constexpr, ACC: tl.constexpr,
):
    # Site-loop backward, pass two, on tensor cores (bf16, after ``_route_bwd_stats_dot`` with
    # STORE_T): the source gradients of ``_route_bwd_sources``,
    #   dv = alpha^T dR + (ds * rstd)^T W - v rstd^2 t / d,      rows (token, source) [BM*BN, DHP]
    # on tiles laid out as ``_route_bwd_stats_dot``'s (program (p, h): head h of every progs-th tile
    # of BM tokens), recomputing the scores and a = <dr, v> as there (no [S, N, M, H, 2] round trip)
    # and summing t over the heads from the partials pass one stored. The host launches it once per
    # chunk of at most ``dispatch.DOT_SOURCES_CHUNK`` sources, each with its own tile: n_src, n_acc, the offset
    # tables, rstd and t then count from the chunk's first source. The coefficients and W enter
    # as bf16x2 splits (hi * hi + hi * lo + lo * hi); dR and V are bf16 already. With ACC, source
    # i < n_acc adds acc_base + acc_offs[i] (a gradient sink's sum so far). DT > 0: a head's last DT
    # columns are a second tile (``_route_fwd_sites_dot``).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BM * BS)  # rows (token, site)
    q = tl.arange(0, BM * BN)  # rows (token, source)
    s_r = r % BS
    m_r = r // BS
    j_q = q % BN
    m_q = q // BN
    c_1 = tl.arange(0, DHP)
    col = h * DH + c_1[None, :]  # [1, DHP]
    cmask = c_1[None, :] < DH  # a head's columns of the width padded to DHP
    smask = s_r < n_sites
    jmask = j_q < n_src
    w_off = s_r[:, None] * D + col
    w = tl.load(w_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)  # [BM*BS, DHP] bf16 hi
    w_lo = tl.load(wlo_ptr + w_off, mask=smask[:, None] & cmask, other=0.0)
    g_off = tl.multiple_of(tl.load(g_offs + s_r, mask=smask, other=0), G_ALIGN)[:, None]  # [BM*BS, 1]
    off = tl.multiple_of(tl.load(src_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]  # [BM*BN, 1]
    d_off = tl.multiple_of(tl.load(dsrc_offs + j_q, mask=jmask, other=0), ALIGN)[:, None]
    if ACC:
        amask = j_q < n_acc
        a_off = tl.multiple_of(tl.load(acc_offs + j_q, mask=amask, other=0), ALIGN)[:, None]
    same = m_r[:, None] == m_q[None, :]  # [BM*BS, BM*BN]: the blocks of one token
    h_1 = tl.arange(0, BH)
    if DT > 0:
        col_t = h * DH + DHP + tl.arange(0, DT)[None, :]  # [1, DT]
        w_t = tl.load(w_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)  # [BM*BS, DT]
        w_lo_t = tl.load(wlo_ptr + s_r[:, None] * D + col_t, mask=smask[:, None], other=0.0)
    for tile in range(pid, num_tiles, progs):
        rows_r = tl.cast(tile, tl.int64) * BM + m_r
        rows_q = tl.cast(tile, tl.int64) * BM + m_q
        rmask = smask & (rows_r < M)
        qmask = jmask & (rows_q < M)
        dr = tl.load(g_base + g_off + rows_r[:, None] * D + col, mask=rmask[:, None] & cmask, other=0.0)  # [BM*BS, DHP]
        x_off = rows_q[:, None] * D + col
        v = tl.load(src_base + off + x_off, mask=qmask[:, None] & cmask, other=0.0)  # [BM*BN, DHP]
        if ACC:  # issued with the values: its latency overlaps theirs and the products
            acc = tl.load(acc_base + a_off + x_off, mask=(qmask & amask)[:, None] & cmask, other=0.0)
        if DT > 0:
            dr_t = tl.load(g_base + g_off + rows_r[:, None] * D + col_t, mask=rmask[:, None], other=0.0)  # [BM*BS, DT]
            x_off_t = rows_q[:, None] * D + col_t
            v_t = tl.load(src_base + off + x_off_t, mask=qmask[:, None], other=0.0)  # [BM*BN, DT]
            if ACC:
                acc_t = tl.load(acc_base + a_off + x_off_t, mask=(qmask & amask)[:, None], other=0.0)
        sh_r = (s_r.to(tl.int64) * M + rows_r) * H + h
        lse = tl.load(lse_ptr + sh_r, mask=rmask, other=0.0)
        dsum = tl.load(dsum_ptr + sh_r, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + j_q.to(tl.int64) * M + rows_q, mask=qmask, other=1.0)  # [BM*BN]
        t_off = ((j_q.to(tl.int64) * M + rows_q) * H)[:, None] + h_1[None, :]
        t = tl.reduce(tl.load(t_ptr + t_off, mask=qmask[:, None] & (h_1[None, :] < H), other=0.0), 1, ADD)  # [BM*BN]
        sc, a = dot_scores(w, w_lo, dr, v, None, None, DOT_F32)
        if DT > 0:
            sc, a = dot_scores(w_t, w_lo_t, dr_t, v_t, sc, a, DOT_F32)
        sc = sc * rstd[None, :]
        live = same & rmask[:, None] & qmask[None, :]
        alpha = tl.where(live, tl.exp(sc - lse[:, None]), 0.0)
        coef = tl.trans(tl.where(live, alpha * (a - dsum[:, None]), 0.0) * rstd[None, :])  # (ds * rstd)^T [BM*BN, BM*BS]
        p_hi, p_lo = split(tl.trans(alpha))
        c_hi, c_lo = split(coef)
        dv = source_grad_dot(p_hi, p_lo, c_hi, c_lo, dr, w, w_lo, DOT_F32)
        dv -= v.to(tl.float32) * (rstd * rstd * t / D)[:, None]
        if ACC:
            dv += acc.to(tl.float32)
        tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=qmask[:, None] & cmask)
        if DT > 0:
            dv_t = source_grad_dot(p_hi, p_lo, c_hi, c_lo, dr_t, w_t, w_lo_t, DOT_F32)
            dv_t -= v_t.to(tl.float32) * (rstd * rstd * t / D)[:, None]
            if ACC:
                dv_t += acc_t.to(tl.float32)
            tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=qmask[:, None])
