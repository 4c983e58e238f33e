"""Fused routed experts, bf16 weights: y[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e] x[t]) * (w3[e] x[t])), e = ids[t,k].

w13 [E, 2I, D] holds the gate rows (w1) then the up rows (w3); w2 is [E, D, I].

Grouped path (prefill): moe_align -> _grouped_swiglu (tiles of BM sorted slots x BN of I, both GEMMs of w1|w3 in one
pass, SwiGLU in the epilogue, h [T*K, I]) -> _grouped_down (h @ w2[e].T, routed weight in the epilogue, one row per
slot) -> _sum_slots (y[t] = sum over its K slots, fp32). Tiles past the padded count exit at once.
Decode path (T*K <= min(DECODE_MAX_SLOTS, 2E)): no alignment and no 16-row tile per token: _decode_swiglu is one
GEMV per (slot, BN of I), _decode_down accumulates a token's K slots (weights applied) for a BN slice of D and writes y.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.align import moe_align

# The grouped (prefill) GEMMs: BN x BK tiles (BM follows the routing load). On sm_90a (triton 3.6) with D or I not
# a multiple of 16, BM = 64 spilled 92-556 B at 4 warps and BM = 16 spilled 12 B at 8: warps follow BM.
GROUPED_CONFIGS = declare(ConfigSpace(
    "moe.experts._grouped", key=("BM", "D", "I"), default={"BN": 64, "BK": 64, "num_warps": 8},
    buckets=[({"BM": 32}, {"BN": 64, "BK": 64, "num_warps": 4})],
    candidates=[{"BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
                {"BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4}]))
DECODE_MAX_SLOTS = 64  # GEMV path while T*K <= 64 and <= 2 E (few re-reads of an expert); untuned: check on GPU


@triton.jit
def _grouped_swiglu(x, w13, h, sorted_ids, expert_ids, num_post, D, I, n_slots, K: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    RNE: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m * BM >= tl.load(num_post):
        return
    e = tl.load(expert_ids + i_m).to(tl.int64)
    rows = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_row = rows < n_slots
    tok = (rows // K).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    w_gate = w13 + e * 2 * I * D + o_n[None, :].to(tl.int64) * D
    w_up = w_gate + I * D
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < D
        a = tl.load(x + tok[:, None] * D + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        m_b = m_k[:, None] & m_n[None, :]
        bg = tl.load(w_gate + o_k[:, None], mask=m_b, other=0.0)
        bu = tl.load(w_up + o_k[:, None], mask=m_b, other=0.0)
        if UPCAST_DOT:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h + rows[:, None].to(tl.int64) * I + o_n[None, :], round_bf16(act, RNE).to(h.dtype.element_ty),
             mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _grouped_down(h, w2, topk_weights, y, sorted_ids, expert_ids, num_post, D, I, n_slots,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST_DOT: tl.constexpr, RNE: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m * BM >= tl.load(num_post):
        return
    e = tl.load(expert_ids + i_m).to(tl.int64)
    rows = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_row = rows < n_slots
    rows64 = rows.to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    w_row = w2 + e * D * I + o_n[None, :].to(tl.int64) * I
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < I
        a = tl.load(h + rows64[:, None] * I + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w_row + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    acc *= tl.load(topk_weights + rows, mask=m_row, other=0.0)[:, None]
    tl.store(y + rows64[:, None] * D + o_n[None, :], round_bf16(acc, RNE).to(y.dtype.element_ty),
             mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _sum_slots(y_slots, y, T, D, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr):
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (o_t[:, None] < T) & (o_d[None, :] < D)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(y_slots + (o_t[:, None] * K + k) * D + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + o_t[:, None] * D + o_d[None, :], round_bf16(acc, RNE).to(y.dtype.element_ty), mask=mask)


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
def _decode_down(h, w2, topk_ids, topk_weights, y, D, I, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 RNE: tl.constexpr):
    t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k in range(K):
        e = tl.load(topk_ids + t * K + k).to(tl.int64)
        rw = tl.load(topk_weights + t * K + k)
        w_row = w2 + e * D * I + o_n[:, None].to(tl.int64) * I
        for k0 in range(0, I, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < I
            hv = tl.load(h + (t * K + k) * I + o_k, mask=m_k, other=0.0).to(tl.float32) * rw
            acc += tl.load(w_row + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32) \
                * hv[None, :]
    tl.store(y + t * D + o_n, round_bf16(tl.sum(acc, axis=1), RNE).to(y.dtype.element_ty), mask=m_n)


def _block(n: int, cap: int) -> int:
    return max(16, min(next_pow2(n), cap))


def _decode(x, topk_ids, topk_weights, w13, w2):
    T, D = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    h = torch.empty((T * K, I), dtype=x.dtype, device=x.device)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    BN, BK = (_block(I, 128), _block(D, 256)) if INTERPRET else (16, 256)
    _decode_swiglu[(T * K, triton.cdiv(I, BN))](x, w13, h, topk_ids, D, I, K=K, BN=BN, BK=BK,
                                                        RNE=rounds_bf16(h.dtype))
    BN, BK = (_block(D, 128), _block(I, 256)) if INTERPRET else (16, 256)
    _decode_down[(T, triton.cdiv(D, BN))](h, w2, topk_ids, topk_weights, y, D, I, K=K, BN=BN, BK=BK,
                                                   RNE=rounds_bf16(y.dtype))
    return y


def _grouped(x, topk_ids, topk_weights, w13, w2, block_m):
    T, D = x.shape
    E, K, I = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, E, block_m)
    tiles = expert_ids.shape[0]
    h = torch.empty((T * K, I), dtype=x.dtype, device=x.device)
    y_slots = torch.empty((T * K, D), dtype=x.dtype, device=x.device)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    meta, options = split(GROUPED_CONFIGS.pick(BM=block_m, D=D, I=I))
    BN, BK = (_block(I, 128), _block(D, 128)) if INTERPRET else (meta["BN"], meta["BK"])
    _grouped_swiglu[(tiles, triton.cdiv(I, BN))](x, w13, h, sorted_ids, expert_ids, num_post, D, I, T * K, K=K,
                                                 BM=block_m, BN=BN, BK=BK, UPCAST_DOT=INTERPRET,
                                                 RNE=rounds_bf16(h.dtype), **options)
    BN, BK = (_block(D, 128), _block(I, 128)) if INTERPRET else (meta["BN"], meta["BK"])
    _grouped_down[(tiles, triton.cdiv(D, BN))](h, w2, topk_weights, y_slots, sorted_ids, expert_ids, num_post, D,
                                               I, T * K, BM=block_m, BN=BN, BK=BK, UPCAST_DOT=INTERPRET,
                                               RNE=rounds_bf16(y_slots.dtype), **options)
    BT, BD = (_block(T, 64), _block(D, 256)) if INTERPRET else (16, 128)
    _sum_slots[(triton.cdiv(T, BT), triton.cdiv(D, BD))](y_slots, y, T, D, K=K, BT=BT, BD=BD,
                                                          RNE=rounds_bf16(y.dtype))
    return y


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, path: str = "auto") -> torch.Tensor:
    """x [T, D], topk_ids [T, K] int, topk_weights [T, K] f32, w13 [E, 2I, D], w2 [E, D, I] -> y [T, D] (x.dtype).
    path: "auto" (decode when T*K <= min(DECODE_MAX_SLOTS, 2E)), "decode" or "grouped"."""
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.float().contiguous()
    T, K = topk_ids.shape
    if T == 0:
        return torch.zeros_like(x)
    if path == "auto":
        path = "decode" if T * K <= min(DECODE_MAX_SLOTS, 2 * w13.shape[0]) else "grouped"
    if path not in ("decode", "grouped"):
        raise ValueError(f"unknown path {path!r}: auto, decode or grouped")
    if path == "decode":
        return _decode(x, topk_ids, topk_weights, w13, w2)
    block_m = 16 if T <= w13.shape[0] or INTERPRET else 64  # vLLM's default: BLOCK_M 16 while M <= E
    return _grouped(x, topk_ids, topk_weights, w13, w2, block_m)
