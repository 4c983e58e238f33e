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
