"""Issue 15: hardening from outside (unit-level checks; the end-to-end ones are in test_hardening_e2e.py)."""

import os

import pytest
import torch

import spark_bench


def test_backends_are_callable_with_the_inputs_as_keywords():
    op = spark_bench.get_op("kda.gate")
    inputs = op.make_inputs({"tokens": 5, "heads": 2, "head_dim": 8}, device="cpu", dtype="fp32", seed=0)
    out = op.backends["torch"](**inputs)
    assert torch.equal(out, op.backends["torch"].fn(**inputs))


def test_one_process_owns_a_run_directory(tmp_path):
    from spark_bench.results import ResultsError, RunStore

    first, second = RunStore(tmp_path / "run"), RunStore(tmp_path / "run")
    first.lock()
    with pytest.raises(ResultsError, match=rf"in use by pid {os.getpid()} on "):
        second.lock()
    first.unlock()
    second.lock()  # released: the next owner gets it (the kernel also releases it when the owner dies)
    second.unlock()


def test_out_pointing_at_a_file_is_one_line(tmp_path):
    from spark_bench.results import ResultsError, RunStore

    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ResultsError, match="is a file"):
        RunStore(path).lock()


@pytest.fixture
def hostile_registry(monkeypatch):
    from conftest import TESTS

    from spark_bench.registry import Registry

    monkeypatch.syspath_prepend(str(TESTS / "plugins"))
    import hostile_plugin

    reg = Registry()
    reg.load_object("hostile_plugin", hostile_plugin)
    return reg


def _run_case(reg, op, backend, params=None, dtype="fp32"):
    from spark_bench.sweep import Case
    from spark_bench.timing import TimingConfig
    from spark_bench.worker import CaseRunner

    case = Case(op, backend, params or {"rows": 3, "cols": 5}, dtype, "cpu", 0)
    return CaseRunner(reg).run(case, TimingConfig.quick())


@pytest.mark.parametrize("backend, needle", [
    ("float64_out", "output 0: dtype float64, expected float32"),
    ("overwrites_input", "input x was modified in place"),
    ("empty_out", "shape (0, 5) != reference (3, 5)"),
])
def test_the_check_catches_what_values_alone_pass(hostile_registry, backend, needle):
    rec = _run_case(hostile_registry, "hostile.check", backend)
    assert rec["status"] == "mismatch" and needle in rec["error"], rec["error"]
    assert rec["timing"] is None


def test_the_check_still_passes_good_backends_and_the_fp64_reference(hostile_registry):
    for backend in ("fine", "reference"):
        rec = _run_case(hostile_registry, "hostile.check", backend)
        assert rec["status"] == "ok", (backend, rec["error"])


def test_an_empty_output_is_not_a_perfect_match():
    from spark_bench.check import tensor_metrics

    m = tensor_metrics(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.float64))
    assert "empty" in m["error"]
