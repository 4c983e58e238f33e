"""spark_bench/worker.py edges a mutation audit found untested: how an exception is classified (a MemoryError is an
`oom`, a CUDA error restarts the worker, Ctrl-C is never a case's failure), the throughput numbers' formulas, the
rotated input sets' references per parameter point, and the worker-start timeout variables."""

import pytest
import test_hostile_backends

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.inputs import generator, randn
from spark_bench.registry import Registry
from spark_bench.sweep import Case, UsageError
from spark_bench.timing import TimingConfig
from spark_bench.worker import CaseRunner, classify

hostile_registry = test_hostile_backends.hostile_registry  # the shared fixture
FAST = TimingConfig(warmup_s=0.0, min_samples=2, max_samples=2, min_time_s=0.0, max_time_s=0.0, target_rel_ci=0.5)


def _inputs(p, *, device, dtype, seed):
    return {"x": randn((p["rows"], 4), generator(device, seed), dtype=dtype, device=device)}


edge = Op(name="edge.scale", make_inputs_fn=_inputs, reference=lambda x: 2 * x.double(),
          cost=lambda p, dtype: Cost(flops=3 * p["rows"], bytes=40 * p["rows"]),
          axes=[Axis("rows", [3])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})


@edge.backend("good")
def _good(x):
    return 2 * x


SHAPES: list = []  # the input shapes `shape_spy` was called on


@edge.backend("shape_spy")
def _shape_spy(x):
    SHAPES.append(tuple(x.shape))
    return 2 * x


@edge.backend("ctrl_c")
def _ctrl_c(x):
    raise KeyboardInterrupt


@edge.backend("cuda_error")
def _cuda_error(x):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@edge.backend("plain_error")
def _plain_error(x):
    raise RuntimeError("something else went wrong")


@pytest.fixture
def runner():
    reg = Registry()
    reg.load_object("edge", edge)
    return CaseRunner(reg)


def _case(backend, rows=3, op="edge.scale"):
    return Case(op, backend, {"rows": rows, "cols": 5} if op.startswith("hostile") else {"rows": rows}, "fp32", "cpu",
                0)


def test_a_memory_error_is_an_oom_whatever_its_message():
    assert classify(MemoryError()) == "oom"  # str(MemoryError()) is empty: no marker text to find
    assert classify(MemoryError("no more")) == "oom"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "oom"
    assert classify(ValueError("bad shape")) == "error"


def test_ctrl_c_in_a_backend_is_raised_not_recorded(runner):
    """In-process runs (the pytest plugin, --executor inprocess): Ctrl-C must stop the sweep, not be journalled as
    the case's `error`."""
    with pytest.raises(KeyboardInterrupt):
        runner.run(_case("ctrl_c"), FAST, n_sets=1)


def test_a_cuda_error_asks_for_a_fresh_worker_and_another_error_does_not(runner):
    poisoned = runner.run(_case("cuda_error"), FAST, n_sets=1)
    assert poisoned["status"] == "error" and poisoned["restart_worker"] is True
    plain = runner.run(_case("plain_error"), FAST, n_sets=1)
    assert plain["status"] == "error" and "restart_worker" not in plain


def test_gbps_and_tflops_are_the_cost_over_the_median(runner):
    rec = runner.run(_case("good"), FAST, n_sets=1)
    assert rec["status"] == "ok"
    seconds = rec["timing"]["median"] * 1e-6
    assert rec["gbps"] == pytest.approx(40 * 3 / seconds / 1e9)  # bytes, not flops
    assert rec["tflops"] == pytest.approx(3 * 3 / seconds / 1e12)
    assert rec["cost"] == {"flops": 9, "bytes": 120, "tokens": None}
    assert rec["labels"] == [] and rec["recompiles_during_timing"] == 0  # seeded inputs, nothing recompiled


def test_inputs_that_ignore_the_seed_are_labelled():
    import torch

    unseeded = Op(name="edge.unseeded", make_inputs_fn=lambda p, *, device, dtype, seed: {"x": torch.randn(3, 4)},
                  reference=lambda x: 2 * x.double(), cost=lambda p, dtype: Cost(flops=1, bytes=1),
                  axes=[Axis("rows", [3])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    unseeded.backend("good")(_good)
    reg = Registry()
    reg.load_object("edge", unseeded)
    rec = CaseRunner(reg).run(_case("good", op="edge.unseeded"), FAST, n_sets=1)
    assert rec["status"] == "ok" and rec["labels"] == ["unseeded-inputs"]


def test_each_parameter_point_runs_on_its_own_inputs(runner):
    """Inputs are cached for the next backend of the same point only: a case of another point (same op) must not
    be timed on the previous point's inputs while its record names its own parameters and cost."""
    SHAPES.clear()
    for rows in (3, 6):
        assert runner.run(_case("shape_spy", rows=rows), FAST, n_sets=1)["status"] == "ok"
    assert set(SHAPES) == {(3, 4), (6, 4)} and SHAPES[0] == (3, 4) and SHAPES[-1] == (6, 4)


def test_rotated_sets_are_checked_against_their_own_points_reference(hostile_registry):
    """One worker runs two parameter points of an op with rotated inputs: the second point's rotated sets must be
    checked against its own references, not the first point's (cached per point)."""
    runner = CaseRunner(hostile_registry)
    first = runner.run(_case("fine", rows=3, op="hostile.rotating"), FAST, n_sets=4)
    second = runner.run(_case("fine", rows=6, op="hostile.rotating"), FAST, n_sets=4)
    for rec in (first, second):
        assert rec["status"] == "ok", rec["error"]
        assert rec["check"]["input_sets"] == {"checked": 4} and rec["timing"]["input_sets"] == 4


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_variable_must_be_a_positive_finite_number(monkeypatch, value):
    from spark_bench.executors.worker_process import env_seconds

    monkeypatch.setenv("SPARK_BENCH_EDGE_TIMEOUT", value)
    with pytest.raises(UsageError, match="SPARK_BENCH_EDGE_TIMEOUT"):
        env_seconds("SPARK_BENCH_EDGE_TIMEOUT", 5)
    monkeypatch.setenv("SPARK_BENCH_EDGE_TIMEOUT", " 2.5 ")
    assert env_seconds("SPARK_BENCH_EDGE_TIMEOUT", 5) == 2.5
    monkeypatch.delenv("SPARK_BENCH_EDGE_TIMEOUT")
    assert env_seconds("SPARK_BENCH_EDGE_TIMEOUT", 5) == 5.0


def test_an_interpreted_backend_checks_one_input_set_and_says_so():
    """Interpreted Triton costs seconds a call: only set 0 is checked, and the record says the others were skipped
    (not that they were checked); the timing still rotates through all of them."""
    rot = Op(name="edge.rotating", make_inputs_fn=_inputs, reference=lambda x: 2 * x.double(),
             cost=lambda p, dtype: Cost(flops=1, bytes=1), axes=[Axis("rows", [3])], dtypes=["fp32"],
             tolerance={"fp32": Tolerance(1e-6)}, rotate=("x",))
    rot.backend("interp", labels=("interpreted",))(_good)
    reg = Registry()
    reg.load_object("edge", rot)
    rec = CaseRunner(reg).run(_case("interp", op="edge.rotating"), FAST, n_sets=4)
    assert rec["status"] == "ok" and "interpreted" in rec["labels"]
    assert rec["check"]["input_sets"] == {"checked": 1, "skipped": "interpreted"}
    assert rec["recheck"] == {"skipped": "interpreted"} and rec["timing"]["input_sets"] == 4
