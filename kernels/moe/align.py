"""moe_align_block_size (vLLM's semantics): the T*K (token, slot) pairs grouped by expert, each expert's segment
padded to a multiple of BLOCK_M with the sentinel T*K, the expert of every BLOCK_M tile, and the padded count.

Three kernels over chunks of BN flat slots (slot s = t*K + k), order within an expert = slot order (stable):
  _align_count    per-chunk expert histogram [chunks, BE]
  _align_offsets  one program: per-chunk base per expert (prefix sum over chunks, BC chunks per step), padded
                  segment starts, tile experts (-1 past the padded count), padded count
  _align_scatter  sorted_ids[start[e] + base[chunk, e] + rank in chunk] = s
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2
from spark_bench.kernels.configs import ConfigSpace, declare, split

# Chunks of BN = min(TILE // next_pow2(E), BN_MAX) slots for _align_count and _align_scatter (a [BN, BE] tile; the
# E = 1 scatter spilled on sm_90a at BN = 16384); the offsets pass walks [BUDGET // BE]-row tiles.
CHUNK_CONFIGS = declare(ConfigSpace(
    "moe.align._align_chunks", key=("N", "E"), default={"TILE": 16384, "BN_MAX": 8192, "num_warps": 4},
    candidates=[{"TILE": 8192, "BN_MAX": 4096, "num_warps": 4}, {"TILE": 16384, "BN_MAX": 8192, "num_warps": 8}],
    doc="slots per chunk of the count and scatter kernels (one program each)"))
OFFSETS_CONFIGS = declare(ConfigSpace(
    "moe.align._align_offsets", key=("N", "E"), default={"BUDGET": 8192, "num_warps": 4},
    candidates=[{"BUDGET": 4096, "num_warps": 4}, {"BUDGET": 16384, "num_warps": 8}],
    doc="elements per [chunks, BE] / [tiles, BE] step of the single-program offsets pass"))


@triton.jit
def _align_count(ids, counts, N, E, BN: tl.constexpr, BE: tl.constexpr):
    c = tl.program_id(0)
    o_n = c * BN + tl.arange(0, BN)
    e = tl.load(ids + o_n, mask=o_n < N, other=-1)
    o_e = tl.arange(0, BE)
    hit = (e[:, None] == o_e[None, :]) & (o_e[None, :] < E)
    tl.store(counts + c * BE + o_e, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _align_offsets(counts, base, start, expert_ids, num_post, n_chunks, max_blocks, E, BM: tl.constexpr,
                   BE: tl.constexpr, BC: tl.constexpr, BB: tl.constexpr):
    o_e = tl.arange(0, BE)
    running = tl.zeros([BE], dtype=tl.int32)
    for c0 in range(0, n_chunks, BC):  # exclusive prefix sum over chunks, BC chunks at a time
        o_c = c0 + tl.arange(0, BC)
        offs = o_c[:, None] * BE + o_e[None, :]
        tile = tl.load(counts + offs, mask=(o_c < n_chunks)[:, None], other=0)
        tl.store(base + offs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=(o_c < n_chunks)[:, None])
        running += tl.sum(tile, axis=0)
    padded = (running + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(start + o_e, end - padded)
    tl.store(num_post, total)
    for b0 in range(0, max_blocks, BB):
        o_b = b0 + tl.arange(0, BB)
        # the expert of tile b = how many experts end at or before the tile's first row
        before = (end[None, :] <= o_b[:, None] * BM) & (o_e[None, :] < E)
        eid = tl.sum(before.to(tl.int32), axis=1)
        tl.store(expert_ids + o_b, tl.where(o_b * BM < total, eid, -1), mask=o_b < max_blocks)


@triton.jit
def _align_scatter(ids, base, start, sorted_ids, N, E, BN: tl.constexpr, BE: tl.constexpr):
    c = tl.program_id(0)
    o_n = c * BN + tl.arange(0, BN)
    e = tl.load(ids + o_n, mask=o_n < N, other=-1)
    o_e = tl.arange(0, BE)
    hit = (e[:, None] == o_e[None, :]) & (o_e[None, :] < E)
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    offset = tl.load(base + c * BE + o_e) + tl.load(start + o_e)
    pos = tl.sum(tl.where(hit, rank + offset[None, :], 0), axis=1)
    tl.store(sorted_ids + pos, o_n, mask=(o_n < N) & (e >= 0) & (e < E))


def align_sizes(num_slots: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(length of sorted_ids, number of tiles): the worst case T*K + E*(BLOCK_M - 1) rows, vLLM's bound."""
    max_padded = num_slots + num_experts * (block_m - 1)
    return max_padded, triton.cdiv(max_padded, block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, K] int -> (sorted_ids [T*K + E*(BM-1)] int32, expert_ids [tiles] int32 (-1 past the padded
    count), num_tokens_post_pad [1] int32)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    N, E, dev = ids.numel(), num_experts, ids.device
    max_padded, max_blocks = align_sizes(N, E, block_m)
    BE = next_pow2(E)
    chunks, chunk_options = split(CHUNK_CONFIGS.pick(N=N, E=E))
    BN = max(16, min(next_pow2(N), (1 << 16 if INTERPRET else chunks["TILE"]) // BE,
                     1 << 16 if INTERPRET else chunks["BN_MAX"]))
    n_chunks = triton.cdiv(N, BN)
    counts = torch.empty((n_chunks, BE), dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    start = torch.empty(BE, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((max_padded,), N, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    _align_count[(n_chunks,)](ids, counts, N, E, BN=BN, BE=BE, **chunk_options)
    offsets, offsets_options = split(OFFSETS_CONFIGS.pick(N=N, E=E))
    budget = 1 << 16 if INTERPRET else offsets["BUDGET"]
    BB = max(16, min(next_pow2(max_blocks), budget // BE))
    BC = max(2, min(next_pow2(n_chunks), budget // BE))
    _align_offsets[(1,)](counts, base, start, expert_ids, num_post, n_chunks, max_blocks, E, BM=block_m, BE=BE,
                         BC=BC, BB=BB, **offsets_options)
    _align_scatter[(n_chunks,)](ids, base, start, sorted_ids, N, E, BN=BN, BE=BE, **chunk_options)
    return sorted_ids, expert_ids, num_post
