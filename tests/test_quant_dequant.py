"""quant.dequant: every dequantizer against gguf's numpy one (the oracle), bit-exact in fp32, one rounding in bf16,
on random valid blocks, on random bytes (every bit position, subnormal and negative d) and on quantized weights."""

import numpy as np
import pytest
import torch
from spark_bench.kernels.quant.dequant import dequantize as triton_dequantize
from spark_bench.plugins.quant import kquants

from spark_bench import get_op
from spark_bench.check import check_outputs, poisoned_allocations

OP = get_op("quant.dequant")
FORMATS = ["q2_k", "q3_k"]
D_OFFSETS = {"q2_k": (80, 82), "q3_k": (108,)}  # byte offsets of the fp16 d (and dmin) in a block


def oracle(raw, fmt):
    return torch.from_numpy(kquants.dequantize_gguf(raw, fmt))


def random_bytes(fmt, rows, cols, seed):
    """Uniformly random blocks (all scale/code/mask bits exercised) with finite d/dmin of both signs, from
    subnormal (< 6.1e-5) to large."""
    gen = torch.Generator().manual_seed(seed)
    bb = kquants.kquant(fmt).block_bytes
    blocks = torch.randint(0, 256, (rows, cols // 256, bb), generator=gen, dtype=torch.uint8)
    for off in D_OFFSETS[fmt]:
        mag = 10.0 ** (torch.rand(rows, cols // 256, generator=gen) * 11 - 8)
        d = torch.randn(rows, cols // 256, generator=gen).sign() * mag
        blocks[..., off:off + 2] = kquants._to_f16_bytes(d)
    return blocks.reshape(rows, -1)


def all_dequantizers(raw, fmt, dtype):
    return {
        "triton": triton_dequantize(raw, fmt, dtype),
        "torch": kquants.dequantize_torch(raw, fmt, dtype),
        "reference": kquants.dequantize_reference(raw, fmt).to(dtype),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed, rows, cols", [(0, 1, 256), (1, 37, 768), (2, 5, 512)])
def test_bit_exact_on_random_valid_blocks(fmt, seed, rows, cols):
    raw = kquants.random_blocks(fmt, rows, cols, torch.Generator().manual_seed(seed), std=0.02)
    assert raw.shape == (rows, kquants.row_bytes(fmt, cols)) and raw.dtype == torch.uint8
    want = oracle(raw, fmt)
    assert want.shape == (rows, cols) and 0.01 < float(want.std()) < 0.04
    for dtype in (torch.float32, torch.bfloat16):
        for name, got in all_dequantizers(raw, fmt, dtype).items():
            assert got.dtype == dtype and got.shape == (rows, cols), name
            # fp32: every product is exact; bf16: that value rounded once to nearest even
            assert torch.equal(got, want.to(dtype)), f"{name} {dtype}: {(got.float() - want).abs().max()}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", [3, 4])
def test_bit_exact_on_random_bytes(fmt, seed):
    raw = random_bytes(fmt, 9, 512, seed)
    d = raw.view(9, 2, -1)[..., D_OFFSETS[fmt][0]:D_OFFSETS[fmt][0] + 2].contiguous().view(torch.float16)
    assert (d < 0).any() and (d > 0).any() and ((d.abs() < 6.1e-5) & (d != 0)).any()  # negative and subnormal d
    want = oracle(raw, fmt)
    for dtype in (torch.float32, torch.bfloat16):
        for name, got in all_dequantizers(raw, fmt, dtype).items():
            assert torch.equal(got, want.to(dtype)), f"{name} {dtype}: {(got.float() - want).abs().max()}"


@pytest.mark.parametrize("fmt, rows", [("q2_k", 48), ("q3_k", 40)])
@pytest.mark.parametrize("grid_y_cap", [None, 2])
def test_expert_stack_writes_only_the_hit_experts(fmt, rows, grid_y_cap, monkeypatch):
    """dequantize(raw [E, rows, bytes], hit=flags): flagged experts bit-exact with the oracle (bf16: rounded once),
    the others never written (NaN under poisoned allocations); rows not a power of two per expert. Super-blocks
    fastest in the grid, or (more row blocks than grid dimension 1 takes: a cap of 2 here) row blocks fastest."""
    if grid_y_cap is not None:
        monkeypatch.setattr("spark_bench.kernels.common.MAX_GRID_YZ", grid_y_cap)
    E, cols = 5, 512
    raw = kquants.random_blocks(fmt, (E, rows), cols, torch.Generator().manual_seed(5))
    hit = torch.tensor([0, 1, 0, 0, 1], dtype=torch.int32)
    with poisoned_allocations():
        got = triton_dequantize(raw, fmt, torch.bfloat16, hit=hit)
    want = oracle(raw.reshape(E * rows, -1), fmt).view(E, rows, cols).to(torch.bfloat16)
    assert torch.equal(got[hit.bool()], want[hit.bool()])
    assert got[~hit.bool()].isnan().all()
    with pytest.raises(ValueError):
        triton_dequantize(raw, fmt, hit=hit[:3])


def test_q3k_hmask_sense_is_inverted():
    """A set hmask bit means q = q2 (offset 0); a clear one q = q2 - 4. One block, d = 1, every l_j = 17."""
    block = torch.zeros(110, dtype=torch.uint8)
    block[0] = 0b00000001  # element 0 (byte 0, bit 0): high bit set; element 1 (byte 1) clear
    block[32] = 0b11  # qs byte 0 low bits: element 0 has q2 = 3
    block[33] = 0b10  # element 1 has q2 = 2
    block[96:104] = 0x11  # bits 0-3 of every l_j = 1
    block[104:108] = 0b01010101  # bits 4-5 of every l_j = 1: l_j = 17
    block[108:110] = kquants._to_f16_bytes(torch.tensor(1.0))
    raw = block.view(1, 110)
    want = oracle(raw, "q3_k")
    assert float(want[0, 0]) == (17 - 32) * 3 and float(want[0, 1]) == (17 - 32) * (2 - 4)
    for name, got in all_dequantizers(raw, "q3_k", torch.float32).items():
        assert torch.equal(got, want), name


@pytest.mark.parametrize("fmt, max_nmse", [("q2_k", 0.15), ("q3_k", 0.05)])
def test_quantizer_writes_valid_close_blocks(fmt, max_nmse):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(6, 768, generator=gen) * 0.02
    raw = kquants.quantize(w, fmt)
    back = oracle(raw, fmt)
    nmse = float(((back - w) ** 2).mean() / (w**2).mean())
    assert nmse < max_nmse, nmse
    assert torch.equal(triton_dequantize(raw, fmt, torch.float32), back)
    if fmt == "q3_k":  # llama.cpp's scheme gives d the sign of the block's largest scale: both occur
        d = raw.view(6, 3, 110)[..., 108:110].contiguous().view(torch.float16)
        assert (d < 0).any() and (d > 0).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_backends_pass_the_check(fmt):
    for dtype in ("bf16", "fp32"):
        inputs = OP.make_inputs({"format": fmt, "rows": 3, "cols": 512}, dtype=dtype, seed=1)
        ref = OP.reference(**inputs)
        for name in ("triton", "torch", "gguf"):
            out = OP.backends[name].fn(**inputs)
            check = check_outputs(OP, out, ref, inputs, dtype)
            assert check["ok"], f"{name} {dtype}: {check['message']}"


def test_check_catches_a_swapped_nibble():
    """The fp32 tolerance is bit-exact: swapping Q2_K's scale and min nibbles must fail."""
    inputs = OP.make_inputs({"format": "q2_k", "rows": 2, "cols": 256}, dtype="fp32", seed=2)
    raw = inputs["raw"].clone().view(2, 84)
    raw[:, :16] = (raw[:, :16] >> 4) | (raw[:, :16] << 4)
    check = check_outputs(OP, kquants.dequantize_torch(raw, "q2_k"), OP.reference(**inputs), inputs, "fp32")
    assert not check["ok"]


def test_gguf_peer_is_host_only():
    assert OP.backends["gguf"].unavailable("cuda") is not None
    assert OP.backends["gguf"].unavailable("cpu") is None
    assert isinstance(kquants.dequantize_gguf(OP.make_inputs({}, seed=0)["raw"], "q2_k"), np.ndarray)


def test_cost_model():
    c = OP.cost({"format": "q3_k", "rows": 4, "cols": 512}, "bf16")
    assert c.bytes == 4 * 512 * 110 / 256 + 4 * 512 * 2
