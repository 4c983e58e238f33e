"""Ray: a sweep spread over the GPUs of a Ray cluster (the optional extra: pip install 'spark-bench[ray]').

One actor per GPU of the cluster (num_gpus=1; num_cpus=1 each on CPU), each case one actor call. The actor wraps the
local executor's WorkerSlot: the case runs in a worker process the actor spawns on its node, pinned to the actor's GPU
(Ray sets CUDA_VISIBLE_DEVICES), so a segfault, abort or hang costs one case (`crash` / `timeout`, with the worker's
stderr tail) and the actor lives on. An actor that dies itself (node lost, actor killed) turns the case it was running
into `crash`, or runs it again (`--retries`), requeues the calls queued behind it, and is replaced. Records stream back
to the driver as they finish; the driver alone writes the journal, so `--resume` works as it does locally.
Each actor holds `depth` calls (one running, the next waiting) so it never idles waiting for the driver.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spark_bench.executors.base import Attempts, Executor, Pending, RunContext, Sink, Slot, failed_record
from spark_bench.sweep import Case, UsageError

ENV_PREFIXES = ("SPARK_BENCH_", "TRITON_")  # passed to the actors (plugins to load, the Triton interpreter)


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'spark-bench[ray]' (or pip install ray)") from None
    return ray


class CaseActor:
    """Runs inside a Ray actor process: one WorkerSlot on the actor's GPU (or CPU)."""

    def __init__(self, ctx: dict[str, Any], label: str) -> None:
        import ray

        from spark_bench.executors.local import WorkerSlot

        ids = ray.get_gpu_ids()
        index = ids[0] if ids else None
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        device = ctx["device"]
        self.slot = Slot(label, device, gpu=str(index if index is not None else label), index=index)
        self.runner = WorkerSlot(self.slot, RunContext.from_dict(ctx), Path(tempfile.mkdtemp(prefix="spark-bench-")))

    def identity(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "device_index": self.slot.index,
                "worker": self.slot.label}

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        return self.runner.run_case(Case(**case))

    def close(self) -> None:
        self.runner.close()


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, address: str | None = None, retries: int = 0, max_actors: int | None = None, depth: int = 2,
                 env_vars: dict[str, str] | None = None) -> None:
        self.address, self.retries, self.max_actors, self.depth = address, retries, max_actors, depth
        self.env_vars = dict(env_vars or {})
        self.identities: dict[int, Any] = {}  # actor number -> ObjectRef of its identity()
        self.calls: dict[int, Any] = {}  # actor number -> its calls in flight, (ObjectRef, Case), while running

    def describe(self) -> str:
        return f"ray ({self.address or os.environ.get('RAY_ADDRESS') or 'local instance'})"

    def slots_count(self) -> int | None:
        return self.max_actors  # None: one per GPU of the cluster, unknown until it runs

    def actor_info(self) -> dict[int, dict[str, Any]]:
        """Identity (pid, host, device) of every actor started so far that answered."""
        ray = import_ray()
        ready, _ = ray.wait(list(self.identities.values()), num_returns=len(self.identities), timeout=60)
        by_ref = {ref: n for n, ref in self.identities.items()}
        out = {}
        for ref in ready:
            try:
                out[by_ref[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                pass
        return out

    def run(self, cases: Sequence[Case], ctx: RunContext, sink: Sink) -> None:
        if ":" in ctx.device:
            raise UsageError(f"--executor ray assigns GPUs itself: use --device cuda, not {ctx.device!r}")
        ray = import_ray()
        started = not ray.is_initialized()
        if started:
            ray.init(address=self.address, include_dashboard=False, ignore_reinit_error=True)
        try:
            _Sweep(ray, self, ctx, sink).run(cases)
        finally:
            if started:
                ray.shutdown()


class _Sweep:
    """The driver loop of one Ray run: feed actors, collect records as they finish, replace dead actors."""

    def __init__(self, ray, executor: RayExecutor, ctx: RunContext, sink: Sink) -> None:
        self.ray, self.ex, self.ctx, self.sink = ray, executor, ctx, sink
        gpu = ctx.device.startswith("cuda")
        kind = "GPU" if gpu else "CPU"
        total = int(ray.cluster_resources().get(kind, 0))
        if total == 0:
            raise UsageError(f"the Ray cluster has no {kind}")
        self.n_actors = min(total, executor.max_actors or total)
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)} | executor.env_vars
        self.options = {"num_gpus": 1 if gpu else 0, "num_cpus": 1, "max_restarts": 0, "max_task_retries": 0,
                        "runtime_env": {"env_vars": env}}
        self.actor_cls = ray.remote(CaseActor)
        self.numbers = itertools.count()
        self.actors: dict[int, Any] = {}
        self.calls: dict[int, collections.deque] = executor.calls  # actor -> (ref, case) deque, in execution order
        self.calls.clear()
        self.owner: dict[Any, int] = {}  # ref -> actor
        self.pending = Pending([])
        self.attempts = Attempts(executor.retries)

    def spawn(self) -> None:
        n = next(self.numbers)
        actor = self.actor_cls.options(**self.options).remote(self.ctx.to_dict(), f"ray-{n}")
        self.actors[n], self.calls[n] = actor, collections.deque()
        self.ex.identities[n] = actor.identity.remote()

    def feed(self) -> None:
        for n, actor in self.actors.items():
            while len(self.calls[n]) < self.ex.depth and (case := self.pending.next(n)) is not None:
                ref = actor.run.remote(case.to_dict())
                self.calls[n].append((ref, case))
                self.owner[ref] = n
                if len(self.calls[n]) == 1:
                    self.sink.phase(case, "start")

    def settle(self, case: Case, record: dict[str, Any]) -> None:
        if self.attempts.settle(case, record):
            self.sink.result(case, record)
        else:
            self.pending.put_back([case])

    def lost(self, n: int, exc: BaseException) -> None:
        """Actor n died: its running case is a crash (or a retry), the calls behind it go back to the queue."""
        calls = self.calls.pop(n)
        actor = self.actors.pop(n)
        for ref, _case in calls:
            self.owner.pop(ref, None)
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        ident = self._identity(n)
        where = f" on {ident['host']}" if ident.get("host") else ""
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        running = calls[0][1]
        record = failed_record(running, "crash", f"Ray actor ray-{n} died{where}: {message}", phase="ray-actor")
        record.update(host=ident.get("host"), device_index=ident.get("device_index"), worker=f"ray-{n}")
        self.pending.release(n, first=[case for _ref, case in list(calls)[1:]])
        self.settle(running, record)
        if self.pending:
            self.spawn()

    def _identity(self, n: int) -> dict[str, Any]:
        ref = self.ex.identities.get(n)
        try:
            return self.ray.get(ref, timeout=0) if ref is not None else {}
        except Exception:  # noqa: BLE001 - the actor died before it answered
            return {}

    def run(self, cases: Sequence[Case]) -> None:
        self.pending = Pending(cases, self.ctx.deadline)
        for _ in range(min(self.n_actors, len(self.pending.groups))):
            self.spawn()
        try:
            while self.pending or self.owner:
                self.feed()
                ready, _ = self.ray.wait(list(self.owner), num_returns=1, timeout=1.0)
                for ref in ready:
                    n = self.owner.pop(ref, None)
                    if n is None:
                        continue  # belonged to an actor already handled as lost
                    try:
                        record = self.ray.get(ref)
                    except self.ray.exceptions.RayTaskError:
                        raise  # the actor is alive but could not run a worker: an environment error, as locally
                    except self.ray.exceptions.RayError as exc:  # actor or node lost
                        self.lost(n, exc)
                        continue
                    entry = next(e for e in self.calls[n] if e[0] == ref)
                    self.calls[n].remove(entry)
                    self.settle(entry[1], record)
                    if self.calls[n]:
                        self.sink.phase(self.calls[n][0][1], "start")
        finally:
            for actor in self.actors.values():
                try:
                    self.ray.kill(actor, no_restart=True)  # its worker process dies with it (PDEATHSIG)
                except Exception:  # noqa: BLE001
                    pass
