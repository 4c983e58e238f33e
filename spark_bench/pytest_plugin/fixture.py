"""The `spark_bench` fixture: your own callable, checked against your reference, timed by spark-bench's engine.

    def test_my_kernel(spark_bench):
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        spark_bench(my_kernel, x, reference=my_reference, tolerance=1e-2, nbytes=2 * x.nbytes)

Keyword-only settings (pass a functools.partial for a callable that takes arguments with these names):
    device: where it runs (default: the device of the first tensor argument, else cpu) - picks the timer.
    reference: called like fn (on clones of the arguments); its outputs are compared with fn's (RMS error ratio,
        max |diff|, like every spark-bench op); a mismatch fails the test before any timing.
    tolerance: the largest error ratio allowed (float) or a spark_bench.Tolerance.
    flops, nbytes: work per call, for TFLOP/s, GB/s and % of roofline in extra_info.
    timing: a spark_bench.timing.TimingConfig (default: the session's, from --spark-quick / --spark-max-time ...).
Returns fn's result (of the correctness call when a reference is given).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from spark_bench.pytest_plugin.replay import feed, not_timed, timing_info


def _clone(value: Any) -> Any:
    import torch

    return value.clone() if isinstance(value, torch.Tensor) else value


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import torch

    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


class SparkBench:
    def __init__(self, request: pytest.FixtureRequest, benchmark: Any, state: Any) -> None:
        self.request, self.benchmark, self.state = request, benchmark, state

    def __call__(self, fn: Any, *args: Any, device: str | None = None, reference: Any = None,
                 tolerance: Any = 1e-3, flops: float | None = None, nbytes: float | None = None,
                 timing: Any = None, **kwargs: Any) -> Any:
        from spark_bench.timing import measure

        tensor = _first_tensor(args, kwargs)
        device = device or (str(tensor.device) if tensor is not None else "cpu")
        info = self.benchmark.extra_info
        info.update(function=getattr(fn, "__qualname__", repr(fn)), device=device,
                    fingerprint_id=self.state.fingerprint(device)["fingerprint_id"])
        if reference is not None:
            result = self._check(fn, reference, tolerance, device, args, kwargs)
        else:
            result = fn(*args, **kwargs)
            _sync(device)
        cfg = timing or self.state.timing_config(device, minimal=not self.benchmark.enabled)
        record = measure([functools.partial(fn, *args, **kwargs)], device, cfg)
        seconds = record["median"] * 1e-6
        info.update(timing_info(record), flops=flops, nbytes=nbytes,
                    gbps=nbytes / seconds / 1e9 if nbytes and seconds > 0 else None,
                    tflops=flops / seconds / 1e12 if flops and seconds > 0 else None)
        if info["gbps"] is not None:
            from spark_bench.pytest_plugin.cases import roofline_pct

            dtype = _dtype_name(tensor)
            info["roofline"] = roofline_pct(self.state, {"device": device, "dtype": dtype, "gbps": info["gbps"],
                                                         "tflops": info["tflops"]})
        feed(self.benchmark, self.request.node, record)
        return result

    def _check(self, fn: Any, reference: Any, tolerance: Any, device: str, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        from spark_bench.check import default_compare, poisoned_allocations
        from spark_bench.op import Tolerance
        from spark_bench.timing import on_device

        tol = tolerance if isinstance(tolerance, Tolerance) else Tolerance(float(tolerance))
        with on_device(device), poisoned_allocations():  # cuda:N current: the poison fills N's allocations
            out = fn(*map(_clone, args), **{k: _clone(v) for k, v in kwargs.items()})
            _sync(device)
        ref = reference(*map(_clone, args), **{k: _clone(v) for k, v in kwargs.items()})
        metrics, ok, message = default_compare(out, ref, tol)
        self.benchmark.extra_info["check"] = {"ok": ok, "err_ratio": metrics.get("err_ratio"),
                                              "max_abs": metrics.get("max_abs"), "cosine": metrics.get("cosine"),
                                              "tolerance": {"err_ratio": tol.err_ratio, "max_abs": tol.max_abs}}
        if not ok:
            not_timed(self.benchmark)
            pytest.fail(f"{getattr(fn, '__qualname__', fn)} does not match the reference: {message} "
                        f"(err_ratio={metrics.get('err_ratio')}, max_abs={metrics.get('max_abs')}, "
                        f"tolerance err_ratio<={tol.err_ratio})", pytrace=False)
        return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))  # the tensors' device, not the current one


def _dtype_name(tensor: Any) -> str | None:
    from spark_bench.dtypes import canonical_dtype

    try:
        return canonical_dtype(str(tensor.dtype)) if tensor is not None else None
    except ValueError:
        return None
