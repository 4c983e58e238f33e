"""KDA output norm: y = o * rsqrt(mean(o*o over V) + eps) * weight * sigmoid(z), per (token, head) row.

One [V] weight shared by all heads; the gate is SIGMOID (not fla's default swish). fp32 math, output in o's dtype.
One program normalises BR rows of V elements.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, round_bf16, rounds_bf16, row_block


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
    BR = row_block(BV)
    _gated_rmsnorm_fwd[(triton.cdiv(R, BR),)](o, z, weight.contiguous(), y, R, eps, V=V, BR=BR, BV=BV,
                                              ROUND=rounds_bf16(y.dtype))
    return y
