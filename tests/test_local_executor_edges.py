"""spark_bench/executors/local.py and base.py edges a mutation audit found untested, driven by scripted fake workers
(no process is spawned, no wall time is measured): the per-phase timeout, how a dead worker is labelled, when a
crash is re-run, a worker that asks to be replaced or died idle, a retried case reported once, and --devices."""

import os
import types

import pytest

from spark_bench.executors import local
from spark_bench.executors.base import CaseQueue, RunContext, Sink, Slot, parse_devices, stamp
from spark_bench.sweep import Case, UsageError
from spark_bench.timing import TimingConfig

CASE = Case("op", "x", {"n": 1}, "fp32", "cpu", 0)


class Clock:
    """A fake time.monotonic for local.py: it moves only when a fake worker says a message took time."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class FakeWorker:
    """A worker whose answers to each case are scripted: SCRIPTS holds one list of (seconds it takes, message) per
    worker started, in start order. receive() returns None (a timeout) when the next message would come too late."""

    scripts: list = []
    made: list = []
    clock = Clock()

    def __init__(self, device, log_dir, env=None, label=""):
        self.log_path = log_dir / f"fake-{len(FakeWorker.made)}.log"
        self.script = list(FakeWorker.scripts.pop(0)) if FakeWorker.scripts else []
        self.sent, self.killed, self.send_fails = [], False, False
        self.process = types.SimpleNamespace(is_alive=lambda: not self.killed, pid=None)
        self.conn = types.SimpleNamespace(send=self._send)
        FakeWorker.made.append(self)

    def _send(self, message):
        if self.send_fails:
            raise OSError("broken pipe")
        self.sent.append(message)

    def wait_ready(self, timeout, notice):
        pass

    def move_log(self, log_dir, timeout):
        self.moved_to = log_dir

    def receive(self, timeout):
        seconds, msg = self.script.pop(0)
        if seconds > timeout:
            FakeWorker.clock.now += max(timeout, 0.0)
            self.script.insert(0, (seconds - timeout, msg))
            return None
        FakeWorker.clock.now += seconds
        return msg

    def kill(self):
        self.killed = True

    stop = kill


@pytest.fixture
def fake_workers(monkeypatch):
    FakeWorker.scripts, FakeWorker.made, FakeWorker.clock = [], [], Clock()
    monkeypatch.setattr(local, "Worker", FakeWorker)
    monkeypatch.setattr(local, "time", types.SimpleNamespace(monotonic=FakeWorker.clock.monotonic))
    return FakeWorker


def _slot(tmp_path, timeout_s=10.0, confirm=True):
    ctx = RunContext("cpu", TimingConfig(), timeout_s, confirm_crashes=confirm)
    return local.WorkerSlot(Slot("cpu0", "cpu", index="cpu0"), ctx, tmp_path)


def _ok(case=CASE):
    return ("result", {**case.record_fields(), "status": "ok", "error": None})


def test_each_phase_message_restarts_the_phase_timeout(tmp_path, fake_workers):
    """The timeout is per phase: a case whose phases each take 6 s of a 10 s timeout is not a timeout, though the
    case takes 24 s; a phase that takes 11 s is, named by its phase."""
    fake_workers.scripts = [[(6, ("phase", CASE.case_id, "inputs")), (6, ("phase", CASE.case_id, "check")),
                             (6, ("phase", CASE.case_id, "timing")), (6, _ok())],
                            [(6, ("phase", CASE.case_id, "check")), (11, _ok())]]
    slot = _slot(tmp_path)
    phases = []
    rec = slot.run_case(CASE, lambda c, p: phases.append(p))
    assert rec["status"] == "ok" and phases == ["inputs", "check", "timing"]
    slot.retire()
    late = slot.run_case(CASE)
    assert late["status"] == "timeout" and late["phase"] == "check" and "no progress for 10 s" in late["error"]
    assert fake_workers.made[1].killed and slot.worker is None  # a hung worker is killed, never reused


@pytest.mark.parametrize("code, cause, oom_hint", [(-9, "killed by SIGKILL", True), (-11, "killed by SIGSEGV", False),
                                                   (3, "exit code 3", False)])
def test_a_dead_worker_is_a_crash_named_by_its_exit(tmp_path, fake_workers, code, cause, oom_hint):
    fake_workers.scripts = [[(1, ("phase", CASE.case_id, "setup")), (1, ("dead", code))]]
    rec = _slot(tmp_path, confirm=False).run_case(CASE)
    assert rec["status"] == "crash" and rec["phase"] == "setup"
    assert rec["error"].startswith(f"worker {cause}") and rec["error"].endswith("in phase 'setup'")
    assert ("OOM killer" in rec["error"]) is oom_hint


def test_without_confirm_crashes_a_crash_is_recorded_as_it_came(tmp_path, fake_workers):
    """--no-confirm-crashes: no second worker re-runs the case."""
    fake_workers.scripts = [[(1, ("dead", -11))], [(1, _ok())]]
    rec = _slot(tmp_path, confirm=False).run_case(CASE)
    assert rec["status"] == "crash" and len(fake_workers.made) == 1
    assert "crash_confirmed" not in rec and "crash_not_reproduced" not in rec


def test_a_crash_is_rerun_in_a_fresh_worker_and_blames_the_case_before(tmp_path, fake_workers):
    before = Case("op", "y", {"n": 1}, "fp32", "cpu", 0)
    fake_workers.scripts = [[(1, _ok(before)), (1, ("dead", -11))], [(1, _ok())]]
    slot = _slot(tmp_path)
    assert slot.run_case(before)["status"] == "ok"
    rec = slot.run_case(CASE)
    assert rec["status"] == "ok" and rec["suspect_previous"] == before.case_id
    assert rec["crash_not_reproduced"]["status"] == "crash" and "SIGSEGV" in rec["earlier_errors"][0]
    assert len(fake_workers.made) == 2 and fake_workers.made[0].killed


def test_a_worker_that_asks_to_restart_is_replaced_before_the_next_case(tmp_path, fake_workers):
    """A CUDA error poisons the worker's context: the record says so (`restart_worker`, never journalled) and the
    next case gets a fresh worker."""
    fake_workers.scripts = [[(1, ("result", {**CASE.record_fields(), "status": "error", "error": "CUDA error",
                                             "restart_worker": True}))], [(1, _ok())]]
    slot = _slot(tmp_path)
    rec = slot.run_case(CASE)
    assert rec["status"] == "error" and "restart_worker" not in rec
    assert fake_workers.made[0].killed and slot.worker is None
    assert slot.run_case(CASE)["status"] == "ok" and len(fake_workers.made) == 2


def test_a_worker_that_died_idle_is_replaced_and_the_case_runs(tmp_path, fake_workers):
    fake_workers.scripts = [[(1, _ok())], [(1, _ok())]]
    slot = _slot(tmp_path)
    assert slot.run_case(CASE)["status"] == "ok"
    fake_workers.made[0].send_fails = True  # its pipe broke since the last case
    rec = slot.run_case(CASE)
    assert rec["status"] == "ok"
    assert len(fake_workers.made) == 2 and fake_workers.made[1].sent and fake_workers.made[0].killed


def test_a_retried_crash_reaches_the_journal_once(tmp_path, fake_workers):
    """--retries 1: the crashed attempt goes back in the queue and only the final record is reported."""
    fake_workers.scripts = [[(1, ("dead", -11))], [(1, _ok())]]
    results = []
    ctx = RunContext("cpu", TimingConfig(), 10.0, log_dir=tmp_path, confirm_crashes=False)
    local.LocalExecutor(retries=1).run([CASE], ctx, Sink(phase=lambda c, p: None,
                                                         result=lambda c, r: results.append(r)))
    assert [r["status"] for r in results] == ["ok"]
    assert results[0]["attempts"] == 2 and "SIGSEGV" in results[0]["earlier_errors"][0]


def test_a_timeout_is_final_at_once_even_with_retries():
    """Only a crash (a dead worker, a lost node) is retried: a timeout would only hang again for as long."""
    slot = parse_devices("cpu0", "cpu")[0]
    queue = CaseQueue([CASE], retries=2, energy=False)
    assert queue.take(slot) == CASE
    assert queue.finish(slot, CASE, {"status": "timeout", "error": "no progress"}) is True
    assert queue.take(slot) is None


def test_a_record_is_stamped_with_the_physical_device_index():
    slot = Slot("cuda:0", "cuda", (("CUDA_VISIBLE_DEVICES", "3"),), gpu="3", board="gpu3", index=3)
    rec = stamp({}, slot, host="h")
    assert rec == {"host": "h", "device_index": 3, "worker": "cuda:0"}


def test_cpu_slots_share_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    slots = parse_devices("a,b,c", "cpu")
    assert [dict(s.env)["OMP_NUM_THREADS"] for s in slots] == ["2", "2", "2"]
    assert dict(parse_devices("a", "cpu")[0].env)["OMP_NUM_THREADS"] == "8"


def test_a_gpu_index_past_the_last_is_refused(monkeypatch):
    monkeypatch.setattr("spark_bench.executors.base._visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr("spark_bench.executors.base._nvml_board", lambda index: None)
    assert [s.index for s in parse_devices("1", "cuda")] == [1]
    with pytest.raises(UsageError, match="'2' is not a GPU here"):
        parse_devices("2", "cuda")


def test_spawning_a_worker_leaves_the_parents_environment_as_it_was(tmp_path, monkeypatch):
    """A slot's worker gets its CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS through the environment at spawn time; the
    parent's own must be restored (set, changed or absent) or every later worker and the parent inherit it."""
    from spark_bench.executors.worker_process import Worker

    monkeypatch.setenv("SPARK_BENCH_EDGE_SET", "parent")
    monkeypatch.delenv("SPARK_BENCH_EDGE_NEW", raising=False)
    worker = Worker("cpu", tmp_path, {"SPARK_BENCH_EDGE_SET": "child", "SPARK_BENCH_EDGE_NEW": "child"}, "cpu0")
    try:
        assert os.environ["SPARK_BENCH_EDGE_SET"] == "parent" and "SPARK_BENCH_EDGE_NEW" not in os.environ
    finally:
        worker.kill()


def test_a_crash_keeps_the_last_lines_of_its_own_part_of_the_log(tmp_path):
    """faulthandler's stack is at the end of what the case wrote: the tail, never the head, and never an earlier
    case's lines."""
    from spark_bench.executors.worker_process import log_size, log_tail

    log = tmp_path / "worker.log"
    log.write_text("earlier case\n")
    start = log_size(log)
    with open(log, "a") as f:
        f.write("".join(f"line {i}\n" for i in range(40)) + "Fatal Python error: Segmentation fault\n")
    tail = log_tail(log, start=start).splitlines()
    assert len(tail) == 25 and tail[-1] == "Fatal Python error: Segmentation fault" and tail[0] == "line 16"
    short = tmp_path / "short.log"
    short.write_text("earlier case\nthis case\n")
    assert log_tail(short, start=len("earlier case\n")) == "this case" and "earlier case" in log_tail(short)


@pytest.mark.parametrize("prestarted_on", ["cpu", "cuda"])
def test_a_prestarted_worker_is_adopted_only_by_a_run_on_its_device(tmp_path, fake_workers, prestarted_on):
    """Workers prestarted for another device are not this run's: they are killed, not left running idle (holding a
    device context) until the process exits; one prestarted for this device runs the cases."""
    fake_workers.scripts = [[(1, _ok())], [(1, _ok())]]
    executor = local.LocalExecutor()
    executor.early, executor.early_device = {"cpu": FakeWorker("cpu", tmp_path)}, prestarted_on
    prestarted = fake_workers.made[0]
    results = []
    ctx = RunContext("cpu", TimingConfig(), 10.0, log_dir=tmp_path / "logs")
    executor.run([CASE], ctx, Sink(phase=lambda c, p: None, result=lambda c, r: results.append(r)))
    assert [r["status"] for r in results] == ["ok"] and prestarted.killed and executor.early == {}
    if prestarted_on == "cpu":
        assert len(fake_workers.made) == 1 and prestarted.sent and prestarted.moved_to == tmp_path / "logs"
    else:
        assert len(fake_workers.made) == 2 and not prestarted.sent and fake_workers.made[1].sent


def test_a_crash_the_sweeps_end_left_unconfirmed_says_why(tmp_path, fake_workers):
    """Ctrl-C arrives as the crashed case is about to re-run: the crash is recorded as it came, unconfirmed, with the
    reason it was not re-run; no new worker is started."""
    fake_workers.scripts = [[(1, ("dead", -11))]]
    slot = _slot(tmp_path)

    def on_phase(case, phase):
        if phase == "confirm-crash":
            slot.stopping = True  # the interrupt

    rec = slot.run_case(CASE, on_phase)
    assert rec["status"] == "crash" and "SIGSEGV" in rec["error"] and "crash_confirmed" not in rec
    assert rec["earlier_errors"] == ["the sweep is stopping"] and len(fake_workers.made) == 1


def test_cases_put_back_run_before_any_new_point():
    """A crashed case's retry, or the calls queued behind a lost worker, run next: before any new parameter point."""
    from spark_bench.executors.base import Pending

    cases = [Case("op", b, {"n": n}, "fp32", "cpu", 0) for n in (1, 2, 3) for b in ("x", "y")]
    pending = Pending(cases)
    first = pending.next("w1")
    pending.release("w1", first=[first])  # w1's worker is lost before its point ended
    assert [pending.next("w2"), pending.next("w2")] == cases[:2]
    retry = pending.next("w2")
    assert retry.params == {"n": 2}
    pending.put_back([retry])  # it crashed: retried before point 3
    assert pending.next("w3") is retry
    assert pending.next("w2").params == {"n": 2} and pending.next("w3").params == {"n": 3}


def test_an_error_in_one_slot_stops_the_others_taking_cases(tmp_path, fake_workers, monkeypatch):
    """A slot that fails (not a start-up failure: a bug) ends the sweep: the other slots finish the case they run
    and take no other; the error is raised."""
    import threading

    closed = threading.Event()
    real_close = local.CaseQueue.close

    def close(self):
        real_close(self)
        closed.set()

    class Broken(FakeWorker):
        def wait_ready(self, timeout, notice):
            raise ValueError("a bug in the slot")

    class Waits(FakeWorker):
        def receive(self, timeout):
            closed.wait(timeout=10)  # its case ends once the sweep has been stopped (a safety timeout only)
            return super().receive(timeout)

    monkeypatch.setattr(local.CaseQueue, "close", close)
    monkeypatch.setattr(local, "Worker", lambda device, log_dir, env, label: (Broken if label == "cpu0" else Waits)(
        device, log_dir, env, label))
    fake_workers.scripts = [[(1, ("result", {"status": "ok"}))] * 6] * 2  # whichever slot's worker starts first
    cases = [Case("op", "x", {"n": n}, "fp32", "cpu", 0) for n in range(6)]
    results, raised = [], []
    ctx = RunContext("cpu", TimingConfig(), 10.0, log_dir=tmp_path)

    def run():
        try:
            local.LocalExecutor(parse_devices("cpu0,cpu1", "cpu")).run(
                cases, ctx, Sink(phase=lambda c, p: None, result=lambda c, r: results.append(r)))
        except ValueError as exc:
            raised.append(exc)

    sweep = threading.Thread(target=run, daemon=True)
    sweep.start()
    sweep.join(timeout=60)  # not stopped, the other slot waits forever for the broken slot's case to end
    assert not sweep.is_alive(), "the sweep hung"
    assert [str(e) for e in raised] == ["a bug in the slot"] and len(results) <= 1
