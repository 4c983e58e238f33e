"""Kernels that are wrong for a GPU in ways the interpreter cannot see: the offline gate must report them."""

import triton
import triton.language as tl


@triton.jit
def mismatched_branches(x, y, n_blocks, B: tl.constexpr):
    """Like _short_conv_prefill before its fix: `p` holds a [B, B] tile in one branch and a [B] vector in the
    other, so the scf.if that Triton builds for it has no single type."""
    i = tl.program_id(0)
    o = tl.arange(0, B)
    if i < n_blocks:
        p = x + o[:, None] * B + o[None, :]
    else:
        p = x + o
    tl.store(y + i, tl.sum(tl.load(p)))


@triton.jit
def staged_too_deep(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A dot loop whose fp32 tiles, multi-buffered num_stages deep, overflow an H200 block's shared memory."""
    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + o_m[:, None] * K + (k0 + o_k)[None, :])
        w = tl.load(b + (k0 + o_k)[:, None] * BN + o_n[None, :])
        acc = tl.dot(x, w, acc)
    tl.store(c + o_m[:, None] * BN + o_n[None, :], acc)


@triton.jit
def fits(x, y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)


@triton.jit
def unrolled_forever(x, y, T: tl.constexpr):
    """A static_range over a huge constexpr (a decode kernel given a prefill length): minutes in Triton's passes."""
    acc = tl.load(x)
    for t in tl.static_range(T):
        acc = acc * 1.0001 + tl.load(x + t)
    tl.store(y, acc)
