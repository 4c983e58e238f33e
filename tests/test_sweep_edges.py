"""spark_bench/sweep.py edges a mutation audit found untested: the backends of a point run in an order seeded per
point (never always A before B, so drift favours neither), the same on a rebuild (a resume); the backends of one
point share their inputs (one seed per point, not per case)."""

import dataclasses

import pytest

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.inputs import generator, randn
from spark_bench.registry import Registry
from spark_bench.sweep import Case, SweepSpec, build_cases

POINTS = list(range(1, 17))

ordered = Op(name="edge.order", make_inputs_fn=lambda p, *, device, dtype, seed: {
    "x": randn((p["n"], 2), generator(device, seed), dtype=dtype, device=device)},
    reference=lambda x: x.double(), cost=lambda p, dtype: Cost(flops=p["n"], bytes=p["n"]),
    axes=[Axis("n", POINTS)], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})


@ordered.backend("a")
def _a(x):
    return x


@ordered.backend("b")
def _b(x):
    return x


def _registry():
    reg = Registry()
    reg.load_object("edge", ordered)
    return reg


def _orders(seed=0):
    cases = build_cases(_registry(), SweepSpec(ops=["edge.order"], device="cpu", seed=seed))
    assert len(cases) == 2 * len(POINTS)
    by_point: dict[int, list[str]] = {}
    for case in cases:
        by_point.setdefault(case.params["n"], []).append(case.backend)
    assert all(sorted(backends) == ["a", "b"] for backends in by_point.values())  # each point's backends together
    assert [c.params["n"] for c in cases[::2]] == POINTS
    return [tuple(by_point[n]) for n in POINTS]


def test_the_backends_of_each_point_run_in_a_seeded_order_that_varies_by_point():
    orders = _orders()
    assert set(orders) == {("a", "b"), ("b", "a")}  # 16 points: never always one backend first
    assert _orders() == orders  # a rebuild (--resume) gives the same order
    assert any(_orders(seed) != orders for seed in (1, 2, 3))  # the run's seed picks it


def test_the_backends_of_one_point_share_their_inputs_and_points_differ():
    one = [Case("edge.order", b, {"n": 3}, "fp32", "cpu", 0) for b in ("a", "b")]
    assert one[0].input_seed() == one[1].input_seed() and one[0].group == one[1].group
    other = Case("edge.order", "a", {"n": 4}, "fp32", "cpu", 0)
    assert other.input_seed() != one[0].input_seed()
    assert Case("edge.order", "a", {"n": 3}, "fp32", "cpu", 1).input_seed() != one[0].input_seed()  # the seed


def test_an_axis_set_twice_adds_up_and_a_list_names_each_value_once():
    from spark_bench.sweep import merge_sets, split_list

    assert merge_sets(["n=1", "n=4,1", "m=2"]) == {"n": ["1", "4"], "m": ["2"]}
    assert split_list("--dtype", ["fp32,bf16", "fp32"]) == ["fp32", "bf16"]


def test_runnable_refuses_a_selection_of_skipped_cases_only():
    from spark_bench.sweep import UsageError, runnable

    ready = Case("edge.order", "a", {"n": 1}, "fp32", "cpu", 0)
    skipped = dataclasses.replace(ready, backend="b", skip="needs a GPU")
    said: list[str] = []
    assert runnable([ready, skipped], "nothing", said.append) == [ready]
    assert said == ["skipped edge.order b: needs a GPU"]
    with pytest.raises(UsageError, match="^nothing to run; edge.order b: needs a GPU$"):
        runnable([skipped], "nothing to run", said.append)


def test_a_dtype_is_swept_only_on_the_ops_that_support_it():
    both = Op(name="edge.both", make_inputs_fn=ordered.make_inputs_fn, reference=ordered.reference,
              cost=ordered.cost, axes=[Axis("n", [1])], dtypes=["fp32", "bf16"],
              tolerance={"fp32": Tolerance(1e-6), "bf16": Tolerance(1e-2)})
    both.backend("a")(_a)
    reg = _registry()
    reg.load_object("edge2", both)
    cases = build_cases(reg, SweepSpec(ops=["edge.*"], device="cpu", dtypes=["bf16"]))
    assert {(c.op, c.dtype) for c in cases} == {("edge.both", "bf16")}
