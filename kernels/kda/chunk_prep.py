"""KDA chunk stage 0: the chunk-local cumulative decay G = cumsum(g) (fp32, natural log), with the gate fused.

Also the small @triton.jit helpers the KDA cores share (fused gate, L2 norm on load, output rounding) and the
varlen chunk table.
g is the log-space decay, or with GATE the raw gate: -exp(A_log[h]) * softplus(g + dt_bias[h*K + d]).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import round_bf16, softplus, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

# The cumsum runs along the tokens, so channels split freely: grid (chunks, H, K/BK). BK = K = 128 at 4 warps is
# the [64, 128] fp32 tile of one chunk (146-211 registers, 2-3 CTAs/SM on sm_90a); BK = 64 halves the tile and
# doubles the programs.
CONFIGS = declare(ConfigSpace(
    "kda.chunk_prep._chunk_cumsum", key=("H", "K"),
    default={"BK": 128, "num_warps": 4},
    candidates=[{"BK": 64, "num_warps": 4}, {"BK": 64, "num_warps": 2}, {"BK": 128, "num_warps": 8}]))


@triton.jit
def kda_decay(g, A_log, dt_bias, i_h, o_k, m_k, K: tl.constexpr):
    """The KDA gate on a [..., BK] tile of raw logits of head i_h: A_log per head, dt_bias per channel."""
    bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    return -a * softplus(g + bias)


@triton.jit
def l2_normalize_rows(x, L2NORM: tl.constexpr):
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis when L2NORM (masked columns hold zeros)."""
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)
    return x


@triton.jit
def to_output_dtype(x, out, INTERPRET: tl.constexpr):
    """fp32 x cast to out's element type, rounding to nearest even: the interpreter truncates fp32 -> bf16."""
    if INTERPRET:
        if out.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(out.dtype.element_ty)


@triton.jit
def dot_operand(x, DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """x as a tl.dot operand: bf16 when DOT_BF16 (fp32 accumulation stays the caller's), else fp32. Under the
    interpreter, whose bf16 dot is broken, it is rounded to the nearest bf16 and kept fp32, so tests see the GPU's
    operand rounding."""
    if DOT_BF16:
        if INTERPRET:
            x = round_bf16(x.to(tl.float32), True)
        else:
            x = x.to(tl.bfloat16)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _chunk_cumsum(g, A_log, dt_bias, chunk_start, chunk_end, gcum, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    start = tl.load(chunk_start + i_c).to(tl.int64)
    end = tl.load(chunk_end + i_c).to(tl.int64)
    if start >= end:
        return
    rows = start + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    mask = (rows < end)[:, None] & m_k[None, :]
    offs = (rows[:, None] * H + i_h) * K + o_k[None, :]
    b_g = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    if GATE:
        b_g = tl.where(mask, kda_decay(b_g, A_log, dt_bias, i_h, o_k[None, :], m_k[None, :], K), 0.0)
    tl.store(gcum + offs, tl.cumsum(b_g, axis=0), mask=mask)


def chunk_table(cu_seqlens: torch.Tensor, total: int, chunk: int):
    """(start, end, n, first) of every chunk of every sequence, computed on the device without a host sync: `n` =
    total // chunk + N is an upper bound of the chunk count; the spare entries have start == end (empty). A
    sequence's chunks are numbered consecutively from first[seq] (int32 [N])."""
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + chunk - 1) // chunk
    last = n_chunks.cumsum(0)
    n = total // chunk + N
    c = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(last, c, right=True)
    valid = seq < N
    seq = seq.clamp(max=N - 1)
    start = cu[seq] + (c - (last[seq] - n_chunks[seq])) * chunk
    end = torch.where(valid, cu[seq + 1], start)
    return start.to(torch.int32), end.to(torch.int32), n, (last - n_chunks).to(torch.int32)


def chunk_cumsum(g, chunk_start, chunk_end, n_chunks, *, BT, A_log=None, dt_bias=None, gate=False):
    """g [T, H, K] -> fp32 chunk-local cumsum of the decay (the gate applied first when `gate`)."""
    T, H, K = g.shape
    gcum = torch.empty(T, H, K, dtype=torch.float32, device=g.device)
    dummy = gcum  # never read when GATE is off
    full_k = max(16, triton.next_power_of_2(K))
    meta, options = split(CONFIGS.pick(H=H, K=K))
    meta["BK"] = full_k if widen() else min(meta["BK"], full_k)
    _chunk_cumsum[(n_chunks, H, triton.cdiv(K, meta["BK"]))](
        g, A_log if gate else dummy, dt_bias if gate else dummy, chunk_start, chunk_end, gcum,
        H=H, K=K, BT=BT, GATE=gate, **meta, **options)
    return gcum
