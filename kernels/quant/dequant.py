"""GGUF Q2_K / Q3_K rows -> bf16 or fp32: one program dequantizes BR rows of one 256-weight super-block column,
32 weights at a time (device functions: kernels/quant/kquants.py). dequantize_experts does it for the [E, rows,
bytes] expert stacks of the GGUF MoE prefill, skipping the experts no token was routed to (a flag per expert read
on the device: no host sync), whose scratch rows stay unwritten.

Bit-exact with gguf's numpy dequantizer in fp32 (every product is exact); bf16 output is the fp32 value rounded
once to nearest even (under the interpreter by integer ops, whose own cast truncates).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, ordered_grid, ordered_ids, widen
from spark_bench.kernels.quant.kquants import CHUNK, aligned, bf16_rne, block_ptr, block_scales, dequant_chunk

BLOCK_BYTES = {"q2_k": 84, "q3_k": 110}


@triton.jit
def _dequant_rows(raw, out, hit, n_rows, row_bytes, cols, rows_per_expert, BR: tl.constexpr, Q3: tl.constexpr,
                  RNE_BF16: tl.constexpr, SKIP: tl.constexpr, BLOCKS_FASTEST: tl.constexpr):
    """SKIP: rows of expert r // rows_per_expert are written only where hit[expert] != 0 (BR divides the rows
    per expert, so a program's rows are one expert's). BLOCKS_FASTEST: grid (super-blocks, row blocks), so the
    programs in flight read and write whole rows (with row blocks fastest, as before 2026-12-05, they took one
    84-110-byte block of each row and one 512-byte piece of each bf16 row; a model, not measured)."""
    b, i_r = ordered_ids(BLOCKS_FASTEST, 1)
    if SKIP:
        if tl.load(hit + i_r * BR // rows_per_expert) == 0:
            return
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
    mask = o_r < n_rows
    block = block_ptr(raw + o_r * row_bytes, b, Q3)
    d, dmin = block_scales(block, mask, Q3)
    dst = out + o_r * cols + b * 256 + tl.arange(0, CHUNK)[None, :]
    for c in range(0, 256, CHUNK):
        w = dequant_chunk(block, mask, d, dmin, c, Q3)
        if RNE_BF16:
            w = bf16_rne(w)
        tl.store(dst + c, w.to(out.dtype.element_ty), mask=mask)


def dequantize(raw: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16, hit: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """raw: [..., nb*block_bytes] uint8 (rows of `fmt` blocks) -> [..., nb*256] in `dtype`. hit: optional int32
    flags over raw's first dimension (experts, raw [E, rows, bytes]): only the flagged experts' rows are written.
    out: an optional contiguous destination of that shape and dtype (a reused scratch; a group of experts is
    raw[e0:e1] with hit[e0:e1])."""
    bb = BLOCK_BYTES[fmt]
    if raw.dtype != torch.uint8 or raw.shape[-1] % bb:
        raise ValueError(f"{fmt} expects uint8 rows of a multiple of {bb} bytes, got {raw.dtype} {tuple(raw.shape)}")
    raw = aligned(raw.contiguous(), 2 if fmt == "q3_k" else 4)
    row_bytes = raw.shape[-1]
    cols = row_bytes // bb * 256
    n_rows = raw.numel() // max(1, row_bytes)
    shape = (*raw.shape[:-1], cols)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous {shape} {dtype}")
    if out.numel() == 0:
        return out
    BR = min(next_pow2(n_rows), 2048) if widen() else 32
    rows_per_expert = n_rows
    if hit is not None:
        if raw.dim() != 3 or hit.shape != raw.shape[:1]:
            raise ValueError(f"hit {tuple(hit.shape)} must flag the experts of raw [E, rows, bytes] {tuple(raw.shape)}")
        rows_per_expert = raw.shape[1]
        BR = min(BR, rows_per_expert & -rows_per_expert)  # a power of two dividing the rows per expert
        hit = hit.to(torch.int32).contiguous()
    grid, blocks_fastest = ordered_grid(cols // 256, triton.cdiv(n_rows, BR))
    _dequant_rows[grid](raw, out, hit, n_rows, row_bytes, cols, rows_per_expert, BR=BR, Q3=fmt == "q3_k",
                        RNE_BF16=INTERPRET and dtype == torch.bfloat16, SKIP=hit is not None,
                        BLOCKS_FASTEST=blocks_fastest)
    return out
