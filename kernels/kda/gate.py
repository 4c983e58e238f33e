"""KDA forget gate: g[t, h, d] = -exp(A_log[h]) * softplus(g_raw[t, h, d] + dt_bias[h*K + d]), fp32 out.

A_log is per HEAD (outside the softplus), dt_bias per CHANNEL (inside it): swapping the two broadcasts is the
highest-risk bug of the KDA block (kda.md, pitfall 1). One program handles BT tokens of one head; the token stride
is an argument, so a strided view of g (rows of a wider projection) is read in place.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import next_pow2, ordered_grid, ordered_ids, row_block, softplus, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

# BT tokens x next_pow2(K) per program: 4096 elements (BT = 32 at K = 128, 64 at K <= 64), 4 warps: 79-80 registers
# for 16-bit inputs (94-96 fp32), 5-6 CTAs/SM on sm_90a since softplus keeps its digits (55-63 and 8-9 before): about
# 49 KB of loads in flight per SM against the ~25 KB that 4.8 TB/s x ~700 ns asks (a model; BT = 16, 48 registers and
# 10 CTAs/SM, is a candidate). The grid is T/BT x H programs whatever BT: at T = 1 it is H programs of one row.
# HEADS_FASTEST: consecutive programs take the heads of the same tokens, so the programs in flight read and write
# one contiguous stretch of [T, H, K] (a head's 32 rows alone are 256-byte pieces 8 KB apart at H = 32, K = 128:
# with the tokens fastest, as before, every DRAM page was opened once per head). A model, not measured: on the
# first H200 run the token-fastest kernel moved 75-82% of the measured copy bandwidth at 64k tokens (issue 12 asks
# 80%); `spark-bench tune` times both. Grid dimension 1 is capped at 65535 (T/BT beyond it: tokens fastest).
CONFIGS = declare(ConfigSpace(
    "kda.gate._kda_gate_fwd", key=("T", "K", "dtype"),
    default={"BT": 32, "HEADS_FASTEST": 1, "num_warps": 4},
    buckets=[({"K": 64}, {"BT": 64, "HEADS_FASTEST": 1, "num_warps": 4})],
    candidates=[{"BT": 16, "HEADS_FASTEST": 1, "num_warps": 4}, {"BT": 64, "HEADS_FASTEST": 1, "num_warps": 8},
                {"BT": 32, "HEADS_FASTEST": 0, "num_warps": 4}]))  # the order until 2026-12-05


@triton.jit
def _kda_gate_fwd(g_raw, A_log, dt_bias, out, T, stride_t, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, HEADS_FASTEST: tl.constexpr):
    i_h, i_t = ordered_ids(HEADS_FASTEST, 1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_k = tl.arange(0, BK)
    mask = (o_t[:, None] < T) & (o_k[None, :] < K)
    x = tl.load(g_raw + o_t[:, None] * stride_t + i_h * K + o_k[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    y = -a * softplus(x + bias[None, :])
    tl.store(out + o_t[:, None] * (H * K) + i_h * K + o_k[None, :], y, mask=mask)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g: [..., H, K] (any float dtype; rows may be strided), A_log: [H] (any shape with H elements),
    dt_bias: [H*K] -> fp32 [..., H, K] (contiguous)."""
    H, K = g.shape[-2:]
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    g = g.reshape(-1, H, K)  # a view when the leading dimensions allow it
    if g.stride(2) != 1 or g.stride(1) != K:
        g = g.contiguous()
    T = g.shape[0]
    BK = next_pow2(K)
    meta, options = split(CONFIGS.pick(T=T, K=K, dtype=str(g.dtype)))
    if widen():
        meta["BT"] = row_block(BK)
    grid, heads_fastest = ordered_grid(H, triton.cdiv(T, meta["BT"]), prefer=meta["HEADS_FASTEST"])
    meta["HEADS_FASTEST"] = int(heads_fastest)
    _kda_gate_fwd[grid](g, A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous(), out, T,
                        g.stride(0), H=H, K=K, BK=BK, **meta, **options)
    return out
