"""What the KDA cores share: the small @triton.jit helpers (fused gate, L2 norm on load, output rounding, bf16 dot
operands) and the varlen chunk table. The chunk-local cumsum of the decay is fused into chunk_intra.py.
g is the log-space decay, or with GATE the raw gate: -exp(A_log[h]) * softplus(g + dt_bias[h*K + d]).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import round_bf16, softplus


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
def tf32(x, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """An fp32 tl.dot operand at PREC "tf32": under the interpreter, whose dots are fp32 whatever input_precision
    says, its mantissa is cut to tf32's 10 bits (truncated, as Hopper's wgmma reads fp32 operands from shared
    memory), so the tests see the GPU's operand precision; unchanged on the GPU and at other precisions."""
    if INTERPRET:
        if PREC == "tf32":
            x = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return x


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
