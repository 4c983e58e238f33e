"""bf16 routed experts, decode path (few slots): GEMVs on CUDA cores, no alignment and no 16-row tile per token.

  _decode_swiglu  h[p, n] = silu(w1[e, n] . x[t]) * (w3[e, n] . x[t]) for slot p = t*K + k, e = ids[p]: one program
                  per (slot, BN rows of I), bf16 h. With few slots (the shared expert: 1 per token) D is split in S1
                  slices too, and the gate / up dots go out as fp32 partials that _decode_down sums (in order) and
                  activates as it loads h.
  _decode_down    part[p*S + s] = w[p] * (w2[e][:, slice s] @ h[p, slice s]) in fp32: one program per (slot, slice
                  of I, BN rows of D). A token's K slots (and S slices) are separate programs, so T = 1 launches
                  K*S*D/BN of them (Kimi-Linear: 1152) instead of D/BN with a serial loop over the slots.
  _sum_slots      y[t] = the token's K*S partials summed in a fixed order (kernels/moe/slots.py): deterministic.
S1 and S (slices of D and of I) are the smallest splits that reach MIN_CTAS programs.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.slots import sum_slots

SWIGLU_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_swiglu", key=("P", "D", "I"),
    default={"BN": 8, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
    candidates=[{"BN": 16, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
                {"BN": 8, "BK": 512, "MIN_CTAS": 2048, "num_warps": 8}],
    doc="BN rows of w1 and of w3 per program, BK columns of D per step, D split until MIN_CTAS programs"))
DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_down", key=("P", "D", "I"),
    default={"BN": 16, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
    buckets=[({"P": 2}, {"BN": 16, "BK": 128, "MIN_CTAS": 1024, "num_warps": 4})],  # shared expert: S slices of I
    # BN=16 with BK=512 at 8 warps spilled 4 B at D = 7168 (DeepSeek-V3) on sm_90a: `kernels --candidates` found it
    candidates=[{"BN": 8, "BK": 256, "MIN_CTAS": 1024, "num_warps": 4},
                {"BN": 8, "BK": 512, "MIN_CTAS": 2048, "num_warps": 8}],
    doc="BN rows of w2 per program, BK columns of I per step, I split until the grid has MIN_CTAS programs"))


@triton.jit
def _decode_swiglu(x, w13, h, topk_ids, D, I, D_SPLIT, S1, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PARTS: tl.constexpr, RNE: tl.constexpr):
    """Program (p*S1 + s, n-tile): the gate and up dots of slot p over slice s of D. PARTS (S1 > 1): writes them as
    fp32 partials h[p*S1 + s] = [gate | up] ([P*S1, 2I]) for _decode_down to finish; else bf16 h[p] = SwiGLU."""
    i_ps, i_n = tl.program_id(0), tl.program_id(1)
    s = i_ps // S1
    e = tl.load(topk_ids + s).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    w_gate = w13 + e * 2 * I * D + o_n[:, None].to(tl.int64) * D
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    k_end = tl.minimum(D, (i_ps % S1 + 1) * D_SPLIT)
    for k0 in range(i_ps % S1 * D_SPLIT, k_end, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_end
        xv = tl.load(x + (s // K) * D + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        m_w = m_n[:, None] & m_k[None, :]
        acc_g += tl.load(w_gate + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(w_gate + I * D + o_k[None, :], mask=m_w, other=0.0).to(tl.float32) * xv
    g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    if PARTS:
        tl.store(h + i_ps.to(tl.int64) * 2 * I + o_n, g, mask=m_n)
        tl.store(h + i_ps.to(tl.int64) * 2 * I + I + o_n, u, mask=m_n)
    else:
        tl.store(h + s * I + o_n, round_bf16(g / (1.0 + tl.exp(-g)) * u, RNE).to(h.dtype.element_ty), mask=m_n)


@triton.jit
def _h_slice(h, p, o_k, m_k, I, S1, PARTS: tl.constexpr):
    """h[p, o_k] in fp32: loaded, or (PARTS) SwiGLU of the S1 gate / up partials summed in order."""
    if PARTS:
        g = tl.zeros(o_k.shape, dtype=tl.float32)
        u = tl.zeros(o_k.shape, dtype=tl.float32)
        for s in range(S1):
            row = h + (p * S1 + s).to(tl.int64) * 2 * I
            g += tl.load(row + o_k, mask=m_k, other=0.0)
            u += tl.load(row + I + o_k, mask=m_k, other=0.0)
        hv = g / (1.0 + tl.exp(-g)) * u
    else:
        hv = tl.load(h + p * I + o_k, mask=m_k, other=0.0).to(tl.float32)
    return hv


@triton.jit
def _decode_down(h, w2, topk_ids, topk_weights, part, D, I, I_SPLIT, S, S1, BN: tl.constexpr, BK: tl.constexpr,
                 PARTS: tl.constexpr):
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
        hv = _h_slice(h, p, o_k, m_k, I, S1, PARTS)
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


def up_split(P: int, D: int, I: int, BN: int, min_ctas: int) -> tuple[int, int]:
    """(S1, D_SPLIT): slices of D (D_SPLIT a multiple of 64) giving P*S1*cdiv(I, BN) >= min_ctas programs."""
    want = max(1, min(triton.cdiv(D, 64), triton.cdiv(min_ctas, P * triton.cdiv(I, BN))))
    d_split = triton.cdiv(triton.cdiv(D, want), 64) * 64
    return triton.cdiv(D, d_split), d_split


def decode(x, topk_ids, topk_weights, w13, w2, split_i: int | None = None, split_d: int | None = None):
    """y [T, D] for few slots. split_i / split_d: force the slice width of I (down) and of D (gate/up; tests).
    Under the interpreter D is not split unless forced."""
    T, D = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    P = T * K
    meta, options = split(SWIGLU_CONFIGS.pick(P=P, D=D, I=I))
    BN, BK = (_block(I, 128), _block(D, 256) if split_d is None else 16) if INTERPRET else (meta["BN"], meta["BK"])
    S1, d_split = (1, D) if INTERPRET else up_split(P, D, I, BN, meta["MIN_CTAS"])
    if split_d is not None:
        S1, d_split = triton.cdiv(D, split_d), split_d
    parts = S1 > 1
    h = torch.empty((P * S1, 2 * I) if parts else (P, I), dtype=torch.float32 if parts else x.dtype,
                    device=x.device)
    _decode_swiglu[(P * S1, triton.cdiv(I, BN))](x, w13, h, topk_ids, D, I, d_split, S1, K=K, BN=BN, BK=BK,
                                                 PARTS=parts, RNE=rounds_bf16(h.dtype), **options)
    meta, options = split(DOWN_CONFIGS.pick(P=P, D=D, I=I))
    BN, BK = (_block(D, 128), _block(I, 256) if split_i is None else 16) if INTERPRET else (meta["BN"], meta["BK"])
    S, i_split = down_split(P, D, I, BN, BK, meta["MIN_CTAS"])
    if split_i is not None:
        S, i_split = triton.cdiv(I, split_i), split_i
    part = torch.empty((P * S, D), dtype=torch.float32, device=x.device)
    _decode_down[(P * S, triton.cdiv(D, BN))](h, w2, topk_ids, topk_weights, part, D, I, i_split, S, S1, BN=BN,
                                              BK=BK, PARTS=parts, **options)
    return sum_slots(part, T, x.dtype)
