"""KDA chunk stage 1, the 16 x 16 diagonal blocks of A_qk and L (chunk_intra.py calls diag_block per row block).

Overflow (kda.md pitfall 4): exp(G_i - G_j) is never split at the chunk start. Inside a diagonal block the split is
by recursive halving: the 4 x 4 leaves pairwise (no split), the second quarter of each half against its first at
the half's middle row, and the second half against the first at the block's middle row, every factor <= 1. That is
96 exponentials per K column instead of the 256 of all pairs (`test_chunk_intra_exponentials_per_chunk_head`).
Products are fp32 vector ops: the tiles are too small for tensor cores.
"""

import triton
import triton.language as tl


@triton.jit
def _pick(x, axis: tl.constexpr, which: tl.constexpr):
    """x's entries at index `which` of its size-2 axis `axis` (0 or 1), that axis dropped."""
    o_2 = tl.arange(0, 2)
    if axis == 0:
        sel = (o_2 == which)[:, None, None, None]
    else:
        sel = (o_2 == which)[None, :, None, None]
    return tl.sum(tl.where(sel, x, 0.0), axis)


@triton.jit
def _half(x, which: tl.constexpr, QR: tl.constexpr, BKD: tl.constexpr):
    """Half `which` (0: first, 1: second) of a [2, 2, QR, BKD] row-block operand, as [2 QR, BKD] rows."""
    return tl.reshape(_pick(x, 0, which), [2 * QR, BKD])


@triton.jit
def _split_block(q_rows, k_rows, k_cols, g_rows, g_cols, g_m, m_rows, m_cols):
    """sum_d a_i k_j exp(G_i - G_j), a = q and a = k, for rows i after the split row m and columns j <= m, as
    (a_i exp(G_i - G_m)) . (k_j exp(G_m - G_j)): both factors <= 1 (kda.md pitfall 4). [..., R, BKD] operands,
    g_m [..., 1, BKD] -> two [..., R, R]."""
    e_rows = tl.expand_dims(tl.exp(tl.where(m_rows, g_rows - g_m, 0.0)), -2)
    cols = tl.expand_dims(k_cols * tl.exp(tl.where(m_cols, g_m - g_cols, 0.0)), -3)
    qk = tl.sum(tl.expand_dims(q_rows, -2) * e_rows * cols, -1)
    return qk, tl.sum(tl.expand_dims(k_rows, -2) * e_rows * cols, -1)


@triton.jit
def diag_block(q, k, gl, sq, sk, r, end, n_q, n_k, i_h, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                BKD: tl.constexpr):
    """sum_d q_i k_j exp(G_i - G_j) and sum_d k_i k_j exp(G_i - G_j) for i >= j inside the row block of rows
    r..r+BC-1, over K in slices of BKD, by recursive halving: the four diagonal BC/4 x BC/4 blocks pairwise (no split
    of the exponent); the lower-left quarter of each half, and the lower-left half of the block, split at the last
    row m before them (_split_block). 96 exponentials per K column instead of BC^2 = 256 pairwise at BC = 16.
    Row index (p, s, i) = (half, quarter in half, row in quarter). Returns [BC, BC] tiles, upper part unspecified
    (the caller masks)."""
    QR: tl.constexpr = BC // 4
    o_q = tl.arange(0, QR)
    o_2 = tl.arange(0, 2)
    rows5 = r + (o_2[:, None, None] * 2 + o_2[None, :, None]) * QR + o_q[None, None, :]  # [2, 2, QR]
    m5 = rows5 < end
    pair = (o_q[:, None] >= o_q[None, :])[None, None, :, :] & m5[:, :, :, None] & m5[:, :, None, :]
    mid1 = r + (o_2 * 2 + 1) * QR - 1  # [2]: last row of each half's first quarter
    mid0 = r + 2 * QR - 1  # the last row of the first half
    m_b1 = (r + (o_2[:, None] * 2 + 1) * QR + o_q[None, :] < end)[:, :, None]  # second quarters of the halves
    m_t1 = (r + o_2[:, None] * 2 * QR + o_q[None, :] < end)[:, :, None]  # first quarters
    m_b0 = (r + 2 * QR + tl.arange(0, 2 * QR) < end)[:, None]  # the second half
    m_t0 = (r + tl.arange(0, 2 * QR) < end)[:, None]
    n_q5 = tl.reshape(n_q, [2, 2, QR, 1])
    n_k5 = tl.reshape(n_k, [2, 2, QR, 1])
    leaf_qk = tl.zeros([2, 2, QR, QR], dtype=tl.float32)
    leaf_kk = tl.zeros([2, 2, QR, QR], dtype=tl.float32)
    l1_qk = tl.zeros([2, QR, QR], dtype=tl.float32)
    l1_kk = tl.zeros([2, QR, QR], dtype=tl.float32)
    l0_qk = tl.zeros([2 * QR, 2 * QR], dtype=tl.float32)
    l0_kk = tl.zeros([2 * QR, 2 * QR], dtype=tl.float32)
    for ks in range(0, BK, BKD):
        o_s = ks + tl.arange(0, BKD)
        m_s = o_s < K
        mask = m5[:, :, :, None] & m_s[None, None, None, :]
        cols = i_h * K + o_s[None, None, None, :]
        q5 = tl.load(q + rows5[:, :, :, None] * sq + cols, mask=mask, other=0.0).to(tl.float32) * n_q5
        k5 = tl.load(k + rows5[:, :, :, None] * sk + cols, mask=mask, other=0.0).to(tl.float32) * n_k5
        g5 = tl.load(gl + rows5[:, :, :, None] * K + o_s[None, None, None, :], mask=mask, other=0.0)
        # the diagonal quarters, pairwise: [2, 2, QR(i), QR(j), BKD]
        k_dec = k5[:, :, None, :, :] * tl.exp(tl.where(pair[:, :, :, :, None],
                                                        g5[:, :, :, None, :] - g5[:, :, None, :, :], 0.0))
        leaf_qk += tl.sum(q5[:, :, :, None, :] * k_dec, 4)
        leaf_kk += tl.sum(k5[:, :, :, None, :] * k_dec, 4)
        # the second quarter of each half against its first, split at mid1
        m_1 = (mid1 < end)[:, None] & m_s[None, :]
        g_1 = tl.load(gl + mid1[:, None] * K + o_s[None, :], mask=m_1, other=0.0)[:, None, :]
        m_b, m_t = (m_b1 & m_s[None, None, :]), (m_t1 & m_s[None, None, :]) & m_1[:, None, :]
        g_b, g_t, k_t = _pick(g5, 1, 1), _pick(g5, 1, 0), _pick(k5, 1, 0)
        qk, kk = _split_block(_pick(q5, 1, 1), _pick(k5, 1, 1), k_t, g_b, g_t, g_1, m_b, m_t)
        l1_qk += qk
        l1_kk += kk
        # the second half against the first, split at mid0: [2 QR, BKD] operands
        m_0 = (mid0 + 0 * o_s < end) & m_s
        g_0 = tl.load(gl + mid0 * K + o_s, mask=m_0, other=0.0)[None, :]
        m_b = m_b0 & m_s[None, :]
        m_t = m_t0 & m_0[None, :]
        qk, kk = _split_block(_half(q5, 1, QR, BKD), _half(k5, 1, QR, BKD), _half(k5, 0, QR, BKD),
                              _half(g5, 1, QR, BKD), _half(g5, 0, QR, BKD), g_0, m_b, m_t)
        l0_qk += qk
        l0_kk += kk
    return _assemble(leaf_qk, l1_qk, l0_qk, BC, QR), _assemble(leaf_kk, l1_kk, l0_kk, BC, QR)


@triton.jit
def _assemble(leaf, l1, l0, BC: tl.constexpr, QR: tl.constexpr):
    """[BC, BC] from the diagonal quarters leaf [2, 2, QR, QR], the in-half blocks l1 [2, QR, QR] and the
    lower-left half l0 [2 QR, 2 QR], as a [p, s, i, p', s', j] tile (row (2p + s) QR + i, column (2p' + s') QR + j)."""
    o_2 = tl.arange(0, 2)
    p = o_2[:, None, None, None, None, None]
    s = o_2[None, :, None, None, None, None]
    p2 = o_2[None, None, None, :, None, None]
    s2 = o_2[None, None, None, None, :, None]
    t = tl.where((p == p2) & (s == s2), leaf[:, :, :, None, None, :], 0.0)
    t = tl.where((p == p2) & (s > s2), l1[:, None, :, None, None, :], t)
    t = tl.where(p > p2, tl.reshape(l0, [2, QR, 2, QR])[None, :, :, None, :, :], t)
    return tl.reshape(t, [BC, BC])
