"""The KDA short conv at widths other than Kimi-Linear's 4: every other test draws W = 4, where the padded window
tile BW = next_pow2(W - 1) equals W, so a kernel that confused BW with W (the last column of the shifted window at
BW - 2, the state rows at BW - 1 columns) passed them all. W = 2, 3 and 5 (BW = 1, 2, 4) against the fp64
references: the prefill conv (kda.short_conv), the decode step (kda.short_conv_decode) and the fused block decode
(kda.block_decode, kernels/kda/block_decode.py's conv window and its shift)."""

import pytest
import torch

import spark_bench
from spark_bench.check import tensor_metrics

PREFILL = spark_bench.get_op("kda.short_conv")
DECODE = spark_bench.get_op("kda.short_conv_decode")
BLOCK = spark_bench.get_op("kda.block_decode")
WIDTHS = [2, 3, 5]


def err_ratio(out, ref):
    return tensor_metrics(out, ref)["err_ratio"]  # the sweep's own check (a KeyError: shapes or NaNs differ)


def steps(op, inputs, n, seed):
    """n decode steps of op's Triton backend and of its reference, each on a fresh x: yields (output, reference
    output, the reference's inputs) after each; `inputs` and the reference's copy hold their pools, updated in place."""
    ref = {k: v.clone() for k, v in inputs.items()}
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(inputs["x"].shape, generator=g)
        yield op.backends["triton"].fn(**{**inputs, "x": x}), op.reference(**{**ref, "x": x}), ref


def rewidth(inputs, width, seed, weight="weight", state="conv_state"):
    """inputs with a [D, width] conv weight and a [..., D, width - 1] state (pool) drawn afresh."""
    g = torch.Generator().manual_seed(seed)
    w, s = inputs[weight], inputs[state]
    return {**inputs, weight: ((torch.rand(w.shape[0], width, generator=g) * 2 - 1) * width ** -0.5).to(w.dtype),
            state: torch.randn(*s.shape[:-1], width - 1, generator=g).to(s.dtype)}


@pytest.mark.parametrize("width", WIDTHS)
def test_prefill_conv_at_other_widths(width):
    """Sequences of 1, 2, 5 and 3 tokens (shorter than W - 1: their new state keeps part of the old one)."""
    inputs = PREFILL.make_inputs({"batch": 1, "seq_len": 1, "varlen": "tiny5", "heads": 1, "head_dim": 7},
                                 dtype="fp32", seed=width)
    inputs = rewidth(inputs, width, seed=width)
    y, state = PREFILL.backends["triton"].fn(**inputs)
    y_ref, state_ref = PREFILL.reference(**inputs)
    assert state.shape == state_ref.shape == (*inputs["conv_state"].shape[:2], width - 1)
    assert err_ratio(y, y_ref) <= 1e-5
    assert torch.equal(state.float(), state_ref)


@pytest.mark.parametrize("width", WIDTHS)
def test_decode_steps_at_other_widths(width):
    """Three decode steps: the shifted window (its last column the new token) feeds the next step."""
    inputs = rewidth(DECODE.make_inputs({"batch": 3, "heads": 1, "head_dim": 7}, dtype="fp32", seed=width), width,
                     seed=width, state="conv_state_pool")
    for y, y_ref, ref in steps(DECODE, inputs, 3, seed=10 + width):
        assert err_ratio(y, y_ref) <= 1e-5
        assert torch.equal(inputs["conv_state_pool"], ref["conv_state_pool"].to(inputs["conv_state_pool"].dtype))


@pytest.mark.parametrize("width", WIDTHS)
def test_fused_block_decode_at_other_widths(width):
    """Two steps of the two-launch block decode: launch 1 convolves from the pool window, launch 2 shifts it."""
    params = {"batch": 2, "heads": 1, "head_dim": 16, "head_dim_v": 24, "hidden": 24}
    inputs = rewidth(BLOCK.make_inputs(params, dtype="fp32", seed=width), width, seed=width, weight="conv",
                     state="conv_state_pool")
    for out, out_ref, ref in steps(BLOCK, inputs, 2, seed=20 + width):
        assert err_ratio(out, out_ref) <= 1e-3
        assert err_ratio(inputs["conv_state_pool"], ref["conv_state_pool"]) <= 1e-6
        assert err_ratio(inputs["state_pool"], ref["state_pool"]) <= 1e-3
