"""kernels/quant/kdot.py: Q2_K / Q3_K super-blocks times an activation vector (mantissa-trick codes, one FMA per
weight for the scales), against the fp64 dot with gguf's dequantized weights (the oracle), on random valid blocks and
on random bytes (every code, scale and hmask bit, negative Q3_K scales, d and dmin of both signs from subnormal to
large)."""

import pytest
import torch
import triton
import triton.language as tl
from spark_bench.kernels.quant.kdot import row_sums, superblock_fma, superblock_offsets
from spark_bench.kernels.quant.kquants import block_ptr
from spark_bench.plugins.quant import kquants
from test_quant_dequant import random_bytes  # random bytes, finite d of both signs


@triton.jit
def _dot_rows(raw, x, out, n_rows, row_bytes, NB, BR: tl.constexpr, Q3: tl.constexpr):
    o_r = tl.arange(0, BR)[:, None]
    mask = o_r < n_rows
    rows = raw + o_r * row_bytes
    acc = tl.zeros([BR, 2, 2, 16], dtype=tl.float32)
    for b in range(NB):
        acc = superblock_fma(block_ptr(rows, b, Q3), mask, tl.load(x + b * 256 + superblock_offsets()), acc, Q3)
    tl.store(out + o_r, row_sums(acc), mask=mask)


def dot(raw, x, fmt):
    rows = raw.shape[0]
    out = torch.empty(rows, 1)
    _dot_rows[(1,)](raw, x, out, rows, raw.shape[1], x.numel() // 256, BR=triton.next_power_of_2(rows),
                    Q3=fmt == "q3_k")
    return out[:, 0]


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k"])
@pytest.mark.parametrize("seed, rows, cols, bytes_", [(0, 5, 512, False), (1, 3, 768, True), (2, 9, 256, True)])
def test_superblock_dot_matches_the_oracle(fmt, seed, rows, cols, bytes_):
    gen = torch.Generator().manual_seed(seed)
    raw = random_bytes(fmt, rows, cols, seed) if bytes_ else kquants.random_blocks(fmt, rows, cols, gen)
    x = torch.randn(cols, generator=gen).bfloat16().float()
    w = torch.from_numpy(kquants.dequantize_gguf(raw, fmt)).double()
    want = w @ x.double()
    bound = 1e-5 * (w.abs() @ x.double().abs()) + 1e-30
    got = dot(raw, x, fmt).double()
    assert ((got - want).abs() <= bound).all(), (got - want).abs() / bound
