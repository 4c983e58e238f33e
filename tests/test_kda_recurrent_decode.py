"""kda.recurrent_decode: every CPU backend against our fp32 token loop and fla's naive_recurrent_kda, 1-4 tokens
per sequence, K != V, on a state pool whose unindexed slots must stay bit-identical."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402
from spark_bench.plugins.kda import recurrent_decode as decode  # noqa: E402

op = decode.op
BACKENDS = {"triton": decode.triton_recurrent_decode, "torch": decode.torch_recurrent_decode,
            "fla": decode.fla_recurrent_decode, "reference": decode.reference_recurrent_decode}


def make(T, *, N=7, H=2, K=32, V=16, fused=True, dtype="fp32", seed=0):
    params = {"batch": N, "seq_len": T, "heads": H, "head_dim_k": K, "head_dim_v": V, "fused": fused}
    return op.make_inputs(params, dtype=dtype, seed=seed)


def run(fn, inputs):
    """Call on a copy of the inputs; returns (o, pool after the call) as the runner compares them."""
    copy = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    return op.outputs(fn(**copy), copy)


def fla_naive(inputs):
    slots = inputs["ssm_state_indices"].long()
    o, s = naive_recurrent_kda(**cc.naive_inputs(inputs), scale=inputs["scale"],
                               initial_state=inputs["initial_state"][slots], output_final_state=True)
    pool = inputs["initial_state"].clone()
    pool[slots] = s
    return o, pool


def check(out, ref, inputs, tol, what):
    pool0, slots = inputs["initial_state"], inputs["ssm_state_indices"].long()
    untouched = torch.ones(pool0.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(out[1][untouched], pool0[untouched]), f"{what}: unindexed slots changed"
    assert not torch.equal(out[1][slots], pool0[slots]), f"{what}: indexed slots not updated"
    for name, a, b in zip(("o", "pool"), out, ref, strict=True):
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        err = cc.err_ratio(a, b)
        assert err <= tol, f"{what}: {name} error ratio {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_backends_match_references(T):
    fused = T % 2 == 1
    inputs = make(T, fused=fused, seed=T)
    naive = fla_naive(inputs)
    for name, fn in BACKENDS.items():
        check(run(fn, inputs), naive, inputs, 1e-5, f"{name} T={T} fused={fused}")


@pytest.mark.parametrize("dtype, tol", [("bf16", 5e-3), ("fp16", 5e-3)])
def test_half_precision(dtype, tol):
    inputs = make(2, N=5, H=2, K=24, V=40, dtype=dtype, seed=21)
    ref = run(op.reference, inputs)
    for name in ("triton", "torch"):
        check(run(BACKENDS[name], inputs), ref, inputs, tol, f"{name} {dtype}")


@pytest.mark.parametrize("A_log, dt_bias", [(2.77, -1.0), (6.0, 6.0)])
def test_extreme_gates(A_log, dt_bias):
    inputs = make(2, N=3, H=2, seed=9)
    inputs["A_log"] = torch.full_like(inputs["A_log"], A_log)
    inputs["dt_bias"] = torch.full_like(inputs["dt_bias"], dt_bias)
    naive = fla_naive(inputs)
    for name in ("triton", "torch", "reference"):
        check(run(BACKENDS[name], inputs), naive, inputs, 1e-5, f"{name} extreme gates")


def test_transposed_state_layout_is_caught():
    inputs = make(1, N=3, H=2, K=32, V=16, seed=4, fused=False)
    ref = run(op.reference, inputs)
    pool = inputs["initial_state"]
    S, H, K, V = pool.shape
    swapped = dict(inputs, initial_state=pool.transpose(-1, -2).contiguous().view(S, H, K, V))
    assert cc.err_ratio(run(decode.triton_recurrent_decode, swapped)[0], ref[0]) > 0.05


def test_torch_compile():
    inputs = make(1, N=2, H=2, K=16, V=16, seed=2)
    backend = op.backends["torch_compile"]
    compiled = backend.setup(backend.fn, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                          for k, v in inputs.items()})  # its warm-up call updates that copy
    check(run(compiled, inputs), fla_naive(inputs), inputs, 1e-5, "torch_compile")


def test_cost_model():
    p = {"batch": 4, "seq_len": 1, "heads": 32, "head_dim_k": 128, "head_dim_v": 128, "fused": False}
    N, H, d = 4, 32, 128
    assert op.cost(p, "bf16").flops == pytest.approx(7 * N * H * d * d)
    assert op.cost(p, "bf16").bytes == pytest.approx(2 * N * H * d * d * 4 + N * H * (3 * 2 * d + 4 * d + 2 * d + 2)
                                                     + 4 * N)


def test_grid_takes_v_tiles_fastest_unless_the_sequences_exceed_grid_dimension_2(monkeypatch, record_grids):
    """A state matrix's V tiles run in consecutive programs (grid (V/BV, H, N)); past CUDA's 65535 cap on grid
    dimension 2 the old order (N, H, V/BV) is taken; both give the reference's outputs and pool."""
    from spark_bench.kernels.kda import recurrent_decode as kernel

    grids = record_grids(kernel, "_recurrent_decode")
    monkeypatch.setattr(kernel, "widen", lambda: False)  # the declared BV = 32: 2 V tiles of V = 48
    inputs = make(2, N=3, H=2, K=32, V=48, seed=3)
    ref = run(BACKENDS["reference"], inputs)
    for cap in (65535, 2):
        monkeypatch.setattr("spark_bench.kernels.common.MAX_GRID_YZ", cap)
        for got, want in zip(run(BACKENDS["triton"], inputs), ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert grids == [(2, 2, 3), (3, 2, 2)]
