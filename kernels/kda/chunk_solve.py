"""KDA chunk stage 1, the solve (I + L)^-1 and what is formed from it, in two phases as fla splits its intra
solve from `recompute_w_u_fwd` (chunk_intra.py runs them per chunk and head):

1. in the row-block loop, unit_lower_inverse replaces each diagonal block L_ii in the program's fp32 slot by
   D_i = (I + L_ii)^-1 (exact fp32 forward substitution in registers, vector ops);
2. after it, invert builds the whole X = (I + L)^-1 [BT, BT] in registers by block forward substitution,
   X_i = D_i E_i - D_i (L_i,<i X), one tensor-core merge dot per row block (the diagonal blocks stay exact fp32);
   apply_inverse forms W = X (Diag(beta) exp(G) K) (the right-hand side waits in W's rows in the output dtype: bf16
   for 16-bit inputs, rounded before the solve as fla's bf16 recompute_w_u_fwd operands are) and U = X Diag(beta) V
   as [BT, BT] x [BT, 32] dots; fold_query then forms Q' = Qd - Tril(A_qk) W from W and A_qk as stored.

Dot precision is the caller's PREC: tf32 for 16-bit inputs, 3xTF32 for fp32 ones (IEEE [64, 64] operands on CUDA
cores spill).
"""

import triton
import triton.language as tl
from spark_bench.kernels.kda.chunk_prep import dot_operand, tf32, to_output_dtype


@triton.jit
def unit_lower_inverse(L, BC: tl.constexpr):
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
def load_beta(beta, rows, mask, H: tl.constexpr, i_h, BETA_SIGMOID: tl.constexpr):
    """beta [T, H] of head i_h at `rows`, fp32, sigmoid applied when BETA_SIGMOID; 0 where ~mask."""
    b = tl.load(beta + rows * H + i_h, mask=mask, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.where(mask, tl.sigmoid(b), 0.0)
    return b


@triton.jit
def invert(lslot, start, end, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
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
            merged = tl.dot(tf32(tl.where(o_t[None, :] < i_b * BC, row, 0.0), PREC, INTERPRET),
                            tf32(tl.reshape(x, [BT, BT]), PREC, INTERPRET),
                            input_precision=PREC)
            x_i = tl.where(o_t[None, :] >= i_b * BC, row, 0.0) - tl.dot(
                tf32(d_i, PREC, INTERPRET), tf32(merged, PREC, INTERPRET), input_precision=PREC)
            x = tl.where((o_b == i_b)[:, None, None], x_i[None, :, :], x)
    return tl.reshape(x, [BT, BT])


@triton.jit
def apply_inverse(ai, v, beta, start, end, i_h, w, u, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                   PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """W = ai @ (W's rows: the right-hand sides, overwritten in place) and U = ai @ Diag(beta) V, in column slices
    of 32, ai = (I + L)^-1 [BT, BT] fp32."""
    rows = start + tl.arange(0, BT)
    m_t = rows < end
    ai = tf32(ai, PREC, INTERPRET)
    b_beta = load_beta(beta, rows, m_t, H, i_h, BETA_SIGMOID)  # reloaded, not kept live across the loop
    for k0 in range(0, BK, 32):
        o_k = k0 + tl.arange(0, 32)
        mask = m_t[:, None] & (o_k < K)[None, :]
        p_w = w + (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_w = tl.dot(ai, tf32(tl.load(p_w, mask=mask, other=0.0).to(tl.float32), PREC, INTERPRET),
                     input_precision=PREC)
        tl.debug_barrier()  # every thread has read this slice's right-hand sides before any overwrites them
        tl.store(p_w, to_output_dtype(b_w, w, INTERPRET), mask=mask)
    for v0 in range(0, BV, 32):
        o_v = v0 + tl.arange(0, 32)
        mask = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + rows[:, None] * sv + i_h * V + o_v[None, :], mask=mask, other=0.0).to(tl.float32)
        b_u = tl.dot(ai, tf32(b_v * b_beta[:, None], PREC, INTERPRET), input_precision=PREC)
        tl.store(u + (rows[:, None] * H + i_h) * V + o_v[None, :], to_output_dtype(b_u, u, INTERPRET), mask=mask)


@triton.jit
def fold_query(w, qd, aqk, start, end, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Q' = Qd - Tril(A_qk) W over Qd in place, from W and A_qk as stored (the operands the old output pass met in
    U - W h and Tril(A_qk) U'): bf16 dot operands for 16-bit inputs (exact, as they are stored), fp32 ones (PREC)
    for fp32 inputs. Run after apply_inverse, whose (I + L)^-1 is dead by then (with both live, fp32 inputs
    spilled 24-88 B). [BT / 2, BT] x [BT, 32] steps: whole [BT, BT] A_qk tiles (their 64-bit pointers) spilled
    8-16 B under triton 3.6."""
    DOT_BF16: tl.constexpr = w.dtype.element_ty == tl.bfloat16  # 16-bit inputs: W and A_qk are stored bf16
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
