"""y[t] = sum over the R partial rows of token t (rows t*R .. t*R + R - 1 of [T*R, D], any float dtype), summed in
fp32 in a fixed order (deterministic: no atomics). R is K (one row per routed slot) or K*S (a slot's output split
over S slices of the reduction). Used by the bf16 and GGUF expert paths.

Two ways, chosen by the declared FUSE of `moe.slots._sum_slots` (1 at decode sizes, T <= 8):
  _sum_slots      its own launch (BT tokens x BD columns per program);
  sum_tile        inside the kernel that writes the partials: the last of a D tile's programs to finish (a ticket
                  per tile, kernels/common.py) sums the tile's T x R rows and stores y. At T = 1 that removes a
                  launch of D / 256 = 9 programs (Kimi-Linear) from the decode path; the winner's loop is serial
                  over tokens, hence decode sizes only.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import (
    last_to_arrive,
    next_pow2,
    ordered_grid,
    ordered_ids,
    round_bf16,
    rounds_bf16,
    tickets,
    widen,
)
from spark_bench.kernels.configs import ConfigSpace, declare, split

SUM_CONFIGS = declare(ConfigSpace(
    "moe.slots._sum_slots", key=("T", "D"),
    default={"BT": 16, "BD": 128, "FUSE": 0, "num_warps": 4},
    buckets=[({"T": 8}, {"BT": 1, "BD": 256, "FUSE": 1, "num_warps": 4})],  # decode: in the partials' kernel
    candidates=[{"BT": 1, "BD": 256, "FUSE": 0, "num_warps": 4},  # decode, its own launch: D / 256 programs
                {"BT": 8, "BD": 256, "FUSE": 0, "num_warps": 4}, {"BT": 32, "BD": 128, "FUSE": 0, "num_warps": 8}],
    doc="FUSE: the partials' kernel sums them (a ticket per D tile); else BT tokens x BD columns per program"))


@triton.jit
def _sum_slots(y_slots, y, ids, T, D, E, R: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr,
               D_FASTEST: tl.constexpr, CHECK_IDS: tl.constexpr):
    """D_FASTEST: grid (D/BD, T/BT), so consecutive programs take the column tiles of the same rows and the programs
    in flight stream whole rows of y_slots; token blocks fastest, as before 2026-12-05, each pass over y_slots
    (302 MB at T = 16k, K = 8, D = 2304) read one 256-byte piece of every 4.6 KB row, D/BD passes (a model).
    CHECK_IDS (one row per slot, R = K): a slot whose expert id ids[t*R + r] is outside [0, E) adds nothing (no
    GEMM wrote its row: the alignment leaves such slots out)."""
    i_d, i_t = ordered_ids(D_FASTEST, 1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    mask = (o_t[:, None] < T) & (o_d[None, :] < D)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for r in tl.static_range(R):
        m_r = mask
        if CHECK_IDS:
            e = tl.load(ids + o_t * R + r, mask=o_t < T, other=-1)
            m_r = mask & ((e >= 0) & (e < E))[:, None]
        acc += tl.load(y_slots + (o_t[:, None] * R + r) * D + o_d[None, :], mask=m_r, other=0.0).to(tl.float32)
    tl.store(y + o_t[:, None] * D + o_d[None, :], round_bf16(acc, RNE).to(y.dtype.element_ty), mask=mask)


@triton.jit
def sum_tile(part, y, tickets, tile, n_programs, o_n, m_n, T, D, R, RP: tl.constexpr, RNE: tl.constexpr):
    """Called by each of the n_programs programs of D tile `tile` (columns o_n) after storing its partials: the last
    to arrive stores y[t, o_n] = the sum of token t's R rows of part (a [RP, BN] tile per token, summed by one
    tl.sum: a fixed order) for every token."""
    if last_to_arrive(tickets, tile, n_programs):
        o_r = tl.arange(0, RP)
        mask = (o_r < R)[:, None] & m_n[None, :]
        for t in range(T):
            rows = (t * R + o_r).to(tl.int64)
            v = tl.load(part + rows[:, None] * D + o_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y + t * D + o_n, round_bf16(tl.sum(v, axis=0), RNE).to(y.dtype.element_ty), mask=m_n)


class FusedSum:
    """How a partials kernel's slots are summed: in the kernel when `fused` (the declared FUSE at T tokens and D
    columns, and `allowed` by the caller), else by a _sum_slots launch. The kernel takes `kernel_args(part, tiles)`;
    `finish(part)` returns y either way."""

    def __init__(self, owner: str, T: int, D: int, R: int, out_dtype: torch.dtype, device, allowed: bool = True):
        self.config = SUM_CONFIGS.pick(T=T, D=D)
        self.fused = bool(self.config["FUSE"]) and allowed
        self.owner, self.T, self.R, self.out_dtype = owner, T, R, out_dtype
        self.y = torch.empty((T, D), dtype=out_dtype, device=device) if self.fused else None

    def kernel_args(self, part: torch.Tensor, tiles: int) -> dict:
        """The partials kernel's arguments y, tickets, T, R and constexprs FUSE, RP, RNE (unfused: part stands in for
        the pointers it does not use)."""
        if not self.fused:
            return {"y": part, "tickets": part, "T": self.T, "R": self.R, "FUSE": False, "RP": 1, "RNE": False}
        return {"y": self.y, "tickets": tickets(self.owner, part.device, tiles), "T": self.T, "R": self.R,
                "FUSE": True, "RP": next_pow2(self.R), "RNE": rounds_bf16(self.out_dtype)}

    def finish(self, part: torch.Tensor) -> torch.Tensor:
        return self.y if self.fused else sum_slots(part, self.T, self.out_dtype, self.config)


def sum_slots(y_slots: torch.Tensor, T: int, out_dtype: torch.dtype, config: dict | None = None,
              ids: torch.Tensor | None = None, experts: int = 0) -> torch.Tensor:
    """[T*R, D] partials -> [T, D] in out_dtype (the R rows of each token summed in order, fp32). ids ([T*R] int32,
    one row per slot): rows whose id is outside [0, experts) are skipped (the grouped GEMMs never write them)."""
    D = y_slots.shape[1]
    R = y_slots.shape[0] // T
    y = torch.empty((T, D), dtype=out_dtype, device=y_slots.device)
    meta, options = split(config or SUM_CONFIGS.pick(T=T, D=D))
    meta.pop("FUSE", None)
    BT, BD = (max(1, min(next_pow2(T), 64)), max(16, min(next_pow2(D), 256))) if widen() else \
        (meta["BT"], meta["BD"])
    grid, d_fastest = ordered_grid(triton.cdiv(D, BD), triton.cdiv(T, BT))  # tokens first past 1M at BT = 16
    _sum_slots[grid](y_slots, y, y if ids is None else ids, T, D, experts, R=R, BT=BT, BD=BD,
                     RNE=rounds_bf16(out_dtype), D_FASTEST=d_fastest, CHECK_IDS=ids is not None, **options)
    return y
