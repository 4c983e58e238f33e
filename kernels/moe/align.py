"""moe_align_block_size (vLLM's semantics): the T*K (token, slot) pairs grouped by expert, each expert's segment
padded to a multiple of BLOCK_M with the sentinel T*K, the expert of every BLOCK_M tile, and the padded count.

Chunks of BN flat slots (slot s = t*K + k); order within an expert = slot order (stable); no atomics.
  one chunk (decode sizes, N <= BN): _align_scatter alone, ONE=True: it counts its chunk itself. One launch.
  more chunks (prefill):
  _align_count    per-chunk expert histogram [chunks, BE]
  _align_prefix   per expert (BEP experts per program, in parallel): base[chunk, e] = exclusive prefix over chunks,
                  totals[e]
  _align_scatter  every program derives the padded segment starts from totals (a [BE] cumsum), writes
                  sorted_ids[start[e] + base[chunk, e] + rank in chunk] = s for its chunk, and, for its share of the
                  tiles, the tile experts (-1 past the padded count) and the sentinels of the tiles' padding rows
                  (disjoint from every slot's position, so no torch.full and no ordering between programs).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

# Chunks of BN = min(TILE // next_pow2(E), BN_MAX) slots (a [BN, BE] tile; the E = 1 scatter spilled on sm_90a at
# BN = 16384); the tile pass walks [TB, BE] steps with TB = BUDGET // BE. With 2-32 experts the scatter's cumsum down
# a [TILE / BE, BE] tile of 16384 spilled 92-208 B at 255 registers (BE 4-32; BE 2 at 255 without): those take 4096
# (E = 1 and E >= 33 kept 16384: 106-167 registers, no spill).
CHUNK_CONFIGS = declare(ConfigSpace(
    "moe.align._align_chunks", key=("N", "E"), default={"TILE": 16384, "BN_MAX": 8192, "num_warps": 4},
    buckets=[({"E": (2, 32)}, {"TILE": 4096, "BN_MAX": 8192, "num_warps": 4})],
    candidates=[{"TILE": 8192, "BN_MAX": 4096, "num_warps": 4}, {"TILE": 16384, "BN_MAX": 8192, "num_warps": 8}],
    doc="slots per chunk of the count and scatter kernels (one program each)"))
OFFSETS_CONFIGS = declare(ConfigSpace(
    "moe.align._align_offsets", key=("N", "E"), default={"BUDGET": 8192, "PREFIX": 2048, "BEP": 16, "num_warps": 4},
    # PREFIX = 8192 ([512, 16] tiles at 4 warps) spilled 184 B on sm_90a. Past 256 experts (the routed ones plus the
    # shared one: BE = 512) TB = 4 at BM = 64 (moe.layer at T = 512, the block_m candidate) spilled 4 B under triton
    # 3.9: BUDGET 1024 keeps TB = 2 there. Only past 2048 slots, where each program has few tiles (TB was already 2
    # from T = 1024 on); at decode sizes one program walks all ~250 tiles and keeps its [16, BE] steps
    buckets=[({"E": (257, 1 << 30), "N": (2049, 1 << 40)},
              {"BUDGET": 1024, "PREFIX": 2048, "BEP": 16, "num_warps": 4})],
    candidates=[{"BUDGET": 4096, "PREFIX": 1024, "BEP": 16, "num_warps": 4},
                {"BUDGET": 16384, "PREFIX": 4096, "BEP": 32, "num_warps": 8}],
    doc="elements per [chunks, BEP] step of the prefix (BEP experts per program), per [tiles, BE] scatter step"))


@triton.jit
def _chunk_hits(ids, c, N, E, BN: tl.constexpr, BE: tl.constexpr):
    """(slots o_n, experts e, one-hot [BN, BE]) of chunk c."""
    o_n = c * BN + tl.arange(0, BN)
    e = tl.load(ids + o_n, mask=o_n < N, other=-1)
    o_e = tl.arange(0, BE)
    return o_n, e, (e[:, None] == o_e[None, :]) & (o_e[None, :] < E)


@triton.jit
def _align_count(ids, counts, N, E, BN: tl.constexpr, BE: tl.constexpr):
    c = tl.program_id(0)
    _, _, hit = _chunk_hits(ids, c, N, E, BN, BE)
    tl.store(counts + c * BE + tl.arange(0, BE), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _align_prefix(counts, base, totals, n_chunks, BE: tl.constexpr, BC: tl.constexpr, BEP: tl.constexpr):
    o_e = tl.program_id(0) * BEP + tl.arange(0, BEP)
    running = tl.zeros([BEP], dtype=tl.int32)
    for c0 in range(0, n_chunks, BC):
        o_c = c0 + tl.arange(0, BC)
        offs = o_c[:, None] * BE + o_e[None, :]
        m = (o_c < n_chunks)[:, None]
        tile = tl.load(counts + offs, mask=m, other=0)
        tl.store(base + offs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=m)
        running += tl.sum(tile, axis=0)
    tl.store(totals + o_e, running)


@triton.jit
def _align_scatter(ids, base, totals, sorted_ids, expert_ids, num_post, N, E, max_padded, max_blocks, tiles_per,
                   BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, TB: tl.constexpr, ONE: tl.constexpr):
    c = tl.program_id(0)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    o_n, e, hit = _chunk_hits(ids, c, N, E, BN, BE)
    hits = hit.to(tl.int32)
    if ONE:
        count = tl.sum(hits, axis=0)
        chunk_base = tl.zeros([BE], dtype=tl.int32)
    else:
        count = tl.load(totals + o_e)
        chunk_base = tl.load(base + c * BE + o_e)
    padded = (count + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    total = tl.sum(padded, axis=0)
    pos = tl.sum(tl.where(hit, tl.cumsum(hits, axis=0) - 1 + (chunk_base + start)[None, :], 0), axis=1)
    tl.store(sorted_ids + pos, o_n, mask=(o_n < N) & (e >= 0) & (e < E))
    if c == 0:
        tl.store(num_post, total)
    filled = start + count  # rows [start, filled) of an expert's segment hold slots, [filled, end) sentinels
    o_r = tl.arange(0, BM)
    for b0 in range(c * tiles_per, tl.minimum((c + 1) * tiles_per, max_blocks), TB):
        o_b = b0 + tl.arange(0, TB)
        m_b = o_b < tl.minimum((c + 1) * tiles_per, max_blocks)
        # the expert of tile b = how many experts end at or before the tile's first row
        eid = tl.sum(((end[None, :] <= o_b[:, None] * BM) & m_e[None, :]).to(tl.int32), axis=1)
        live = o_b * BM < total
        tl.store(expert_ids + o_b, tl.where(live, eid, -1), mask=m_b)
        fill_end = tl.sum(tl.where(o_e[None, :] == eid[:, None], filled[None, :], 0), axis=1)
        row = o_b[:, None] * BM + o_r[None, :]
        pad = (row >= tl.where(live, fill_end, 0)[:, None]) & (row < max_padded)
        tl.store(sorted_ids + row, N, mask=pad & m_b[:, None])


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
    BN = max(16, min(next_pow2(N), (1 << 16 if widen() else chunks["TILE"]) // BE,
                     1 << 16 if widen() else chunks["BN_MAX"]))
    n_chunks = triton.cdiv(N, BN)
    offsets, offsets_options = split(OFFSETS_CONFIGS.pick(N=N, E=E))
    budget = 1 << 16 if widen() else offsets["BUDGET"]
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    totals = torch.empty(BE, dtype=torch.int32, device=dev)
    one = n_chunks == 1
    base = totals
    if not one:
        counts = torch.empty((n_chunks, BE), dtype=torch.int32, device=dev)
        base = torch.empty_like(counts)
        _align_count[(n_chunks,)](ids, counts, N, E, BN=BN, BE=BE, **chunk_options)
        BEP = min(BE, offsets["BEP"])
        BC = max(2, min(next_pow2(n_chunks), (1 << 16 if widen() else offsets["PREFIX"]) // BEP))
        _align_prefix[(BE // BEP,)](counts, base, totals, n_chunks, BE=BE, BC=BC, BEP=BEP, **offsets_options)
    tiles_per = triton.cdiv(max_blocks, n_chunks)
    TB = max(2, min(next_pow2(tiles_per), max(2, budget // max(BE, block_m))))
    _align_scatter[(n_chunks,)](ids, base, totals, sorted_ids, expert_ids, num_post, N, E, max_padded, max_blocks,
                                tiles_per, BM=block_m, BN=BN, BE=BE, TB=TB, ONE=one, **chunk_options)
    return sorted_ids, expert_ids, num_post
