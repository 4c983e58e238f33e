"""Routed experts (SwiGLU) with GGUF weights: w1|w3 in Q2_K, w2 in Q3_K.

    y[t] = sum_k w[t, k] * (silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T,   e = topk_ids[t, k]

w13 [E, 2I, D/256*84] uint8 (gate rows 0..I-1, up rows I..2I-1), w2 [E, D, I/256*110] uint8; I and D multiples
of 256. Three paths, chosen by the wrapper from the token count and the mean pairs per expert:
  decode   (T <= DECODE_MAX_TOKENS) GEMVs on the blocks, integer codes against the activation with the sub-block
           scales factored out (kernels/moe/experts_gguf_decode.py).
  grouped  (fused prefill, light load) pairs aligned by expert (kernels/moe/align.py, vLLM's moe_align_block_size
           format), BM-row tiles through tl.dot against weight tiles dequantized in registers, 32 weights at a time
           (kernels/quant/kquants.py); per-pair outputs weighted in the epilogue, summed over K by _sum_slots. Every
           tile re-dequantizes its expert's weights: right while few tiles share an expert.
  dequant  (heavy load: mean pairs per expert >= DEQUANT_MIN_LOAD, declared in PREFILL_CONFIGS) the hit experts
           dequantized once into a bf16 scratch (kernels/quant/dequant.py, unhit experts skipped on the device), then
           the bf16 grouped GEMMs of kernels/moe/experts.py (grouped_experts): tensor cores at bf16 rate,
           the dequantization paid once per weight instead of once per tile. Scratch: bounded by the declared
           DEQUANT_SCRATCH_MB (SCRATCH_CONFIGS): experts in groups of what fits (dequant_groups), one alignment for
           all, per group its hit experts dequantized into ONE reused scratch and the GEMMs over that group's tiles
           only (the others exit at once); no host sync. Kimi-Linear: one group (3.6 GB), DeepSeek-V3 TP1: 6 of 44.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.align import moe_align
from spark_bench.kernels.moe.experts import block_m_for, grouped_experts
from spark_bench.kernels.moe.experts_gguf_decode import decode
from spark_bench.kernels.moe.slots import sum_slots
from spark_bench.kernels.quant.dequant import dequantize
from spark_bench.kernels.quant.kquants import CHUNK, aligned, block_ptr, block_scales, dequant_chunk

# The grouped (prefill) kernels: BN columns per tile (BM, rows per tile, follows the routing load). 8 warps at every
# BM: at BM = 16 with 4 warps _grouped_down spilled on sm_90a under triton 3.9.
GROUPED_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf._grouped", key=("BM",), default={"BN": 64, "num_warps": 8},
    candidates=[{"BN": 64, "num_warps": 8, "num_stages": 4}]))  # forced at BM = 16, _grouped_up spilled 4-20 B on
# sm_90a with BN = 128 (8 warps, 2 or 3 stages) and BN = 32 (4 warps), and under triton 3.6 8 B with BN = 64 at 2
# stages (4 or 8 warps): not candidates
# BM from the mean pairs per expert (load = T*K // E): padding waste against weight re-dequantization per tile.
BLOCK_M_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf.block_m", key=("load",), default={"BM": 64},
    buckets=[({"load": 23}, {"BM": 16}), ({"load": 95}, {"BM": 32})], candidates=[{"BM": 128}],
    doc="BM of both grouped kernels (and the alignment); load = mean pairs per expert"))
# Prefill: dequantize-once above this mean load (pairs per expert, T*K // E), the fused grouped path below. The
# fused path re-dequantizes an expert's 3*I*D weights (~8 ALU ops each) once per BM-row tile, ceil(load / BM) times;
# dequant-once spends the same ALU once plus ~5 B per weight of bf16 write and re-read, and runs the GEMMs at bf16
# tensor-core rate. By a model of H200 rates (kernel-review.md section 4 item 4) they cross near one full 64-row
# tile per expert (Kimi-Linear T ~ 2k); not measured: tune times the candidates (triton forces neither path).
PREFILL_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf.prefill", key=("D", "I"), default={"DEQUANT_MIN_LOAD": 64},
    candidates=[{"DEQUANT_MIN_LOAD": 16}, {"DEQUANT_MIN_LOAD": 256}, {"DEQUANT_MIN_LOAD": 1 << 30}],
    doc="mean pairs per expert from which the prefill dequantizes the hit experts into a bf16 scratch and runs the "
        "bf16 grouped GEMMs (below: the fused dequant-in-register grouped path)"))
# The dequant path's bf16 scratch, MiB: experts are dequantized and multiplied in groups of what fits (3*I*D*2 B
# each). 4096 is the paper choice: all 256 Kimi-Linear experts fit (3.6 GB, one group: the launches of an unbounded
# scratch); DeepSeek-V3 at TP1 (88 MB per expert) takes 6 groups of 44 (3.9 GB instead of 22.5 GB), each extra group
# costing 2 GEMM launches whose off-group tiles exit at once. Not measured: tune times the candidates.
SCRATCH_CONFIGS = declare(ConfigSpace(
    "moe.experts_gguf.scratch", key=("D", "I"), default={"DEQUANT_SCRATCH_MB": 4096},
    candidates=[{"DEQUANT_SCRATCH_MB": 1024}, {"DEQUANT_SCRATCH_MB": 16384}],
    doc="MiB of bf16 scratch the dequant prefill path dequantizes experts into, a group of experts at a time"))
Q2K_BYTES, Q3K_BYTES = 84, 110
# auto: the decode path up to this many tokens. The decode path reads each weight once per (token, slot) at ~3-5 ALU
# ops per weight (integer codes, factored scales); the grouped one dequantizes it once per 16..64-row tile (~8 ops)
# plus 4 extra launches (align, sum): by a model of H200 rates they cross near 8 tokens for E/K = 32 (not yet
# measured; triton_decode / triton_grouped force one).
DECODE_MAX_TOKENS = 8


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


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
    if widen():
        meta["BN"] = 256
    BN = meta["BN"]
    _grouped_up[(tiles, triton.cdiv(I, BN))](x, sorted_ids, expert_ids, num_post, w13, h, P, K, D, I, w13.shape[2],
                                             BM=BM, UPCAST_DOT=INTERPRET, **meta, **options)
    _grouped_down[(tiles, triton.cdiv(D, BN))](h, sorted_ids, expert_ids, num_post, weights, w2, out, P, D, I,
                                               w2.shape[2], BM=BM, UPCAST_DOT=INTERPRET, **meta, **options)
    return sum_slots(out, T, x.dtype, ids=ids, experts=E)


def dequant_groups(E: int, I: int, D: int) -> list[tuple[int, int]]:
    """The dequant path's expert groups [lo, hi): as few as the declared scratch allows, balanced, sized a multiple
    of 4 where it can be (hit[lo:] stays 16-byte aligned: no second specialisation of _dequant_rows)."""
    budget = SCRATCH_CONFIGS.pick(D=D, I=I)["DEQUANT_SCRATCH_MB"] * (1 << 20)
    fits = max(1, int(budget // (3 * I * D * 2)))
    quad = 4 if fits >= 4 else 1
    size = triton.cdiv(triton.cdiv(E, triton.cdiv(E, fits // quad * quad)), quad) * quad  # <= fits
    return [(lo, min(E, lo + size)) for lo in range(0, E, size)]


def _dequantized(x, ids, weights, w13, w2, T, D, E, I, K):
    """The hit experts dequantized once into a bounded bf16 scratch, a group at a time, then the bf16 grouped GEMMs
    of that group's tiles (grouped_experts: one alignment, one slot sum)."""
    bucket = ids.long().clamp_(-1, E).remainder_(E + 1)  # an id outside [0, E) lands in bucket E: no expert
    hit = torch.zeros(E + 1, dtype=torch.int32, device=x.device).index_fill_(0, bucket, 1)[:E]
    groups = dequant_groups(E, I, D)
    n = max(hi - lo for lo, hi in groups)
    w13_bf16 = torch.empty((n, 2 * I, D), dtype=torch.bfloat16, device=x.device)
    w2_bf16 = torch.empty((n, D, I), dtype=torch.bfloat16, device=x.device)

    def filled():  # lazily: group g + 1 overwrites the scratch after group g's GEMMs (stream order)
        for lo, hi in groups:
            a = dequantize(w13[lo:hi], "q2_k", torch.bfloat16, hit=hit[lo:hi], out=w13_bf16[:hi - lo])
            b = dequantize(w2[lo:hi], "q3_k", torch.bfloat16, hit=hit[lo:hi], out=w2_bf16[:hi - lo])
            yield lo, a, b

    return grouped_experts(x, ids.view(T, K), weights, filled(), E, I, block_m_for(T * K, E))


def prefill_path(T: int, K: int, E: int, D: int, I: int) -> str:
    """grouped (fused) or dequant, from the mean pairs per expert against the declared threshold."""
    threshold = PREFILL_CONFIGS.pick(D=D, I=I)["DEQUANT_MIN_LOAD"]
    return "dequant" if T * K // max(1, E) >= threshold else "grouped"


def experts_gguf(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, path: str = "auto", rows_per_program: int | None = None,
                 split_i: int | None = None, split_d: int | None = None) -> torch.Tensor:
    """x [T, D] bf16, topk_ids [T, K] int, topk_weights [T, K] f32, w13 [E, 2I, D/256*84] uint8 (Q2_K),
    w2 [E, D, I/256*110] uint8 (Q3_K) -> y [T, D] in x's dtype. path: auto | decode | grouped | dequant | prefill
    (prefill: grouped or dequant by the declared load threshold, as auto beyond DECODE_MAX_TOKENS);
    rows_per_program: the decode path's BR (tests force the GPU's 16 under the interpreter); split_i / split_d:
    its slices of I (down) and of D (gate/up)."""
    T, D, E, I, K = _check(x, topk_ids, topk_weights, w13, w2)
    if T == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), aligned(w13.contiguous(), 4), aligned(w2.contiguous(), 2)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if path == "auto":
        path = "decode" if T <= DECODE_MAX_TOKENS else "prefill"
    if path == "prefill":
        path = prefill_path(T, K, E, D, I)
    if path == "decode":
        return decode(x, ids, weights, w13, w2, T, D, I, K, rows_per_program, split_i, split_d)
    if path == "grouped":
        return _grouped(x, ids, weights, w13, w2, T, D, E, I, K)
    if path == "dequant":
        return _dequantized(x, ids, weights, w13, w2, T, D, E, I, K)
    raise ValueError(f"unknown path {path!r}: auto, decode, grouped, dequant or prefill")
