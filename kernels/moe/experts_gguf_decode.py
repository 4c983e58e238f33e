"""GGUF routed experts at decode (few tokens): matrix-vector products straight on the Q2_K / Q3_K blocks.

    h[p]  = weights[p] * silu(x[t] . w1[e]) * (x[t] . w3[e])   (_decode_up, Q2_K, pair p = t*K + k, e = ids[p])
    part  = h[p] . w2[e]                                          (_decode_down, Q3_K; a token's K*S parts summed
                                                                   by the last program of each D tile, or by
                                                                   _sum_slots)

Each program owns BR output rows of one pair and walks its reduction one whole 256-weight super-block per
iteration (kernels/quant/kdot.py): the activation slice is loaded once per program and broadcast over the rows, each
row's code bytes once, the codes become floats by the mantissa trick (no I2F), the sub-block scale and min enter
as one FMA per weight and a second FMA accumulates w*x; rows are reduced once, after the loop. Offline SASS
(sm_90a, triton 3.9, Kimi-Linear T = 1; the loop body over the 32 weights a thread handles per iteration, loads,
addressing and per-sub-block scales included): ~8 instructions per weight in _decode_up (Q2_K; 2 are FFMA) and ~12
in _decode_down (Q3_K), against ~21 and ~42 for the previous 32-weight dequantize-then-multiply chunks with an I2F
per weight.
Grids: programs over the flattened (pair, slice, row) outputs, so T = 1 already launches T*K*I/BR up programs and
T*K*S*D/BR down programs (>= 1,024 at Kimi-Linear sizes). The slices split the reduction: S of I (down) and S1 of D
(gate/up, the shared expert's few pairs) chosen so a grid reaches MIN_CTAS; their fp32 partials are summed in a
fixed order (deterministic, no atomics): gate/up partials by the down kernel as it loads h, down partials by
the last program of each D tile or by _sum_slots (kernels/moe/slots.py). Matrix-vector products on CUDA cores: a
single token never pads a 16-row tensor-core tile.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.slots import FusedSum, sum_tile
from spark_bench.kernels.quant.kdot import row_sums, superblock_fma, superblock_offsets
from spark_bench.kernels.quant.kquants import block_ptr

# BR output rows per program (a program's rows share one pair when BR divides I / D). BR = 8 gives T*K*I/8 = 1024
# up programs at T = 1 (Kimi-Linear); the down projection is one program per (pair, slice of I, BR rows of D), S
# slices chosen so the grid reaches MIN_CTAS. With few pairs (the shared expert) gate/up split D too.
# UNROLL: super-blocks per loop trip; 2 lets ptxas issue the next one's loads before this one's FMAs at the cost of
# registers (Kimi-Linear T = 1, sm_90a: up 80 -> 96, down 112 -> 168 under 3.9): a tuning candidate,
# docs/kernels-moe.md.
DECODE_UP_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._decode_up", key=("P", "D", "I"),
    default={"BR": 8, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 4},
    candidates=[{"BR": 16, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 4},
                {"BR": 8, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 2},
                {"BR": 8, "MIN_CTAS": 384, "UNROLL": 1, "num_warps": 4},  # fewer D slices: less partial traffic
                {"BR": 8, "MIN_CTAS": 1024, "UNROLL": 2, "num_warps": 4}],
    doc="BR (gate, up) row pairs per program, D split in super-block slices until MIN_CTAS; P = T*K pairs"))
DECODE_DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._decode_down", key=("P", "D", "I"),
    default={"BR": 16, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 4},
    buckets=[({"P": 2}, {"BR": 8, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 8})],  # shared expert: I/256 slices
    candidates=[{"BR": 8, "MIN_CTAS": 1024, "UNROLL": 1, "num_warps": 4},
                {"BR": 16, "MIN_CTAS": 2048, "UNROLL": 1, "num_warps": 4},
                {"BR": 16, "MIN_CTAS": 1024, "UNROLL": 2, "num_warps": 4}],
    doc="BR rows of D per program; I split into S super-block slices until the grid has MIN_CTAS programs"))


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _flat_rows(LEN, ROWS, BR: tl.constexpr, SHARED: tl.constexpr):
    """This program's BR rows r of a flattened [N, LEN] output (r = i * LEN + j): (r, valid, i, j), all [BR, 1].
    SHARED (BR divides LEN): every row has the same i, returned as a scalar."""
    r0 = tl.program_id(0).to(tl.int64) * BR
    r = r0 + tl.arange(0, BR)[:, None]
    if SHARED:
        i = r0 // LEN
    else:
        i = r // LEN
    return r, r < ROWS, i, r % LEN


@triton.jit
def _per_weight(v, SHARED: tl.constexpr):
    """Per-row data v ([BR, 1], or a scalar when SHARED) shaped to broadcast against [., 2, 4, 2, 16] super-blocks
    (kernels/quant/kdot.py's layout)."""
    if not SHARED:
        v = v[:, :, None, None, None]
    return v


@triton.jit
def _row_load(ptr, mask, SHARED: tl.constexpr):
    """Load per-pair / per-token data: unmasked when the program's rows share it (then all are valid)."""
    if SHARED:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _decode_up(x, ids, weights, w13, h, P, S1, K, D, I, E, rb13, NB_SPLIT, BR: tl.constexpr, SHARED: tl.constexpr,
               PARTS: tl.constexpr, UNROLL: tl.constexpr):
    """h[p, n] = weights[p] * silu(x[t] . w1[e, n]) * (x[t] . w3[e, n]) for pair p = t*K + k, e = ids[p]; rows
    (p*S1 + s, n) flattened, fp32 h. PARTS (S1 > 1 slices of NB_SPLIT super-blocks of D): the gate and up dots of
    slice s go out as partials h[p*S1 + s] = [gate | weights[p] * up] ([P*S1, 2I]), finished by _decode_down.
    The routing weight enters here (the down projection is linear in h): in _decode_down its value stayed live
    across the super-block loop and ptxas kept it in local memory (a 4 B spill) with the fused slot sum."""
    r, ok, ps, n = _flat_rows(I, P * S1 * I, BR, SHARED)
    ok3 = ok[:, :, None, None, None]
    p = ps // S1
    b0 = ps % S1 * NB_SPLIT
    e = _row_load(ids + p, ok, SHARED)
    routed = (e >= 0) & (e < E)  # an id outside [0, E) (vLLM's -1) adds nothing: weight 0, expert 0's addresses,
    e = tl.where(routed, e, 0).to(tl.int64)  # and (one pair per program) no super-block streamed
    gate_rows = w13 + (e * 2 * I + n) * rb13
    up_rows = gate_rows + I * rb13
    x_row = x + _per_weight((p // K) * D, SHARED) + superblock_offsets()
    x_b0 = _per_weight(b0, SHARED)
    acc_g = tl.zeros([BR, 2, 2, 16], dtype=tl.float32)
    acc_u = tl.zeros([BR, 2, 2, 16], dtype=tl.float32)
    j0 = 0
    if SHARED:  # the program's rows are one pair's: an unrouted one starts at the end (its first trip moves, not
        # the bound: a computed bound spilled 4 B in _decode_down at the shared expert's key under 3.9)
        j0 = tl.where(routed, 0, NB_SPLIT)
    for j in tl.range(j0, NB_SPLIT, loop_unroll_factor=UNROLL):
        xv = _row_load(x_row + (x_b0 + j) * 256, ok3, SHARED).to(tl.float32)
        acc_g = superblock_fma(block_ptr(gate_rows, b0 + j, False), ok, xv, acc_g, False)
        acc_u = superblock_fma(block_ptr(up_rows, b0 + j, False), ok, xv, acc_u, False)
    acc_g = row_sums(acc_g)
    acc_u = row_sums(acc_u) * tl.where(routed, _row_load(weights + p, ok, SHARED), 0.0)
    if PARTS:
        row = h + ps * 2 * I + n
        tl.store(row, acc_g, mask=ok)
        tl.store(row + I, acc_u, mask=ok)
    else:
        tl.store(h + r, _silu_mul(acc_g, acc_u), mask=ok)


@triton.jit
def _h_block(h, p, off, mask, I, S1, SHARED: tl.constexpr, PARTS: tl.constexpr):
    """h[p, off] (fp32): loaded, or (PARTS) SwiGLU of its S1 gate / up partials summed in order."""
    if PARTS:
        g = tl.zeros(off.shape, dtype=tl.float32)
        u = tl.zeros(off.shape, dtype=tl.float32)
        row = h + p * S1 * 2 * I + off
        for _ in range(S1):
            g += _row_load(row, mask, SHARED)
            u += _row_load(row + I, mask, SHARED)
            row += 2 * I
        hk = _silu_mul(g, u)
    else:
        hk = _row_load(h + p * I + off, mask, SHARED)
    return hk


@triton.jit
def _decode_down(h, ids, w2, part, y, tickets, T, R, P, S, S1, D, I, E, rb2, NB_SPLIT, BR: tl.constexpr,
                 SHARED: tl.constexpr, PARTS: tl.constexpr, FUSE: tl.constexpr, RP: tl.constexpr, RNE: tl.constexpr,
                 UNROLL: tl.constexpr):
    """part[p*S + s, n] = h[p] . w2[e, n] (h carries the routing weight) over super-blocks s*NB_SPLIT ..
    (s+1)*NB_SPLIT - 1 of I (S * NB_SPLIT = I / 256); rows (p*S + s, n) flattened, fp32 partials summed per token
    by _sum_slots, or (FUSE, which needs SHARED: a program's rows are one D tile of one (p, s)) by the tile's last
    program."""
    r, ok, ps, n = _flat_rows(D, P * S * D, BR, SHARED)
    ok3 = ok[:, :, None, None, None]
    p = ps // S
    b0 = ps % S * NB_SPLIT
    e = _row_load(ids + p, ok, SHARED)
    routed = (e >= 0) & (e < E)  # h is 0 where not routed: nothing to stream (one pair per program)
    e = tl.where(routed, e, 0).to(tl.int64)
    rows = w2 + (e * D + n) * rb2
    p3, h_b0 = _per_weight(p, SHARED), _per_weight(b0, SHARED)
    acc = tl.zeros([BR, 2, 2, 16], dtype=tl.float32)
    j0 = 0
    if SHARED:  # the program's rows are one pair's: an unrouted one starts at the end
        j0 = tl.where(routed, 0, NB_SPLIT)
    for j in tl.range(j0, NB_SPLIT, loop_unroll_factor=UNROLL):
        hv = _h_block(h, p3, (h_b0 + j) * 256 + superblock_offsets(), ok3, I, S1, SHARED, PARTS)
        acc = superblock_fma(block_ptr(rows, b0 + j, True), ok, hv, acc, True)
    tl.store(part + r, row_sums(acc), mask=ok)
    if FUSE:
        tile = tl.program_id(0) % (D // BR)
        o_n = tile * BR + tl.arange(0, BR)
        sum_tile(part, y, tickets, tile, P * S, o_n, o_n < D, T, D, R, RP, RNE)


def down_split(P: int, D: int, NB: int, BR: int, min_ctas: int) -> int:
    """S: the smallest divisor of the NB super-blocks (of I for the down projection, of D for gate/up) giving
    P*S*D/BR >= min_ctas programs (D: the output rows per pair), else NB."""
    return next((s for s in range(1, NB + 1) if NB % s == 0 and P * s * triton.cdiv(D, BR) >= min_ctas), NB)


def decode(x, ids, weights, w13, w2, T, D, I, K, rows_per_program=None, split_i=None, split_d=None):
    """x [T, D], ids / weights [T*K] (int32 / fp32), w13 / w2 the Q2_K / Q3_K blocks (aligned) -> y [T, D].
    rows_per_program: BR (8-16 on the GPU: every program within one pair, its x or h row a broadcast vector;
    large under the interpreter, many pairs per program). split_i / split_d: force S / S1, the slices of I of the
    down projection and of D of gate/up (divisors of I / 256, D / 256; under the interpreter D is not split unless
    forced)."""
    P = T * K
    meta, options = split(DECODE_UP_CONFIGS.pick(P=P, D=D, I=I))
    BR = rows_per_program or (min(next_pow2(P * I), 1024) if widen() else meta["BR"])
    S1 = split_d or (1 if widen() else down_split(P, I, D // 256, BR, meta["MIN_CTAS"]))
    parts = S1 > 1
    h = torch.empty((P * S1, 2 * I) if parts else (P, I), dtype=torch.float32, device=x.device)
    _decode_up[(triton.cdiv(P * S1 * I, BR),)](x, ids, weights, w13, h, P, S1, K, D, I, w13.shape[0],
                                               w13.shape[2], D // 256 // S1,
                                               BR=BR, SHARED=I % BR == 0, PARTS=parts, UNROLL=meta["UNROLL"], **options)
    meta, options = split(DECODE_DOWN_CONFIGS.pick(P=P, D=D, I=I))
    BR = rows_per_program or (min(next_pow2(P * D), 1024) if widen() else meta["BR"])
    S = split_i or down_split(P, D, I // 256, BR, meta["MIN_CTAS"])
    part = torch.empty((P * S, D), dtype=torch.float32, device=x.device)
    # fused: needs one D tile per program (BR divides D)
    slot_sum = FusedSum("moe.experts_gguf._decode_down", T, D, K * S, x.dtype, x.device, allowed=D % BR == 0)
    _decode_down[(triton.cdiv(P * S * D, BR),)](h, ids, w2, part, P=P, S=S, S1=S1, D=D, I=I, E=w2.shape[0],
                                                rb2=w2.shape[2], NB_SPLIT=I // 256 // S, BR=BR, SHARED=D % BR == 0,
                                                PARTS=parts, UNROLL=meta["UNROLL"],
                                                **slot_sum.kernel_args(part, D // BR), **options)
    return slot_sum.finish(part)
