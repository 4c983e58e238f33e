"""Triton device functions that dequantize GGUF Q2_K / Q3_K rows in registers, 32 weights of a super-block at a time.

Layouts and formulas: plugins/quant/kquants.py (moe.md). Within a 32-aligned chunk of a 256-weight super-block
every weight takes its 2-bit code from the same 32 consecutive qs bytes at the same shift, its high bit (Q3_K)
from hmask bytes 0..31 at the same bit, and its scale from one of two 16-weight sub-blocks: so each chunk is a few
contiguous [BN, 32] byte loads plus per-row scalars, with every offset a compile-time constant. All products are
exact in fp32 (the result is bit-exact with gguf's numpy dequantizer).
`block` are uint8 pointers to each row's current super-block ([BN, 1]), `mask` which rows exist ([BN, 1]).
"""

import triton
import triton.language as tl

CHUNK = tl.constexpr(32)  # weights per dequantized chunk


def aligned(raw, alignment: int):
    """`raw` itself when its first byte is `alignment`-aligned (block_ptr's promise), else an aligned copy."""
    return raw if raw.data_ptr() % alignment == 0 else raw.clone()


@triton.jit
def _f16_bits(bits):
    """The fp16 in the low 16 bits of an unsigned integer -> fp32."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def block_ptr(rows, b, Q3: tl.constexpr):
    """Pointers to super-block b of each row ([BN, 1] only). The layout keeps Q2_K blocks 4-byte and Q3_K blocks 2-byte
    aligned (84- and 110-byte blocks, rows of whole blocks, callers check the base pointer): the hint lets the
    compiler load each chunk's bytes as vectors, a few rows per thread (cuobjdump: no register spills)."""
    if Q3:
        blk = tl.multiple_of(rows + b * 110, [2, 2])
    else:
        blk = tl.multiple_of(rows + b * 84, [4, 4])
    return blk


@triton.jit
def block_scales(block, mask, Q3: tl.constexpr):
    """(d, dmin) of each row's super-block, fp32 (block's shape); dmin is 0 for Q3_K. One 16-bit load of Q3_K's d,
    one 32-bit load of Q2_K's d | dmin (little-endian), under block_ptr's alignment promise, instead of byte pairs."""
    if Q3:
        d = tl.load((block + 108).to(tl.pointer_type(tl.float16)), mask=mask, other=0).to(tl.float32)
        dmin = tl.zeros_like(d)
    else:
        word = tl.load((block + 80).to(tl.pointer_type(tl.uint32)), mask=mask, other=0)
        d, dmin = _f16_bits(word), _f16_bits(word >> 16)
    return d, dmin


@triton.jit
def _byte_pair(block, mask, OFFSET):
    """Bytes OFFSET and OFFSET + 1 (OFFSET even: 2-byte aligned under block_ptr's promise) of each row's
    super-block as one 16-bit load -> (first, second), int32."""
    word = tl.load((block + OFFSET).to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)
    return word & 255, word >> 8


@triton.jit
def _q3_scale_pair(block, mask, J):
    """(l_J - 32, l_(J+1) - 32) for each row, J even: bits 0-3 from scales[J % 8] (high nibble for J >= 8), bits 4-5
    from scales[8 + J % 4] (at bit 2 * (J // 4)). J and J + 1 share both shifts and take adjacent bytes, so the pair
    costs two 16-bit loads instead of four byte loads."""
    low_a, low_b = _byte_pair(block, mask, 96 + J % 8)
    high_a, high_b = _byte_pair(block, mask, 104 + J % 4)
    s_low = 4 * (J // 8)
    s_high = 2 * (J // 4)
    l_a = ((low_a >> s_low) & 15) | (((high_a >> s_high) & 3) << 4)
    l_b = ((low_b >> s_low) & 15) | (((high_b >> s_high) & 3) << 4)
    return l_a - 32, l_b - 32


@triton.jit
def _codes(block, mask, QS: tl.constexpr, C0):
    """2-bit codes of weights C0 .. C0+31: qs[32 * (C0 // 128) + i] >> 2 * ((C0 % 128) // 32), qs at byte QS."""
    qb = tl.load(block + QS + (C0 // 128) * 32 + tl.arange(0, CHUNK)[None, :], mask=mask, other=0).to(tl.int32)
    return (qb >> ((C0 % 128) // 32 * 2)) & 3


@triton.jit
def dequant_chunk(block, mask, d, dmin, C0, Q3: tl.constexpr):
    """Weights C0 .. C0+31 (C0 a multiple of 32) of each row's super-block -> fp32 [BN, 32]; d, dmin from
    block_scales. Q2_K: d * (sc_j & 15) * q - dmin * (sc_j >> 4); Q3_K: d * (l_j - 32) * (q2 - 4 * (hmask bit
    clear)), j = (C0 + i) // 16."""
    first = tl.arange(0, CHUNK)[None, :] < 16  # sub-block C0 // 16, else C0 // 16 + 1
    if Q3:
        high = (tl.load(block + tl.arange(0, CHUNK)[None, :], mask=mask, other=0).to(tl.int32) >> (C0 // 32)) & 1
        q = (_codes(block, mask, 32, C0) - 4 + 4 * high).to(tl.float32)
        l_a, l_b = _q3_scale_pair(block, mask, C0 // 16)
        w = d * tl.where(first, l_a, l_b).to(tl.float32) * q
    else:
        q = _codes(block, mask, 16, C0).to(tl.float32)
        sc_a, sc_b = _byte_pair(block, mask, C0 // 16)
        dl = tl.where(first, d * (sc_a & 15).to(tl.float32), d * (sc_b & 15).to(tl.float32))
        ml = tl.where(first, dmin * (sc_a >> 4).to(tl.float32), dmin * (sc_b >> 4).to(tl.float32))
        w = dl * q - ml
    return w


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even with integer ops: the interpreter's fp32->bf16 cast truncates, the
    GPU's rounds to nearest even, so INTERPRET runs use this to store the bits the GPU stores (finite x)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
