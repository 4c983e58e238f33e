"""The pytest plugin's pieces without an inner pytest session: case ids, the baseline's timer, failure messages, the
`spark_bench` fixture's check and rates, the replay timer and the weights part of a fingerprint (found by a mutation
audit: every test here failed on a plausible bug that the session-level tests let pass)."""

from types import SimpleNamespace

import pytest
import torch

from spark_bench.pytest_plugin import SparkState, cases, fixture
from spark_bench.pytest_plugin.replay import ReplayTimer, fingerprint_difference
from spark_bench.timing import config_for


def _case(op, **params):
    return SimpleNamespace(op=op, backend="torch", dtype="bf16", params=params)


def test_point_ids_read_booleans_as_flags():
    assert cases.point_id({"fused": True, "heads": 4, "mode": "fast"}) == "fused-H4-fast"
    assert cases.point_id({"fused": False}) == "no_fused"
    assert cases.point_id({"fused": False, "heads": 4}, verbose=True) == "fused=False-heads=4"


def test_only_the_op_whose_ids_collide_gets_verbose_ids():
    clash = [_case("op.a", left="x-y", right="z"), _case("op.a", left="x", right="y-z")]  # both read `x-y-z`
    names = cases.case_names([*clash, _case("op.b", heads=4)])
    assert names == ["op.a[torch-bf16-left=x-y-right=z]", "op.a[torch-bf16-left=x-right=y-z]",
                     "op.b[torch-bf16-H4]"]


def _item(timer_option, saved_extra, nodeid="spark-bench::op.x[torch-bf16-T1]"):
    mapping = {"base.json": {nodeid: {"extra_info": saved_extra}}}
    config = SimpleNamespace(getoption=lambda name: timer_option,
                             _benchmarksession=SimpleNamespace(compared_mapping=mapping))
    return SimpleNamespace(config=config, nodeid=nodeid)


def test_the_baseline_timer_is_kept_only_under_timer_auto():
    graph = {"timer": "cuda-graph", "calls_per_sample": 24}
    assert cases.baseline_timer(_item("auto", graph)) == "graph:24"
    for pinned in ("events", "graph"):  # a timer given on the command line wins, whichever it is
        assert cases.baseline_timer(_item(pinned, graph)) is None


def test_a_mismatch_names_a_zero_max_abs_tolerance():
    record = {"check": {"err_ratio": 0.5, "max_abs": 1.0, "tolerance": {"err_ratio": 1e-3, "max_abs": 0.0}}}
    assert cases.check_summary(record) == "err_ratio=0.5, max_abs=1, tolerance err_ratio<=0.001, max_abs<=0.0"


class _State:
    """What run_case and the fixture ask of SparkState, recording the timing configs they take."""

    def __init__(self, record=None, roofline=None):
        self.configs, self.record, self._roofline = [], record, roofline
        self.runner = SimpleNamespace(run=lambda case, cfg: self.configs.append(cfg) or self.record)

    def fingerprint(self, device):
        return {"fingerprint_id": "f" * 16}

    def roofline(self, device):
        return self._roofline

    def timing_config(self, device, minimal=False):
        self.configs.append(minimal)
        return SparkState.timing_config(SimpleNamespace(config=_config()), device, minimal)


def _config(**options):
    return SimpleNamespace(getoption=lambda name, default=None: options.get(name, default))


def _run_case(monkeypatch, status, enabled=True, **record):
    fed = []
    monkeypatch.setattr(cases, "feed", lambda benchmark, item, timing: fed.append(timing))
    record = {"op": "op.x", "backend": "torch", "params": {"tokens": 1}, "dtype": "bf16", "device": "cpu",
              "labels": {}, "status": status, "timing": {"median": 2.0, "n": 1, "samples": [2.0]}, **record}
    case = SimpleNamespace(op="op.x", backend="torch", dtype="bf16", params={"tokens": 1}, device="cpu",
                           weights=None, case_id="c0")
    state = _State(record)
    benchmark = SimpleNamespace(enabled=enabled, extra_info={}, _mode=None)
    cases.run_case(case, state, benchmark, _item("events", {}))
    return state, fed


def test_a_disabled_benchmark_times_one_call(monkeypatch):
    state, fed = _run_case(monkeypatch, "ok", enabled=False)
    assert state.configs[0] is True and state.configs[1].max_samples == 1 and len(fed) == 1


def test_a_broken_case_fails_with_the_backends_traceback(monkeypatch):
    with pytest.raises(pytest.fail.Exception) as failed:
        _run_case(monkeypatch, "error", error="ValueError: boom",
                  traceback='  File "kernel.py", line 7, in backend\n    raise ValueError("boom")')
    assert "op.x torch bf16 {'tokens': 1} on cpu: error: ValueError: boom" in str(failed.value)
    assert 'kernel.py", line 7' in str(failed.value)  # where it broke, not only what


def test_roofline_percent_needs_bandwidth_only(monkeypatch):
    peak = {"datasheet": {"bandwidth_gbps": 100.0, "tflops": {}}}
    record = {"device": "cpu", "dtype": "fp32", "gbps": 50.0, "tflops": None}
    assert cases.roofline_pct(_State(roofline=peak), record) == {
        "pct_bw_measured": None, "pct_bw_datasheet": 50.0, "pct_flops_measured": None, "pct_flops_datasheet": None}


def test_session_timing_config_follows_the_options():
    state = SimpleNamespace(config=_config(spark_quick=False, spark_no_flush=True, spark_timer="auto"))
    cfg = SparkState.timing_config(state, "cpu")
    assert cfg == config_for("cpu", False, flush=False, mode="auto")  # the CPU default, not quick's
    assert cfg.flush is False


@pytest.fixture
def bench(monkeypatch):
    """A SparkBench whose timing is a fake record (median 2 us) and whose feed is recorded."""
    timed = {}

    def measure(fns, device, cfg):
        timed.update(device=device, cfg=cfg)
        return {"median": timed.get("median_us", 2.0), "n": 1, "samples": [2.0], "timer": "cpu-perf_counter"}

    monkeypatch.setattr("spark_bench.timing.measure", measure)
    monkeypatch.setattr(fixture, "feed", lambda benchmark, node, record: timed.setdefault("fed", record))
    benchmark = SimpleNamespace(enabled=True, extra_info={}, _mode=None)
    spark = fixture.SparkBench(SimpleNamespace(node=None), benchmark, _State())
    return spark, benchmark.extra_info, timed


def test_fixture_rates_in_the_right_units(bench):
    spark, info, _ = bench
    assert spark(lambda x: x + 1, torch.zeros(3), flops=2e6, nbytes=4e3) is not None
    assert info["gbps"] == pytest.approx(2.0) and info["tflops"] == pytest.approx(1.0)  # 4 kB, 2 MFLOP in 2 us


def test_fixture_with_a_zero_median_has_no_rates(bench):
    spark, info, timed = bench
    timed["median_us"] = 0.0
    spark(lambda x: x, torch.zeros(3), flops=1.0, nbytes=1.0)
    assert info["gbps"] is None and info["tflops"] is None


def test_fixture_returns_fns_result_and_finds_the_device_in_keywords(bench):
    spark, info, timed = bench
    x = torch.empty(2, device="meta")
    assert spark(lambda *, x: ("out", x.device.type), x=x) == ("out", "meta")
    assert timed["device"] == info["device"] == "meta"


def test_fixture_checks_an_in_place_kernel_on_copies(bench):
    spark, info, _ = bench
    x = torch.arange(4.0)
    out = spark(lambda x: x.mul_(2), x, reference=lambda x: 2 * x.double())
    assert torch.equal(out, 2 * torch.arange(4.0)) and torch.equal(x, torch.arange(4.0))  # the caller's x untouched
    assert info["check"]["ok"] and info["check"]["err_ratio"] == 0.0


def test_fixture_default_tolerance_is_1e_3(bench):
    spark, info, _ = bench
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    spark(lambda x: x * 1.0005, x, reference=lambda x: x.double())
    with pytest.raises(pytest.fail.Exception, match=r"does not match the reference.*tolerance err_ratio<=0\.001"):
        spark(lambda x: x * 1.005, x, reference=lambda x: x.double())


def test_fixture_rooflines_with_the_tensors_dtype(bench, monkeypatch):
    spark, _, _ = bench
    seen = []
    monkeypatch.setattr(cases, "roofline_pct", lambda state, record: seen.append(record["dtype"]))
    spark(lambda x: x, torch.zeros(3, dtype=torch.bfloat16), nbytes=6)
    assert seen == ["bf16"]


def test_replay_timer_refuses_a_round_it_has_no_sample_for():
    timer = ReplayTimer()
    timer.load([1e-6], "cpu-perf_counter")
    assert (timer(), timer(), timer.exhausted, timer.__name__) == (0.0, 1e-6, True, "spark_bench.cpu-perf_counter")
    timer()
    with pytest.raises(RuntimeError, match="more rounds than loaded samples"):
        timer()


def _weights(routing="r" * 64):
    return {"path": "m.gguf", "layer": 3, "sha256": "a" * 64, "routing": {"sha256": routing}}


def test_fingerprints_of_one_device_differ_by_their_weights():
    fp = {"fingerprint_id": "0123456789abcdef"}
    assert fingerprint_difference({**fp, "weights": _weights()}, {**fp, "weights": _weights()}) is None
    other_routing = fingerprint_difference({**fp, "weights": _weights()}, {**fp, "weights": _weights("s" * 64)})
    assert other_routing == ("weights m.gguf layer 3 sha256 aaaaaaaaaaaa routing rrrrrrrrrrrr -> "
                             "m.gguf layer 3 sha256 aaaaaaaaaaaa routing ssssssssssss")
    assert fingerprint_difference({**fp, "weights": "layer 3"}, fp) == "weights malformed ('layer 3') -> random"
