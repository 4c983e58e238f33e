"""Fused routed experts with GGUF weights dequantized in registers: w1|w3 in Q2_K, w2 in Q3_K (no bf16 copy).

    y[t] = sum_k w[t, k] * (silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T,   e = topk_ids[t, k]

w13 [E, 2I, D/256*84] uint8 (gate rows 0..I-1, up rows I..2I-1), w2 [E, D, I/256*110] uint8; I and D multiples
of 256. Two paths (the SwiGLU intermediate h [T*K, I] goes through memory):
  decode   (few tokens) programs over the flattened (token-slot pair, I row) outputs, then over (pair, slice of I,
           D row) with fp32 partials, which _sum_slots (kernels/moe/slots.py) adds per token in a fixed order: so
           T = 1 launches K*S*D/BR down programs (>= 1,024 at Kimi-Linear sizes) instead of D/BR with a serial loop
           over the K slots, deterministically. Matrix-vector products on CUDA cores, so a single token never pads a
           16-row tensor-core tile; a program's BR rows share one pair (x or h row loaded once).
  grouped  (prefill) pairs aligned by expert (kernels/moe/align.py, vLLM's moe_align_block_size format), BM-row
           tiles through tl.dot against dequantized bf16 weight tiles; per-pair outputs weighted in the epilogue,
           then summed over the K slots by _sum_slots.
Weights are dequantized 32 at a time (kernels/quant/kquants.py): per-row d/dmin once per super-block, then
contiguous code loads with compile-time offsets.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.align import moe_align
from spark_bench.kernels.moe.slots import sum_slots
from spark_bench.kernels.quant.kquants import CHUNK, aligned, block_ptr, block_scales, dequant_chunk

# The grouped (prefill) kernels: BN columns per tile (BM, rows per tile, follows the routing load). 8 warps at every
# BM: at BM = 16 with 4 warps _grouped_down spilled on sm_90a under triton 3.9.
GROUPED_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._grouped", key=("BM",), default={"BN": 64, "num_warps": 8},
    candidates=[{"BN": 64, "num_warps": 4, "num_stages": 2}]))  # forced at BM = 16, _grouped_up spilled 4-20 B on
# sm_90a with BN = 128 (8 warps, 2 or 3 stages) and BN = 32 (4 warps): not candidates
# BM from the mean pairs per expert (load = T*K // E): padding waste against weight re-dequantization per tile.
BLOCK_M_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf.block_m", key=("load",), default={"BM": 64},
    buckets=[({"load": 23}, {"BM": 16}), ({"load": 95}, {"BM": 32})], candidates=[{"BM": 128}],
    doc="BM of both grouped kernels (and the alignment); load = mean pairs per expert"))
# Decode: BR output rows per program (a program's rows share one pair when BR divides I / D). BR = 8 gives
# T*K*I/8 = 1024 up programs at T = 1 (Kimi-Linear); the down projection is one program row set per (pair, slice
# of I, BR rows of D) with fp32 partials, S slices chosen so the grid reaches MIN_CTAS. With few pairs (the shared
# expert) gate/up split D too, as fp32 partials that the down kernel sums and activates as it loads h.
DECODE_UP_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._decode_up", key=("P", "D", "I"), default={"BR": 8, "MIN_CTAS": 1024, "num_warps": 4},
    candidates=[{"BR": 16, "MIN_CTAS": 1024, "num_warps": 4}, {"BR": 8, "MIN_CTAS": 1024, "num_warps": 2},
                {"BR": 8, "MIN_CTAS": 384, "num_warps": 4}],  # fewer D slices: less partial traffic for the down
    doc="BR (gate, up) row pairs per program, D split in super-block slices until MIN_CTAS; P = T*K pairs"))
DECODE_DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._decode_down", key=("P", "D", "I"), default={"BR": 16, "MIN_CTAS": 1024, "num_warps": 4},
    buckets=[({"P": 2}, {"BR": 8, "MIN_CTAS": 1024, "num_warps": 4})],  # shared expert: I has only I/256 slices
    candidates=[{"BR": 8, "MIN_CTAS": 1024, "num_warps": 4}, {"BR": 16, "MIN_CTAS": 2048, "num_warps": 4}],
    doc="BR rows of D per program; I split into S super-block slices until the grid has MIN_CTAS programs"))

Q2K_BYTES, Q3K_BYTES = 84, 110
# auto: the decode path up to this many tokens. Both paths spend ~8 ALU ops per dequantized weight, the decode path
# once per (token, slot), the grouped one once per 16..64-row tile, plus 4 extra launches (align, sum): by a model
# of H200 rates they cross near 8 tokens for E/K = 32 (not yet measured; triton_decode / triton_grouped force one).
DECODE_MAX_TOKENS = 8


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _flat_rows(LEN, ROWS, BR: tl.constexpr, SHARED: tl.constexpr):
    """This program's BR rows r of a flattened [N, LEN] output (r = i * LEN + j): (r, valid, i, j), i and j as
    [BR, 1]. SHARED (BR divides LEN): every row has the same i, returned as a scalar."""
    r0 = tl.program_id(0).to(tl.int64) * BR
    r = r0 + tl.arange(0, BR)
    if SHARED:
        i = r0 // LEN
    else:
        i = (r // LEN)[:, None]
    return r, r < ROWS, i, (r % LEN)[:, None]


@triton.jit
def _row_load(ptr, okc, SHARED: tl.constexpr):
    """Load per-pair / per-token data: unmasked when the program's rows share it (then all are valid)."""
    if SHARED:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=okc, other=0)
    return v


@triton.jit
def _decode_up(x, ids, w13, h, P, S1, K, D, I, rb13, NB_SPLIT, BR: tl.constexpr, SHARED: tl.constexpr,
               PARTS: tl.constexpr):
    """h[p, n] = silu(x[t] . w1[e, n]) * (x[t] . w3[e, n]) for pair p = t*K + k, e = ids[p]; rows (p*S1 + s, n)
    flattened, fp32 h. PARTS (S1 > 1 slices of NB_SPLIT super-blocks of D): the gate and up dots of slice s go out
    as partials h[p*S1 + s] = [gate | up] ([P*S1, 2I]), finished by _decode_down."""
    r, ok, ps, n = _flat_rows(I, P * S1 * I, BR, SHARED)
    okc = ok[:, None]
    p = ps // S1
    b0 = ps % S1 * NB_SPLIT
    e = _row_load(ids + p, okc, SHARED).to(tl.int64)
    gate_rows = w13 + (e * 2 * I + n) * rb13
    up_rows = gate_rows + I * rb13
    x_row = x + (p // K) * D + tl.arange(0, CHUNK)[None, :]
    acc_g = tl.zeros([BR, CHUNK], dtype=tl.float32)
    acc_u = tl.zeros([BR, CHUNK], dtype=tl.float32)
    for j in range(0, NB_SPLIT):
        g_blk = block_ptr(gate_rows, b0 + j, False)
        u_blk = block_ptr(up_rows, b0 + j, False)
        dg, mg = block_scales(g_blk, okc, False)
        du, mu = block_scales(u_blk, okc, False)
        for c in range(0, 256, CHUNK):
            xk = _row_load(x_row + (b0 + j) * 256 + c, okc, SHARED).to(tl.float32)
            acc_g += dequant_chunk(g_blk, okc, dg, mg, c, False) * xk
            acc_u += dequant_chunk(u_blk, okc, du, mu, c, False) * xk
    if PARTS:
        row = h + (ps * 2 * I + n)
        tl.store(row, tl.sum(acc_g, axis=1)[:, None], mask=okc)
        tl.store(row + I, tl.sum(acc_u, axis=1)[:, None], mask=okc)
    else:
        tl.store(h + r, _silu_mul(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)), mask=ok)


@triton.jit
def _h_chunk(h, p, off, okc, I, S1, SHARED: tl.constexpr, PARTS: tl.constexpr):
    """h[p, off] (fp32): loaded, or (PARTS) SwiGLU of its S1 gate / up partials summed in order."""
    if PARTS:
        g = tl.zeros(off.shape, dtype=tl.float32)
        u = tl.zeros(off.shape, dtype=tl.float32)
        for s in range(S1):
            row = h + (p * S1 + s) * 2 * I + off
            g += _row_load(row, okc, SHARED)
            u += _row_load(row + I, okc, SHARED)
        hk = _silu_mul(g, u)
    else:
        hk = _row_load(h + p * I + off, okc, SHARED)
    return hk


@triton.jit
def _decode_down(h, ids, weights, w2, part, P, S, S1, D, I, rb2, NB_SPLIT, BR: tl.constexpr, SHARED: tl.constexpr,
                 PARTS: tl.constexpr):
    """part[p*S + s, n] = weights[p] * (h[p] . w2[e, n]) over super-blocks s*NB_SPLIT .. (s+1)*NB_SPLIT - 1 of I
    (S * NB_SPLIT = I / 256); rows (p*S + s, n) flattened, fp32 partials (summed per token by _sum_slots)."""
    r, ok, ps, n = _flat_rows(D, P * S * D, BR, SHARED)
    okc = ok[:, None]
    p = ps // S
    b0 = ps % S * NB_SPLIT
    e = _row_load(ids + p, okc, SHARED).to(tl.int64)
    rows = w2 + (e * D + n) * rb2
    acc = tl.zeros([BR, CHUNK], dtype=tl.float32)
    for j in range(0, NB_SPLIT):
        blk = block_ptr(rows, b0 + j, True)
        d, dmin = block_scales(blk, okc, True)
        for c in range(0, 256, CHUNK):
            hk = _h_chunk(h, p, (b0 + j) * 256 + c + tl.arange(0, CHUNK)[None, :], okc, I, S1, SHARED, PARTS)
            acc += dequant_chunk(blk, okc, d, dmin, c, True) * hk
    out = tl.sum(acc * _row_load(weights + p, okc, SHARED), axis=1)
    tl.store(part + r, out, mask=ok)


@triton.jit
def _tile_rows(sorted_ids, expert_ids, num_post, P, BM: tl.constexpr):
    """The pairs of this program's BM-row tile, whether each is real (not padding), and the tile's expert."""
    pid_m = tl.program_id(0)
    o_m = pid_m * BM + tl.arange(0, BM)
    in_range = o_m < tl.load(num_post)
    pair = tl.load(sorted_ids + o_m, mask=in_range, other=P)
    e = tl.load(expert_ids + pid_m, mask=pid_m * BM < tl.load(num_post), other=-1)
    return pair, pair < P, e


@triton.jit
def _grouped_up(x, sorted_ids, expert_ids, num_post, w13, h, P, K, D, I, rb13,
                BM: tl.constexpr, BN: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """h[pair, n] = silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T) for the BM pairs of one expert tile; bf16 h."""
    pair, real, e = _tile_rows(sorted_ids, expert_ids, num_post, P, BM)
    if e < 0:
        return
    e = e.to(tl.int64)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = (o_n < I)[:, None]
    gate_rows = w13 + (e * 2 * I + o_n[:, None]) * rb13
    up_rows = gate_rows + I * rb13
    x_rows = x + (pair // K).to(tl.int64)[:, None] * D + tl.arange(0, CHUNK)[None, :]
    dot_ty = tl.float32 if UPCAST_DOT else tl.bfloat16
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for b in range(0, D // 256):
        g_blk = block_ptr(gate_rows, b, False)
        u_blk = block_ptr(up_rows, b, False)
        dg, mg = block_scales(g_blk, n_ok, False)
        du, mu = block_scales(u_blk, n_ok, False)
        for c in range(0, 256, CHUNK):
            xk = tl.load(x_rows + b * 256 + c, mask=real[:, None], other=0.0).to(dot_ty)
            acc_g = tl.dot(xk, tl.trans(dequant_chunk(g_blk, n_ok, dg, mg, c, False).to(dot_ty)), acc_g)
            acc_u = tl.dot(xk, tl.trans(dequant_chunk(u_blk, n_ok, du, mu, c, False).to(dot_ty)), acc_u)
    out = h + pair.to(tl.int64)[:, None] * I + o_n[None, :]
    tl.store(out, _silu_mul(acc_g, acc_u).to(h.dtype.element_ty), mask=real[:, None] & (o_n < I)[None, :])


@triton.jit
def _grouped_down(h, sorted_ids, expert_ids, num_post, weights, w2, out, P, D, I, rb2,
                  BM: tl.constexpr, BN: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """out[pair, n] = weights[pair] * (h[pair] @ w2[e].T) for the BM pairs of one expert tile."""
    pair, real, e = _tile_rows(sorted_ids, expert_ids, num_post, P, BM)
    if e < 0:
        return
    e = e.to(tl.int64)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = (o_n < D)[:, None]
    rows = w2 + (e * D + o_n[:, None]) * rb2
    h_rows = h + pair.to(tl.int64)[:, None] * I + tl.arange(0, CHUNK)[None, :]
    dot_ty = tl.float32 if UPCAST_DOT else tl.bfloat16
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for b in range(0, I // 256):
        blk = block_ptr(rows, b, True)
        d, dmin = block_scales(blk, n_ok, True)
        for c in range(0, 256, CHUNK):
            hk = tl.load(h_rows + b * 256 + c, mask=real[:, None], other=0.0).to(dot_ty)
            acc = tl.dot(hk, tl.trans(dequant_chunk(blk, n_ok, d, dmin, c, True).to(dot_ty)), acc)
    acc *= tl.load(weights + pair, mask=real, other=0.0)[:, None]
    dst = out + pair.to(tl.int64)[:, None] * D + o_n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=real[:, None] & (o_n < D)[None, :])


def _check(x, topk_ids, topk_weights, w13, w2):
    T, D = x.shape
    E, two_i, rb13 = w13.shape
    I = two_i // 2
    if D % 256 or I % 256 or rb13 != D // 256 * Q2K_BYTES:
        raise ValueError(f"w13 {tuple(w13.shape)} is not Q2_K [E, 2I, D/256*84] for D={D} (D, I multiples of 256)")
    if tuple(w2.shape) != (E, D, I // 256 * Q3K_BYTES) or w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"w2 {tuple(w2.shape)} {w2.dtype} is not Q3_K uint8 [E={E}, D={D}, I/256*110]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} vs T={T}")
    return T, D, E, I, topk_ids.shape[1]


def down_split(P: int, D: int, NB: int, BR: int, min_ctas: int) -> int:
    """S: the smallest divisor of the NB super-blocks (of I for the down projection, of D for gate/up) giving
    P*S*D/BR >= min_ctas programs (D: the output rows per pair), else NB."""
    return next((s for s in range(1, NB + 1) if NB % s == 0 and P * s * triton.cdiv(D, BR) >= min_ctas), NB)


def _decode(x, ids, weights, w13, w2, T, D, I, K, rows_per_program=None, split_i=None, split_d=None):
    """rows_per_program: BR (8-16 on the GPU: every program within one pair, its x or h row a broadcast vector;
    large under the interpreter, many pairs per program). split_i / split_d: force S / S1, the slices of I of the
    down projection and of D of gate/up (divisors of I / 256, D / 256; under the interpreter D is not split unless
    forced)."""
    P = T * K
    meta, options = split(DECODE_UP_CONFIGS.pick(P=P, D=D, I=I))
    BR = rows_per_program or (min(next_pow2(P * I), 4096) if INTERPRET else meta["BR"])
    S1 = split_d or (1 if INTERPRET else down_split(P, I, D // 256, BR, meta["MIN_CTAS"]))
    parts = S1 > 1
    h = torch.empty((P * S1, 2 * I) if parts else (P, I), dtype=torch.float32, device=x.device)
    _decode_up[(triton.cdiv(P * S1 * I, BR),)](x, ids, w13, h, P, S1, K, D, I, w13.shape[2], D // 256 // S1, BR=BR,
                                               SHARED=I % BR == 0, PARTS=parts, **options)
    meta, options = split(DECODE_DOWN_CONFIGS.pick(P=P, D=D, I=I))
    BR = rows_per_program or (min(next_pow2(P * D), 4096) if INTERPRET else meta["BR"])
    S = split_i or down_split(P, D, I // 256, BR, meta["MIN_CTAS"])
    part = torch.empty((P * S, D), dtype=torch.float32, device=x.device)
    _decode_down[(triton.cdiv(P * S * D, BR),)](h, ids, weights, w2, part, P, S, S1, D, I, w2.shape[2],
                                                I // 256 // S, BR=BR, SHARED=D % BR == 0, PARTS=parts, **options)
    return sum_slots(part, T, x.dtype)


def _block_m(pairs: int, experts: int) -> int:
    """Rows per tile from the mean pairs per expert (padding waste vs weight re-reads)."""
    return BLOCK_M_CONFIGS.pick(load=pairs // max(1, experts))["BM"]


def _grouped(x, ids, weights, w13, w2, T, D, E, I, K):
    P = T * K
    BM = _block_m(P, E)
    sorted_ids, expert_ids, num_post = moe_align(ids.view(T, K), E, BM)
    tiles = expert_ids.numel()
    h = torch.empty((P, I), dtype=torch.bfloat16, device=x.device)
    out = torch.empty((P, D), dtype=torch.bfloat16, device=x.device)
    meta, options = split(GROUPED_CONFIGS.pick(BM=BM))
    if INTERPRET:
        meta["BN"] = 256
    BN = meta["BN"]
    _grouped_up[(tiles, triton.cdiv(I, BN))](x, sorted_ids, expert_ids, num_post, w13, h, P, K, D, I, w13.shape[2],
                                             BM=BM, UPCAST_DOT=INTERPRET, **meta, **options)
    _grouped_down[(tiles, triton.cdiv(D, BN))](h, sorted_ids, expert_ids, num_post, weights, w2, out, P, D, I,
                                               w2.shape[2], BM=BM, UPCAST_DOT=INTERPRET, **meta, **options)
    return sum_slots(out, T, x.dtype)


def experts_gguf(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, path: str = "auto", rows_per_program: int | None = None,
                 split_i: int | None = None, split_d: int | None = None) -> torch.Tensor:
    """x [T, D] bf16, topk_ids [T, K] int, topk_weights [T, K] f32, w13 [E, 2I, D/256*84] uint8 (Q2_K),
    w2 [E, D, I/256*110] uint8 (Q3_K) -> y [T, D] in x's dtype. path: auto | decode | grouped;
    rows_per_program: the decode path's BR (tests force the GPU's 16 under the interpreter); split_i / split_d:
    its slices of I (down) and of D (gate/up)."""
    T, D, E, I, K = _check(x, topk_ids, topk_weights, w13, w2)
    if T == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), aligned(w13.contiguous(), 4), aligned(w2.contiguous(), 2)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if path == "auto":
        path = "decode" if T <= DECODE_MAX_TOKENS else "grouped"
    if path == "decode":
        return _decode(x, ids, weights, w13, w2, T, D, I, K, rows_per_program, split_i, split_d)
    if path == "grouped":
        return _grouped(x, ids, weights, w13, w2, T, D, E, I, K)
    raise ValueError(f"unknown path {path!r}: auto, decode or grouped")
