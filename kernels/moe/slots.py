"""y[t] = sum over the R partial rows of token t (rows t*R .. t*R + R - 1 of [T*R, D], any float dtype), summed in
fp32 in a fixed order (deterministic: no atomics). R is K (one row per routed slot) or K*S (a slot's output split
over S slices of the reduction). Used by the bf16 and GGUF expert paths."""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16
from spark_bench.kernels.configs import ConfigSpace, declare, split

SUM_CONFIGS = declare(ConfigSpace(
    "moe.slots._sum_slots", key=("T", "D"), default={"BT": 16, "BD": 128, "num_warps": 4},
    buckets=[({"T": 8}, {"BT": 1, "BD": 256, "num_warps": 4})],  # decode: one token per program, D/256 programs
    candidates=[{"BT": 8, "BD": 256, "num_warps": 4}, {"BT": 32, "BD": 128, "num_warps": 8}],
    doc="BT tokens x BD columns per program; the R partials of a token are summed in registers"))


@triton.jit
def _sum_slots(y_slots, y, T, D, R: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr):
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (o_t[:, None] < T) & (o_d[None, :] < D)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for r in tl.static_range(R):
        acc += tl.load(y_slots + (o_t[:, None] * R + r) * D + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + o_t[:, None] * D + o_d[None, :], round_bf16(acc, RNE).to(y.dtype.element_ty), mask=mask)


def sum_slots(y_slots: torch.Tensor, T: int, out_dtype: torch.dtype) -> torch.Tensor:
    """[T*R, D] partials -> [T, D] in out_dtype (the R rows of each token summed in order, fp32)."""
    D = y_slots.shape[1]
    R = y_slots.shape[0] // T
    y = torch.empty((T, D), dtype=out_dtype, device=y_slots.device)
    meta, options = split(SUM_CONFIGS.pick(T=T, D=D))
    BT, BD = (max(1, min(next_pow2(T), 64)), max(16, min(next_pow2(D), 256))) if INTERPRET else \
        (meta["BT"], meta["BD"])
    _sum_slots[(triton.cdiv(T, BT), triton.cdiv(D, BD))](y_slots, y, T, D, R=R, BT=BT, BD=BD,
                                                          RNE=rounds_bf16(out_dtype), **options)
    return y
