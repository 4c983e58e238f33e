"""Triton device functions: the dot product of each GGUF Q2_K / Q3_K row's 256-weight super-block with an fp32
activation slice, one whole super-block per call, without dequantizing a weight (decode GEMVs).

Factored scales. A super-block is 16 sub-blocks j of 16 weights; Q2_K weights are d*sc_j*q - dmin*m_j, Q3_K
weights d*l_j*(q2 + 4*hbit - 4). So per row
    Q2_K:  sum_j d*sc_j * (sum_i q_i x_i) - dmin*m_j * X_j,      Q3_K:  sum_j d*l_j * (sum_i (q2_i + 4 h_i) x_i - 4 X_j)
with X_j = sum of x over sub-block j, computed once per super-block for all rows (activation_sums). Only the
per-weight code dot sum_i c_i x_i runs per weight; the 16 sub-block scales are applied per row, 1/16 of an op each.

No int->float conversion per weight (the magic-number trick in the mantissa): the code c (2 bits, or 3 with the
Q3_K high bit) is shifted into the top mantissa bits of 1.0, so the bits read as f = 1 + c/4 (Q2_K) or 1 + c/8
(Q3_K) exactly; then sum_i f_i x_i = X_j + (sum_i c_i x_i)/4 (or /8), and the code dot is 4*(S_j - X_j) (8*(...)).
Per weight that is a shift and a masked or (one LOP3) on the byte, plus one FMA: f*x is exact in fp32 for bf16 x
(8 + 4 significant bits), and the subtraction S_j - X_j loses nothing that matters (S_j, X_j ~ sum |x|, error
2^-24 of that). Codes come from byte loads at compile-time offsets (qs byte 32*(j//8) + 16*(j%2) + i at shift
2*((j//2)%4); the Q3_K high bit from hmask byte 16*(j%2) + i, bit j//2), contiguous 16 bytes per sub-block.
Shapes: `block` [BR, 1] uint8 pointers to each row's super-block (kernels/quant/kquants.py's block_ptr), `mask`
[BR, 1], `x` fp32 [1 or BR, 16, 16] (sub-block, position), `xsum` its sums [1 or BR, 16]. Returns [BR, 1] fp32.
"""

import triton
import triton.language as tl
from spark_bench.kernels.quant.kquants import load_f16

ONE_BITS = tl.constexpr(0x3F800000)  # 1.0f


@triton.jit
def subblock_offsets():
    """[1, 16, 16] offsets 16*j + i of the super-block's weights as (sub-block j, position i)."""
    j = tl.arange(0, 16)[None, :, None]
    return j * 16 + tl.arange(0, 16)[None, None, :]


@triton.jit
def activation_sums(x):
    """X_j: x [R, 16, 16] summed over each sub-block -> [R, 16] (once per super-block, shared by every row)."""
    return tl.sum(x, axis=2)


@triton.jit
def _code_bits(block, mask3, Q3: tl.constexpr):
    """The weights' codes as float bits 1 + c/4 (Q2_K) or 1 + c/8 (Q3_K, c = q2 + 4*hbit): [BR, 16, 16] fp32."""
    j = tl.arange(0, 16)[None, :, None]
    i = tl.arange(0, 16)[None, None, :]
    blk = block[:, :, None]
    shift = 2 * ((j // 2) % 4)
    if Q3:
        qs = tl.load(blk + 32 + 32 * (j // 8) + 16 * (j % 2) + i, mask=mask3, other=0).to(tl.int32)
        hm = tl.load(blk + 16 * (j % 2) + i, mask=mask3, other=0).to(tl.int32)
        bits = ((qs << (20 - shift)) & 0x300000) | ((hm << (22 - j // 2)) & 0x400000) | ONE_BITS
    else:
        qs = tl.load(blk + 16 + 32 * (j // 8) + 16 * (j % 2) + i, mask=mask3, other=0).to(tl.int32)
        bits = ((qs << (21 - shift)) & 0x600000) | ONE_BITS
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q3_scales(block, mask):
    """l_j - 32 of the 16 sub-blocks, [BR, 16] int32: bits 0-3 from scales[j % 8] (high nibble for j >= 8), bits 4-5
    from scales[8 + j % 4] at bit 2 * (j // 4)."""
    j = tl.arange(0, 16)[None, :]
    low = (tl.load(block + 96 + j % 8, mask=mask, other=0).to(tl.int32) >> (4 * (j // 8))) & 15
    high = (tl.load(block + 104 + j % 4, mask=mask, other=0).to(tl.int32) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@triton.jit
def superblock_dot(block, mask, x, xsum, Q3: tl.constexpr):
    """sum over the super-block of w[r, i] * x[i] for each row r (the module doc's factored form) -> [BR, 1]."""
    s = tl.sum(_code_bits(block, mask[:, :, None], Q3) * x, axis=2)  # S_j = X_j + code dot / 4 (or / 8)
    if Q3:
        d = load_f16(block + 108, mask)
        acc = (d * _q3_scales(block, mask).to(tl.float32)) * (8.0 * s - 12.0 * xsum)
    else:
        sc = tl.load(block + tl.arange(0, 16)[None, :], mask=mask, other=0).to(tl.int32)
        d = load_f16(block + 80, mask)
        dmin = load_f16(block + 82, mask)
        acc = (d * (sc & 15).to(tl.float32)) * (4.0 * (s - xsum)) - (dmin * (sc >> 4).to(tl.float32)) * xsum
    return tl.sum(acc, axis=1)[:, None]
