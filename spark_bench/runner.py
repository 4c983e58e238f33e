"""The sweep runner: hands the cases not yet in the journal to an executor and journals each result as it comes back.

Executors (spark_bench/executors/): `local` (default: crash-isolated worker processes with per-phase timeouts, one per
device with `--devices`), `inprocess` (debugging, no isolation) and `ray` (a Ray cluster). Whichever runs the cases,
this process alone writes results.jsonl: every record is appended and fsynced as its case ends, so a killed sweep
keeps everything measured, and `resume` skips the cases already in the journal. Each record names the host, device
index and worker it ran on; the case identity (case_id) never includes them, so resuming on other devices does not
duplicate a case.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from spark_bench import results
from spark_bench.executors.base import Executor, RunContext, Sink, failed_record
from spark_bench.executors.local import LocalExecutor
from spark_bench.executors.plan import interleave_ops
from spark_bench.executors.worker_process import STARTUP_TIMEOUT_S, Worker, env_seconds, startup_timeout
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig
from spark_bench.worker import ENERGY_ENV

__all__ = ["STARTUP_TIMEOUT_S", "Runner", "Worker", "check_timeout_variables", "default_timeout", "failed_record",
           "pending", "startup_timeout"]

ProgressFn = Callable[[Case, str], None]


class Runner:
    def __init__(self, store: results.RunStore, cfg: TimingConfig, *, timeout_s: float, device: str,
                 n_sets: int = 4, on_phase: ProgressFn | None = None,
                 on_result: Callable[[Case, dict[str, Any]], None] | None = None,
                 decorate: Callable[[dict[str, Any]], None] | None = None,
                 executor: Executor | None = None, energy: bool | None = None, confirm_crashes: bool = True,
                 deadline: float | None = None) -> None:
        self.store, self.cfg, self.timeout_s, self.device, self.n_sets = store, cfg, timeout_s, device, n_sets
        self.on_phase = on_phase or (lambda case, phase: None)
        self.on_result = on_result or (lambda case, record: None)
        self.decorate = decorate or (lambda record: None)
        self.executor = executor or LocalExecutor()
        if energy is None:  # energy is measured on CUDA unless `--no-energy` (SPARK_BENCH_ENERGY=0)
            energy = device.startswith("cuda") and os.environ.get(ENERGY_ENV, "1") != "0"
        self.energy = energy  # power-safe scheduling: one running case per board while energy is measured
        self.confirm_crashes = confirm_crashes
        self.deadline = deadline  # time.monotonic() after which no new parameter point starts (`run --budget`)

    def run(self, cases: Sequence[Case]) -> list[dict[str, Any]]:
        """Run every case not yet in the journal; returns the records of this invocation (in finishing order)."""
        todo = pending(self.store, cases)
        records: list[dict[str, Any]] = []
        if todo and self.store.run_file.is_file():  # a budget-stopped run goes on: its count of cases left is stale
            run = self.store.read_run()
            if run.pop("stopped_by_budget", None) is not None:
                self.store.write_run(run)

        def journal(case: Case, record: dict[str, Any]) -> None:
            record["executor"] = self.executor.name
            self.decorate(record)
            self.store.append(record)
            suspect = record.pop("suspect_previous", None)
            if suspect is not None:  # the worker died just after it: an asynchronous fault is likely its own
                record["suspect_previous"] = suspect
                self.store.amend(suspect, suspect=(
                    f"the worker died during the next case ({case.case_id}), which then passed in a fresh worker: "
                    "this case may have left an asynchronous fault (e.g. an illegal memory access surfacing at the "
                    "next sync)"), label="suspect")
            records.append(record)
            self.on_result(case, record)

        for case in todo:
            if case.skip:
                self.on_phase(case, "start")
                journal(case, failed_record(case, "skipped", case.skip))
        runnable = [c for c in todo if not c.skip]
        if self.deadline is not None:  # a budget: every op's first points before any op's later ones
            runnable = interleave_ops(runnable)
        if runnable:
            ctx = RunContext(self.device, self.cfg, self.timeout_s, self.n_sets, self.store.path / "logs", self.energy,
                             self.confirm_crashes, self.deadline)
            self.executor.run(runnable, ctx, Sink(phase=self.on_phase, result=journal))
        return records


def pending(store: results.RunStore, cases: Sequence[Case]) -> list[Case]:
    """The cases not in the journal yet, each once, in sweep order."""
    done = {r["case_id"] for r in store.read_results()}
    todo = []
    for case in cases:
        if case.case_id not in done:
            done.add(case.case_id)
            todo.append(case)
    return todo


def check_timeout_variables() -> None:
    """Read SPARK_BENCH_TIMEOUT and SPARK_BENCH_STARTUP_TIMEOUT now: a bad value is one UsageError line before a
    command writes anything (a worker or Ray actor reading it later would journal every case as a crash)."""
    default_timeout("cpu")
    startup_timeout()


def default_timeout(device: str) -> float:
    """Per-phase timeout: generous on CPU, where Triton runs interpreted."""
    return env_seconds("SPARK_BENCH_TIMEOUT", 600 if device.startswith("cpu") else 300)


def budget_left_note(run: dict[str, Any], store: results.RunStore, cases: Sequence[Case], budget_s: float | None,
                     ) -> str | None:
    """After `run --budget`: records in run.json how many cases the budget left (`stopped_by_budget`; Runner.run
    drops it when a later invocation starts on them) and returns the line that says so, or None when none is left.
    Without a budget it reads nothing."""
    if not budget_s:
        return None
    left = [c for c in pending(store, cases) if not c.skip]
    if not left:
        return None
    run["stopped_by_budget"] = {"budget_s": budget_s, "cases_left": len(left)}
    return (f"budget of {budget_s:g} s reached: {len(cases) - len(left)} of {len(cases)} cases are in {store.path} "
            f"(the points begun were finished); `spark-bench run --resume {results.shell_path(store.path)}` runs "
            f"the other {len(left)}")
