"""kda.gate: every CPU backend against our fp64 reference and fla's naive gate, on odd sizes and several seeds."""

import pytest
import torch
import torch.nn.functional as F

from spark_bench import get_op
from spark_bench.check import check_outputs

OP = get_op("kda.gate")
CPU_BACKENDS = ["triton", "torch"]


def call(name, inputs):
    b = OP.backends[name]
    fn = b.setup(b.fn, inputs) if b.setup else b.fn
    return fn(**inputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("seed, tokens, heads, head_dim", [(0, 1, 3, 60), (1, 65, 3, 100), (2, 130, 2, 128)])
def test_backend_matches_reference(backend, dtype, seed, tokens, heads, head_dim):
    inputs = OP.make_inputs({"tokens": tokens, "heads": heads, "head_dim": head_dim}, dtype=dtype, seed=seed)
    out = call(backend, inputs)
    assert out.dtype == torch.float32 and out.shape == (tokens, heads, head_dim)
    check = check_outputs(OP, out, OP.reference(**inputs), inputs, dtype)
    assert check["ok"], check["message"]
    assert (out <= 0).all()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_torch_compile_matches_reference(dtype):
    inputs = OP.make_inputs({"tokens": 67, "heads": 3, "head_dim": 60}, dtype=dtype, seed=5)
    check = check_outputs(OP, call("torch_compile", inputs), OP.reference(**inputs), inputs, dtype)
    assert check["ok"], check["message"]


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_agrees_with_fla_naive_gate(seed):
    from fla.ops.kda.gate import naive_kda_gate

    inputs = OP.make_inputs({"tokens": 33, "heads": 3, "head_dim": 60}, dtype="fp32", seed=seed)
    ours = OP.reference(**inputs)
    theirs = naive_kda_gate(inputs["g"], inputs["A_log"], inputs["dt_bias"]).double()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_extreme_gates_stay_finite():
    inputs = OP.make_inputs({"tokens": 17, "heads": 3, "head_dim": 60}, dtype="fp32", seed=3)
    inputs["g"] = inputs["g"] * 40  # softplus far past its threshold (20) on both sides
    inputs["A_log"] = inputs["A_log"] + 3
    ref = OP.reference(**inputs)
    for name in ("triton", "torch"):
        out = call(name, inputs)
        assert torch.isfinite(out).all()
        assert check_outputs(OP, out, ref, inputs, "fp32")["ok"]


def test_check_catches_a_transposed_dt_bias():
    """kda.md pitfall 1: dt_bias is per channel h*K + d. Reading it as d*H + h must fail the check."""
    inputs = OP.make_inputs({"tokens": 19, "heads": 3, "head_dim": 60}, dtype="bf16", seed=4)
    H, K = 3, 60
    g, a_log, dt_bias = inputs["g"], inputs["A_log"], inputs["dt_bias"]
    wrong = -a_log.exp().view(H, 1) * F.softplus(g.float() + dt_bias.view(K, H).T)
    check = check_outputs(OP, wrong, OP.reference(**inputs), inputs, "bf16")
    assert not check["ok"] and check["err_ratio"] > 1e-2


def test_grid_order_heads_fastest_unless_the_token_blocks_exceed_grid_dimension_1(monkeypatch, record_grids):
    """The kernel takes the heads of the same tokens in consecutive programs (grid (H, T/BT)); past CUDA's 65535 cap
    on grid dimension 1 it falls back to tokens fastest, and both orders give the reference's values."""
    from spark_bench.kernels.kda import gate

    grids = record_grids(gate, "_kda_gate_fwd")
    inputs = OP.make_inputs({"tokens": 97, "heads": 3, "head_dim": 128}, dtype="bf16", seed=7)
    ref = OP.reference(**inputs)
    for cap in (65535, 2):
        monkeypatch.setattr("spark_bench.kernels.common.MAX_GRID_YZ", cap)
        monkeypatch.setattr(gate, "widen", lambda: False)  # the declared BT = 32 (4 token blocks), not widened
        check = check_outputs(OP, call("triton", inputs), ref, inputs, "bf16")
        assert check["ok"], check["message"]
    assert grids == [(3, 4), (4, 3)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_softplus_keeps_its_digits_far_below_zero(dtype):
    """softplus(x) ~ exp(x) for x << 0: log(1 + exp(x)) rounded to 0 below x ~ -16.6 (the kernel's gate was 0 where
    the reference's is -a * 2e-9) and lost digits from x ~ -9, failing the check once dt_bias sat near -10."""
    for shift in (-6.0, -10.0, -20.0, -40.0):
        inputs = OP.make_inputs({"tokens": 33, "heads": 2, "head_dim": 64}, dtype=dtype, seed=9)
        inputs["dt_bias"] = inputs["dt_bias"] + shift
        out = call("triton", inputs)
        ref = OP.reference(**inputs)
        check = check_outputs(OP, out, ref, inputs, dtype)
        assert check["ok"], f"dt_bias shifted by {shift}: {check['message']}"
        assert (out < 0).all(), f"dt_bias shifted by {shift}: a decay rounded to 0"
