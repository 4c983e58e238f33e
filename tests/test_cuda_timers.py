"""The CUDA timers' logic (spark_bench/timing.py) on a simulated device, without a GPU.

torch.cuda's events, streams and graphs are replaced by a fake whose clock only moves when a fake kernel runs: a
kernel of d us advances it by d, an event reads it, a graph records the kernels launched while it captures and runs
them again on replay. So every expected time is exact: what the events and graph timers must return (the flush kept
out of the event pair; the flush graph's median subtracted from the graph's), the auto mode's choice, and the
fallback to events when a call cannot be captured. What it cannot show is how a real GPU behaves (launch gaps,
clocks): that is tests/gpu/xcheck_do_bench.py's job on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from spark_bench import timing
from spark_bench.timing import TimingConfig


class FakeDevice:
    def __init__(self) -> None:
        self.clock_us = 0.0
        self.capturing: list | None = None  # the kernels of the graph being captured
        self.launched = 0
        self.current = 0  # torch.cuda.current_device()
        self.recorded_on: set[int] = set()  # the current device whenever an event was recorded
        self.replays = 0
        self.replay_jitter = lambda i: 0.0  # extra us of the i-th graph replay (noise a real GPU has)
        self.upload_us = 0.0  # extra us of each graph's first replay
        self.host_us = 0.0  # the host's own clock: it enqueues; the GPU cannot start what is not enqueued yet
        self.launch_us = 0.0  # host time to launch one call (a Python wrapper's); the flush costs none
        self.sync_debug = "default"  # torch.cuda.set_sync_debug_mode
        self.captures = 0  # graph captures begun
        self.streams_set: list = []  # torch.cuda.set_stream calls

    def run(self, us: float) -> None:
        """The GPU runs `us` of work once it is enqueued and the work before it is done."""
        self.clock_us = max(self.clock_us, self.host_us) + us

    def kernel(self, us: float, fail_in_capture: bool = False, host: bool = True, syncs: bool = False):
        def launch() -> None:
            if syncs and self.sync_debug == "error":
                raise RuntimeError("called a synchronizing CUDA operation")
            if self.capturing is not None:
                if fail_in_capture:
                    raise RuntimeError("operation not permitted when stream is capturing")
                self.capturing.append(us)
            else:
                self.host_us += self.launch_us if host else 0.0
                self.run(us)
                self.launched += 1
        return launch

    def install(self, monkeypatch: pytest.MonkeyPatch, flush_us: float) -> None:
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t: float | None = None

            def record(self) -> None:
                assert device.capturing is None, "an event recorded inside a capture"
                device.run(0.0)
                self.t = device.clock_us
                device.recorded_on.add(device.current)

            def query(self) -> bool:  # done: the GPU passed it by the host's present time
                return self.t is not None and self.t <= device.host_us

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: Event) -> float:  # milliseconds, as torch's
                return (end.t - self.t) / 1e3

        class CUDAGraph:
            def __init__(self) -> None:
                self.kernels: list[float] = []
                self.replayed = False

            def replay(self) -> None:
                device.run(device.upload_us * (not self.replayed))  # a graph's first replay uploads it
                self.replayed = True
                device.clock_us += sum(self.kernels) + device.replay_jitter(device.replays)
                device.replays += 1
                device.launched += len(self.kernels)

        @contextlib.contextmanager
        def graph(g: CUDAGraph):
            device.captures += 1
            device.capturing = g.kernels
            try:
                yield
            finally:
                device.capturing = None

        class Stream:
            def wait_stream(self, other: Stream) -> None:
                pass

        @contextlib.contextmanager
        def current(d: torch.device):
            before, device.current = device.current, d.index
            try:
                yield
            finally:
                device.current = before

        def synchronize(*args) -> None:
            device.host_us = max(device.host_us, device.clock_us)

        for name, value in {"Event": Event, "CUDAGraph": CUDAGraph, "graph": graph, "Stream": Stream,
                            "current_stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                            "synchronize": synchronize, "device": current,
                            "get_sync_debug_mode": lambda: device.sync_debug,
                            "set_sync_debug_mode": lambda mode: setattr(device, "sync_debug", mode),
                            "set_stream": device.streams_set.append,
                            "_sleep": lambda cycles: device.run(cycles / timing.CYCLES_PER_US)}.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)
        monkeypatch.setattr(timing, "flusher", lambda dev, enabled: self.kernel(flush_us, host=False) if enabled else
                            (lambda: None))


CFG = TimingConfig(warmup_s=0.0, min_samples=20, max_samples=200, min_time_s=0.0, max_time_s=5.0,
                   target_rel_ci=0.01, graph_target_us=500.0)


@pytest.fixture
def gpu(monkeypatch):
    device = FakeDevice()
    device.install(monkeypatch, flush_us=40.0)
    return device


@pytest.mark.parametrize("kernel_us", [3.0, 120.0])
def test_events_time_the_call_and_leave_the_flush_out(gpu, kernel_us):
    rec = timing.time_cuda_events([gpu.kernel(kernel_us)], CFG, "cuda:0")
    assert rec["timer"] == "cuda-event" and rec["median"] == pytest.approx(kernel_us)
    assert rec["min"] == rec["max"] and rec["converged"] and rec["l2_flush"] is True


def test_events_keep_the_hosts_launch_time_out(gpu, monkeypatch):
    """The first H200 run: kda.gate's 3.6 us kernel timed 60.5 us with events (the GPU waited for the wrapper's launch
    after each flush). Behind the hold, each batch is enqueued before the GPU gets to it: the kernel's 3 us."""
    gpu.launch_us = 100.0
    rec = timing.time_cuda_events([gpu.kernel(3.0)], CFG, "cuda:0")
    assert rec["median"] == pytest.approx(3.0) and rec["holds_expired"] == 0 and rec["hold_us"] == timing.HOLD_START_US
    monkeypatch.setattr(timing, "_hold", lambda us: None)  # what the timer measured before: the launch gap
    # the GPU idled from the flush's end (the previous kernel's 3 us and the 40 us flush after its launch) until this
    # launch, 100 us after the previous one: 100 - 43 + 3
    assert timing.time_cuda_events([gpu.kernel(3.0)], CFG, "cuda:0")["median"] == pytest.approx(60.0)


def test_a_hold_the_gpu_outran_is_doubled_and_its_batch_discarded(gpu, monkeypatch):
    monkeypatch.setattr(timing, "HOLD_START_US", 100.0)
    gpu.launch_us = 100.0  # a batch of 16 needs 1.6 ms of hold: 100, 200, 400, 800 us ran out
    rec = timing.time_cuda_events([gpu.kernel(3.0)], CFG, "cuda:0")
    assert rec["holds_expired"] == 4 and rec["hold_us"] == 1600.0
    assert set(rec["samples"]) == {3.0} and not rec["notes"]


def test_long_calls_need_no_longer_hold(gpu):
    gpu.launch_us = 100.0  # the GPU stays behind the host: no batch is discarded
    rec = timing.time_cuda_events([gpu.kernel(500.0)], CFG, "cuda:0")
    assert rec["holds_expired"] == 0 and rec["median"] == pytest.approx(500.0)


def test_a_host_slower_than_the_longest_hold_is_said(gpu, monkeypatch):
    monkeypatch.setattr(timing, "HOLD_START_US", 100.0)
    monkeypatch.setattr(timing, "HOLD_MAX_US", 400.0)
    gpu.launch_us = 100.0
    rec = timing.time_cuda_events([gpu.kernel(3.0)], dataclasses.replace(CFG, max_samples=32), "cuda:0")
    assert rec["hold_us"] == 400.0 and rec["holds_expired"] == 2
    assert "2 batches were enqueued slower than the GPU ran them" in rec["notes"][0]


def test_events_rotate_the_input_sets(gpu):
    rec = timing.time_cuda_events([gpu.kernel(10.0), gpu.kernel(30.0)], CFG, "cuda:0")
    assert sorted(set(rec["samples"])) == [10.0, 30.0] and rec["samples"].count(10.0) == rec["samples"].count(30.0)


@pytest.mark.parametrize("kernel_us,flush", [(2.0, True), (7.5, False)])
def test_graph_subtracts_the_flush_graph_and_divides_by_the_calls_it_unrolls(gpu, kernel_us, flush):
    cfg = dataclasses.replace(CFG, flush=flush)
    rec = timing.time_cuda_graph([gpu.kernel(kernel_us)], cfg, "cuda:0", estimate_us=kernel_us)
    n = rec["calls_per_sample"]
    assert n == round(cfg.graph_target_us / kernel_us)  # about graph_target_us of work per replay
    assert rec["timer"] == "cuda-graph" and rec["median"] == pytest.approx(kernel_us)
    assert rec["flush_us_per_call_subtracted"] == pytest.approx(40.0 if flush else 0.0)


def test_the_flush_graphs_noise_is_in_the_graph_timers_ci(gpu):
    """Replays alternate call graph, flush graph: jitter on the flush replays alone. Subtracting the flushes' median
    gave every sample the same value, a zero-width CI; the paired difference carries the flushes' spread."""
    gpu.replay_jitter = lambda i: 0.0 if i % 2 == 0 else 6.0 * ((i * 7919) % 13) / 13
    cfg = dataclasses.replace(CFG, min_samples=40, max_samples=40)
    rec = timing.time_cuda_graph([gpu.kernel(2.0)], cfg, "cuda:0", estimate_us=2.0)
    assert rec["ci_high"] > rec["ci_low"] and rec["max"] > rec["min"]
    assert rec["median"] == pytest.approx(2.0, abs=6.0 / rec["calls_per_sample"])
    assert rec["clamped_samples"] == 0 and "notes" not in rec


def test_a_call_lost_in_the_flushs_noise_is_clamped_and_counted(gpu):
    gpu.replay_jitter = lambda i: 0.0 if i % 2 == 0 else 800.0 * (i % 4 == 1)  # every other flush replay is slow
    cfg = dataclasses.replace(CFG, min_samples=20, max_samples=20)
    rec = timing.time_cuda_graph([gpu.kernel(1.0)], cfg, "cuda:0", estimate_us=1.0)
    assert rec["clamped_samples"] == 10 and rec["min"] == 0.0 and rec["max"] == pytest.approx(1.0)
    assert rec["notes"] == ["10 of 20 samples were within the flush's noise and stored as 0"]


def test_both_graphs_are_warmed_before_the_samples(gpu):
    """The flush graph's first replay (its upload) was inside the first sample's subtracted flush: clamped to 0."""
    gpu.upload_us = 5000.0
    cfg = dataclasses.replace(CFG, warmup_s=1e-6)  # a warm-up of one replay
    rec = timing.time_cuda_graph([gpu.kernel(2.0)], cfg, "cuda:0", estimate_us=2.0)
    assert rec["clamped_samples"] == 0 and rec["min"] == pytest.approx(2.0) and rec["max"] == pytest.approx(2.0)


def test_the_subtracted_flush_is_the_true_median(gpu):
    """An even number of flush replays: the median is the mean of the middle two (torch's median is the lower)."""
    gpu.replay_jitter = lambda i: 0.0 if i % 2 == 0 else 100.0 * ((i // 2) % 2)  # flushes alternate +0 / +100 us
    cfg = dataclasses.replace(CFG, min_samples=20, max_samples=20)
    rec = timing.time_cuda_graph([gpu.kernel(200.0)], cfg, "cuda:0", estimate_us=200.0)
    assert rec["flush_us_per_call_subtracted"] == pytest.approx(40.0 + 50.0 / rec["calls_per_sample"])


def test_graph_of_rotating_sets_times_their_mean(gpu):
    rec = timing.time_cuda_graph([gpu.kernel(1.0), gpu.kernel(3.0)], CFG, "cuda:0", estimate_us=2.0)
    assert rec["calls_per_sample"] % 2 == 0 and rec["median"] == pytest.approx(2.0)


@pytest.mark.parametrize("kernel_us,timer", [(5.0, "cuda-graph"), (80.0, "cuda-event")])
def test_auto_mode_graphs_small_calls_and_uses_events_for_large_ones(gpu, kernel_us, timer):
    rec = timing.measure([gpu.kernel(kernel_us)], "cuda:0", CFG)
    assert rec["timer"] == timer and rec["median"] == pytest.approx(kernel_us)
    assert (timing.GRAPH_BELOW_US > kernel_us) == (timer == "cuda-graph")


def test_a_call_that_cannot_be_captured_is_timed_with_events_and_says_so(gpu, monkeypatch):
    """A failed capture can leave torch 2.11's allocator believing a capture is underway (every later capture of the
    process fails): the stream is restored and the worker restarted after the case."""
    monkeypatch.setattr(timing, "_capture_failed", False)
    rec = timing.measure([gpu.kernel(4.0, fail_in_capture=True)], "cuda:0", CFG)
    assert rec["timer"] == "cuda-event" and rec["median"] == pytest.approx(4.0)
    assert rec["notes"] == ["graph capture failed, timed with events: RuntimeError: operation not permitted when "
                            "stream is capturing"]
    assert timing.capture_failed() and len(gpu.streams_set) == 1


def test_a_call_that_syncs_with_the_host_is_never_captured(gpu, monkeypatch):
    """Found before any capture (sync debug mode "error" around one call), so nothing is left broken."""
    monkeypatch.setattr(timing, "_capture_failed", False)
    rec = timing.measure([gpu.kernel(4.0, syncs=True)], "cuda:0", CFG)
    assert rec["timer"] == "cuda-event" and rec["median"] == pytest.approx(4.0) and gpu.captures == 0
    assert rec["notes"] == ["it synchronises with the host (called a synchronizing CUDA operation): timed with events, "
                            "no stream hold, its launch gaps in its times"]
    assert not timing.capture_failed() and gpu.sync_debug == "default"
    assert rec["hold_us"] == 0 and rec["holds_expired"] == 0  # held, every batch of such a call read late


def test_a_launch_gap_in_the_middle_of_a_batch_discards_it(gpu):
    """Only the batch's last call was checked: a 3 ms host pause before the 4th call's launch left a 3 ms sample."""
    calls = iter(range(10**6))
    kernel = gpu.kernel(300.0)

    def paused_once():
        if next(calls) == 3:
            gpu.host_us += 3000.0
        kernel()

    rec = timing.time_cuda_events([paused_once], CFG, "cuda:0")
    assert rec["holds_expired"] == 1 and max(rec["samples"]) == pytest.approx(300.0)


def test_no_batch_is_discarded_past_max_time(gpu, monkeypatch):
    gpu.launch_us = 20_000.0  # 20 ms of host time per call: every batch comes out late
    monkeypatch.setattr(timing._Stopper, "elapsed", lambda self: 10.0)  # max_time_s (5 s) long past
    rec = timing.time_cuda_events([gpu.kernel(3.0)], CFG, "cuda:0")
    assert rec["holds_expired"] == 0 and rec["stop_reason"] == "max_time" and len(rec["samples"]) == 16
    assert "1 batches were enqueued slower than the GPU ran them behind a 1 ms hold" in rec["notes"][0]


def test_another_error_under_the_sync_probe_is_the_calls_own(gpu):
    def fails_when_probed():
        if gpu.sync_debug == "error":
            raise RuntimeError("an error of the call's own")
        gpu.kernel(4.0)()

    with pytest.raises(RuntimeError, match="an error of the call's own"):
        timing.measure([fails_when_probed], "cuda:0", dataclasses.replace(CFG, mode="graph"))
    assert gpu.sync_debug == "default"


@pytest.mark.parametrize("mode", ["events", "auto"])
def test_the_timed_device_is_current_while_timing(gpu, mode):
    """pytest --spark-device cuda:1 runs in a process whose current device is 0: the events must be cuda:1's."""
    rec = timing.measure([gpu.kernel(5.0)], "cuda:1", dataclasses.replace(CFG, mode=mode))
    assert rec["median"] == pytest.approx(5.0) and gpu.recorded_on == {1} and gpu.current == 0


def test_forced_modes_and_the_sample_cap(gpu):
    cfg = dataclasses.replace(CFG, mode="events", max_samples=32, target_rel_ci=0.0)  # never converges
    rec = timing.measure([gpu.kernel(5.0)], "cuda:0", cfg)
    assert rec["timer"] == "cuda-event" and rec["stop_reason"] == "max_samples" and rec["n"] == 32
    rec = timing.measure([gpu.kernel(5.0)], "cuda:0", dataclasses.replace(cfg, max_samples=17))  # not a batch
    assert rec["stop_reason"] == "max_samples" and rec["n"] == 17
    rec = timing.measure([gpu.kernel(500.0)], "cuda:0", dataclasses.replace(CFG, mode="graph"))
    assert rec["timer"] == "cuda-graph" and rec["median"] == pytest.approx(500.0)


def test_a_kept_graph_timer_keeps_the_bases_calls_per_replay(gpu):
    """`run --like` of a case the base graphed at 37 calls per replay: the same 37 (a forced graph used to unroll
    graph_target_us / 10 us = 50, another amortisation of the launch gaps), and an event base stays events."""
    base = timing.measure([gpu.kernel(13.5)], "cuda:0", CFG)
    kept = timing.kept_timer(base)
    assert base["timer"] == "cuda-graph" and kept == f"graph:{base['calls_per_sample']}" == "graph:38"
    again = timing.measure([gpu.kernel(13.5)], "cuda:0", timing.with_kept_timer(CFG, kept))
    assert again["timer"] == "cuda-graph" and again["calls_per_sample"] == 38
    legacy = timing.measure([gpu.kernel(13.5)], "cuda:0", timing.with_kept_timer(CFG, "graph"))  # an older run.json
    assert legacy["calls_per_sample"] == 50
    assert timing.kept_timer(timing.measure([gpu.kernel(80.0)], "cuda:0", CFG)) == "events"
    assert timing.kept_timer({"timer": "cpu-perf_counter", "calls_per_sample": 1}) is None
    assert timing.with_kept_timer(dataclasses.replace(CFG, mode="events"), "graph:9").mode == "events"  # --timer wins


def test_a_cases_device_memory_is_read_on_its_own_gpu(monkeypatch):
    """In process (pytest --spark-device cuda:1) another GPU may be current: the peak is reset and read on cuda:1."""
    from spark_bench import worker

    asked = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: asked.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: asked.append(("read", device)) or 7)
    assert worker._memory_end("cuda:1", worker._memory_start("cuda:1"))["device_peak_bytes"] == 7
    assert asked == [("reset", torch.device("cuda:1")), ("read", torch.device("cuda:1"))]


def test_a_worker_whose_capture_failed_asks_to_be_restarted(monkeypatch):
    """After a failed capture every case the worker runs asks for a fresh process (the local executor retires it)."""
    from spark_bench.sweep import Case
    from spark_bench.worker import CaseRunner

    case = Case("kda.gate", "torch", {"tokens": 1, "heads": 4, "head_dim": 60}, "fp32", "cpu", 0)
    assert "restart_worker" not in CaseRunner().run(case, TimingConfig.quick(), 1)
    monkeypatch.setattr(timing, "_capture_failed", True)
    assert CaseRunner().run(case, TimingConfig.quick(), 1)["restart_worker"] is True
