"""KDA output norm: y = o * rsqrt(mean(o*o over V) + eps) * weight * sigmoid(z), per (token, head) row.

One [V] weight shared by all heads; the gate is SIGMOID (not fla's default swish). fp32 math, output in o's dtype.
One program normalises BR rows of V elements.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, round_bf16, rounds_bf16, row_block, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

# Key: R = tokens x heads rows, V. Prefill: BR x next_pow2(V) = 4096 elements (32 rows of 128, 64 of 64), 4 warps.
# Decode (R <= 512, T <= 16 at H = 32): 4 rows per program on 1 warp, so T = 1 at H = 32 is 8 programs, not one.
CONFIGS = declare(ConfigSpace(
    "kda.gated_rmsnorm._gated_rmsnorm_fwd", key=("R", "V", "dtype"),
    default={"BR": 32, "num_warps": 4},
    buckets=[({"R": 512}, {"BR": 4, "num_warps": 1}), ({"V": 64}, {"BR": 64, "num_warps": 4})],
    candidates=[{"BR": 1, "num_warps": 1}, {"BR": 8, "num_warps": 2}, {"BR": 64, "num_warps": 8}]))


@triton.jit
def _gated_rmsnorm_fwd(o, z, weight, y, R, eps, V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
                       ROUND: tl.constexpr):
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    mask = (o_r < R)[:, None] & m_v[None, :]
    offs = o_r[:, None] * V + o_v[None, :]
    x = tl.load(o + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / V + eps)
    w = tl.load(weight + o_v, mask=m_v, other=0.0).to(tl.float32)
    g = tl.load(z + offs, mask=mask, other=0.0).to(tl.float32)
    out = round_bf16(x * rstd[:, None] * w[None, :] * tl.sigmoid(g), ROUND)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """o, z: [..., V] (same shape), weight [V] -> y like o."""
    V = o.shape[-1]
    o, z = o.contiguous(), z.contiguous()
    y = torch.empty_like(o)
    R = o.numel() // V
    BV = next_pow2(V)
    meta, options = split(CONFIGS.pick(R=R, V=V, dtype=str(o.dtype)))
    if BV > 128:  # the declared rows are for V <= 128: keep BR x BV at most that many elements
        meta["BR"] = max(1, meta["BR"] * 128 // BV)
    if widen():
        meta["BR"] = row_block(BV)
    _gated_rmsnorm_fwd[(triton.cdiv(R, meta["BR"]),)](o, z, weight.contiguous(), y, R, eps, V=V, BV=BV,
                                                      ROUND=rounds_bf16(y.dtype), **meta, **options)
    return y
