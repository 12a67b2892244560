"""The site loop (``bwd_stats`` then ``bwd_sources``): the backward of phase one, and of one site over many sources.

Phase one of two-phase routing routes S sites against the same sources; its backward would hold
every site's gradient of a token in the two-pass kernel. The site loop holds one site's at a time:
pass one (one program per site and range of token tiles) forms each site's
``D = sum_i alpha_i <dr, v_i>_h - dlse``, stores every score and ``<dr, v_i>_h`` and sums
``dw = sum_tokens (X - D Y)`` with ``X = sum_i alpha_i <dr, v_i>_h rstd_i v_i``,
``Y = sum_i alpha_i rstd_i v_i`` in one loop; pass two (one program per token tile and source)
writes each source's gradient with the sites in its loop:

    dv = sum_s alpha_s dr_s + rstd ds_s w_s - v rstd^2 sum_s sum_h ds_s s_s / d,  ds_s = alpha_s (a_s - D_s)

Each source's key rstd comes from the forward (``[N, M]`` float32) where it was saved. With a
gradient sink (``ACC``) pass two adds each source's gradient into the sink's slot in place.
"""

import triton
import triton.language as tl

from lit_mhar.kernels.common import ADD


@triton.jit
def _route_bwd_stats(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dlse_ptr,
    gate_ptr, dgate_ptr,
    dsum_ptr, dw_ptr, sa_ptr, rstd_ptr,
    M, eps, num_tiles, progs_per_site,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr,
    BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, HAS_DLSE: tl.constexpr,
    ADDITIVE: tl.constexpr, HAS_RSTD: tl.constexpr, LONE_SOURCE: tl.constexpr,
):
    """Site loop, pass one: one program per (site, range of token tiles); stores D ``[S, M, H]``,
    the scores and ``<dr, v_i>_h`` ``[S, N, M, H, 2]`` for pass two, and ``dw`` (and the gate's
    gradient) as per-program partials."""
    # Site-loop backward, pass one: per (site, token) D = sum_i alpha_i <dr, v_i>_h - dlse (and the
    # score s_i and a_i = <dr, v_i>_h of every source, stored for pass two: [S, N, M, H, 2]), and
    # this program's share of dw = sum_tokens sum_i ds_i rstd_i v_i, which one loop gives as
    # sum_tokens (X - D * Y) with X = sum_i alpha_i a_i rstd_i v_i, Y = sum_i alpha_i rstd_i v_i.
    # Program pid serves site pid % n_sites (the programs of a tile run side by side and share its
    # source tiles through L2) and tiles pid // n_sites, + progs_per_site, ... (fixed order).
    # Additive form (one site): dr = gate * dout, and this program's share of
    # d gate = sum_tokens dout * r, with r = sum_i alpha_i v_i formed on the way. With LONE_SOURCE
    # (one source) the weight is exactly 1 and dw = sum_tokens (a - D) rstd v: the score's
    # gradient is the lse's alone, exactly 0 without one.
    # Lane tensors have twins ``*_t`` over each head's last DT channels when DT > 0 (see forward.py).
    pid = tl.program_id(0)
    s_1d = pid % n_sites + tl.arange(0, 1)
    s_i = s_1d[:, None, None, None]  # [1, 1, 1, 1]
    smask = s_i < n_sites
    m_i = tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    w = tl.load(w_ptr + s_i * D + col, mask=smask & cmask, other=0.0)  # [1, 1, BH, BDH]
    g_off = tl.multiple_of(tl.load(g_offs + s_1d, mask=s_1d < n_sites, other=0), G_ALIGN)[:, None, None, None]
    dw_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
    if DT > 0:
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        w_t = tl.load(w_ptr + s_i * D + col_t, mask=smask & (h_i < H), other=0.0)
        dw_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)
    if ADDITIVE:
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        dgate_acc = tl.full([1, 1, BH, BDH], 0.0, tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
            dgate_acc_t = tl.full([1, 1, BH, DT], 0.0, tl.float32)
    for tile in range(pid // n_sites, num_tiles, progs_per_site):
        rows = tl.cast(tile, tl.int64) * BM + m_i
        x_off = rows * D + col
        xmask = (rows < M) & cmask
        hm_off = rows * H + h_i
        hmask = (rows < M) & (h_i < H)
        sh_off = s_i.to(tl.int64) * M * H + hm_off  # [1, BM, BH, 1]
        shmask = smask & hmask
        dout = tl.load(g_base + g_off + x_off, mask=smask & xmask, other=0.0).to(tl.float32)  # [1, BM, BH, BDH]
        if ADDITIVE:
            dr = dout * gate
            racc = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
        else:
            dr = dout
        if DT > 0:
            x_off_t = rows * D + col_t
            dout_t = tl.load(g_base + g_off + x_off_t, mask=shmask, other=0.0).to(tl.float32)  # [1, BM, BH, DT]
            if ADDITIVE:
                dr_t = dout_t * gate_t
                racc_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
            else:
                dr_t = dout_t
            xacc_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
            yacc_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
        lse = tl.load(lse_ptr + sh_off, mask=shmask, other=0.0)
        dsum = tl.full([1, BM, BH, 1], 0.0, tl.float32)
        xacc = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
        yacc = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
        off = tl.multiple_of(tl.load(src_offs), ALIGN)
        v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(n_src > 0, M, 0)) & cmask, other=0.0)
        if DT > 0:
            v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(n_src > 0, M, 0)) & (h_i < H), other=0.0)
        if LONE_SOURCE:
            a_lone = tl.full([1, BM, BH, 1], 0.0, tl.float32)
        for i in range(n_src):
            v = v_next.to(tl.float32)  # [1, BM, BH, BDH]
            off = tl.multiple_of(tl.load(src_offs + i + 1), ALIGN)
            v_next = tl.load(src_base + off + x_off, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & cmask, other=0.0)
            sc = tl.reduce(w * v, 3, ADD, keep_dims=True)  # [1, BM, BH, 1]
            a = tl.reduce(dr * v, 3, ADD, keep_dims=True)
            if DT > 0:
                v_t = v_next_t.to(tl.float32)  # [1, BM, BH, DT]
                v_next_t = tl.load(src_base + off + x_off_t, mask=(rows < tl.where(i + 1 < n_src, M, 0)) & (h_i < H), other=0.0)
                sc += tl.reduce(w_t * v_t, 3, ADD, keep_dims=True)
                a += tl.reduce(dr_t * v_t, 3, ADD, keep_dims=True)
            if HAS_RSTD:  # saved by the forward: no reduction over the width (across warps) here
                rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
            else:
                sq = tl.reduce(tl.reduce(v * v, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                if DT > 0:
                    sq += tl.reduce(tl.reduce(v_t * v_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
                rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
            sc = sc * rstd
            if LONE_SOURCE:
                alpha = tl.full([1, BM, BH, 1], 1.0, tl.float32)
                a_lone = a
            else:
                alpha = tl.exp(sc - lse)
            sa_off = ((s_i.to(tl.int64) * n_src + i) * M * H + hm_off) * 2
            tl.store(sa_ptr + sa_off, sc, mask=shmask)
            tl.store(sa_ptr + sa_off + 1, a, mask=shmask)
            dsum += alpha * a
            ar = alpha * rstd
            xacc += (ar * a) * v
            yacc += ar * v
            if ADDITIVE:
                racc += alpha * v
            if DT > 0:
                xacc_t += (ar * a) * v_t
                yacc_t += ar * v_t
                if ADDITIVE:
                    racc_t += alpha * v_t
        if HAS_DLSE:  # d lse_h enters every score like a constant shift of its D
            dsum -= tl.load(dlse_ptr + sh_off, mask=shmask, other=0.0)
        tl.store(dsum_ptr + sh_off, dsum, mask=shmask)
        if LONE_SOURCE:  # (X - D * Y would leave rounding where ds is exactly 0)
            dw_acc += tl.reduce((a_lone - dsum) * yacc, 1, ADD, keep_dims=True)
        else:
            dw_acc += tl.reduce(xacc - dsum * yacc, 1, ADD, keep_dims=True)
        if ADDITIVE:
            dgate_acc += tl.reduce(tl.reduce(dout * racc, 0, ADD, keep_dims=True), 1, ADD, keep_dims=True)
        if DT > 0:
            if LONE_SOURCE:
                dw_acc_t += tl.reduce((a_lone - dsum) * yacc_t, 1, ADD, keep_dims=True)
            else:
                dw_acc_t += tl.reduce(xacc_t - dsum * yacc_t, 1, ADD, keep_dims=True)
            if ADDITIVE:
                dgate_acc_t += tl.reduce(tl.reduce(dout_t * racc_t, 0, ADD, keep_dims=True), 1, ADD, keep_dims=True)
    # partial row of (site, this program's share): [progs_per_site, n_sites, d], summed by the host
    part = tl.cast(pid // n_sites, tl.int64) * n_sites + s_i
    tl.store(dw_ptr + part * D + col, dw_acc, mask=smask & cmask)
    if DT > 0:
        tl.store(dw_ptr + part * D + col_t, dw_acc_t, mask=smask & (h_i < H))
    if ADDITIVE:
        tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col, dgate_acc, mask=cmask)
        if DT > 0:
            tl.store(dgate_ptr + tl.cast(pid, tl.int64) * D + col_t, dgate_acc_t, mask=h_i < H)


@triton.jit
def _route_bwd_sources(
    src_base, src_offs, n_src,
    w_ptr, n_sites,
    g_base, g_offs,
    lse_ptr, dsum_ptr, sa_ptr,
    gate_ptr,
    dsrc_base, dsrc_offs, acc_base, acc_offs, n_acc, rstd_ptr,
    M, eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, DT: tl.constexpr,
    BM: tl.constexpr, ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, ADDITIVE: tl.constexpr, HAS_RSTD: tl.constexpr,
    ACC: tl.constexpr, LONE_SOURCE: tl.constexpr,
):
    """Site loop, pass two: one program per (token tile, source); each source's gradient from the
    scores, D and ``<dr, v_i>_h`` pass one stored, the sites in its loop."""
    # Site-loop backward, pass two: one program per (token tile, source), the source varying
    # fastest (the programs of a tile share the sites' gradient tiles through L2). The source tile
    # stays in registers while the sites go by:
    #   dv = sum_s alpha_s dr_s + rstd ds_s w_s - v rstd^2 sum_s sum_h ds_s s_s / d,
    # with the scores s_s and <dr_s, v>_h that pass one stored: no reduction over lanes per site.
    # Source i's gradient goes to dsrc_base + dsrc_offs[i]; with ACC, sources i < n_acc add to it
    # acc_base + acc_offs[i] (a gradient sink's sum so far; the same place to add in place).
    pid = tl.program_id(0)
    i = pid % n_src
    rows = tl.cast(pid // n_src, tl.int64) * BM + tl.arange(0, BM)[None, :, None, None]
    h_i = tl.arange(0, BH)[None, None, :, None]
    j_i = tl.arange(0, BDH)[None, None, None, :]
    col = h_i * DH + j_i
    cmask = (h_i < H) & (j_i < DH)
    x_off = rows * D + col
    xmask = (rows < M) & cmask
    hm_off = rows * H + h_i
    hmask = (rows < M) & (h_i < H)
    off = tl.multiple_of(tl.load(src_offs + i), ALIGN)
    v = tl.load(src_base + off + x_off, mask=xmask, other=0.0).to(tl.float32)  # [1, BM, BH, BDH]
    if DT > 0:  # lane tensors have twins ``*_t`` over each head's last DT channels (see forward.py)
        col_t = h_i * DH + BDH + tl.arange(0, DT)[None, None, None, :]  # [1, 1, BH, DT]
        x_off_t = rows * D + col_t
        v_t = tl.load(src_base + off + x_off_t, mask=hmask, other=0.0).to(tl.float32)  # [1, BM, BH, DT]
        dv_t = tl.full([1, BM, BH, DT], 0.0, tl.float32)
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + tl.cast(i, tl.int64) * M + rows, mask=rows < M, other=1.0)  # [1, BM, 1, 1]
    else:
        sq = tl.reduce(tl.reduce(v * v, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
        if DT > 0:
            sq += tl.reduce(tl.reduce(v_t * v_t, 3, ADD, keep_dims=True), 2, ADD, keep_dims=True)
        rstd = 1.0 / tl.sqrt(sq / D + eps)  # [1, BM, 1, 1]
    dv = tl.full([1, BM, BH, BDH], 0.0, tl.float32)
    t = tl.full([1, BM, BH, 1], 0.0, tl.float32)
    g_off = tl.multiple_of(tl.load(g_offs), G_ALIGN)
    dr_next = tl.load(g_base + g_off + x_off, mask=xmask, other=0.0)
    if DT > 0:
        dr_next_t = tl.load(g_base + g_off + x_off_t, mask=hmask, other=0.0)
    if ADDITIVE:  # one site: dr = gate * dout
        gate = tl.load(gate_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if DT > 0:
            gate_t = tl.load(gate_ptr + col_t, mask=h_i < H, other=0.0).to(tl.float32)
    for s in range(n_sites):
        dr = dr_next.to(tl.float32)
        if ADDITIVE:
            dr = dr * gate
        g_off = tl.multiple_of(tl.load(g_offs + s + 1), G_ALIGN)
        dr_next = tl.load(g_base + g_off + x_off, mask=(rows < tl.where(s + 1 < n_sites, M, 0)) & cmask, other=0.0)
        if DT > 0:
            dr_t = dr_next_t.to(tl.float32)
            if ADDITIVE:
                dr_t = dr_t * gate_t
            dr_next_t = tl.load(g_base + g_off + x_off_t, mask=(rows < tl.where(s + 1 < n_sites, M, 0)) & (h_i < H), other=0.0)
        w = tl.load(w_ptr + s * D + col, mask=cmask, other=0.0)  # [1, 1, BH, BDH]
        sh_off = tl.cast(s, tl.int64) * M * H + hm_off
        sa_off = ((tl.cast(s, tl.int64) * n_src + i) * M * H + hm_off) * 2
        sc = tl.load(sa_ptr + sa_off, mask=hmask, other=0.0)  # [1, BM, BH, 1]
        if LONE_SOURCE:  # a softmax over one source: the weight is exactly 1
            alpha = tl.full([1, BM, BH, 1], 1.0, tl.float32)
        else:
            alpha = tl.exp(sc - tl.load(lse_ptr + sh_off, mask=hmask, other=0.0))
        ds = alpha * (tl.load(sa_ptr + sa_off + 1, mask=hmask, other=0.0) - tl.load(dsum_ptr + sh_off, mask=hmask, other=0.0))
        dv += alpha * dr + (rstd * ds) * w
        if DT > 0:
            w_t = tl.load(w_ptr + s * D + col_t, mask=h_i < H, other=0.0)  # [1, 1, BH, DT]
            dv_t += alpha * dr_t + (rstd * ds) * w_t
        t += ds * sc
    t = tl.reduce(t, 2, ADD, keep_dims=True)  # [1, BM, 1, 1]
    dv -= v * (rstd * rstd * t / D)
    d_off = tl.multiple_of(tl.load(dsrc_offs + i), ALIGN)
    if ACC:
        a_off = tl.multiple_of(tl.load(acc_offs + i), ALIGN)
        acc_rows = rows < tl.where(i < n_acc, M, 0)
        dv += tl.load(acc_base + a_off + x_off, mask=acc_rows & cmask, other=0.0).to(tl.float32)
    tl.store(dsrc_base + d_off + x_off, dv.to(dsrc_base.dtype.element_ty), mask=xmask)
    if DT > 0:
        dv_t -= v_t * (rstd * rstd * t / D)
        if ACC:
            dv_t += tl.load(acc_base + a_off + x_off_t, mask=acc_rows & (h_i < H), other=0.0).to(tl.float32)
        tl.store(dsrc_base + d_off + x_off_t, dv_t.to(dsrc_base.dtype.element_ty), mask=hmask)
