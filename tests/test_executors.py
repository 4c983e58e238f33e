"""Executors: fake CPU "devices" run in parallel and agree with in-process runs; the power-safe scheduling rule;
retries; --devices parsing; --dry-run's estimate from stored results."""

import dataclasses
import importlib
import itertools
import json
import threading
import time

import pytest
import torch
from conftest import TESTS

from spark_bench import results
from spark_bench.executors import CaseQueue, make_executor, parse_devices
from spark_bench.executors.inprocess import InProcessExecutor
from spark_bench.executors.local import LocalExecutor
from spark_bench.registry import Registry
from spark_bench.runner import Runner
from spark_bench.sweep import Case, UsageError
from spark_bench.timing import TimingConfig

FAST = TimingConfig(warmup_s=0.0, min_samples=2, max_samples=2, min_time_s=0.0, max_time_s=0.0, target_rel_ci=0.5)
SLOW_S = 0.3
CASES = ([Case("fault.scale", "slow", {"rows": r, "cols": 5}, "fp32", "cpu", 0) for r in (3, 5, 7, 9)]
         + [Case("fault.scale", b, {"rows": 3, "cols": 5}, "fp32", "cpu", 0) for b in ("good", "raises", "wrong")])
EXPECTED = {"slow": "ok", "good": "ok", "raises": "error", "wrong": "mismatch"}


@pytest.fixture
def fault_process(monkeypatch):
    """This process and the workers it spawns load the fault plugin; the slow backend sleeps SLOW_S per call."""
    monkeypatch.syspath_prepend(str(TESTS / "plugins"))
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "fault_plugin")
    monkeypatch.setenv("FAULT_SLOW_S", str(SLOW_S))


def _run(tmp_path, name, executor, cases=CASES, energy=False):
    store = results.RunStore(tmp_path / name)
    store.create({"run_id": name})
    return Runner(store, FAST, timeout_s=60, device="cpu", executor=executor, energy=energy).run(cases)


def _overlaps(timeline):
    spans = sorted(timeline, key=lambda t: t[2])
    return sum(1 for a, b in itertools.pairwise(spans) if b[2] < a[3])


def test_fake_devices_run_in_parallel_and_agree_with_inprocess(tmp_path, fault_process, monkeypatch):
    import fault_plugin

    reg = Registry()
    reg.load_object("fault_plugin", fault_plugin)
    inproc = InProcessExecutor(reg)  # one case at a time, this process
    ref = _run(tmp_path, "inprocess", inproc)
    # Each worker's first slow case waits for another worker's: on a loaded machine one worker can otherwise start so
    # late that the other has run every case by then, and nothing overlaps (failed so in CI once).
    (tmp_path / "meet").mkdir()
    monkeypatch.setenv("FAULT_MEET_DIR", str(tmp_path / "meet"))
    # three fake devices: cpu0 alone on board b0, cpu1 and cpu2 sharing board b1 (never at once: energy is on)
    local = LocalExecutor(parse_devices("cpu0@b0,cpu1@b1,cpu2@b1", "cpu"))
    parallel = _run(tmp_path, "local", local, energy=True)

    def outcome(records):
        return {r["case_id"]: r["status"] for r in records}

    assert outcome(ref) == outcome(parallel) == {c.case_id: EXPECTED[c.backend] for c in CASES}
    workers = {r["worker"] for r in parallel}
    assert "cpu0" in workers and workers & {"cpu1", "cpu2"} and workers <= {"cpu0", "cpu1", "cpu2"}
    assert all(r["host"] and r["executor"] == "local" and r["device_index"] == r["worker"] for r in parallel)
    assert all("cpu" not in r["case_id"].split("|")[2] for r in parallel)  # the device is not in the case identity
    assert _overlaps(local.timeline) > 0 and _overlaps(inproc.timeline) == 0
    assert _overlaps([t for t in local.timeline if t[0] in ("cpu1", "cpu2")]) == 0  # the board rule held
    # Parallelism is proven by the overlap of recorded start/end times above, never by a wall-time speed-up: a loaded
    # CI machine makes any clock comparison flaky (issue 15, item 9).


def _drive(queue, slots, seconds=0.02):
    """Threads playing workers: each takes cases for its slot, 'runs' one, reports it; returns (slot, start, end)."""
    spans, lock = [], threading.Lock()

    def worker(slot):
        while (case := queue.take(slot)) is not None:
            t0 = time.monotonic()
            time.sleep(seconds)
            with lock:
                spans.append((slot, t0, time.monotonic()))
            queue.finish(slot, case, {"status": "ok"})

    threads = [threading.Thread(target=worker, args=(s,)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return spans


def _max_concurrency(spans, key):
    events = sorted([(t0, 1, key(s)) for s, t0, _ in spans] + [(t1, -1, key(s)) for s, _, t1 in spans])
    running, peak = {}, 0
    for _, delta, k in events:
        running[k] = running.get(k, 0) + delta
        peak = max(peak, running[k])
    return peak


@pytest.mark.parametrize("energy", [True, False])
def test_scheduler_rule_with_fake_devices(energy):
    # two labels on one GPU (never together), a second GPU on the first one's board, a GPU alone on its board
    slots = parse_devices("a@b0,a@b0,c@b0,d@b1", "cpu")
    cases = [Case("op", "x", {"i": i}, "fp32", "cpu", 0) for i in range(24)]
    spans = _drive(CaseQueue(cases, retries=0, energy=energy), slots)
    assert len(spans) == 24
    assert _max_concurrency(spans, lambda s: s.gpu) == 1  # timing cases never share a GPU
    board_peak = _max_concurrency(spans, lambda s: s.board)
    assert board_peak == (1 if energy else 2)  # a and c share board b0
    assert _max_concurrency(spans, lambda s: "all") >= 2  # different boards still run at the same time


def test_crashed_case_is_requeued_up_to_retries():
    case = Case("op", "x", {}, "fp32", "cpu", 0)
    slot = parse_devices("cpu0", "cpu")[0]
    queue = CaseQueue([case], retries=2, energy=False)
    outcomes = []
    for status in ("crash", "crash", "crash"):
        assert queue.take(slot) == case
        record = {"status": status, "error": f"worker died {len(outcomes)}"}
        outcomes.append(queue.finish(slot, case, record))
    assert outcomes == [False, False, True] and queue.take(slot) is None
    assert record["attempts"] == 3 and record["earlier_errors"] == ["worker died 0", "worker died 1"]
    ok_queue = CaseQueue([case], retries=2, energy=False)
    ok_queue.take(slot)
    assert ok_queue.finish(slot, case, {"status": "error"})  # errors are not retried


def test_devices_and_executor_options():
    slots = parse_devices("cpu0, cpu1@x", "cpu")
    assert [(s.label, s.device, s.board) for s in slots] == [("cpu0", "cpu", "cpu0"), ("cpu1", "cpu", "x")]
    assert dict(slots[0].env)["OMP_NUM_THREADS"].isdigit()
    assert len(parse_devices("all", "cpu")) >= 1
    assert parse_devices(None, "cpu")[0].label == "cpu"
    with pytest.raises(UsageError, match="not a GPU"):
        parse_devices("cpu0", "cuda")
    with pytest.raises(UsageError, match="--device cuda"):
        parse_devices("0", "cuda:1")
    with pytest.raises(UsageError, match="--executor ray"):
        make_executor("local", ray_address="127.0.0.1:6379")
    with pytest.raises(UsageError, match="inprocess"):
        make_executor("inprocess", devices="cpu0,cpu1")
    with pytest.raises(UsageError, match="assigns GPUs itself"):
        make_executor("ray", device="cuda:1")
    with pytest.raises(UsageError, match="retries"):
        make_executor("local", retries=-1)
    assert make_executor("local", devices="cpu0,cpu1").slots_count() == 2


def test_a_gpu_named_twice_is_refused(monkeypatch):
    monkeypatch.setattr("spark_bench.executors.base._visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr("spark_bench.executors.base._nvml_board", lambda index: None)
    assert [s.label for s in parse_devices("0,1", "cuda")] == ["cuda:0", "cuda:1"]
    with pytest.raises(UsageError, match="names GPU 0 more than once"):
        parse_devices("0,1,0@b", "cuda")


def test_dry_run_estimates_from_stored_results(tmp_path, monkeypatch, fault_process):
    import fault_plugin
    from click.testing import CliRunner

    from spark_bench import cli

    registry_module = importlib.import_module("spark_bench.registry")  # the module (the package exports a function)

    reg = Registry()
    reg.load_object("fault_plugin", fault_plugin)
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    monkeypatch.chdir(tmp_path)  # results/ is relative to the working directory
    stored = tmp_path / "results" / "old"
    stored.mkdir(parents=True)
    exact = Case("fault.scale", "good", {"rows": 3, "cols": 5}, "fp32", "cpu", 0).case_id
    lines = [{"case_id": exact, "op": "fault.scale", "backend": "good", "device": "cpu", "status": "ok",
              "duration_s": d} for d in (1.0, 3.0, 2.0)]
    lines.append({"case_id": "other", "op": "fault.scale", "backend": "slow", "device": "cpu", "status": "ok",
                  "duration_s": 7.0})
    (stored / "results.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")
    args = ["run", "--op", "fault.scale", "--backend", "good", "--backend", "slow", "--backend", "raises",
            "--backend", "unavailable", "--device", "cpu", "--quick", "--devices", "cpu0,cpu1", "--dry-run"]
    result = CliRunner().invoke(cli.main, args)
    out = result.output
    assert result.exit_code == 0, out
    assert "fault.scale good rows=3 cols=5 fp32  ~2.00s (case)" in out
    assert "fault.scale good rows=17 cols=5 fp32  ~2.00s (op+backend)" in out
    assert "fault.scale slow rows=3 cols=5 fp32  ~7.00s (op+backend)" in out
    assert "fault.scale raises rows=3 cols=5 fp32  ~5.00s (default)" in out
    assert "skipped: needs a device nobody has" in out
    assert out.splitlines()[0].startswith("spark-bench dry run: 8 cases on cpu, 6 to run, 2 skipped, executor ")
    # 2 + 2 + 7 + 7 + 5 + 5 = 28 s of case time, 14 s on two workers
    assert "estimate: 28.0s of case time" in out and "on 2 workers: 14.0s" in out
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["old"]  # nothing ran, no run directory
    listed = [float(line.rsplit("~", 1)[1].split("s")[0]) for line in out.splitlines()
              if line.startswith("  fault.scale") and "~" in line]
    fits = sum(sum(listed[:i + 1]) / 2 <= 8 for i in range(len(listed)))  # the cases ending within 8 s on 2 workers
    budgeted = CliRunner().invoke(cli.main, [*args, "--budget", "8s"]).output
    assert 0 < fits < 6 and f"--budget 8.0s: about {fits} of 6 cases fit by these estimates" in budgeted
    # the run itself says the same estimate in its first line: 2 + 2 s for the good backend's two cases
    result = CliRunner().invoke(cli.main, ["run", "--op", "fault.scale", "--backend", "good", "--backend",
                                           "unavailable", "--device", "cpu", "--quick", "--no-report", "--out",
                                           str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    assert ("4 cases on cpu, 2 to run, 2 skipped (estimate ~4.0s of case time; --dry-run has the breakdown) -> "
            in result.output.splitlines()[0])


def test_estimates_read_only_the_newest_run_directories(tmp_path):
    import os

    from spark_bench.executors.plan import stored_durations

    for age, seconds in ((300, 9.0), (200, 2.0), (100, 3.0)):  # the oldest run says 9 s
        run = tmp_path / f"run{age}"
        run.mkdir()
        path = run / "results.jsonl"
        path.write_text(json.dumps({"case_id": "c", "op": "x", "backend": "b", "device": "cpu", "status": "ok",
                                    "duration_s": seconds}) + "\n")
        os.utime(path, (1e9 - age, 1e9 - age))
    assert sorted(stored_durations(tmp_path)["c"]) == [2.0, 3.0, 9.0]
    assert sorted(stored_durations(tmp_path, newest=2)["c"]) == [2.0, 3.0]


def test_the_plan_ends_with_a_summary_per_op(tmp_path):
    from spark_bench.executors.plan import print_plan

    cases = [Case("x.big", "b", {"n": n}, "fp32", "cpu", 0) for n in range(3)]
    cases += [Case("x.small", "b", {"n": 1}, "fp32", "cpu", 0),
              dataclasses.replace(Case("x.small", "peer", {"n": 1}, "fp32", "cpu", 0), skip="peer not installed")]
    lines: list[str] = []
    print_plan(cases, cases, "local", 1, tmp_path, echo=lines.append)
    at = lines.index("per op:")
    assert lines[at + 1].split() == ["x.big", "3", "to", "run", "0", "skipped", "~15.0s"]  # 5 s a case, no history
    assert lines[at + 2].split() == ["x.small", "1", "to", "run", "1", "skipped", "~5.0s"]
    assert lines[at + 3].startswith("estimate: 20.0s of case time")


def test_the_first_line_estimate_says_what_it_guessed():
    """On a machine without stored durations (a fresh GPU box) a flat 5 s per case would announce hours of sweep:
    the run's first line says it has nothing to estimate from; mixed, it counts the guessed cases."""
    from collections import Counter

    from spark_bench.session import estimate_note

    assert estimate_note({"a": 5.0, "b": 5.0}, Counter(default=2)) == \
        " (no stored durations for these cases to estimate from: the ETA learns as they run)"
    assert estimate_note({"a": 5.0, "b": 70.0}, Counter(default=1, case=1)) == \
        " (estimate ~1m 15s of case time, 1 of them guessed at 5s each; --dry-run has the breakdown)"
    assert estimate_note({"a": 2.0, "b": 0.0}, Counter(reference=1, skipped=1)) == \
        " (estimate ~2.0s of case time; --dry-run has the breakdown)"
    assert estimate_note({"b": 0.0}, Counter(skipped=1)) == ""


def test_a_workers_pipe_closed_by_two_threads_at_once_is_closed_once():
    """SIGTERM ends the sweep on the main thread while a slot's thread cleans up its worker: both close the pipe. A
    Connection's close is not atomic, so the second os.close got EBADF (a traceback instead of exit 143)."""
    import multiprocessing as mp

    from spark_bench.executors.worker_process import Worker

    worker = Worker.__new__(Worker)  # the pipe and its lock only: no process
    worker.conn, _other = mp.Pipe()
    worker._close_lock = threading.Lock()
    real_close, closes, errors = worker.conn._close, [], []

    def slow_close():  # hold the window between "handle is open" and "handle = None" open
        closes.append(worker.conn.fileno())
        time.sleep(0.2)
        real_close()

    worker.conn._close = slow_close

    def close():
        try:
            worker._close()
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(closes) == 1 and worker.conn.closed


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_worker_starts_for_a_bare_device_name(tmp_path, device):
    """`--device cuda` (no index) is what a GPU run's workers get. torch.cuda.set_device(torch.device("cuda")) raises
    ValueError before touching CUDA, so every worker died at start-up on the first H200 run (2026-12-05): on this CPU
    machine the same worker (interpreting, no CUDA) must start, and its start-up must leave no error in its log."""
    from spark_bench.executors.worker_process import Worker

    worker = Worker(device, tmp_path)
    try:
        worker.wait_ready()
    finally:
        worker.stop()
    log = worker.log_path.read_text() if worker.log_path.exists() else ""
    assert "Traceback" not in log


def test_use_device_passes_torchs_own_argument_check(monkeypatch):
    """Only `cuda:N` selects a device, with an index torch accepts; `cuda` and `cpu` leave the current one."""
    from torch._utils import _get_device_index

    from spark_bench.devices import use_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    for device in ("cuda", "cpu", "cuda:1"):
        use_device(device)
    assert chosen == [1]


def test_a_start_the_sweeps_end_killed_is_no_failure_and_starts_no_other(tmp_path, monkeypatch):
    """Ctrl-C kills a worker while it starts: that is the sweep ending, not a start-up failure to retry (a new worker
    would be spawned after shut()) or to count toward 'workers cannot start'."""
    from spark_bench.executors import local
    from spark_bench.executors.base import RunContext, Slot
    from spark_bench.executors.worker_process import WorkerStartError

    made = []

    class DyingWorker:
        def __init__(self, *args):
            made.append(self)
            self.log_path = tmp_path / "worker.log"

        def wait_ready(self, timeout, notice):
            slot.stopping = True  # the interrupt arrives while it starts
            raise WorkerStartError("worker died during start-up (killed by SIGKILL)")

        def kill(self):
            pass

    monkeypatch.setattr(local, "Worker", DyingWorker)
    slot = local.WorkerSlot(Slot("cpu", "cpu"), RunContext("cpu", TimingConfig(), 60.0), tmp_path)
    with pytest.raises(RuntimeError, match="the sweep is stopping"):
        slot._worker()
    assert len(made) == 1 and slot.start_failures == []


def test_pending_past_its_deadline_finishes_the_points_begun_and_starts_none():
    from spark_bench.executors.base import Pending
    from spark_bench.sweep import Case

    cases = [Case(op="o", backend=b, params={"n": n}, dtype="fp32", device="cpu", seed=0)
             for n in (1, 2) for b in ("x", "y")]
    pending = Pending(cases, deadline=time.monotonic() + 3600)
    first = pending.next("w1")
    assert first.params == {"n": 1} and pending
    pending.deadline = time.monotonic() - 1  # the budget runs out mid-point
    assert pending.next("w2") is None  # no new point for another worker
    rest = pending.next("w1")
    assert rest.params == {"n": 1} and rest.backend != first.backend  # the point begun finishes
    assert pending.next("w1") is None and not pending  # and then nothing: point n=2 is left
    assert [c.params for c in pending.groups[0]] == [{"n": 2}, {"n": 2}]
    pending.put_back([rest])  # a retry of the begun point (its worker crashed): still run after the deadline
    assert pending and pending.next("w2") is rest and pending.next("w2") is None and not pending


def test_a_budgeted_run_takes_the_ops_points_in_turn():
    from spark_bench.executors.plan import interleave_ops
    from spark_bench.sweep import Case

    def point(op, n):
        return [Case(op=op, backend=b, params={"n": n}, dtype="fp32", device="cpu", seed=0) for b in ("x", "y")]

    cases = [*point("a", 1), *point("a", 2), *point("a", 3), *point("b", 1)]
    order = [(c.op, c.params["n"], c.backend) for c in interleave_ops(cases)]
    assert order == [("a", 1, "x"), ("a", 1, "y"), ("b", 1, "x"), ("b", 1, "y"), ("a", 2, "x"), ("a", 2, "y"),
                     ("a", 3, "x"), ("a", 3, "y")]
