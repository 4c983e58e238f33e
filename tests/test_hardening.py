"""Issue 15: hardening from outside (unit-level checks; the end-to-end ones are in test_hardening_e2e.py)."""

import torch

import spark_bench


def test_backends_are_callable_with_the_inputs_as_keywords():
    op = spark_bench.get_op("kda.gate")
    inputs = op.make_inputs({"tokens": 5, "heads": 2, "head_dim": 8}, device="cpu", dtype="fp32", seed=0)
    out = op.backends["torch"](**inputs)
    assert torch.equal(out, op.backends["torch"].fn(**inputs))
