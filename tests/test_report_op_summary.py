"""spark_bench/report/model.py op_summary: without a baseline the fastest backend is the one fastest at the most
points, a point being its parameters AND dtype, "fastest" meaning the smallest median; the fp32 reference is never
the fastest backend; the summary's roofline is the best of the fastest backend's cases. Hand-made results."""

import pytest

from spark_bench.report.model import op_summary


def _r(backend, median, dtype="fp32", n=1, pct=None):
    return {"op": "x.op", "backend": backend, "params": {"n": n}, "dtype": dtype, "status": "ok",
            "timing": {"median": median}, "roofline": {"pct_bw_measured": pct} if pct else None}


def test_without_a_baseline_the_most_wins_over_params_and_dtype_decide():
    """n=1 fp32: a 5 < b 10; n=1 bf16: b 4 < a 8; n=2 fp32: a 3 < b 6. Three points, a fastest at two."""
    results = [_r("a", 5.0), _r("b", 10.0), _r("a", 8.0, "bf16"), _r("b", 4.0, "bf16"), _r("a", 3.0, n=2),
               _r("b", 6.0, n=2)]
    s = op_summary("x.op", results, {}, "torch")  # no torch results: no speedups, count wins
    assert (s["fastest"], s["wins"], s["shapes"]) == ("a", 2, 3)


def test_the_reference_is_never_the_fastest_backend():
    results = [_r("torch", 10.0), _r("triton", 5.0), _r("reference", 1.0)]
    s = op_summary("x.op", results, {}, "torch")
    assert s["fastest"] == "triton" and s["speedup"] == pytest.approx(2.0)


def test_the_roofline_is_the_best_case_of_the_fastest_backend():
    results = [_r("torch", 10.0, pct=90.0), _r("triton", 5.0, pct=30.0), _r("torch", 20.0, n=2),
               _r("triton", 10.0, n=2, pct=60.0)]
    s = op_summary("x.op", results, {}, "torch")
    assert s["fastest"] == "triton" and s["roofline"] == pytest.approx((60.0, "BW measured"))
