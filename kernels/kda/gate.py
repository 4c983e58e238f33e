"""KDA forget gate: g[t, h, d] = -exp(A_log[h]) * softplus(g_raw[t, h, d] + dt_bias[h*K + d]), fp32 out.

A_log is per HEAD (outside the softplus), dt_bias per CHANNEL (inside it): swapping the two broadcasts is the
highest-risk bug of the KDA block (kda.md, pitfall 1). One program handles BT tokens of one head.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, row_block, softplus


@triton.jit
def _kda_gate_fwd(g_raw, A_log, dt_bias, out, T, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_k = tl.arange(0, BK)
    mask = (o_t[:, None] < T) & (o_k[None, :] < K)
    offs = o_t[:, None] * (H * K) + i_h * K + o_k[None, :]
    x = tl.load(g_raw + offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    y = -a * softplus(x + bias[None, :])
    tl.store(out + offs, y, mask=mask)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g: [..., H, K] (any float dtype), A_log: [H] (any shape with H elements), dt_bias: [H*K] -> fp32 [..., H, K]."""
    H, K = g.shape[-2:]
    g = g.contiguous()
    T = g.numel() // (H * K)
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    BK = next_pow2(K)
    BT = row_block(BK)
    grid = (triton.cdiv(T, BT), H)
    _kda_gate_fwd[grid](g, A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous(), out, T,
                        H=H, K=K, BT=BT, BK=BK)
    return out
