"""The sweep runner: crash-isolated worker processes, per-phase timeouts, a journal that loses nothing.

Each case runs in a spawned worker process (spark_bench/worker.py). An exception becomes `error` (or `oom`), a
segfault/abort/kill `crash` (with the signal and the tail of the worker's stderr, which holds faulthandler's stack),
a phase that outlives the timeout `timeout` (the worker is killed); the worker is then replaced and the sweep goes on.
Every result is appended to results.jsonl and fsynced as the case ends, so a killed sweep keeps everything measured,
and `resume` skips the cases already in the journal.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from spark_bench import results
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig

STARTUP_TIMEOUT_S = 300.0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Worker:
    """One spawned worker process and its pipe."""

    def __init__(self, device: str, log_dir: Path) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
        self.conn, child = ctx.Pipe()
        self.log_path = log_dir / f"worker-{time.time_ns()}.log"
        from spark_bench import worker

        self.process = ctx.Process(target=worker.main, args=(child, device, str(self.log_path)), daemon=True)
        self.process.start()
        child.close()
        self.pid: int | None = None

    def wait_ready(self) -> None:
        msg = self.receive(STARTUP_TIMEOUT_S)
        if msg is None or msg[0] != "ready":
            detail = _tail(self.log_path)
            self.kill()
            raise RuntimeError(f"worker failed to start: {msg!r}\n{detail}")
        self.pid = msg[1]

    def receive(self, timeout: float) -> tuple | None:
        """The next message, None on timeout, ('dead', exitcode) when the process died."""
        ready = wait([self.conn, self.process.sentinel], timeout=max(timeout, 0.0))
        if not ready:
            return None
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        self.process.join(timeout=5)
        return ("dead", self.process.exitcode)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()


def failed_record(case: Case, status: str, error: str, **extra: Any) -> dict[str, Any]:
    return {"case_id": case.case_id, "op": case.op, "backend": case.backend, "params": case.params,
            "dtype": case.dtype, "device": case.device, "status": status, "error": error, "labels": [],
            "check": None, "timing": None, "cost": None, "gbps": None, "tflops": None, "stages": None,
            "extra": {}, "power": None, "roofline": None, "started": results.now(), **extra}


ProgressFn = Callable[[Case, str], None]


class Runner:
    def __init__(self, store: results.RunStore, cfg: TimingConfig, *, timeout_s: float, device: str,
                 n_sets: int = 4, on_phase: ProgressFn | None = None,
                 on_result: Callable[[Case, dict[str, Any]], None] | None = None,
                 decorate: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.store, self.cfg, self.timeout_s, self.device, self.n_sets = store, cfg, timeout_s, device, n_sets
        self.on_phase = on_phase or (lambda case, phase: None)
        self.on_result = on_result or (lambda case, record: None)
        self.decorate = decorate or (lambda record: None)
        self.worker: Worker | None = None
        self.log_dir = store.path / "logs"

    def _worker(self) -> Worker:
        if self.worker is None or not self.worker.process.is_alive():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.worker = Worker(self.device, self.log_dir)
            self.worker.wait_ready()
        return self.worker

    def _retire(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    def run_case(self, case: Case) -> dict[str, Any]:
        if case.skip:
            return failed_record(case, "skipped", case.skip)
        worker = self._worker()
        worker.conn.send(("case", case.to_dict(), self.cfg.to_dict(), self.n_sets))
        phase, deadline = "queued", time.monotonic() + self.timeout_s
        while True:
            msg = worker.receive(deadline - time.monotonic())
            if msg is None:
                self._retire()
                return failed_record(case, "timeout", f"no progress for {self.timeout_s:g} s in phase '{phase}' "
                                     "(worker killed)", phase=phase)
            if msg[0] == "phase":
                phase, deadline = msg[2], time.monotonic() + self.timeout_s
                self.on_phase(case, phase)
            elif msg[0] == "result":
                record = msg[1]
                if record.pop("restart_worker", False):
                    self._retire()
                return record
            elif msg[0] == "dead":
                code = msg[1]
                cause = f"killed by {_signal_name(code)}" if code is not None and code < 0 else f"exit code {code}"
                hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if code == -9 else ""
                log = _tail(worker.log_path)
                self._retire()
                return failed_record(case, "crash", f"worker {cause}{hint} in phase '{phase}'", phase=phase,
                                     worker_log_tail=log)

    def run(self, cases: Sequence[Case]) -> list[dict[str, Any]]:
        """Run every case not yet in the journal; returns the records of this invocation."""
        done = {r["case_id"] for r in self.store.read_results()}
        records = []
        try:
            for case in cases:
                if case.case_id in done:
                    continue
                self.on_phase(case, "start")
                record = self.run_case(case)
                self.decorate(record)
                self.store.append(record)
                done.add(case.case_id)
                records.append(record)
                self.on_result(case, record)
        finally:
            if self.worker is not None:
                self.worker.stop()
                self.worker = None
        return records


def pending(store: results.RunStore, cases: Sequence[Case]) -> list[Case]:
    done = {r["case_id"] for r in store.read_results()}
    return [c for c in cases if c.case_id not in done]


def default_timeout(device: str) -> float:
    """Per-phase timeout: generous on CPU, where Triton runs interpreted."""
    return float(os.environ.get("SPARK_BENCH_TIMEOUT", 600 if device.startswith("cpu") else 300))
