"""GGUF Q2_K / Q3_K rows -> bf16 or fp32: one program dequantizes BR rows of one 256-weight super-block column,
32 weights at a time (device functions: kernels/quant/kquants.py).

Bit-exact with gguf's numpy dequantizer in fp32 (every product is exact); bf16 output is the fp32 value rounded
once to nearest even (under the interpreter by integer ops, whose own cast truncates).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2
from spark_bench.kernels.quant.kquants import CHUNK, aligned, bf16_rne, block_ptr, block_scales, dequant_chunk

BLOCK_BYTES = {"q2_k": 84, "q3_k": 110}


@triton.jit
def _dequant_rows(raw, out, n_rows, row_bytes, cols, BR: tl.constexpr, Q3: tl.constexpr, RNE_BF16: tl.constexpr):
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
    b = tl.program_id(1)
    mask = o_r < n_rows
    block = block_ptr(raw + o_r * row_bytes, b, Q3)
    d, dmin = block_scales(block, mask, Q3)
    dst = out + o_r * cols + b * 256 + tl.arange(0, CHUNK)[None, :]
    for c in range(0, 256, CHUNK):
        w = dequant_chunk(block, mask, d, dmin, c, Q3)
        if RNE_BF16:
            w = bf16_rne(w)
        tl.store(dst + c, w.to(out.dtype.element_ty), mask=mask)


def dequantize(raw: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """raw: [..., nb*block_bytes] uint8 (rows of `fmt` blocks) -> [..., nb*256] in `dtype`."""
    bb = BLOCK_BYTES[fmt]
    if raw.dtype != torch.uint8 or raw.shape[-1] % bb:
        raise ValueError(f"{fmt} expects uint8 rows of a multiple of {bb} bytes, got {raw.dtype} {tuple(raw.shape)}")
    raw = aligned(raw.contiguous(), 2 if fmt == "q3_k" else 4)
    row_bytes = raw.shape[-1]
    cols = row_bytes // bb * 256
    n_rows = raw.numel() // max(1, row_bytes)
    out = torch.empty(*raw.shape[:-1], cols, dtype=dtype, device=raw.device)
    if out.numel() == 0:
        return out
    BR = min(next_pow2(n_rows), 2048) if INTERPRET else 32
    grid = (triton.cdiv(n_rows, BR), cols // 256)
    _dequant_rows[grid](raw, out, n_rows, row_bytes, cols, BR=BR, Q3=fmt == "q3_k",
                        RNE_BF16=INTERPRET and dtype == torch.bfloat16)
    return out
