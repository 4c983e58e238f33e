"""KDA chunk stage 1 (chunk-parallel): per chunk of BT = 64 tokens and head, the chunk-local decay and, in four row
blocks of BC = 16,

    G = cumsum(g) (the gate fused: g may be the raw logits),
    A_qk[i, j] = scale * sum_d q_i k_j exp(G_i - G_j)  (j <= i),  L[i, j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i)
    W = (I + L)^-1 Diag(beta) (exp(G) * K),   U = (I + L)^-1 Diag(beta) V   (the UT transform)

and the operands of stages 2-3: Kd = k * exp(G_last - G) and Q' = Qd - Tril(A_qk) W, Qd = scale * q * exp(G) (the
output's query side, regrouped so that the state pass need not write U - W h; chunk_prefill.py). G stays in the
program's fp32 slot (_chunk_intra) and only its last row per chunk is stored, for the state pass; W, U, Q', Kd and
A_qk are bf16 for 16-bit inputs (fp32 for fp32 inputs), A_qk's blocks above the diagonal never written. Qd is formed
here rather than in the output kernel from q and G: 2 B written and read per element against the 6 B of reading q
and an fp32 G there. q, k and v are read through their
token strides (the block's views of the conv output are not copied).

Overflow (kda.md pitfall 4): exp(G_i - G_j) is never split at the chunk start. Off-diagonal blocks split it at the
row block's first token r: (q_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)) with j < r <= i, both factors <= 1; the
16 x 16 diagonal blocks by recursive halving (_diag_block: 4 x 4 leaves pairwise, the rest split the same way).
The solve, in two phases (as fla splits its intra solve from `recompute_w_u_fwd`): the row-block loop stores L's
[BC, BC] blocks into the program's fp32 slot, with each diagonal block's inverse D_i = (I + L_ii)^-1 in place of
L_ii (exact fp32 forward substitution in registers, vector ops); after it _invert builds the whole
(I + L)^-1 [BT, BT] in registers by block forward substitution, X_i = D_i E_i - D_i (L_i,<i X), one tensor-core
merge dot per row block (the diagonal blocks stay exact fp32), and _apply_inverse forms W and U as [BT, BT] x
[BT, 32] dots; _fold_query then forms Q' from W and A_qk as stored. W's right-hand side Diag(beta) exp(G) K
waits in W's rows in the output dtype (bf16 for 16-bit inputs: rounded before the solve, as fla's bf16
recompute_w_u_fwd operands are).
Dot operands are fp32 (tf32 tensor cores for 16-bit inputs; IEEE for fp32 inputs in the row-block loop, 3xTF32 in
the solve, whose IEEE [64, 64] operands spill): the interpreter's bf16 dot is broken (kernels/common.py), and the
decay-scaled operands are formed in fp32 anyway.
"""

import triton
import triton.language as tl
from spark_bench.kernels.common import widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import dot_operand, kda_decay, l2_normalize_rows, to_output_dtype

from spark_bench import triton_env

# BKD: the K slice of the diagonal blocks' products (_diag_block); elem: the input's element bytes. 4 warps, 2 CTAs
# per SM on sm_90a: 16-bit inputs 230-241 registers (triton 3.9), up to 255 under 3.6; fp32 inputs (IEEE dots on
# CUDA cores in the row-block loop) 252-254 under both, BKD 8 spills 4 B under 3.9 there. 16-bit took BKD 8 until
# _fold_query (session 29): with it, BKD 8 spills 8-16 B under 3.6 (the fused gate / L2 norm / beta sigmoid
# variant: a hoisted 64-bit pointer of the persistent loop), BKD 4 4 B, BKD 16 none; at K <= 32 (the quick sweep's
# heads) it is the other way round: BKD 16 spills 4 B under 3.6, BKD 8 none.
# PROGRAMS_PER_SM: the persistent grid is PROGRAMS_PER_SM x SMs programs (one slot each), the CTAs per SM the
# config reaches (more programs than fit only wait for an SM); 0: one program per (chunk, head), with as many slots
# (whether the persistent loop wins is for `spark-bench tune` on a GPU). fp32 inputs take 0: their persistent loop
# spills 8-52 B at 4 warps. 8 warps spill at most keys under triton 3.6 (8-52 B; session 27's candidate gate).
CONFIGS = declare(ConfigSpace(
    "kda.chunk_intra._chunk_intra", key=("K", "V", "elem"),
    default={"BKD": 16, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1},
    buckets=[({"K": 32, "elem": 2}, {"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1}),
             ({"elem": 2}, {"BKD": 16, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1})],
    candidates=[{"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1},  # 16-bit until session 29
                {"BKD": 16, "PROGRAMS_PER_SM": 0, "num_warps": 8, "num_stages": 1},  # the fp32 default until now
                {"BKD": 4, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1},
                {"BKD": 8, "PROGRAMS_PER_SM": 4, "num_warps": 4, "num_stages": 1},
                {"BKD": 8, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1},  # non-persistent
                {"BKD": 32, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1}],
    # A100 (mma.sync, no wgmma): every 4-warp candidate spills there (4-328 B, `kernels --target sm_80 --candidates`)
    per_target={"sm_80": [({}, {"BKD": 16, "PROGRAMS_PER_SM": 0, "num_warps": 8, "num_stages": 1})]}))


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
def _load_beta(beta, rows, mask, H: tl.constexpr, i_h, BETA_SIGMOID: tl.constexpr):
    """beta [T, H] of head i_h at `rows`, fp32, sigmoid applied when BETA_SIGMOID; 0 where ~mask."""
    b = tl.load(beta + rows * H + i_h, mask=mask, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.where(mask, tl.sigmoid(b), 0.0)
    return b


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
def _chunk_intra(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, slots, glast, w, u, qd, kd, aqk,
                 scale, sq, sk, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
                 PERSISTENT: tl.constexpr):
    """PERSISTENT: program p takes the (chunk, head) items p, p + P, ... (item = head * n_chunks + chunk) and keeps
    each one's G and L in its own slot of slots [P, BT * (K + BT)] fp32 (G [BT, K], then L [BT, BT]), rewritten in
    place per item, so on paper they stay in L2 (13.0 MB at P = 264, K = 128 on an H200) instead of costing 512 B
    of DRAM writes per token and head for G. Otherwise one program (and slot) per item. Only G's last row per chunk
    is stored, into glast [chunks, H, K], for the state pass."""
    pid = tl.program_id(0)
    slot = slots + pid.to(tl.int64) * (BT * (K + BT))
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
    """Work item `item` (head item // n_chunks, chunk item % n_chunks) with G and L in `slot`; spare chunks are
    empty."""
    i_c = item % n_chunks
    i_h = item // n_chunks
    start = tl.load(chunk_start + i_c).to(tl.int64)
    end = tl.load(chunk_end + i_c).to(tl.int64)
    if start < end:
        tl.debug_barrier()  # every thread is done reading the previous item's G and L from the slot
        _one_chunk(q, k, v, g, beta, A_log, dt_bias, start, end, i_c, i_h, slot - start * K, slot + BT * K, glast,
                   w, u, qd, kd, aqk, scale, sq, sk, sv, H, K, V, BT, BC, BK, BV, BKD, GATE, L2NORM, BETA_SIGMOID,
                   PREC, INTERPRET)


@triton.jit
def _one_chunk(q, k, v, g, beta, A_log, dt_bias, start, end, i_c, i_h, gl, lslot, glast, w, u, qd, kd, aqk, scale, sq,
               sk, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Stage 1 of chunk rows start..end-1 and head i_h; G[row, :] at gl + row * K, L's blocks at lslot [BT, BT].
    Row blocks i_b and, inside, earlier row blocks j_b are runtime loops over [BC, *] tiles (unrolled over whole
    [BT, BK] tiles, the kernel held 255 registers x 8 warps, spilled, and compiled for minutes). Carrying L or the
    inverse through that loop in registers spilled under triton 3.6 (28-56 B at 4 warps), hence the slot."""
    _chunk_decay(g, A_log, dt_bias, gl, start, end, i_h, H, K, BT, BK, min(BK, 32), GATE)
    tl.debug_barrier()  # the row blocks read G back
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
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
            b_beta = _load_beta(beta, rows, m_r, H, i_h, BETA_SIGMOID)
            # this block's rows against earlier blocks j < r: the decay split at r, both factors <= 1; exp(G) of
            # the rows as exp(G - G_r) exp(G_r) (both <= 1): one exponential per column instead of one per element
            g_r = tl.load(gl + r * K + o_k, mask=m_k, other=0.0)
            e_r = tl.exp(tl.where(mask_rk, b_g - g_r[None, :], 0.0))
            e_g = e_r * tl.exp(g_r)[None, :]
            tl.store(qd + offs_rk, to_output_dtype(b_q * e_g * scale, qd, INTERPRET), mask=mask_rk)
            b_kd = b_k * tl.exp(tl.where(mask_rk, g_last[None, :] - b_g, 0.0))
            tl.store(kd + offs_rk, to_output_dtype(b_kd, kd, INTERPRET), mask=mask_rk)
            # W's right-hand side Diag(beta) exp(G) * K waits in W's rows for _apply_inverse (U's, beta * v, is
            # formed there from v)
            tl.store(w + offs_rk, to_output_dtype(b_k * e_g * b_beta[:, None], w, INTERPRET), mask=mask_rk)
            q_r = b_q * e_r * scale
            k_r = b_k * e_r
            offs_a = (rows[:, None] * H + i_h) * BT
            offs_l = (i_b * BC + o_c[:, None]) * BT + o_c[None, :]  # L's row block i_b, column block 0, in lslot
            for j_b in range(0, i_b):
                rows_j = start + j_b * BC + o_c  # all < r < end
                p_kj = k + rows_j[:, None] * sk + i_h * K + o_k[None, :]
                k_j = l2_normalize_rows(tl.load(p_kj, mask=m_k[None, :], other=0.0).to(tl.float32), L2NORM)
                g_j = tl.load(gl + rows_j[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
                k_hat = tl.trans(k_j * tl.exp(tl.where(m_k[None, :], g_r[None, :] - g_j, 0.0)))
                a_qk = tl.dot(q_r, k_hat, input_precision=PREC)
                tl.store(aqk + offs_a + j_b * BC + o_c[None, :], to_output_dtype(a_qk, aqk, INTERPRET),
                         mask=m_r[:, None])
                a_kk = tl.dot(k_r, k_hat, input_precision=PREC) * b_beta[:, None]
                tl.store(lslot + offs_l + j_b * BC, a_kk)
            d_qk, d_kk = _diag_block(q, k, gl, sq, sk, r, end, n_q, n_k, i_h, K, BC, BK, BKD)
            d_qk = tl.where(o_c[:, None] >= o_c[None, :], d_qk * scale, 0.0)
            d_kk = tl.where(o_c[:, None] > o_c[None, :], d_kk * b_beta[:, None], 0.0)
            tl.store(aqk + offs_a + i_b * BC + o_c[None, :], to_output_dtype(d_qk, aqk, INTERPRET), mask=m_r[:, None])
            # the diagonal block's inverse in place of L_ii (exact fp32 forward substitution in registers)
            tl.store(lslot + offs_l + i_b * BC, _unit_lower_inverse(d_kk, BC))
    tl.debug_barrier()  # _invert and _apply_inverse read what every thread stored in lslot and W
    # fp32 inputs: 3xTF32 tensor-core dots (near-IEEE) here, where IEEE [64, 64] operands on CUDA cores spill
    INV_PREC: tl.constexpr = "tf32x3" if PREC == "ieee" else PREC
    ai = _invert(lslot, start, end, BT, BC, INV_PREC)
    _apply_inverse(ai, v, beta, start, end, i_h, w, u, sv, H, K, V, BT, BK, BV, BETA_SIGMOID, INV_PREC, INTERPRET)
    tl.debug_barrier()  # _fold_query reads the W every thread stored
    _fold_query(w, qd, aqk, start, end, i_h, H, K, BT, BK, INV_PREC, INTERPRET)


@triton.jit
def _invert(lslot, start, end, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 [BT, BT] fp32, built in registers by block forward substitution over the row blocks i:
    X_i = D_i E_i - D_i (sum_{j < i} L_ij X_j), with lslot [BT, BT] holding L's strictly lower blocks L_ij and, in
    place of L_ii, D_i = (I + L_ii)^-1. The diagonal blocks stay exact fp32; the merges are tensor-core dots
    ([BC, BT] x [BT, BT], then [BC, BC] x [BC, BT]). Row blocks past the chunk's end stay zero."""
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    x = tl.zeros([NB, BC, BT], dtype=tl.float32)
    for i_b in range(0, NB):
        if start + i_b * BC < end:
            rows = i_b * BC + o_c
            row = tl.load(lslot + rows[:, None] * BT + o_t[None, :], mask=(o_t < i_b * BC + BC)[None, :], other=0.0)
            d_i = tl.load(lslot + rows[:, None] * BT + i_b * BC + o_c[None, :])
            merged = tl.dot(tl.where(o_t[None, :] < i_b * BC, row, 0.0), tl.reshape(x, [BT, BT]),
                            input_precision=PREC)
            x_i = tl.where(o_t[None, :] >= i_b * BC, row, 0.0) - tl.dot(d_i, merged, input_precision=PREC)
            x = tl.where((o_b == i_b)[:, None, None], x_i[None, :, :], x)
    return tl.reshape(x, [BT, BT])


@triton.jit
def _apply_inverse(ai, v, beta, start, end, i_h, w, u, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                   PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """W = ai @ (W's rows: the right-hand sides, overwritten in place) and U = ai @ Diag(beta) V, in column slices
    of 32, ai = (I + L)^-1 [BT, BT] fp32."""
    rows = start + tl.arange(0, BT)
    m_t = rows < end
    b_beta = _load_beta(beta, rows, m_t, H, i_h, BETA_SIGMOID)  # reloaded, not kept live across the loop
    for k0 in range(0, BK, 32):
        o_k = k0 + tl.arange(0, 32)
        mask = m_t[:, None] & (o_k < K)[None, :]
        p_w = w + (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_w = tl.dot(ai, tl.load(p_w, mask=mask, other=0.0).to(tl.float32), input_precision=PREC)
        tl.debug_barrier()  # every thread has read this slice's right-hand sides before any overwrites them
        tl.store(p_w, to_output_dtype(b_w, w, INTERPRET), mask=mask)
    for v0 in range(0, BV, 32):
        o_v = v0 + tl.arange(0, 32)
        mask = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + rows[:, None] * sv + i_h * V + o_v[None, :], mask=mask, other=0.0).to(tl.float32)
        b_u = tl.dot(ai, b_v * b_beta[:, None], input_precision=PREC)
        tl.store(u + (rows[:, None] * H + i_h) * V + o_v[None, :], to_output_dtype(b_u, u, INTERPRET), mask=mask)


@triton.jit
def _fold_query(w, qd, aqk, start, end, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Q' = Qd - Tril(A_qk) W over Qd in place, from W and A_qk as stored (the operands the old output pass met in
    U - W h and Tril(A_qk) U'): bf16 dot operands for 16-bit inputs (exact, as they are stored), fp32 ones (PREC)
    for fp32 inputs. Run after _apply_inverse, whose (I + L)^-1 is dead by then (with both live, fp32 inputs
    spilled 24-88 B). [BT / 2, BT] x [BT, 32] steps: whole [BT, BT] A_qk tiles (their 64-bit pointers) spilled
    8-16 B under triton 3.6."""
    DOT_BF16: tl.constexpr = PREC == "tf32"  # 16-bit inputs: W and A_qk are stored bf16
    BR: tl.constexpr = BT // 2
    rows = start + tl.arange(0, BT)
    m_t = rows < end
    o_t = tl.arange(0, BT)
    for k0 in range(0, BK, 32):
        o_k = k0 + tl.arange(0, 32)
        m_k = (o_k < K)[None, :]
        b_w = dot_operand(tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k,
                                  other=0.0), DOT_BF16, INTERPRET)
        for r0 in range(0, BT, BR):
            o_r = r0 + tl.arange(0, BR)
            rows_r = start + o_r
            m_r = (rows_r < end)[:, None]
            tril = m_r & (o_r[:, None] >= o_t[None, :])  # A_qk's upper blocks are never written
            a_qk = tl.load(aqk + (rows_r[:, None] * H + i_h) * BT + o_t[None, :], mask=tril, other=0.0)
            offs = (rows_r[:, None] * H + i_h) * K + o_k[None, :]
            b_qd = tl.load(qd + offs, mask=m_r & m_k, other=0.0).to(tl.float32)
            tl.debug_barrier()  # every thread has read these rows of Qd before any overwrites them
            b_q = b_qd - tl.dot(dot_operand(a_qk, DOT_BF16, INTERPRET), b_w, input_precision=PREC)
            tl.store(qd + offs, to_output_dtype(b_q, qd, INTERPRET), mask=m_r & m_k)


def chunk_intra(q, k, v, g, beta, chunk_start, chunk_end, n_chunks, *, scale, BT, l2norm, beta_sigmoid, prec,
                interpret, gate=False, A_log=None, dt_bias=None):
    """q, k [T, H, K], v [T, H, V] (rows may be strided), g [T, H, K] (the log decay, or the raw gate logits when
    `gate`), beta [T, H] -> (G_last fp32 [n_chunks, H, K]: G's last row per chunk, W, U, Q', Kd, A_qk [T, H, BT]
    (lower block triangle only)): bf16 for 16-bit inputs, fp32 for fp32 inputs."""
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
    slots = torch.empty(programs, BT * (K + BT), dtype=torch.float32, device=q.device)
    meta["BKD"] = BK if widen() else min(BK, meta["BKD"])
    _chunk_intra[(programs,)](
        q, k, v, g, beta, A_log if gate else glast, dt_bias if gate else glast, chunk_start, chunk_end, n_chunks,
        slots, glast, w, u, qd, kd, aqk, scale, q.stride(0), k.stride(0), v.stride(0),
        H=H, K=K, V=V, BT=BT, BC=16, BK=BK, BV=max(16, triton.next_power_of_2(V)), GATE=gate,
        L2NORM=l2norm, BETA_SIGMOID=beta_sigmoid, PREC=prec, INTERPRET=interpret, PERSISTENT=per_sm > 0,
        **meta, **options)
    return glast, w, u, qd, kd, aqk
