"""KDA decode core: 1-4 tokens per sequence on an fp32 state pool [S, H, K, V], updated in place at the slots
`ssm_state_indices` [N]. One program per (sequence, head, BV columns): the state tile [K, BV] stays in registers
for the sequence's T tokens and is written back once. Slots not indexed are never touched. A negative slot (vLLM's
PAD_SLOT_ID = -1, the rows a CUDA-graph batch is padded with) is a padding row: no state is read or written and its
outputs are zero (fla's kernel and the torch backends do not check for it).

Per token (fp32): S *= exp(g)[:, None]; u = beta * (v - k @ S); S += outer(k, u); o = (scale * q) @ S,
with the q/k L2 norm, the gate and the beta sigmoid optionally fused (flags as in chunk_prep.py). q, k and v
are read through their sequence and token strides (heads and channels contiguous), so the block's views of the conv
output are not copied.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, live_rows, ordered_grid, ordered_ids, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import kda_decay, l2_normalize_rows, to_output_dtype

# BV columns of the [K, V] state per program (K whole: BK = next_pow2(K)). BV = 32 at 4 warps: the [128, 32] fp32
# tile is 32 registers per thread, 80-126 in all, no spills, 4-6 CTAs/SM; N x H x V/BV programs (128 CTAs at N = 1,
# H = 32). N <= 2: BV = 16 doubles the programs (256 at N = 1), at 4 warps (53-72 registers, 7-10 CTAs/SM): at 2
# warps the fp32 path spills 8 B under triton 3.6 (the GPU machine's), though not under 3.9.
# V_FASTEST: the grid is (V/BV, H, N), so a state matrix's V/BV column tiles run in consecutive programs and the
# programs in flight read and write whole stretches of the pool; with (N, H, V/BV), as before 2026-12-05, a program's
# 128-byte row pieces 512 B apart met their siblings' N x H programs later (a model, not measured; the old order is
# a candidate for `spark-bench tune`). Past 65535 sequences (grid dimension 2's cap) the wrapper takes the old order.
CONFIGS = declare(ConfigSpace(
    "kda.recurrent_decode._recurrent_decode", key=("N", "K", "V", "dtype"),
    default={"BV": 32, "V_FASTEST": 1, "num_warps": 4},
    # N <= 2: every program is resident at once whatever the order, and V_FASTEST 1 spilled 8 B (fp32, T = 3,
    # fused; ptxas settles on 64 registers there) under triton 3.9
    buckets=[({"N": 2}, {"BV": 16, "V_FASTEST": 0, "num_warps": 4})],
    # sm_100a: BV 16 spilled 8 B at H = 96, T = 2 with the fused gate (the stress-heads preset); BV 32, a declared
    # candidate, compiles clean at every key there (docs/kernels.md, per-target rules)
    per_target={"sm_100a": [({"N": 2}, {"BV": 32, "V_FASTEST": 0, "num_warps": 4})]},
    candidates=[{"BV": 32, "V_FASTEST": 1, "num_warps": 2}, {"BV": 64, "V_FASTEST": 1, "num_warps": 8},
                {"BV": 32, "V_FASTEST": 0, "num_warps": 4}]))


def decode_grid(N: int, H: int, v_blocks: int, meta: dict) -> tuple:
    """The grid of a kernel over state tiles (state_tile), V tiles fastest when meta["V_FASTEST"] and N fits grid
    dimension 2 (meta["V_FASTEST"] is set to the order taken)."""
    grid, v_fastest = ordered_grid(v_blocks, N, (H,), prefer=meta["V_FASTEST"])
    meta["V_FASTEST"] = int(v_fastest)
    return grid


@triton.jit
def state_tile(slots, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               V_FASTEST: tl.constexpr):
    """The [K, BV] state tile of a program of grid (V/BV, H, N) when V_FASTEST, else (N, H, V/BV): (sequence,
    head, its pool slot, K and V offsets and masks, the tile's offsets in a [S, H, K, V] pool and its mask, empty
    for a padding row: slot < 0)."""
    i_v, i_n = ordered_ids(V_FASTEST, 2)
    i_n = i_n.to(tl.int64)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    slot = tl.load(slots + i_n).to(tl.int64)
    offs_s = ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    return i_n, i_h, slot, o_k, o_v, m_k, m_v, offs_s, live_rows(m_k[:, None] & m_v[None, :], slot)


@triton.jit
def delta_step(S, b_q, b_k, b_v, b_g, b_beta, scale):
    """One token of the gated delta rule on a [K, BV] fp32 state tile: S *= exp(g); u = beta (v - k S);
    S += k u^T; o = scale q S. Returns (S, o [BV])."""
    S = S * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_k[:, None] * S, 0))
    S = S + b_k[:, None] * b_u[None, :]
    return S, tl.sum((b_q * scale)[:, None] * S, 0)


@triton.jit
def _recurrent_decode(q, k, v, g, beta, A_log, dt_bias, o, pool, slots, scale, sq_n, sq_t, sk_n, sk_t, sv_n, sv_t,
                      T: tl.constexpr,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      L2NORM: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                      INTERPRET: tl.constexpr, V_FASTEST: tl.constexpr):
    i_n, i_h, slot, o_k, o_v, m_k, m_v, offs_s, mask_s = state_tile(slots, H, K, V, BK, BV, V_FASTEST)
    # a padding row (slot < 0) reads none of its inputs: with q, k, v, g, beta and S all 0, its o is exactly 0
    # whatever garbage it holds (branching around the step instead spilled 8 B in fp32 T = 3 under triton 3.9)
    m_kl = live_rows(m_k, slot)
    m_vl = live_rows(m_v, slot)
    S = tl.load(pool + offs_s, mask=mask_s, other=0.0)
    for t in tl.static_range(T):
        row = (i_n * T + t) * H + i_h  # of the contiguous g, beta and o
        p_q = q + i_n * sq_n + t * sq_t + i_h * K + o_k
        p_k = k + i_n * sk_n + t * sk_t + i_h * K + o_k
        b_q = l2_normalize_rows(tl.load(p_q, mask=m_kl, other=0.0).to(tl.float32), L2NORM)
        b_k = l2_normalize_rows(tl.load(p_k, mask=m_kl, other=0.0).to(tl.float32), L2NORM)
        b_g = tl.load(g + row * K + o_k, mask=m_kl, other=0.0).to(tl.float32)
        if GATE:
            b_g = kda_decay(b_g, A_log, dt_bias, i_h, o_k, m_k, K)
        b_beta = tl.load(beta + row).to(tl.float32)
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
        b_beta = tl.where(slot >= 0, b_beta, 0.0)
        b_v = tl.load(v + i_n * sv_n + t * sv_t + i_h * V + o_v, mask=m_vl, other=0.0).to(tl.float32)
        S, b_o = delta_step(S, b_q, b_k, b_v, b_g, b_beta, scale)
        tl.store(o + row * V + o_v, to_output_dtype(b_o, o, INTERPRET), mask=m_v)
    tl.store(pool + offs_s, S, mask=mask_s)


def kda_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=None,
                         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         A_log=None, dt_bias=None):
    """q, k, g [N, T, H, K], v [N, T, H, V], beta [N, T, H], initial_state (the pool) [S, H, K, V] fp32,
    ssm_state_indices [N] -> (o [N, T, H, V] in v's dtype, the pool, updated in place). q, k and v may be strided
    over N and T (heads and channels contiguous)."""
    N, T, H, K = q.shape
    V = v.shape[-1]
    assert initial_state.dtype == torch.float32 and initial_state.is_contiguous()
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    full_v = max(16, triton.next_power_of_2(V))
    meta, options = split(CONFIGS.pick(N=N, K=K, V=V, dtype=str(v.dtype)))
    meta["BV"] = full_v if widen() else min(meta["BV"], full_v)
    _recurrent_decode[decode_grid(N, H, triton.cdiv(V, meta["BV"]), meta)](
        q, k, v, g, beta,
        A_log.reshape(-1).contiguous() if use_gate_in_kernel else g,
        dt_bias.reshape(-1).contiguous() if use_gate_in_kernel else g,
        o, initial_state, ssm_state_indices.contiguous(), scale, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        T=T, H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)),
        L2NORM=use_qk_l2norm_in_kernel, GATE=use_gate_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        INTERPRET=INTERPRET, **meta, **options)
    return o, initial_state
