"""Fused routed experts, bf16 weights: y[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e] x[t]) * (w3[e] x[t])), e = ids[t,k].

w13 [E, 2I, D] holds the gate rows (w1) then the up rows (w3); w2 is [E, D, I].

Grouped path (prefill): moe_align -> _grouped_swiglu (tiles of BM sorted slots x BN of I, both GEMMs of w1|w3 in one
pass, SwiGLU in the epilogue, h [T*K, I]) -> _grouped_down (h @ w2[e].T, routed weight in the epilogue, one row per
slot) -> _sum_slots (y[t] = sum over its K slots, fp32; kernels/moe/slots.py). Both GEMMs run on a 1-D grid in
grouped tile order (GROUP_M m-tiles sweep every n-tile before the next group starts, so the gathered rows of x or h
stay in L2 instead of being re-read from DRAM once per n-tile); the grid is trimmed to the tiles the routing can
fill (T*K + min(E, T*K)*(BM-1) rows), and tiles past the padded count exit at once. BM follows the mean slots per
expert (BLOCK_M_CONFIGS): 64 or 128 wherever the load allows, so Hopper runs wgmma.
grouped_experts can run the GEMMs per expert group [lo, hi) over one alignment (lo / hi runtime ints: the
tiles of other experts exit at once): the GGUF prefill's bounded bf16 scratch (kernels/moe/experts_gguf.py).
Decode path (T*K <= DECODE_MAX_SLOTS): weight tiles streamed once per hit expert, without alignment; an expert
that several slots share is read once for all of them (kernels/moe/experts_decode.py), so repeats do not bound it.
"""

import math

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.align import moe_align
from spark_bench.kernels.moe.experts_decode import decode
from spark_bench.kernels.moe.slots import sum_slots

# Rows per tile from the mean slots per expert (`load` = T*K // E): padding waste against tensor-core shape.
BLOCK_M_CONFIGS = declare(ConfigSpace(
    "moe.experts.block_m", key=("load",), default={"BM": 128},
    buckets=[({"load": 15}, {"BM": 16}), ({"load": 47}, {"BM": 32}), ({"load": 159}, {"BM": 64})],
    candidates=[{"BM": 64}],
    doc="BM of both grouped GEMMs (and the alignment); load = mean slots per expert"))
# GEMM tiles per BM. On sm_90a (triton 3.6) with D or I not a multiple of 16, BM = 64 spilled 92-556 B at 4 warps
# and BM = 16 spilled 12 B at 8: warps follow BM. GROUP_M m-tiles share their n sweep. ALIGN = gcd(D, I, 16): without
# 16-element rows (the quick sweep's D = 136, I = 72) the 64x64 tiles at BM <= 32 took 255 registers and spilled
# 72-176 B under triton 3.6 (masked unvectorised loads); 32x32 takes 96-148 and none.
SWIGLU_CONFIGS = declare(ConfigSpace(
    "moe.experts._grouped_swiglu", key=("BM", "D", "I", "ALIGN"),
    default={"BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    buckets=[({"BM": 32, "ALIGN": 8}, {"BN": 32, "BK": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
             ({"BM": 32}, {"BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3})],
    candidates=[{"BN": 64, "BK": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 4},
                {"BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}],
    doc="BN columns of w1 and of w3 (two accumulators), BK of D per step, GROUP_M m-tiles per n sweep"))
DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts._grouped_down", key=("BM", "D", "I"),
    default={"BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    buckets=[({"BM": 32}, {"BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
             ({"BM": 64}, {"BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3})],
    candidates=[{"BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
                {"BN": 128, "BK": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3}],
    doc="BN columns of D, BK of I per step, GROUP_M m-tiles per n sweep"))
DECODE_MAX_SLOTS = 64  # decode path while T*K <= 64 (its group tile is [BK, next_pow2(T*K)]); untuned: check on GPU


@triton.jit
def _tile_mn(n_m, n_n, GROUP_M: tl.constexpr):
    """(m-tile, n-tile) of this program in grouped order: GROUP_M consecutive m-tiles, m fastest, sweep all n."""
    pid = tl.program_id(0)
    per_group = GROUP_M * n_n
    first = pid // per_group * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _tile_expert(expert_ids, num_post, i_m, e_lo, e_hi, BM: tl.constexpr):
    """The expert of m-tile i_m relative to e_lo (its weights' index), -1 for a padded tile or one outside
    [e_lo, e_hi)."""
    e = tl.load(expert_ids + i_m, mask=i_m * BM < tl.load(num_post), other=-1)
    return tl.where((e >= e_lo) & (e < e_hi), e - e_lo, -1).to(tl.int64)


# e_lo / e_hi: runtime ints, not specialised on value (no recompile per expert group)
@triton.jit(do_not_specialize=["e_lo", "e_hi"])
def _grouped_swiglu(x, w13, h, sorted_ids, expert_ids, num_post, e_lo, e_hi, D, I, n_slots, n_m, K: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, RNE: tl.constexpr):
    i_m, i_n = _tile_mn(n_m, tl.cdiv(I, BN), GROUP_M)
    e = _tile_expert(expert_ids, num_post, i_m, e_lo, e_hi, BM)
    if e < 0:
        return
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


@triton.jit(do_not_specialize=["e_lo", "e_hi"])
def _grouped_down(h, w2, topk_weights, y, sorted_ids, expert_ids, num_post, e_lo, e_hi, D, I, n_slots, n_m,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  UPCAST_DOT: tl.constexpr, RNE: tl.constexpr):
    i_m, i_n = _tile_mn(n_m, tl.cdiv(D, BN), GROUP_M)
    e = _tile_expert(expert_ids, num_post, i_m, e_lo, e_hi, BM)
    if e < 0:
        return
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


def _block(n: int, cap: int) -> int:
    return max(16, min(next_pow2(n), cap))


def live_tiles(slots: int, experts: int, block_m: int, max_blocks: int) -> int:
    """Tiles the routing can fill: each hit expert (at most min(E, T*K)) pads its segment by < BM rows."""
    return min(max_blocks, triton.cdiv(slots + min(experts, slots) * (block_m - 1), block_m))


def grouped_experts(x, topk_ids, topk_weights, groups, experts, inter, block_m, group_m=None):
    """The grouped path over expert groups: ONE alignment of all `experts`, then for each (lo, w13, w2) of `groups`
    (w13 / w2 holding experts lo .. lo + len(w13) - 1; may be yielded lazily, e.g. into a reused scratch) both
    GEMMs over the same tiles, where the tiles of other experts exit at once: every slot's h and y_slots rows are
    written by the one group holding its expert. One _sum_slots at the end (fixed order: deterministic)."""
    T, D = x.shape
    K, I = topk_ids.shape[1], inter
    P = T * K
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, experts, block_m)
    tiles = live_tiles(P, experts, block_m, expert_ids.shape[0])
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    y_slots = torch.empty((P, D), dtype=x.dtype, device=x.device)
    up, up_options = split(SWIGLU_CONFIGS.pick(BM=block_m, D=D, I=I, ALIGN=math.gcd(D, I, 16)))
    down, down_options = split(DOWN_CONFIGS.pick(BM=block_m, D=D, I=I))
    up_bn, up_bk = (_block(I, 128), _block(D, 128)) if widen() else (up["BN"], up["BK"])
    down_bn, down_bk = (_block(D, 128), _block(I, 128)) if widen() else (down["BN"], down["BK"])
    for lo, w13, w2 in groups:
        hi = lo + w13.shape[0]
        _grouped_swiglu[(tiles * triton.cdiv(I, up_bn),)](
            x, w13, h, sorted_ids, expert_ids, num_post, lo, hi, D, I, P, tiles, K=K, BM=block_m, BN=up_bn,
            BK=up_bk, GROUP_M=group_m or up["GROUP_M"], UPCAST_DOT=INTERPRET, RNE=rounds_bf16(h.dtype), **up_options)
        _grouped_down[(tiles * triton.cdiv(D, down_bn),)](
            h, w2, topk_weights, y_slots, sorted_ids, expert_ids, num_post, lo, hi, D, I, P, tiles, BM=block_m,
            BN=down_bn, BK=down_bk, GROUP_M=group_m or down["GROUP_M"], UPCAST_DOT=INTERPRET,
            RNE=rounds_bf16(y_slots.dtype), **down_options)
    return sum_slots(y_slots, T, x.dtype, ids=topk_ids.reshape(-1), experts=experts)


def block_m_for(slots: int, experts: int) -> int:
    return BLOCK_M_CONFIGS.pick(load=slots // max(1, experts))["BM"]


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, path: str = "auto", block_m: int | None = None,
                  group_m: int | None = None) -> torch.Tensor:
    """x [T, D], topk_ids [T, K] int, topk_weights [T, K] f32, w13 [E, 2I, D], w2 [E, D, I] -> y [T, D] (x.dtype).
    path: "auto" (decode when T*K <= DECODE_MAX_SLOTS), "decode" or "grouped"; block_m / group_m force
    the grouped path's BM and GROUP_M (tests; else from the declared spaces)."""
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.float().contiguous()
    T, K = topk_ids.shape
    if T == 0:
        return torch.zeros_like(x)
    if path == "auto":
        path = "decode" if T * K <= DECODE_MAX_SLOTS else "grouped"
    if path not in ("decode", "grouped"):
        raise ValueError(f"unknown path {path!r}: auto, decode or grouped")
    if path == "decode":
        return decode(x, topk_ids, topk_weights, w13, w2)
    block_m = block_m or block_m_for(T * K, w13.shape[0])
    return grouped_experts(x, topk_ids, topk_weights, [(0, w13, w2)], w13.shape[0], w2.shape[2], block_m,
                           group_m)
