"""What every executor shares: the run context, the result sink, worker slots and the power-safe case queue.

An executor runs cases somewhere (this process, local worker processes, Ray actors) and hands each finished record to
the sink in the parent's thread; the parent (spark_bench.runner.Runner) is the only writer of results.jsonl.

Scheduling rule (CaseQueue): a slot is one worker pinned to one device. Two cases never run at the same time on one
GPU (every case is timed, and timing cases never share a GPU); when energy is measured, two cases never run at the
same time on one board (a power domain: GPUs of a multi-GPU board, MIG slices of one GPU, or labels given as
`name@board`). The backends of one parameter point run back to back on one worker (Pending). A case whose worker
died (`crash`) is re-queued up to `retries` times before it is recorded.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spark_bench import results
from spark_bench.sweep import Case, UsageError
from spark_bench.timing import TimingConfig

RETRYABLE = ("crash",)  # a dead worker or a lost node; errors, mismatches and timeouts are deterministic enough


@dataclasses.dataclass
class RunContext:
    """What a run fixes for every executor: the device type of the cases, timing, per-phase timeout."""

    device: str
    cfg: TimingConfig
    timeout_s: float
    n_sets: int = 4
    log_dir: Path | None = None
    energy: bool = False  # power-safe scheduling: one running case per board
    confirm_crashes: bool = True  # re-run a crashed case in a fresh worker before recording the crash
    deadline: float | None = None  # time.monotonic() after which no new parameter point starts (`run --budget`)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "cfg": self.cfg.to_dict(), "timeout_s": self.timeout_s, "n_sets": self.n_sets,
                "energy": self.energy, "confirm_crashes": self.confirm_crashes}

    @classmethod
    def from_dict(cls, d: dict[str, Any], log_dir: Path | None = None) -> RunContext:
        return cls(d["device"], TimingConfig(**d["cfg"]), d["timeout_s"], d["n_sets"], log_dir, d["energy"],
                   d.get("confirm_crashes", True))


@dataclasses.dataclass
class Sink:
    """Where an executor reports: `phase(case, phase)` for progress, `result(case, record)` once per finished case."""

    phase: Callable[[Case, str], None]
    result: Callable[[Case, dict[str, Any]], None]


class Executor(abc.ABC):
    name = "executor"

    @abc.abstractmethod
    def run(self, cases: Sequence[Case], ctx: RunContext, sink: Sink) -> None:
        """Run every case (none is skipped: the runner records those) and report each record to the sink."""

    def describe(self) -> str:
        return self.name

    def slots_count(self) -> int | None:
        """How many cases run at once (for the dry-run estimate); None when only known at run time."""
        return 1

    def prestart(self, device: str) -> None:
        """Start what the run will need while the caller is still preparing it (local: the worker processes, whose
        start-up then overlaps the parent's plugin discovery). Optional; nothing by default."""
        return None

    def own_pids(self) -> set[int]:
        """The PIDs of the processes this executor started on this machine (prestarted workers): the run's own,
        not "other processes" on the GPU in the preflight."""
        return set()


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker: its label, the device string the worker opens, its environment, and its GPU and board keys."""

    label: str
    device: str
    env: tuple[tuple[str, str], ...] = ()
    gpu: str = ""
    board: str = ""
    index: int | str | None = None  # the physical device index (or UUID) recorded with each result


def failed_record(case: Case, status: str, error: str, **extra: Any) -> dict[str, Any]:
    return {**case.record_fields(), "status": status, "error": error, "labels": [],
            "check": None, "timing": None, "cost": None, "gbps": None, "tflops": None, "stages": None,
            "extra": {}, "power": None, "roofline": None, "started": results.now(), **extra}


def stamp(record: dict[str, Any], slot: Slot, host: str | None = None) -> dict[str, Any]:
    """Where a result was measured: host, physical device index, worker label. Never part of the case identity."""
    record["host"] = host or socket.gethostname()
    record["device_index"] = slot.index
    record["worker"] = slot.label
    return record


def _nvml_board(index: int) -> str | None:
    """The board of a GPU that shares one with others (multi-GPU boards), from NVML; None when alone or unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if pynvml.nvmlDeviceGetMultiGpuBoard(handle):
                return f"board{pynvml.nvmlDeviceGetBoardId(handle)}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return None


def _visible_gpus() -> list[str]:
    import torch

    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    count = torch.cuda.device_count()
    return visible[:count] if visible else [str(i) for i in range(count)]


def parse_devices(text: str | None, device: str) -> list[Slot]:
    """`--devices` -> worker slots. None: one worker on `device`. On CUDA: `all` or GPU indices (as CUDA numbers them
    here), each worker pinned with CUDA_VISIBLE_DEVICES; on CPU: any labels (`cpu0,cpu1`), `all` = one per core.
    `name@board` puts devices in one power domain."""
    kind = device.partition(":")[0]
    if text is None:
        index = device.partition(":")[2]
        return [Slot(device, device, gpu=device, board=device, index=int(index) if index.isdigit() else None)]
    if kind == "cuda" and device != "cuda":
        raise UsageError(f"--devices picks the GPUs itself; use --device cuda, not {device!r}")
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError("--devices needs a list, e.g. --devices 0,1 or --devices all")
    if kind == "cpu":
        if items == ["all"]:
            items = [f"cpu{i}" for i in range(os.cpu_count() or 1)]
        threads = str(max(1, (os.cpu_count() or 1) // len(items)))
        slots = []
        for item in items:
            label, _, board = item.partition("@")
            slots.append(Slot(label, "cpu", (("OMP_NUM_THREADS", threads),), gpu=label, board=board or label,
                              index=label))
        return slots
    visible = _visible_gpus()
    if items == ["all"]:
        items = [str(i) for i in range(len(visible))]
    twice = sorted(label for label, n in collections.Counter(i.partition("@")[0] for i in items).items() if n > 1)
    if twice:  # the scheduler never times two cases on one GPU, so a second worker there only costs a context
        raise UsageError(f"--devices names GPU {', '.join(twice)} more than once; give each GPU once")
    slots = []
    for item in items:
        label, _, board = item.partition("@")
        if not (label.isdigit() and int(label) < len(visible)):
            raise UsageError(f"--devices: {label!r} is not a GPU here; this machine has 0..{len(visible) - 1} or all")
        physical = visible[int(label)]
        index: int | str = int(physical) if physical.isdigit() else physical
        board = board or (isinstance(index, int) and _nvml_board(index)) or f"gpu{physical}"
        slots.append(Slot(f"cuda:{label}", "cuda", (("CUDA_VISIBLE_DEVICES", physical),), gpu=physical,
                          board=board, index=index))
    return slots


class Attempts:
    """Counts the runs of each case and decides whether a failed one runs again."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.count: collections.Counter[str] = collections.Counter()
        self.errors: dict[str, list[str]] = collections.defaultdict(list)

    def settle(self, case: Case, record: dict[str, Any]) -> bool:
        """True when the record is final; False when the case should run again."""
        self.count[case.case_id] += 1
        n = self.count[case.case_id]
        if record.get("status") in RETRYABLE and n <= self.retries:
            self.errors[case.case_id].append(str(record.get("error") or record.get("status")))
            return False
        if n > 1:
            record["attempts"] = n
            record["earlier_errors"] = self.errors.pop(case.case_id, [])
        return True


class Pending:
    """Cases waiting to run, handed out a parameter point at a time: the backends of one point run back to back on
    one worker (which reuses the point's inputs and reference output) and are compared on the same GPU."""

    def __init__(self, cases: Sequence[Case], deadline: float | None = None) -> None:
        groups: dict[str, collections.deque[Case]] = {}
        for case in cases:
            groups.setdefault(case.group, collections.deque()).append(case)
        self.groups = collections.deque(groups.values())
        self.own: dict[Any, collections.deque[Case]] = {}  # worker key -> the rest of the point it is running
        self.begun: collections.deque[collections.deque[Case]] = collections.deque()  # put back: run first, always
        self.deadline = deadline  # past it no new point starts; the points begun finish (their backends compare)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def __bool__(self) -> bool:
        return (bool(self.groups) and not self.expired()) or bool(self.begun) or any(self.own.values())

    def next(self, key: Any) -> Case | None:
        """The next case for worker `key`: the rest of its point first, else cases put back (of points begun), else
        a new point (none past the deadline); None when none of these."""
        own = self.own.get(key)
        if not own:
            if self.begun:
                own = self.own[key] = self.begun.popleft()
            elif not self.groups or self.expired():
                return None
            else:
                own = self.own[key] = self.groups.popleft()
        return own.popleft()

    def put_back(self, cases: Sequence[Case]) -> None:
        """Cases to run next, on any worker, deadline or not: a retry, the calls queued behind a lost worker, the
        case a retired slot took (all of points begun)."""
        if cases:
            self.begun.append(collections.deque(cases))

    def release(self, key: Any, first: Sequence[Case] = ()) -> None:
        """Worker `key` is gone: `first` (its calls that never ran), then the rest of its point, go back to the
        front of the queue."""
        self.put_back([*first, *self.own.pop(key, ())])


class CaseQueue:
    """Hands cases to slot threads under the scheduling rule; thread-safe."""

    def __init__(self, cases: Sequence[Case], retries: int, energy: bool, deadline: float | None = None) -> None:
        self.pending = Pending(cases, deadline)
        self.attempts = Attempts(retries)
        self.energy = energy
        self.busy_gpus: collections.Counter[str] = collections.Counter()
        self.busy_boards: collections.Counter[str] = collections.Counter()
        self.running = 0
        self.closed = False
        self.working = 0  # slots still able to start workers (set by the executor; retire_slot counts them down)
        self.cond = threading.Condition()

    def _free(self, slot: Slot) -> bool:
        return not self.busy_gpus[slot.gpu] and not (self.energy and self.busy_boards[slot.board])

    def take(self, slot: Slot) -> Case | None:
        """The next case for this slot (blocks while its GPU or board is busy); None when the sweep is done."""
        with self.cond:
            while True:
                if self.closed or (not self.pending and not self.running):
                    return None
                case = self.pending.next(id(slot)) if self._free(slot) else None
                if case is not None:
                    self.running += 1
                    self.busy_gpus[slot.gpu] += 1
                    self.busy_boards[slot.board] += 1
                    return case
                self.cond.wait()

    def finish(self, slot: Slot, case: Case, record: dict[str, Any]) -> bool:
        """Release the slot; True when the record is final, False when the case went back in the queue."""
        with self.cond:
            self.running -= 1
            self.busy_gpus[slot.gpu] -= 1
            self.busy_boards[slot.board] -= 1
            final = self.attempts.settle(case, record)
            if not final:
                self.pending.put_back([case])
            self.cond.notify_all()
            return final

    def retire_slot(self, slot: Slot, case: Case) -> bool:
        """`slot` cannot start workers: `case` (taken, not run) and the rest of its point go back to the front of the
        queue for the other slots. False, changing nothing, when it was the last slot working."""
        with self.cond:
            if self.working <= 1:
                return False
            self.working -= 1
            self.running -= 1
            self.busy_gpus[slot.gpu] -= 1
            self.busy_boards[slot.board] -= 1
            self.pending.release(id(slot), first=[case])
            self.cond.notify_all()
            return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
