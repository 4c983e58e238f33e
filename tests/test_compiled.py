"""torch_compile backends: compiled in setup (outside the timings); recompiles inside the timed region are flagged."""

import torch

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.compiled import add_torch_compile
from spark_bench.registry import Registry
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig
from spark_bench.worker import CaseRunner


def make_op(redraw_rows):
    op = Op(name="test.scale", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.randn(p["rows"], 8)},
            reference=lambda x: 3 * x.double(), cost=lambda p, d: Cost(8 * p["rows"], 64 * p["rows"]),
            axes=[Axis("rows", [5], quick=[5])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)},
            rotate=("x",), redraw=lambda p, device, dtype, seed: {"x": torch.randn(redraw_rows, 8)})

    @op.backend("torch")
    def scale(x):
        return 3 * x

    add_torch_compile(op)
    reg = Registry()
    reg.load_object("test", op)
    return reg


def run(reg):
    case = Case("test.scale", "torch_compile", {"rows": 5}, "fp32", "cpu", 0)
    return CaseRunner(reg).run(case, TimingConfig.quick(), n_sets=2)


def test_compile_happens_in_setup_and_steady_shapes_do_not_recompile():
    rec = run(make_op(redraw_rows=5))
    assert rec["status"] == "ok" and rec["timing"]["setup_s"] > 0
    assert rec["recompiles_during_timing"] == 0 and "recompiled-in-timing" not in rec["labels"]


def test_a_new_shape_inside_the_timed_region_is_flagged(monkeypatch):
    # the second rotated input set has another shape: its check, before the timing, compiles it
    rec = run(make_op(redraw_rows=7))
    assert rec["status"] == "ok" and rec["check"]["input_sets"] == {"checked": 2}
    assert rec["recompiles_during_timing"] == 0
    # without that check the timing meets the new shape first: Dynamo compiles inside it, and that is flagged
    monkeypatch.setattr(CaseRunner, "_check_rotated", lambda *args: True)
    rec = run(make_op(redraw_rows=7))
    assert rec["status"] == "ok"
    assert rec["recompiles_during_timing"] >= 1 and "recompiled-in-timing" in rec["labels"]


def test_every_case_of_a_long_lived_worker_compiles_past_dynamos_recompile_limit():
    """A worker runs many shapes; without a reset Dynamo ran the 9th onward eagerly, timed as torch_compile."""
    from spark_bench.compiled import compile_count

    op = Op(name="test.shapes", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.randn(p["rows"], 8)},
            reference=lambda x: 3 * x.double(), cost=lambda p, d: Cost(8 * p["rows"], 64 * p["rows"]),
            axes=[Axis("rows", list(range(1, 12)))], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    op.backend("torch")(lambda x: 3 * x)
    add_torch_compile(op, name="compiled", backend="eager")  # Dynamo's caches without Inductor's compile time
    reg = Registry()
    reg.load_object("test", op)
    runner = CaseRunner(reg)
    for rows in range(1, 12):
        before = compile_count()
        rec = runner.run(Case("test.shapes", "compiled", {"rows": rows}, "fp32", "cpu", 0), TimingConfig.quick())
        assert rec["status"] == "ok" and compile_count() > before, (rows, rec["error"])


def test_a_setup_that_compiles_nothing_is_an_error(monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # Dynamo runs every frame eagerly
    rec = run(make_op(redraw_rows=5))
    assert rec["status"] == "error" and "compiled no graph" in rec["error"], rec["error"]
