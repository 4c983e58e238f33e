"""kda.gated_rmsnorm: backends against the fp64 reference, the reference against torch's rms_norm, and a swish
gate (fla's default) or a per-head weight failing the check."""

import pytest
import torch
import torch.nn.functional as F

import spark_bench

OP = spark_bench.get_op("kda.gated_rmsnorm")


def err_ratio(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tokens,head_dim,seed", [(1, 128, 0), (3, 60, 1), (63, 20, 2), (65, 128, 3),
                                                  (130, 100, 4)])
def test_backends(backend, dtype, tokens, head_dim, seed):
    inputs = OP.make_inputs({"tokens": tokens, "heads": 3, "head_dim": head_dim}, dtype=dtype, seed=seed)
    out = OP.backends[backend].fn(**inputs)
    ref = OP.reference(**inputs)
    assert out.shape == ref.shape and out.dtype == inputs["o"].dtype
    assert err_ratio(out, ref) <= OP.tolerance_for(dtype).err_ratio


def test_reference_matches_rms_norm():
    inputs = OP.make_inputs({"tokens": 5, "heads": 3, "head_dim": 16}, dtype="fp32", seed=9)
    o, z, w = (inputs[k].double() for k in ("o", "z", "weight"))
    expected = F.rms_norm(o, (16,), w, eps=1e-5) * torch.sigmoid(z)
    assert err_ratio(OP.reference(**inputs), expected) < 1e-6


def test_wrong_variants_fail():
    inputs = OP.make_inputs({"tokens": 9, "heads": 3, "head_dim": 16}, dtype="fp32", seed=1)
    ref = OP.reference(**inputs)
    o, z, w = (inputs[k] for k in ("o", "z", "weight"))
    swish = F.rms_norm(o, (16,), w, eps=1e-5) * F.silu(z)
    over_heads = F.rms_norm(o.flatten(1), (48,), w.repeat(3), eps=1e-5).view_as(o) * torch.sigmoid(z)
    tol = OP.tolerance_for("fp32").err_ratio
    assert err_ratio(swish, ref) > 100 * tol
    assert err_ratio(over_heads, ref) > 10 * tol


def test_cost_and_availability():
    cost = OP.cost({"tokens": 10, "heads": 32, "head_dim": 128}, "bf16")
    assert cost.flops == 8 * 10 * 32 * 128 and cost.bytes == 2 * (3 * 10 * 32 * 128 + 128)
    assert OP.backends["fla"].unavailable("cpu")
