"""spark_bench/kernelgate/traffic.py: bytes per kernel counted in the interpreter (issued and unique), against
hand-counted kernels and the cost model; `spark-bench traffic`; --backend globs."""

import json

import pytest
import torch
import triton
import triton.language as tl
from conftest import run_cli

import spark_bench
from spark_bench.kernelgate.traffic import counting, traffic_of


@triton.jit
def _reread(x, y, n, BLOCK: tl.constexpr):
    """Every program reads the same first BLOCK elements and writes its own BLOCK of y (masked to n)."""
    i = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    v = tl.load(x + o, mask=o < n, other=0.0)
    tl.store(y + i * BLOCK + o, v * 2, mask=i * BLOCK + o < n)


@pytest.mark.parametrize("n,block,programs", [(100, 32, 4), (7, 8, 3), (64, 16, 1)])
def test_issued_and_unique_bytes_of_a_hand_counted_kernel(n, block, programs):
    x = torch.randn(max(n, block), dtype=torch.float32)
    y = torch.zeros(programs * block, dtype=torch.float32)
    with counting() as kernels:
        _reread[(programs,)](x, y, n, BLOCK=block)
        _reread[(programs,)](x, y, n, BLOCK=block)
    row = kernels["_reread"]
    read = min(n, block) * 4
    written = sum(max(0, min(block, n - i * block)) for i in range(programs)) * 4
    assert row.launches == 2
    assert row.read_issued == 2 * programs * read and row.read_unique == 2 * read  # unique per launch
    assert row.written_issued == row.written_unique == 2 * written
    assert torch.equal(y[: min(n, block)], 2 * x[: min(n, block)])  # the kernel still ran


def test_counting_restores_the_interpreter():
    import triton.runtime.interpreter as interp
    from spark_bench.kernels import common

    before = (interp.InterpreterBuilder.create_masked_load, interp.GridExecutor.__call__,
              common.WIDEN_WHEN_INTERPRETING)
    with pytest.raises(RuntimeError), counting():
        raise RuntimeError("inside")
    assert (interp.InterpreterBuilder.create_masked_load, interp.GridExecutor.__call__,
            common.WIDEN_WHEN_INTERPRETING) == before


@pytest.mark.parametrize("params", [{"batch": 3, "seq_len": 1, "heads": 2, "head_dim_k": 32, "head_dim_v": 48,
                                     "fused": True},
                                    {"batch": 5, "seq_len": 2, "heads": 3, "head_dim_k": 16, "head_dim_v": 16,
                                     "fused": False}])
def test_the_recurrent_decode_kernel_moves_what_its_cost_model_counts(params):
    """The cost model counts q, k, v, g, beta, o once and the state read and written once: so does the kernel."""
    op = spark_bench.get_op("kda.recurrent_decode")
    r = traffic_of(op, "triton", params, "bf16", seed=1)
    assert [k["kernel"] for k in r["kernels"]] == ["_recurrent_decode"]
    assert r["unique_bytes"] == r["model_bytes"] and r["issued_bytes"] >= r["unique_bytes"]


def test_traffic_command():
    code, out, err = run_cli("traffic", "--op", "kda.block_decode", "--set", "batch=2", "--json")
    assert code == 0, err
    rows = {r["backend"]: r for r in json.loads(out)}
    assert set(rows) == {"triton", "triton_unfused"}
    assert [k["kernel"] for k in rows["triton"]["kernels"]] == ["_conv_recurrent_decode", "_gated_norm_conv_shift"]
    assert len(rows["triton_unfused"]["kernels"]) == 3
    assert all(r["unique_bytes"] > 0 and r["model_bytes"] > 0 for r in rows.values())
    code, _, err = run_cli("traffic", "--op", "nosuch")
    assert code == 2 and "no op matches" in err


def test_backend_globs_select_backends():
    from spark_bench.registry import registry
    from spark_bench.sweep import SweepSpec, UsageError, build_cases

    cases = build_cases(registry(), SweepSpec(ops=["kda.block_decode"], backends=["triton*"], quick=True))
    assert {c.backend for c in cases} == {"triton", "triton_unfused"}
    with pytest.raises(UsageError, match="unknown backend 'nope\\*'"):
        build_cases(registry(), SweepSpec(ops=["kda.block_decode"], backends=["nope*"], quick=True))


@pytest.mark.parametrize("backend", ["torch", "torch_compile"])  # torch_compile: called through its setup
def test_a_backend_without_triton_kernels_says_nothing_was_counted(backend):
    args = ("traffic", "--op", "kda.gate", "--backend", backend, "--set", "tokens=1", "--set", "head_dim=60")
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "no Triton kernel launch was counted" in out and "0x" not in out
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["kernels"] == [] and row["model_bytes"] > 0
    assert row["unique_over_model"] is None and row["issued_over_model"] is None
