"""spark_bench/kernelgate/traffic.py edges: transcendentals counted per evaluated element (masked lanes too), an
atomic (rmw and cas) both read and written, kernels listed by their bytes, a 0-byte cost model in the summary, and
`spark-bench traffic --json` exiting 1 on a failed case."""

from __future__ import annotations

import json
import types

import torch
import triton
import triton.language as tl
from conftest import run_cli
from test_memcheck import _count
from test_traffic import _reread

from spark_bench.kernelgate import traffic
from spark_bench.kernelgate.traffic import counting, traffic_of


@triton.jit
def _special(x, y, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(x + o, mask=o < n, other=1.0)
    tl.store(y + o, tl.exp2(v) + tl.sqrt(v) + tl.exp(v), mask=o < n)


@triton.jit
def _swap(lock, value):
    tl.atomic_cas(lock, 0, value)


def test_each_transcendental_counts_every_lane_it_evaluates():
    """exp2, sqrt and exp of 16 lanes (6 of them masked off for the memory, not for the SFU): 48."""
    x, y = torch.rand(16) + 1, torch.zeros(16)
    with counting() as kernels:
        _special[(1,)](x, y, 10, BLOCK=16)
    assert kernels["_special"].transcendentals == 48
    assert torch.allclose(y[:10], torch.exp2(x[:10]) + torch.sqrt(x[:10]) + torch.exp(x[:10]))


def test_an_atomic_reads_and_writes_its_element():
    counter, lock = torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with counting() as kernels:
        _count[(3,)](counter, 2)
        _swap[(1,)](lock, 7)
    add, cas = kernels["_count"], kernels["_swap"]
    assert (add.read_issued, add.read_unique, add.written_issued, add.written_unique) == (12, 4, 12, 4)
    assert (cas.read_issued, cas.written_issued) == (4, 4)
    assert counter.tolist() == [0, 0, 3, 0] and lock.tolist() == [7]


def test_kernels_are_listed_by_the_bytes_they_move():
    """A small kernel launched first is listed after a large one; the ratios are over the cost model's bytes."""
    def two_kernels(x, y):
        _reread[(1,)](x, y, 4, BLOCK=4)  # 16 B read, 16 written
        _special[(1,)](x, y, 64, BLOCK=64)  # 256 B read, 256 written

    op = types.SimpleNamespace(
        name="test.two", backends={"b": types.SimpleNamespace(prepared=lambda inputs: two_kernels)},
        make_inputs=lambda params, device, dtype, seed: {"x": torch.rand(64) + 1, "y": torch.zeros(64)},
        cost=lambda params, dtype: types.SimpleNamespace(bytes=544))
    r = traffic_of(op, "b", {}, "fp32")
    assert [k["kernel"] for k in r["kernels"]] == ["_special", "_reread"]
    assert r["unique_bytes"] == r["issued_bytes"] == 544 and r["unique_over_model"] == 1.0


def test_a_cost_model_of_zero_bytes_is_summarised_without_a_ratio():
    row = {"op": "o", "backend": "b", "params": {"n": 1}, "dtype": "fp32", "kernels": [{"kernel": "_k"}],
           "unique_bytes": 2_000_000, "issued_bytes": 3_000_000, "model_bytes": 0, "unique_over_model": None,
           "issued_over_model": None}
    assert traffic._summary(row) == "o b n=1 fp32: unique 2 MB, the cost model's 0 MB; issued 3 MB"


def test_a_failed_case_fails_the_json_output_too(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("kernel\nbroke")

    monkeypatch.setattr(traffic, "traffic_of", failing)
    code, out, err = run_cli("traffic", "--op", "kda.gate", "--backend", "triton", "--set", "tokens=1", "--set",
                             "head_dim=60", "--json")
    (row,) = json.loads(out)
    assert code == 1 and row["error"] == "RuntimeError: kernel broke" and row["kernels"] == []


def test_the_seed_reaches_the_input_factory(monkeypatch):
    seeds = []
    monkeypatch.setattr(traffic, "traffic_of", lambda op, backend, params, dtype, seed=0: seeds.append(seed) or {
        "op": op.name, "backend": backend, "params": params, "dtype": dtype, "kernels": []})
    code, out, err = run_cli("traffic", "--op", "kda.gate", "--backend", "triton", "--set", "tokens=1", "--set",
                             "head_dim=60", "--seed", "7", "--json")
    assert code == 0 and seeds == [7], out + err
