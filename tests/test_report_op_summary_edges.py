"""spark_bench/report/model.py op_summary edges (found by mutation testing): without a baseline the fp32 reference
never wins a shape, and the fastest backend's roofline comes from its timed cases only."""

import pytest
from test_report_op_summary import _r

from spark_bench.report.model import op_summary


def test_without_a_baseline_the_reference_wins_no_shape():
    results = [_r("reference", 1.0), _r("triton", 5.0), _r("fla", 7.0), _r("reference", 1.0, n=2),
               _r("fla", 3.0, n=2), _r("triton", 2.0, n=2)]
    s = op_summary("x.op", results, {}, "torch")  # no torch: wins decide, the reference is timed for context only
    assert (s["fastest"], s["wins"], s["shapes"]) == ("triton", 2, 2)


def test_the_roofline_of_the_fastest_backend_ignores_its_failed_cases():
    wrong = {**_r("triton", 1.0, n=3, pct=95.0), "status": "mismatch"}  # a wrong result reads no roof
    results = [_r("torch", 10.0), _r("triton", 5.0, pct=30.0), wrong]
    s = op_summary("x.op", results, {}, "torch")
    assert s["fastest"] == "triton" and s["roofline"] == pytest.approx((30.0, "BW measured"))
