"""`--spark-op`: one pytest item per spark-bench case, checked against the reference, then timed.

Items sit under one collector, node id `spark-bench`, so their node ids (`spark-bench::kda.gate[triton-bf16-T67-H4-
Dh128]`, which --benchmark-compare matches on) do not depend on the directory pytest runs in. Shared axes are
abbreviated (ABBREV); other axes read name+value; string values stand alone; booleans read `fused`/`no_fused`.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from spark_bench.pytest_plugin.replay import ReplayTimer, feed, not_timed, timing_info

ABBREV = {"batch": "B", "seq_len": "L", "heads": "H", "head_dim": "Dh", "head_dim_k": "Dk", "head_dim_v": "Dv",
          "tokens": "T", "hidden": "D", "experts": "E", "topk": "K", "inter": "I", "groups": "G", "rows": "R",
          "cols": "C"}
NODE_ID = "spark-bench"
SOURCE = pytest.StashKey[Any]()


def _part(axis: str, value: Any, verbose: bool) -> str:
    if verbose:
        return f"{axis}={value}"
    if isinstance(value, bool):
        return axis if value else f"no_{axis}"
    if isinstance(value, str):
        return value
    return f"{ABBREV.get(axis, axis)}{value}"


def point_id(params: dict[str, Any], verbose: bool = False) -> str:
    return "-".join(_part(axis, value, verbose) for axis, value in params.items())


def case_names(cases: list[Any]) -> list[str]:
    """`op[backend-dtype-point]` per case; an op whose compact ids collide gets `axis=value` ids."""
    verbose_ops = set()
    for second_pass in (False, True):  # the second names the colliding ops' cases verbosely, and only theirs
        names = [f"{c.op}[{c.backend}-{c.dtype}-{point_id(c.params, c.op in verbose_ops)}]" for c in cases]
        seen: dict[str, Any] = {}
        for case, name in zip(cases, names, strict=True):
            if seen.setdefault(name, case) is not case:
                verbose_ops.add(case.op)
        if not verbose_ops or second_pass:
            return names
    return names


def group_name(case: Any) -> str:
    """Cases of one op, dtype and point share a pytest-benchmark group: the table compares their backends."""
    return f"{case.op}[{case.dtype}-{point_id(case.params)}]"


def sweep_cases(state: Any) -> list[Any]:
    """The cases `spark-bench run` would run with the same options (its own spec builder and checks)."""
    from spark_bench.options import sweep_spec
    from spark_bench.pytest_plugin.gate import usage_error
    from spark_bench.sweep import UsageError, build_cases, split_list
    from spark_bench.weights import make_spec

    opt = state.config.getoption
    try:
        spec = sweep_spec(ops=state.ops, backends=split_list("--backend", opt("spark_backend")),
                          preset=opt("spark_preset"), sets=opt("spark_set"), dtypes=opt("spark_dtype"),
                          device=state.device, quick=opt("spark_quick"), full=opt("spark_full"), seed=opt("spark_seed"),
                          weights=make_spec(opt("spark_weights"), opt("spark_layer"), opt("spark_routing"),
                                            opt("spark_activations")))
        notes: list[str] = []  # why the user's values excluded points, as `spark-bench run` says
        cases = build_cases(state.registry(), spec, notes)
    except UsageError as exc:
        raise usage_error(exc) from None
    if not cases:
        raise usage_error("the selection has no cases (no backend or parameter point matches)"
                          + "".join(f"; {note}" for note in notes))
    return cases


class SparkCases(pytest.Collector):
    """The collector of every --spark-op case."""

    def __init__(self, *, cases: list[Any], state: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cases, self.state = cases, state

    def collect(self) -> list[pytest.Item]:
        items = []
        for case, name in zip(self.cases, case_names(self.cases), strict=True):
            test = _case_test(case, self.state)
            test = pytest.mark.benchmark(group=group_name(case), timer=ReplayTimer())(test)
            if case.skip:
                test = pytest.mark.skip(reason=f"{case.backend} is unavailable on {case.device}: {case.skip}")(test)
            item = SparkCase.from_parent(self, name=name, callobj=test)
            item.stash[SOURCE] = _op_source(self.state, case.op)
            items.append(item)
        return items


class SparkCase(pytest.Function):
    """One case; its location (in skip reports and failure headers) is the op's module, not the plugin's code."""

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.stash.get(SOURCE, None) or self.path, 0, self.name


def _op_source(state: Any, op_name: str) -> str | None:
    try:
        module = sys.modules[state.registry().get(op_name).make_inputs_fn.__module__]
        return module.__file__
    except (KeyError, AttributeError):
        return None


def collect(session: pytest.Session, state: Any) -> list[pytest.Item]:
    if not session.config.pluginmanager.hasplugin("benchmark"):
        raise pytest.UsageError("spark-bench: --spark-op needs the pytest-benchmark plugin (it is disabled)")
    collector = SparkCases.from_parent(session, name=NODE_ID, nodeid=NODE_ID, cases=sweep_cases(state), state=state)
    return list(session.genitems(collector))


def _case_test(case: Any, state: Any):
    def spark_case(benchmark: Any, request: pytest.FixtureRequest) -> None:
        run_case(case, state, benchmark, request.node)

    return spark_case


def run_case(case: Any, state: Any, benchmark: Any, item: pytest.Item) -> None:
    kept = baseline_timer(item)
    if kept is not None:  # as `run --like`: the baseline's timer, not a new probe's (near 50 us it flips)
        import dataclasses

        case = dataclasses.replace(case, timer=kept)
    record = state.runner.run(case, state.timing_config(case.device, minimal=not benchmark.enabled))
    if case.weights:  # what the case ran on, as `spark-bench run` labels its records (weights/label.py)
        from spark_bench.weights.label import labels_of

        label = labels_of([case], state.registry()).get(case.case_id)
        record["weights"] = label
    benchmark.extra_info.update(case_info(record, state))
    if kept is not None:
        benchmark.extra_info["timer_kept"] = kept
    status = record["status"]
    if status != "ok":
        not_timed(benchmark)
        where = f"{case.op} {case.backend} {case.dtype} {case.params} on {case.device}"
        if status == "mismatch":
            pytest.fail(f"{where}: does not match the reference: {record['error']} ({check_summary(record)})",
                        pytrace=False)
        pytest.fail(f"{where}: {status}: {record['error']}\n{record.get('traceback') or ''}".rstrip(), pytrace=False)
    feed(benchmark, item, record["timing"])


def baseline_timer(item: pytest.Item) -> str | None:
    """The CUDA timer ('graph:N', 'events'; timing.kept_timer) the --benchmark-compare baseline timed this benchmark
    with, or None (no baseline loaded, the benchmark not in it, or a CPU timer). Applied under --spark-timer auto."""
    if item.config.getoption("spark_timer") != "auto":
        return None
    from spark_bench.timing import kept_timer

    mapping = getattr(getattr(item.config, "_benchmarksession", None), "compared_mapping", None) or {}
    for benchmarks in mapping.values():
        saved = benchmarks.get(item.nodeid) if isinstance(benchmarks, dict) else None
        extra = saved.get("extra_info") if isinstance(saved, dict) else None
        mode = kept_timer(extra) if isinstance(extra, dict) else None
        if mode is not None:
            return mode
    return None


def check_summary(record: dict[str, Any]) -> str:
    check = record.get("check") or {}
    tol = check.get("tolerance") or {}
    parts = [f"{k}={check[k]:.4g}" for k in ("err_ratio", "max_abs", "cosine") if isinstance(check.get(k), float)]
    parts.append(f"tolerance err_ratio<={tol.get('err_ratio')}" + (f", max_abs<={tol['max_abs']}"
                                                                   if tol.get("max_abs") is not None else ""))
    return ", ".join(parts)


def case_info(record: dict[str, Any], state: Any) -> dict[str, Any]:
    """The benchmark's extra_info: what was measured, how, and the derived rates."""
    timing, check, power = record.get("timing") or {}, record.get("check") or {}, record.get("power") or {}
    info = {
        "op": record["op"], "backend": record["backend"], "params": record["params"], "dtype": record["dtype"],
        "device": record["device"], "labels": record["labels"], "status": record["status"],
        "fingerprint_id": state.fingerprint(record["device"])["fingerprint_id"],
        "check": {k: check.get(k) for k in ("ok", "err_ratio", "max_abs", "cosine")} if check else None,
        "cost": record.get("cost"), "gbps": record.get("gbps"), "tflops": record.get("tflops"),
    }
    if record.get("weights"):
        info["weights"] = record["weights"]
    if timing:
        info.update(timing_info(timing))
        info["roofline"] = record.get("roofline") or roofline_pct(state, record)
    if power.get("energy_j_per_call") is not None:
        info["energy_j_per_call"] = power["energy_j_per_call"]
        info["power"] = power
    if record.get("extra"):
        info["extra"] = record["extra"]
    return info


def roofline_pct(state: Any, record: dict[str, Any]) -> dict[str, Any] | None:
    """% of the device's measured (cached by `spark-bench calibrate`) and datasheet peaks."""
    roofline = state.roofline(record["device"])
    if roofline is None or record.get("gbps") is None:
        return None
    from spark_bench.telemetry.roofline import percent_of_peak

    pct = percent_of_peak(record.get("gbps"), record.get("tflops"), record["dtype"], roofline)
    return pct if any(v is not None for v in pct.values()) else None
