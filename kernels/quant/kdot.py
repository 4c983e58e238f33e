"""Triton device functions: each GGUF Q2_K / Q3_K row's 256-weight super-block times an fp32 activation slice,
one whole super-block per call, with no per-weight int->float conversion (decode GEMVs).

Layout. A super-block is held as [BR, 2, 4, 2, 16] = (row, h, s, p1, p0), weight 128*h + 32*s + 16*p1 + p0: the qs
byte 32*h + 16*p1 + p0 holds the 2-bit codes of its 4 weights s = 0..3 at shift 2*s, so the bytes are loaded once
as [BR, 2, 1, 2, 16] and broadcast over s; each thread then holds a byte's 4 codes and every shift is a
compile-time constant. The Q3_K high bit comes from hmask byte 16*p1 + p0 at bit 4*h + s (loaded [BR, 1, 1, 2, 16]).
The sub-block (16 weights) is j = 8*h + 2*s + p1, so its scale broadcasts from [BR, 2, 4, 2, 1].

Mantissa trick. The code c (2 bits, or 3 with the Q3_K high bit) is shifted into the top mantissa bits of 1.0,
so the bits read as f = 1 + c/4 (Q2_K) or 1 + c/8 (Q3_K) exactly: a shift and a masked or (LOP3) instead of an
I2F. The weight is then one FMA with per-sub-block constants, w = A_j*f + B_j:
    Q2_K:  d*sc_j*q - dmin*m_j = (4 d sc_j) f - (4 d sc_j + dmin m_j)      Q3_K:  d*l_j*(c - 4) = (8 d l_j) f - 12 d l_j
(exact in fp32 but for the rounding of B_j: |error| <= 2^-24 |B_j|), and a second FMA accumulates w*x (summed
over s within the thread) into a [BR, 2, 2, 16] fp32 accumulator that is reduced once per row after the last
super-block (row_sums), so the loop has no cross-thread reduction. The A_j, B_j are computed per (row, sub-block):
1/16 of an op per weight.
`block` are [BR, 1] uint8 pointers to each row's super-block (kernels/quant/kquants.py's block_ptr), `mask` [BR, 1].
"""

import triton
import triton.language as tl
from spark_bench.kernels.quant.kquants import block_scales

ONE_BITS = tl.constexpr(0x3F800000)  # 1.0f


@triton.jit
def _h():
    return tl.arange(0, 2)[None, :, None, None, None]


@triton.jit
def _s():
    return tl.arange(0, 4)[None, None, :, None, None]


@triton.jit
def _p1():
    return tl.arange(0, 2)[None, None, None, :, None]


@triton.jit
def _p0():
    return tl.arange(0, 16)[None, None, None, None, :]


@triton.jit
def superblock_offsets():
    """[1, 2, 4, 2, 16] offsets 128*h + 32*s + 16*p1 + p0 of a super-block's weights: qs byte 32*h + 16*p1 + p0 at
    shift 2*s holds the code; the sub-block is j = 8*h + 2*s + p1."""
    return 128 * _h() + 32 * _s() + 16 * _p1() + _p0()


@triton.jit
def _code_bits(block, mask, Q3: tl.constexpr):
    """The codes as fp32 1 + c/4 (Q2_K) or 1 + c/8 (Q3_K, c = q2 + 4*hbit): [BR, 2, 4, 2, 16]. The bytes are loaded
    once as [BR, 2, 1, 2, 16] (hmask [BR, 1, 1, 2, 16]) and broadcast over the shifts, so each thread holds a byte's
    4 codes with compile-time shifts."""
    blk = block[:, :, None, None, None]
    m = mask[:, :, None, None, None]
    byte = 32 * _h() + 16 * _p1() + _p0()
    if Q3:
        qs = tl.load(blk + 32 + byte, mask=m, other=0).to(tl.int32)
        hm = tl.load(blk + 16 * _p1() + _p0(), mask=m, other=0).to(tl.int32)
        bits = ((qs << (20 - 2 * _s())) & 0x300000) | ((hm << (22 - 4 * _h() - _s())) & 0x400000) | ONE_BITS
    else:
        qs = tl.load(blk + 16 + byte, mask=m, other=0).to(tl.int32)
        bits = ((qs << (21 - 2 * _s())) & 0x600000) | ONE_BITS
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _affine(block, mask, Q3: tl.constexpr):
    """(A_j, B_j) [BR, 2, 4, 2, 1], weight = A_j * f + B_j for the code bits f (Q2_K: f = 1 + q/4, weight
    d*sc*q - dmin*m; Q3_K: f = 1 + c/8, weight d*l*(c - 4)), j = 8*h + 2*s + p1."""
    blk = block[:, :, None, None, None]
    m = mask[:, :, None, None, None]
    j = 8 * _h() + 2 * _s() + _p1()
    d, dmin = block_scales(blk, m, Q3)
    if Q3:
        low = (tl.load(blk + 96 + j % 8, mask=m, other=0).to(tl.int32) >> (4 * (j // 8))) & 15
        high = (tl.load(blk + 104 + j % 4, mask=m, other=0).to(tl.int32) >> (2 * (j // 4))) & 3
        dl = d * ((low | (high << 4)) - 32).to(tl.float32)
        a, b = 8.0 * dl, -12.0 * dl
    else:
        sc = tl.load(blk + j, mask=m, other=0).to(tl.int32)
        a = 4.0 * d * (sc & 15).to(tl.float32)
        b = -(a + dmin * (sc >> 4).to(tl.float32))
    return a, b


@triton.jit
def superblock_fma(block, mask, x, acc, Q3: tl.constexpr):
    """acc + sum over s of w * x for one super-block of each row: w the weights of `block` ([BR, 1] pointers, `mask`
    [BR, 1]), x the activations [1 or BR, 2, 4, 2, 16] at superblock_offsets, acc fp32 [BR, 2, 2, 16]. The sum over
    s (a thread's 4 codes of one byte) stays in registers and keeps the accumulator 4x smaller (sm_90a, triton 3.9:
    _decode_up 72 registers instead of 120)."""
    a, b = _affine(block, mask, Q3)
    return acc + tl.sum((_code_bits(block, mask, Q3) * a + b) * x, axis=2)


@triton.jit
def row_sums(acc):
    """acc [BR, 2, 2, 16] summed per row -> [BR, 1]."""
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)[:, None]
