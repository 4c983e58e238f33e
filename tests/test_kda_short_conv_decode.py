"""kda.short_conv_decode: one step against the fp64 reference, untouched pool slots bit-identical, and k decode
steps equal to a prefill over the same k tokens."""

import pytest
import torch

import spark_bench

OP = spark_bench.get_op("kda.short_conv_decode")
PREFILL = spark_bench.get_op("kda.short_conv")
BACKENDS = ["triton", "torch"]


def err_ratio(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def clone(inputs):
    return {k: v.clone() for k, v in inputs.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("batch,heads,head_dim,seed", [(1, 3, 20, 0), (3, 2, 60, 1), (7, 3, 12, 2)])
def test_step_and_pool(backend, dtype, batch, heads, head_dim, seed):
    inputs = OP.make_inputs({"batch": batch, "heads": heads, "head_dim": head_dim}, dtype=dtype, seed=seed)
    pool_before = inputs["conv_state_pool"].clone()
    ref_inputs = clone(inputs)
    ref = OP.reference(**ref_inputs)
    y = OP.backends[backend].fn(**inputs)
    tol = OP.tolerance_for(dtype).err_ratio
    assert y.shape == ref.shape and torch.isfinite(y.float()).all()
    assert err_ratio(y, ref) <= tol
    slots = inputs["slots"].long()
    assert inputs["conv_state_pool"].shape[0] >= 3 * batch and slots.unique().numel() == batch
    assert torch.equal(inputs["conv_state_pool"], ref_inputs["conv_state_pool"])  # pool writes are copies
    untouched = torch.ones(pool_before.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(inputs["conv_state_pool"][untouched], pool_before[untouched])
    assert not torch.equal(inputs["conv_state_pool"][slots], pool_before[slots])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_decode_steps_match_prefill(backend, steps):
    """k decode steps from a pooled state equal one prefill over the k tokens from the same state."""
    batch = 3
    inputs = OP.make_inputs({"batch": batch, "heads": 3, "head_dim": 12}, dtype="bf16", seed=steps)
    slots = inputs["slots"].long()
    gen = torch.Generator().manual_seed(steps)
    tokens = torch.randn(steps, batch, inputs["x"].shape[1], generator=gen).bfloat16()
    state0 = inputs["conv_state_pool"][slots].clone()
    ys = [OP.backends[backend].fn(x=tokens[i], weight=inputs["weight"], conv_state_pool=inputs["conv_state_pool"],
                                  slots=inputs["slots"]) for i in range(steps)]
    packed = tokens.transpose(0, 1).reshape(batch * steps, -1)  # sequence-major
    cu = torch.arange(batch + 1, dtype=torch.int32) * steps
    y_ref, state_ref = PREFILL.reference(x=packed, weight=inputs["weight"], conv_state=state0, cu_seqlens=cu)
    y_dec = torch.stack(ys, 1).reshape(batch * steps, -1)
    assert err_ratio(y_dec, y_ref) <= OP.tolerance_for("bf16").err_ratio
    assert torch.equal(inputs["conv_state_pool"][slots].float(), state_ref)


def test_cost_and_availability():
    cost = OP.cost({"batch": 4, "heads": 32, "head_dim": 128}, "bf16")
    assert cost.flops == 2 * 4 * 4 * 12288
    assert cost.bytes == 2 * 4 * 12288 * 2 + 2 * 2 * 4 * 12288 * 3 + 2 * 12288 * 4
    assert OP.backends["fla"].unavailable("cpu")
