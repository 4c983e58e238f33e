"""In-process execution, for debugging: CaseRunner in this very process (breakpoints and pdb work).

No isolation: a segfault ends the sweep (the journal keeps every finished case; `--resume` goes on), and there is no
per-phase timeout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from spark_bench import triton_env
from spark_bench.devices import use_device
from spark_bench.executors.base import Executor, Pending, RunContext, Sink, Slot, stamp
from spark_bench.sweep import Case


class InProcessExecutor(Executor):
    name = "inprocess"

    def __init__(self, registry=None) -> None:
        self.registry = registry  # default: the process-wide registry
        self.timeline: list[tuple[str, str, float, float]] = []

    def run(self, cases: Sequence[Case], ctx: RunContext, sink: Sink) -> None:
        from spark_bench.worker import CaseRunner

        triton_env.configure(ctx.device)
        use_device(ctx.device)
        index = ctx.device.partition(":")[2]
        slot = Slot("inprocess", ctx.device, index=int(index) if index.isdigit() else None)
        by_id = {c.case_id: c for c in cases}
        runner = CaseRunner(self.registry, phase=lambda case_id, phase: sink.phase(by_id[case_id], phase))
        pending = Pending(cases, ctx.deadline)  # a point at a time, as the local executor; none new past the deadline
        while (case := pending.next(slot.label)) is not None:
            sink.phase(case, "start")
            t0 = time.monotonic()
            record = stamp(runner.run(case, ctx.cfg, ctx.n_sets), slot)
            record.pop("restart_worker", None)  # nothing to restart here: later cases may fail the same way
            self.timeline.append((slot.label, case.case_id, t0, time.monotonic()))
            sink.result(case, record)
