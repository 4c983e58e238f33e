"""KDA chunk stage 1 (chunk-parallel): per chunk of BT = 64 tokens and head, the chunk-local decay and, in four row
blocks of BC = 16,

    G = cumsum(g) (the gate fused: g may be the raw logits),
    A_qk[i, j] = scale * sum_d q_i k_j exp(G_i - G_j)  (j <= i),  L[i, j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i)
    W = (I + L)^-1 Diag(beta) (exp(G) * K),   U = (I + L)^-1 Diag(beta) V   (the UT transform)

and the operands of stages 2-3: Qd = scale * q * exp(G), Kd = k * exp(G_last - G). G stays in the program's fp32
slot (_chunk_intra) and only its last row per chunk is stored, for the state pass; W, U, Qd, Kd and A_qk are bf16
for 16-bit inputs (fp32 for fp32 inputs). Qd is stored rather than formed in the output kernel from q and G: 2 B
written and read per element against the 6 B of reading q and an fp32 G there. q, k and v are read through their
token strides (the block's views of the conv output are not copied).

Overflow (kda.md pitfall 4): exp(G_i - G_j) is never split at the chunk start. Off-diagonal blocks split it at the
row block's first token r: (q_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)) with j < r <= i, both factors <= 1; the
16 x 16 diagonal blocks by recursive halving (_diag_block: 4 x 4 leaves pairwise, the rest split the same way).
The solve is block forward substitution: each row block
reads the W, U rows of earlier blocks back (written by this program, behind a barrier; L1/L2 hits), merges them
with tensor-core dots, and applies the inverse of its unit-lower diagonal block, found by exact fp32 forward
substitution in registers (row by row, vector ops: no rounding of the inverse to tf32 or bf16).
Dot operands are fp32 (tf32 tensor cores for 16-bit inputs, IEEE for fp32): the interpreter's bf16 dot is broken
(kernels/common.py), and the decay-scaled operands are formed in fp32 anyway.
"""

import triton
import triton.language as tl
from spark_bench.kernels.common import widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import kda_decay, l2_normalize_rows, to_output_dtype

from spark_bench import triton_env

# BKD: the K slice of the diagonal blocks' products (_diag_block); elem: the input's element bytes. 16-bit: 4 warps,
# 213-221 registers (triton 3.9; 246-255 under 3.6), 2 CTAs per SM on sm_90a. fp32 inputs (IEEE dots on CUDA
# cores) spill 92-164 B at 4 warps: 8 warps, 1 CTA per SM.
# PROGRAMS_PER_SM: the persistent grid is PROGRAMS_PER_SM x SMs programs (one G slot each), the CTAs per SM the
# config reaches (more programs than fit only wait for an SM); 0: one program per (chunk, head), G in as many slots
# as a whole [T, H, K] G (the last candidate: whether the persistent loop wins is for `spark-bench tune` on a GPU).
# fp32 inputs take 0 and BKD 16: their persistent loop spills 8-16 B at every 8-warp config under triton 3.6 (the
# GPU machine's), and BKD 32 spills 4 B there.
CONFIGS = declare(ConfigSpace(
    "kda.chunk_intra._chunk_intra", key=("K", "V", "elem"),
    default={"BKD": 16, "PROGRAMS_PER_SM": 0, "num_warps": 8, "num_stages": 1},
    buckets=[({"elem": 2}, {"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1})],
    candidates=[{"BKD": 16, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1},
                {"BKD": 32, "PROGRAMS_PER_SM": 0, "num_warps": 8, "num_stages": 1},
                {"BKD": 8, "PROGRAMS_PER_SM": 1, "num_warps": 8, "num_stages": 1},
                {"BKD": 4, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1},
                {"BKD": 8, "PROGRAMS_PER_SM": 4, "num_warps": 4, "num_stages": 1},
                {"BKD": 32, "PROGRAMS_PER_SM": 1, "num_warps": 8, "num_stages": 1},
                {"BKD": 8, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1}]))  # non-persistent


@triton.jit
def _unit_lower_inverse(L, BC: tl.constexpr):
    """(I + L)^-1 of a strictly lower-triangular [BC, BC] tile by fp32 forward substitution: row i of X is
    e_i - sum_{j<i} L_ij X_j; rows below i are still identity rows then, and L_ij = 0 for j >= i."""
    o = tl.arange(0, BC)
    X = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    for i in range(1, BC):  # a runtime loop of vector ops
        l_i = tl.sum(tl.where(o[:, None] == i, L, 0.0), 0)  # row i of L, indexed by column j
        x_i = tl.where(o == i, 1.0, 0.0) - tl.sum(l_i[:, None] * X, 0)
        X = tl.where(o[:, None] == i, x_i[None, :], X)
    return X


@triton.jit
def _chunk_decay(g, A_log, dt_bias, gl, start, end, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, BKG: tl.constexpr, GATE: tl.constexpr):
    """G = cumsum of the chunk's decay (the gate applied first when GATE), stored fp32 at gl + row * K + column (the
    program's slot), in column slices of BKG (a [64, 128] scan at 4 warps alone takes ~195 registers)."""
    rows = start + tl.arange(0, BT)
    for k0 in range(0, BK, BKG):
        o_k = k0 + tl.arange(0, BKG)
        m_k = o_k < K
        mask = (rows < end)[:, None] & m_k[None, :]
        offs = (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_g = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        if GATE:
            b_g = tl.where(mask, kda_decay(b_g, A_log, dt_bias, i_h, o_k[None, :], m_k[None, :], K), 0.0)
        tl.store(gl + rows[:, None] * K + o_k[None, :], tl.cumsum(b_g, axis=0), mask=mask)


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
def _diag_block(q, k, gl, sq, sk, r, end, n_q, n_k, i_h, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
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


@triton.jit
def _chunk_intra(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, gslots, glast, w, u, qd, kd, aqk,
                 scale, sq, sk, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
                 PERSISTENT: tl.constexpr):
    """PERSISTENT: program p takes the (chunk, head) items p, p + P, ... (item = head * n_chunks + chunk) and keeps
    each one's G in its own slot of gslots [P, BT, K] fp32, rewritten in place per item, so on paper G stays in L2
    (8.7 MB at P = 264, K = 128 on an H200) instead of costing 512 B of DRAM writes per token and head. Otherwise one
    program (and slot) per item. Only G's last row per chunk is stored, into glast [chunks, H, K], for the state
    pass."""
    pid = tl.program_id(0)
    slot = gslots + pid.to(tl.int64) * (BT * K)
    if PERSISTENT:
        for item in range(pid, n_chunks * H, tl.num_programs(0)):
            _item(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, item, slot, glast, w, u, qd,
                  kd, aqk, scale, sq, sk, sv, H, K, V, BT, BC, BK, BV, BKD, GATE, L2NORM, BETA_SIGMOID, PREC, INTERPRET)
    else:
        _item(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, pid, slot, glast, w, u, qd, kd,
              aqk, scale, sq, sk, sv, H, K, V, BT, BC, BK, BV, BKD, GATE, L2NORM, BETA_SIGMOID, PREC, INTERPRET)


@triton.jit
def _item(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, item, slot, glast, w, u, qd, kd, aqk,
          scale, sq, sk, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
          BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Work item `item` (head item // n_chunks, chunk item % n_chunks) with G in `slot`; spare chunks are empty."""
    i_c = item % n_chunks
    i_h = item // n_chunks
    start = tl.load(chunk_start + i_c).to(tl.int64)
    end = tl.load(chunk_end + i_c).to(tl.int64)
    if start < end:
        tl.debug_barrier()  # every thread is done reading the previous item's G from the slot
        _one_chunk(q, k, v, g, beta, A_log, dt_bias, start, end, i_c, i_h, slot - start * K, glast, w, u, qd, kd,
                   aqk, scale, sq, sk, sv, H, K, V, BT, BC, BK, BV, BKD, GATE, L2NORM, BETA_SIGMOID, PREC, INTERPRET)


@triton.jit
def _one_chunk(q, k, v, g, beta, A_log, dt_bias, start, end, i_c, i_h, gl, glast, w, u, qd, kd, aqk, scale, sq, sk,
               sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Stage 1 of chunk rows start..end-1 and head i_h; G[row, :] at gl + row * K. Row blocks i_b and, inside,
    earlier row blocks j_b are runtime loops over [BC, *] tiles: unrolled over whole [BT, BK] tiles, the kernel held
    255 registers x 8 warps, spilled, and compiled for minutes."""
    _chunk_decay(g, A_log, dt_bias, gl, start, end, i_h, H, K, BT, BK, min(BK, 32), GATE)
    tl.debug_barrier()  # the row blocks read G back
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    last = tl.minimum(start + BT, end) - 1
    g_last = tl.load(gl + last * K + o_k, mask=m_k, other=0.0)
    tl.store(glast + (i_c * H + i_h) * K + o_k, g_last, mask=m_k)
    for i_b in range(0, BT // BC):
        r = start + i_b * BC
        if r < end:
            rows = r + o_c
            m_r = rows < end
            mask_rk = m_r[:, None] & m_k[None, :]
            offs_rk = (rows[:, None] * H + i_h) * K + o_k[None, :]  # of the contiguous W, Qd, Kd
            b_q = tl.load(q + rows[:, None] * sq + i_h * K + o_k[None, :], mask=mask_rk, other=0.0).to(tl.float32)
            b_k = tl.load(k + rows[:, None] * sk + i_h * K + o_k[None, :], mask=mask_rk, other=0.0).to(tl.float32)
            if L2NORM:
                n_q = tl.rsqrt(tl.sum(b_q * b_q, 1, keep_dims=True) + 1e-6)
                n_k = tl.rsqrt(tl.sum(b_k * b_k, 1, keep_dims=True) + 1e-6)
            else:
                n_q = tl.full([BC, 1], 1.0, tl.float32)
                n_k = n_q
            b_q = b_q * n_q
            b_k = b_k * n_k
            b_g = tl.load(gl + rows[:, None] * K + o_k[None, :], mask=mask_rk, other=0.0)
            b_beta = tl.load(beta + rows * H + i_h, mask=m_r, other=0.0).to(tl.float32)
            if BETA_SIGMOID:
                b_beta = tl.where(m_r, tl.sigmoid(b_beta), 0.0)
            # this block's rows against earlier blocks j < r: the decay split at r, both factors <= 1; exp(G) of
            # the rows as exp(G - G_r) exp(G_r) (both <= 1): one exponential per column instead of one per element
            g_r = tl.load(gl + r * K + o_k, mask=m_k, other=0.0)
            e_r = tl.exp(tl.where(mask_rk, b_g - g_r[None, :], 0.0))
            e_g = e_r * tl.exp(g_r)[None, :]
            tl.store(qd + offs_rk, to_output_dtype(b_q * e_g * scale, qd, INTERPRET), mask=mask_rk)
            b_kd = b_k * tl.exp(tl.where(mask_rk, g_last[None, :] - b_g, 0.0))
            tl.store(kd + offs_rk, to_output_dtype(b_kd, kd, INTERPRET), mask=mask_rk)
            mask_rv = m_r[:, None] & m_v[None, :]
            offs_rv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            # block forward substitution: (I + L_bb) X_b = Diag(beta_b) rhs_b - sum_{j_b < i_b} L_b,j_b X_j_b
            rhs_w = b_k * e_g * b_beta[:, None]
            p_v = v + rows[:, None] * sv + i_h * V + o_v[None, :]
            rhs_u = tl.load(p_v, mask=mask_rv, other=0.0).to(tl.float32) * b_beta[:, None]
            q_r = b_q * e_r * scale
            k_r = b_k * e_r
            offs_a = (rows[:, None] * H + i_h) * BT
            for j_b in range(0, i_b):
                rows_j = start + j_b * BC + o_c  # all < r < end
                offs_jk = (rows_j[:, None] * H + i_h) * K + o_k[None, :]
                p_kj = k + rows_j[:, None] * sk + i_h * K + o_k[None, :]
                k_j = l2_normalize_rows(tl.load(p_kj, mask=m_k[None, :], other=0.0).to(tl.float32), L2NORM)
                g_j = tl.load(gl + rows_j[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
                k_hat = tl.trans(k_j * tl.exp(tl.where(m_k[None, :], g_r[None, :] - g_j, 0.0)))
                a_qk = tl.dot(q_r, k_hat, input_precision=PREC)
                tl.store(aqk + offs_a + j_b * BC + o_c[None, :], to_output_dtype(a_qk, aqk, INTERPRET),
                         mask=m_r[:, None])
                a_kk = tl.dot(k_r, k_hat, input_precision=PREC) * b_beta[:, None]
                w_j = tl.load(w + offs_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
                u_j = tl.load(u + (rows_j[:, None] * H + i_h) * V + o_v[None, :], mask=m_v[None, :],
                              other=0.0).to(tl.float32)
                rhs_w -= tl.dot(a_kk, w_j, input_precision=PREC)
                rhs_u -= tl.dot(a_kk, u_j, input_precision=PREC)
            d_qk, d_kk = _diag_block(q, k, gl, sq, sk, r, end, n_q, n_k, i_h, K, BC, BK, BKD)
            d_qk = tl.where(o_c[:, None] >= o_c[None, :], d_qk * scale, 0.0)
            d_kk = tl.where(o_c[:, None] > o_c[None, :], d_kk * b_beta[:, None], 0.0)
            tl.store(aqk + offs_a + i_b * BC + o_c[None, :], to_output_dtype(d_qk, aqk, INTERPRET), mask=m_r[:, None])
            inv = _unit_lower_inverse(d_kk, BC)
            b_w = tl.dot(inv, rhs_w, input_precision=PREC)
            tl.store(w + offs_rk, to_output_dtype(b_w, w, INTERPRET), mask=mask_rk)
            tl.store(u + offs_rv, to_output_dtype(tl.dot(inv, rhs_u, input_precision=PREC), u, INTERPRET), mask=mask_rv)
            tl.debug_barrier()  # the next row block reads these W, U rows back


def chunk_intra(q, k, v, g, beta, chunk_start, chunk_end, n_chunks, *, scale, BT, l2norm, beta_sigmoid, prec,
                interpret, gate=False, A_log=None, dt_bias=None):
    """q, k [T, H, K], v [T, H, V] (rows may be strided), g [T, H, K] (the log decay, or the raw gate logits when
    `gate`), beta [T, H] -> (G_last fp32 [n_chunks, H, K]: G's last row per chunk, W, U, Qd, Kd, A_qk [T, H, BT]):
    bf16 for 16-bit inputs, fp32 for fp32 inputs."""
    import torch

    T, H, K = q.shape
    V = v.shape[-1]
    like = {"dtype": torch.float32 if q.dtype == torch.float32 else torch.bfloat16, "device": q.device}
    w, qd, kd = (torch.empty(T, H, K, **like) for _ in range(3))
    u = torch.empty(T, H, V, **like)
    aqk = torch.empty(T, H, BT, **like)
    glast = torch.empty(n_chunks, H, K, dtype=torch.float32, device=q.device)
    BK = max(16, triton.next_power_of_2(K))
    meta, options = split(CONFIGS.pick(K=K, V=V, elem=q.element_size()))
    per_sm = meta.pop("PROGRAMS_PER_SM")  # 0: one program per (chunk, head)
    programs = max(1, min(n_chunks * H, per_sm * triton_env.sm_count(q.device) or n_chunks * H))
    gslots = torch.empty(programs, BT, K, dtype=torch.float32, device=q.device)
    meta["BKD"] = BK if widen() else min(BK, meta["BKD"])
    _chunk_intra[(programs,)](
        q, k, v, g, beta, A_log if gate else glast, dt_bias if gate else glast, chunk_start, chunk_end, n_chunks,
        gslots, glast, w, u, qd, kd, aqk, scale, q.stride(0), k.stride(0), v.stride(0),
        H=H, K=K, V=V, BT=BT, BC=16, BK=BK, BV=max(16, triton.next_power_of_2(V)), GATE=gate,
        L2NORM=l2norm, BETA_SIGMOID=beta_sigmoid, PREC=prec, INTERPRET=interpret, PERSISTENT=per_sm > 0,
        **meta, **options)
    return glast, w, u, qd, kd, aqk
