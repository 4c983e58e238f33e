"""Local worker processes: crash isolation, per-phase timeouts, and one worker per device in parallel.

Each case runs in a spawned worker process (spark_bench/worker.py). An exception becomes `error` (or `oom`), a
segfault/abort/kill `crash` (with the signal and the tail of the worker's stderr, which holds faulthandler's stack),
a phase that outlives the timeout `timeout` (the worker is killed); the worker is then replaced and the sweep goes on.
With several slots (`--devices 0,1` or labels on CPU) one thread per slot drives its worker; results come back to the
calling thread, which alone reports them; a slot whose workers cannot start is retired with a warning and the others
take its cases (the run stops when none can start any). The Ray executor reuses `WorkerSlot` inside its actors.
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spark_bench.executors.base import CaseQueue, Executor, RunContext, Sink, Slot, failed_record, parse_devices, stamp
from spark_bench.executors.worker_process import (
    Worker,
    WorkersCannotStart,
    WorkerStartError,
    log_size,
    log_tail,
    signal_name,
    startup_timeout,
)
from spark_bench.sweep import Case

PhaseFn = Callable[[Case, str], None]
GIVE_UP_AFTER_STARTS = 2  # starts in a row that fail before the run stops (WorkerSlot._worker)


class WorkerSlot:
    """Runs cases one at a time in a (re)spawned worker pinned to one slot; every outcome becomes a record."""

    def __init__(self, slot: Slot, ctx: RunContext, log_dir: Path, early: Worker | None = None) -> None:
        self.slot, self.ctx, self.log_dir = slot, ctx, log_dir
        self.worker: Worker | None = None
        self.early = early  # started by LocalExecutor.prestart, adopted as this slot's first worker
        self.started = 0.0
        self.last_case: str | None = None  # the case the current worker process ran last
        self.stopping = False  # the sweep is ending (interrupted): no worker is started any more
        self.start_failures: list[str] = []  # start-ups that failed before this case's worker started (its record)
        self.startup_timeout = startup_timeout()  # read here, on the run's thread: a bad value is a usage error

    def _waiting(self, waited: float) -> None:
        """A start-up taking long is said on stderr (the progress display and CI logs would otherwise be silent)."""
        print(f"spark-bench: waiting for the worker on {self.slot.label} to start ({waited:.0f} s of "
              f"{self.startup_timeout:g} s; its log: {self.worker.log_path if self.worker else '?'})",
              file=sys.stderr, flush=True)

    def _worker(self) -> Worker:
        """This slot's worker, started when it has none alive. A worker that dies (or hangs) before it is ready is
        tried again at once: a start-up failure is never a case's (none was sent to it yet), so it is charged to none;
        when GIVE_UP_AFTER_STARTS starts in a row fail, the environment is broken and the run stops
        (WorkersCannotStart: one line from the worker's log)."""
        if self.stopping:  # e.g. the crash confirmation of the case whose worker the interrupt just killed
            raise RuntimeError("the sweep is stopping")
        if self.worker is not None and self.worker.process.is_alive():
            return self.worker
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, GIVE_UP_AFTER_STARTS + 1):
            early, self.early = self.early, None
            self.worker = early or Worker(self.slot.device, self.log_dir, dict(self.slot.env), self.slot.label)
            self.last_case = None
            try:
                self.worker.wait_ready(self.startup_timeout, self._waiting)
            except WorkerStartError as exc:
                log = self.worker.log_path
                self.retire()
                if self.stopping:  # killed by the sweep's end (Ctrl-C, SIGTERM): no failure, and no new worker
                    raise RuntimeError("the sweep is stopping") from None
                self.start_failures.append(str(exc).splitlines()[0])
                if attempt == GIVE_UP_AFTER_STARTS:
                    raise WorkersCannotStart.after(self.slot.label, exc, log) from None
                continue
            if early is not None:
                self.worker.move_log(self.log_dir, self.startup_timeout)
            return self.worker
        raise AssertionError("unreachable")

    def shut(self) -> None:
        """The end of the sweep: kill the workers and start none again."""
        self.stopping = True
        self.retire()

    def retire(self) -> None:
        for worker in (self.worker, self.early):
            if worker is not None:
                worker.kill()
        self.worker = self.early = None

    def close(self) -> None:
        if self.early is not None:
            self.early.kill()
            self.early = None
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def run_case(self, case: Case, on_phase: PhaseFn = lambda case, phase: None) -> dict[str, Any]:
        try:
            worker = self._worker()
        except RuntimeError as exc:  # the sweep is stopping, or a prestarted worker could not move its log
            return stamp(self._startup_crash(case, exc), self.slot)
        previous = self.last_case
        self.started = time.monotonic()  # after the worker is up: the timeline shows case time, not startup
        record = self._run_case(worker, case, on_phase)
        if record["status"] == "crash" and self.ctx.confirm_crashes:
            record = self._confirm(case, record, previous, on_phase)
        if self.start_failures:  # not this case's: said with it (a flaky environment shows), charged to none
            record["worker_start_failures"], self.start_failures = self.start_failures, []
        self.last_case = case.case_id if self.worker is not None else None
        return stamp(record, self.slot)

    def _startup_crash(self, case: Case, exc: RuntimeError) -> dict[str, Any]:
        """The record of a case that got no worker (the sweep stopping), with the worker's log tail if any."""
        self.retire()
        first, *tail = str(exc).splitlines() or [""]
        return failed_record(case, "crash", first[:500], phase="startup", worker_log_tail="\n".join(tail))

    def _confirm(self, case: Case, first: dict[str, Any], previous: str | None, on_phase: PhaseFn) -> dict[str, Any]:
        """A crash is charged to a case only when it happens again in a fresh worker: an asynchronous fault (a CUDA
        illegal memory access surfaces at the next sync) kills the worker during whatever case runs next. When the
        re-run does not crash, its record stands, keeping the first error, and the case the dead worker ran before is
        named suspect (the runner marks it in the journal)."""
        on_phase(case, "confirm-crash")
        try:
            again = self._run_case(self._worker(), case, on_phase)
        except RuntimeError as exc:  # the sweep is stopping: the crash stands unconfirmed (the case never re-ran)
            return {**first, "earlier_errors": [*first.get("earlier_errors", []), str(exc).splitlines()[0]]}
        first_error = {"status": first["status"], "error": first["error"], "phase": first.get("phase"),
                       "worker_log_tail": first.get("worker_log_tail")}
        again["earlier_errors"] = [*again.get("earlier_errors", []), first["error"]]
        if again["status"] == "crash":
            again["crash_confirmed"] = True  # it crashed again in a fresh worker: this case's own crash
            return again
        again["crash_not_reproduced"] = first_error
        if previous is not None:
            again["suspect_previous"] = previous
        return again

    def _run_case(self, worker: Worker, case: Case, on_phase: PhaseFn) -> dict[str, Any]:
        message = ("case", case.to_dict(), self.ctx.cfg.to_dict(), self.ctx.n_sets)
        log_start = log_size(worker.log_path)  # this case's part of the worker's log (stdout and stderr), taken first
        try:
            worker.conn.send(message)
        except (OSError, ValueError):  # the idle worker died since the last case: start another
            self.retire()
            worker = self._worker()
            log_start = 0
            worker.conn.send(message)
        timeout_s = self.ctx.timeout_s
        phase, deadline = "queued", time.monotonic() + timeout_s
        while True:
            msg = worker.receive(deadline - time.monotonic())
            if msg is None:
                self.retire()
                return failed_record(case, "timeout", f"no progress for {timeout_s:g} s in phase '{phase}' "
                                     "(worker killed)", phase=phase)
            if msg[0] == "phase":
                phase, deadline = msg[2], time.monotonic() + timeout_s
                on_phase(case, phase)
            elif msg[0] == "result":
                record = msg[1]
                if record.pop("restart_worker", False):
                    self.retire()
                return record
            elif msg[0] == "dead":
                code = msg[1]
                cause = f"killed by {signal_name(code)}" if code is not None and code < 0 else f"exit code {code}"
                hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if code == -9 else ""
                log = log_tail(worker.log_path, start=log_start)
                self.retire()
                return failed_record(case, "crash", f"worker {cause}{hint} in phase '{phase}'", phase=phase,
                                     worker_log_tail=log)


PARK_PREFIX = "spark-bench-workers-"  # + the parent's pid: where prestarted workers log until a run adopts them


def _remove_stale_parks() -> None:
    """The temporary log directories of runs killed before their exit handlers ran (kill -9, SIGTERM): their pid is
    gone. (A pid reused since then keeps its directory until a later run.)"""
    for path in Path(tempfile.gettempdir()).glob(f"{PARK_PREFIX}*-*"):
        try:
            os.kill(int(path.name[len(PARK_PREFIX):].split("-")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not ours, or alive and another user's


class LocalExecutor(Executor):
    """Spawned worker processes on this machine, one per slot (default: one on the run's device)."""

    name = "local"

    def __init__(self, slots: Sequence[Slot] | None = None, retries: int = 0) -> None:
        self.slots, self.retries = (list(slots) if slots else None), retries
        self.timeline: list[tuple[str, str, float, float]] = []  # (slot, case_id, start, end), monotonic seconds
        self.early: dict[str, Worker] = {}  # slot label -> a worker started by prestart()
        self.early_device: str | None = None

    def describe(self) -> str:
        slots = self.slots or []
        return f"local, {len(slots) or 1} worker(s)" + (f" ({', '.join(s.label for s in slots)})" if slots else "")

    def slots_count(self) -> int:
        return len(self.slots or [None])

    def prestart(self, device: str) -> None:
        """Spawn the workers now, logging into a temporary directory until the run adopts them: a worker's start-up
        (torch, every plugin) then overlaps the parent's own. Workers nobody adopts end with this process."""
        if self.early:
            return
        _remove_stale_parks()
        park = Path(tempfile.mkdtemp(prefix=f"{PARK_PREFIX}{os.getpid()}-"))
        atexit.register(shutil.rmtree, park, True)
        self.early_device = device
        for slot in self.slots or parse_devices(None, device):
            self.early[slot.label] = Worker(slot.device, park, dict(slot.env), slot.label)
        atexit.register(lambda: [w.kill() for w in self.early.values()])

    def own_pids(self) -> set[int]:
        return {w.process.pid for w in self.early.values() if getattr(w.process, "pid", None)}

    def run(self, cases: Sequence[Case], ctx: RunContext, sink: Sink) -> None:
        slots = self.slots or parse_devices(None, ctx.device)
        log_dir = ctx.log_dir or Path("logs")
        work = CaseQueue(cases, self.retries, ctx.energy, ctx.deadline)
        work.working = len(slots)
        events: queue.Queue = queue.Queue()
        early, self.early = self.early, {}
        adopt = self.early_device == ctx.device
        runners = [WorkerSlot(slot, ctx, log_dir, early.pop(slot.label, None) if adopt else None) for slot in slots]
        for worker in early.values():  # not this run's (another device or slot): killed, not left idle
            worker.kill()

        def drive(runner: WorkerSlot) -> None:
            try:
                while (case := work.take(runner.slot)) is not None:
                    events.put(("phase", case, "start"))
                    try:
                        record = runner.run_case(case, lambda c, p: events.put(("phase", c, p)))
                    except WorkersCannotStart as exc:  # this slot is broken: the others take its cases, if any
                        if not work.retire_slot(runner.slot, case):
                            raise
                        events.put(("warning", None, f"{exc}; its cases go to the other slots"))
                        return
                    self.timeline.append((runner.slot.label, case.case_id, runner.started, time.monotonic()))
                    if work.finish(runner.slot, case, record):
                        events.put(("result", case, record))
            except BaseException as exc:  # noqa: BLE001 - a worker that cannot start ends the sweep, reported
                events.put(("error", None, exc))
            finally:
                runner.close()
                events.put(("done", None, None))

        threads = [threading.Thread(target=drive, args=(r,), name=f"slot-{r.slot.label}", daemon=True)
                   for r in runners]
        for t in threads:
            t.start()
        alive, error = len(threads), None
        try:
            while alive:
                kind, case, payload = events.get()
                if kind == "phase":
                    sink.phase(case, payload)
                elif kind == "result":
                    sink.result(case, payload)
                elif kind == "error":
                    error = error or payload
                    work.close()
                elif kind == "warning":
                    print(f"warning: {payload}", file=sys.stderr, flush=True)
                else:
                    alive -= 1
        finally:
            work.close()
            for r in runners:
                r.shut()  # unblocks a thread waiting on its worker; no-op after a clean close
            for t in threads:
                t.join(timeout=30)
        if error is not None:
            raise error
