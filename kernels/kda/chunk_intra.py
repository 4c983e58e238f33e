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
and an fp32 G there. q, k and v are read through their token strides (the block's views of the conv output are not
copied).

One file per part: this one holds the row-block loop (off-diagonal blocks, the decayed operands) and the launch;
chunk_diag.py the 16 x 16 diagonal blocks; chunk_solve.py the solve and what is formed from (I + L)^-1.
Overflow (kda.md pitfall 4): exp(G_i - G_j) is never split at the chunk start. Off-diagonal blocks split it at the
row block's first token r: (q_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)) with j < r <= i, both factors <= 1.
Dot operands are fp32 (tf32 tensor cores for 16-bit inputs; IEEE for fp32 inputs in the row-block loop, 3xTF32 in
the solve): the interpreter's bf16 dot is broken (kernels/common.py), and the decay-scaled operands are formed in
fp32 anyway.
"""

import triton
import triton.language as tl
from spark_bench.kernels.common import widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_diag import diag_block
from spark_bench.kernels.kda.chunk_prep import kda_decay, l2_normalize_rows, tf32, to_output_dtype
from spark_bench.kernels.kda.chunk_solve import apply_inverse, fold_query, invert, load_beta, unit_lower_inverse

from spark_bench import triton_env

# BKD: the K slice of the diagonal blocks' products (diag_block); elem: the input's element bytes. 4 warps, 2 CTAs
# per SM on sm_90a: 16-bit inputs 230-241 registers (triton 3.9), up to 255 under 3.6; fp32 inputs (IEEE dots on
# CUDA cores in the row-block loop) 252-254 under both, BKD 8 spills 4 B under 3.9 there. 16-bit took BKD 8 until
# fold_query (session 29): with it, BKD 8 spills 8-16 B under 3.6 (the fused gate / L2 norm / beta sigmoid
# variant: a hoisted 64-bit pointer of the persistent loop), BKD 4 4 B, BKD 16 none; at K <= 32 (the quick sweep's
# heads) it is the other way round: BKD 16 spills 4 B under 3.6, BKD 8 none.
# PROGRAMS_PER_SM: the persistent grid is PROGRAMS_PER_SM x SMs programs (one slot each), the CTAs per SM the
# config reaches (more programs than fit only wait for an SM); 0: one program per (chunk, head), with as many slots
# (whether the persistent loop wins is for `spark-bench tune` on a GPU). fp32 inputs take 0: their persistent loop
# spills 8-52 B at 4 warps. 8 warps spill at most keys under triton 3.6 (8-52 B; session 27's candidate gate).
CONFIGS = declare(ConfigSpace(
    "kda.chunk_intra._chunk_intra", key=("K", "V", "elem"),
    default={"BKD": 16, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1},
    # Outside the presets (head_dim 64), 16-bit, triton 3.6 (no register of headroom there): BKD 16 spilled 4 B at
    # V <= 64 and 36-40 B at K = 64, and the persistent loop still 24 B at K = 64 with BKD 8 (ptxas hoists a
    # pointer out of it): V <= 64 takes BKD 8, K = 64 BKD 8 without the persistent loop (same exponentials, bytes)
    buckets=[({"K": 32, "elem": 2}, {"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1}),
             ({"K": 64, "elem": 2}, {"BKD": 8, "PROGRAMS_PER_SM": 0, "num_warps": 4, "num_stages": 1}),
             ({"V": 64, "elem": 2}, {"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1}),
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
def _chunk_intra(q, k, v, g, beta, A_log, dt_bias, chunk_start, chunk_end, n_chunks, slots, glast, w, u, qd, kd, aqk,
                 scale, sq, sk, sv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, GATE: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
                 PERSISTENT: tl.constexpr):
    """PERSISTENT: program p takes the (chunk, head) items p, p + P, ... (item = chunk * H + head) and keeps
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
    """Work item `item` (chunk item // H, head item % H) with G and L in `slot`; spare chunks are empty. Heads
    fastest: the items in flight read and write whole token rows of q, k, v, g and W, U, Q', Kd ([T, H, *]); with
    chunks fastest, as before 2026-12-05, they took one head's 256-byte piece of each 8 KB row (H = 32, K = 128)."""
    i_c = item // H
    i_h = item % H
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
            b_beta = load_beta(beta, rows, m_r, H, i_h, BETA_SIGMOID)
            # this block's rows against earlier blocks j < r: the decay split at r, both factors <= 1; exp(G) of
            # the rows as exp(G - G_r) exp(G_r) (both <= 1): one exponential per column instead of one per element
            g_r = tl.load(gl + r * K + o_k, mask=m_k, other=0.0)
            e_r = tl.exp(tl.where(mask_rk, b_g - g_r[None, :], 0.0))
            e_g = e_r * tl.exp(g_r)[None, :]
            tl.store(qd + offs_rk, to_output_dtype(b_q * e_g * scale, qd, INTERPRET), mask=mask_rk)
            b_kd = b_k * tl.exp(tl.where(mask_rk, g_last[None, :] - b_g, 0.0))
            tl.store(kd + offs_rk, to_output_dtype(b_kd, kd, INTERPRET), mask=mask_rk)
            # W's right-hand side Diag(beta) exp(G) * K waits in W's rows for apply_inverse (U's, beta * v, is
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
                k_hat = tf32(tl.trans(k_j * tl.exp(tl.where(m_k[None, :], g_r[None, :] - g_j, 0.0))), PREC, INTERPRET)
                a_qk = tl.dot(tf32(q_r, PREC, INTERPRET), k_hat, input_precision=PREC)
                tl.store(aqk + offs_a + j_b * BC + o_c[None, :], to_output_dtype(a_qk, aqk, INTERPRET),
                         mask=m_r[:, None])
                a_kk = tl.dot(tf32(k_r, PREC, INTERPRET), k_hat, input_precision=PREC) * b_beta[:, None]
                tl.store(lslot + offs_l + j_b * BC, a_kk)
            d_qk, d_kk = diag_block(q, k, gl, sq, sk, r, end, n_q, n_k, i_h, K, BC, BK, BKD)
            d_qk = tl.where(o_c[:, None] >= o_c[None, :], d_qk * scale, 0.0)
            d_kk = tl.where(o_c[:, None] > o_c[None, :], d_kk * b_beta[:, None], 0.0)
            tl.store(aqk + offs_a + i_b * BC + o_c[None, :], to_output_dtype(d_qk, aqk, INTERPRET), mask=m_r[:, None])
            # the diagonal block's inverse in place of L_ii (exact fp32 forward substitution in registers)
            tl.store(lslot + offs_l + i_b * BC, unit_lower_inverse(d_kk, BC))
    tl.debug_barrier()  # invert and apply_inverse read what every thread stored in lslot and W
    # fp32 inputs: 3xTF32 tensor-core dots (near-IEEE) here, where IEEE [64, 64] operands on CUDA cores spill
    INV_PREC: tl.constexpr = "tf32x3" if PREC == "ieee" else PREC
    ai = invert(lslot, start, end, BT, BC, INV_PREC, INTERPRET)
    apply_inverse(ai, v, beta, start, end, i_h, w, u, sv, H, K, V, BT, BK, BV, BETA_SIGMOID, INV_PREC, INTERPRET)
    tl.debug_barrier()  # fold_query reads the W every thread stored
    fold_query(w, qd, aqk, start, end, i_h, H, K, BT, BK, INV_PREC, INTERPRET)


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
