"""bf16 routed experts, decode path (few slots): GEMVs on CUDA cores, no alignment and no 16-row tile per token.

  _decode_swiglu  h[p, n] = silu(w1[e, n] . x[t]) * (w3[e, n] . x[t]) for slot p = t*K + k, e = ids[p]: one program
                  per (slot, BN rows of I), bf16 h.
  _decode_down    part[p*S + s] = w[p] * (w2[e][:, slice s] @ h[p, slice s]) in fp32: one program per (slot, slice
                  of I, BN rows of D). A token's K slots (and S slices) are separate programs, so T = 1 launches
                  K*S*D/BN of them (Kimi-Linear: 1152) instead of D/BN with a serial loop over the slots.
  _sum_slots      y[t] = the token's K*S partials summed in a fixed order (kernels/moe/slots.py): deterministic.
S (slices of I) is the smallest split that reaches MIN_CTAS programs, in BK steps (the shared expert: K = 1).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.slots import sum_slots

SWIGLU_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_swiglu", key=("P", "D", "I"), default={"BN": 8, "BK": 256, "num_warps": 4},
    candidates=[{"BN": 16, "BK": 256, "num_warps": 4}, {"BN": 8, "BK": 512, "num_warps": 8}],
    doc="BN rows of w1 and of w3 per program, BK columns of D per step; P = T*K slots"))
DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_down", key=("P", "D", "I"),
    default={"BN": 16, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
    buckets=[({"P": 2}, {"BN": 16, "BK": 128, "MIN_CTAS": 1024, "num_warps": 4})],  # shared expert: S slices of I
    candidates=[{"BN": 8, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
                {"BN": 16, "BK": 512, "MIN_CTAS": 2048, "num_warps": 8}],
    doc="BN rows of w2 per program, BK columns of I per step, I split until the grid has MIN_CTAS programs"))


@triton.jit
def _decode_swiglu(x, w13, h, topk_ids, D, I, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   RNE: tl.constexpr):
    s, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(topk_ids + s).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    w_gate = w13 + e * 2 * I * D + o_n[:, None].to(tl.int64) * D
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < D
        xv = tl.load(x + (s // K) * D + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        m_w = m_n[:, None] & m_k[None, :]
        acc_g += tl.load(w_gate + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(w_gate + I * D + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * xv
    g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    tl.store(h + s * I + o_n, round_bf16(g / (1.0 + tl.exp(-g)) * u, RNE).to(h.dtype.element_ty), mask=m_n)


@triton.jit
def _decode_down(h, w2, topk_ids, topk_weights, part, D, I, I_SPLIT, S, BN: tl.constexpr, BK: tl.constexpr):
    i_ps, i_n = tl.program_id(0), tl.program_id(1)
    p, i_s = i_ps // S, i_ps % S
    e = tl.load(topk_ids + p).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    w_row = w2 + e * D * I + o_n[:, None].to(tl.int64) * I
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    k_end = tl.minimum(I, (i_s + 1) * I_SPLIT)
    for k0 in range(i_s * I_SPLIT, k_end, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_end
        hv = tl.load(h + p * I + o_k, mask=m_k, other=0.0).to(tl.float32)
        acc += tl.load(w_row + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32) \
            * hv[None, :]
    out = tl.sum(acc, axis=1) * tl.load(topk_weights + p)
    tl.store(part + i_ps.to(tl.int64) * D + o_n, out, mask=m_n)


def _block(n: int, cap: int) -> int:
    return max(16, min(next_pow2(n), cap))


def down_split(P: int, D: int, I: int, BN: int, BK: int, min_ctas: int) -> tuple[int, int]:
    """(S, I_SPLIT): the fewest slices of I (I_SPLIT a multiple of BK) that give P*S*cdiv(D, BN) >= min_ctas."""
    want = max(1, min(triton.cdiv(I, BK), triton.cdiv(min_ctas, P * triton.cdiv(D, BN))))
    i_split = triton.cdiv(triton.cdiv(I, want), BK) * BK
    return triton.cdiv(I, i_split), i_split


def decode(x, topk_ids, topk_weights, w13, w2, split_i: int | None = None):
    """y [T, D] for few slots. split_i: force the slices of I of the down projection (tests)."""
    T, D = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    P = T * K
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    meta, options = split(SWIGLU_CONFIGS.pick(P=P, D=D, I=I))
    BN, BK = (_block(I, 128), _block(D, 256)) if INTERPRET else (meta["BN"], meta["BK"])
    _decode_swiglu[(P, triton.cdiv(I, BN))](x, w13, h, topk_ids, D, I, K=K, BN=BN, BK=BK,
                                            RNE=rounds_bf16(h.dtype), **options)
    meta, options = split(DOWN_CONFIGS.pick(P=P, D=D, I=I))
    BN, BK = (_block(D, 128), _block(I, 256) if split_i is None else 16) if INTERPRET else (meta["BN"], meta["BK"])
    S, i_split = down_split(P, D, I, BN, BK, meta["MIN_CTAS"])
    if split_i is not None:
        S, i_split = triton.cdiv(I, triton.cdiv(I, split_i)), triton.cdiv(I, split_i)
    part = torch.empty((P * S, D), dtype=torch.float32, device=x.device)
    _decode_down[(P * S, triton.cdiv(D, BN))](h, w2, topk_ids, topk_weights, part, D, I, i_split, S, BN=BN, BK=BK,
                                              **options)
    return sum_slots(part, T, x.dtype)
