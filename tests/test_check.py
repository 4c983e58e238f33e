import torch

from spark_bench.check import default_compare, poisoned_allocations, tensor_metrics
from spark_bench.op import Tolerance


def test_error_ratio_and_max_abs():
    ref = torch.ones(100, dtype=torch.float64)
    out = ref.clone()
    out[0] += 0.1
    m = tensor_metrics(out, ref)
    assert abs(m["err_ratio"] - 0.01) < 1e-12 and abs(m["max_abs"] - 0.1) < 1e-12


def test_nonfinite_shape_and_count_failures():
    ref = torch.ones(4)
    _, ok, msg = default_compare(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref, Tolerance(1e-3))
    assert not ok and "NaN" in msg
    _, ok, msg = default_compare(torch.ones(5), ref, Tolerance(1e-3))
    assert not ok and "shape" in msg
    _, ok, msg = default_compare((torch.ones(4),), (ref, ref), Tolerance(1e-3))
    assert not ok and "returned 1 tensors" in msg
    _, ok, msg = default_compare(torch.ones(4) * 1.0001, ref, Tolerance(1e-3, max_abs=1e-5))
    assert not ok and "max |diff|" in msg


def test_poisoned_allocations_expose_unwritten_elements():
    x = torch.arange(6.0)
    with poisoned_allocations():
        y = torch.empty_like(x)
        y[:3] = x[:3]
    assert torch.isnan(y[3:]).all()
    _, ok, _ = default_compare(y, x.double(), Tolerance(1e-3))
    assert not ok
    assert torch.empty.__name__ == "empty" and torch.Tensor.new_empty.__name__ == "new_empty"  # restored


def test_the_summary_holds_the_worst_output():
    """A multi-output op's summary err_ratio is the largest output's and its cosine the smallest (a mutation audit
    swapped max and min unseen)."""
    exact, ref = torch.ones(64), torch.ones(64)
    off = torch.linspace(-1, 1, 64)
    metrics, ok, _ = default_compare((exact, off + 0.01), (ref, off), Tolerance(1.0))
    assert ok and metrics["err_ratio"] == metrics["outputs"]["1"]["err_ratio"] > 0
    assert metrics["cosine"] == metrics["outputs"]["1"]["cosine"] < 1 and metrics["outputs"]["0"]["err_ratio"] == 0


def test_max_abs_is_a_bound_at_its_value():
    ref = torch.ones(4, dtype=torch.float64)
    tol = Tolerance(1.0, max_abs=1e-5)
    over, under = ref.clone(), ref.clone()
    over[0] += 2e-5
    under[0] += 0.5e-5
    metrics, ok, message = default_compare(over, ref, tol)
    assert not ok and "max |diff|" in message
    assert default_compare(under, ref, tol)[1]
