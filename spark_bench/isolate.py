"""Plugin code the parent needs, run isolated: backend probes from third-party plugins run in a spawned process with
a timeout, so a probe that hangs, segfaults or floods stdout costs its own backend (recorded as the reason it is
unavailable) and never `spark-bench run` or `list` itself.

Probes that spark-bench ships (spark_bench.probes and the built-in plugins, all under the `spark_bench.` namespace)
are trusted and run in this process; every other probe goes to the isolated process, one at a time, so a failure is
charged to the probe that caused it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import Any

PROBE_TIMEOUT_S = float(os.environ.get("SPARK_BENCH_PROBE_TIMEOUT", "60"))
# The resource tracker (one process that all spawned children share, started by the first spawn) warns at exit of
# each semaphore or shared-memory segment a process registered and never released, then releases it. A child killed
# mid-case (Ctrl-C, SIGTERM, a timeout) leaves those of its libraries (torch.compile's pools): the warning after a
# run's one-line summary said nothing the user can act on. The tracker takes the -W options of the process that
# starts it, so every spawn site goes through spawn_context().
QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def spawn_context() -> Any:
    """multiprocessing's spawn context, with the resource tracker (and the children) started without its leak
    warnings."""
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)
    return mp.get_context("spawn")


STARTUP_S = 300.0  # the isolated prober's start-up (imports) on a loaded machine, as a worker's
Key = tuple[str, str]  # (op, backend)


def trusted(fn: Any) -> bool:
    """A probe written by spark-bench itself (its helpers, its built-in plugins)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    module = getattr(fn, "__module__", None) or ""
    return module == "spark_bench" or module.startswith("spark_bench.")


def _child(conn, device: str, keys: list[Key]) -> None:
    """The isolated prober: loads the plugins like a worker does and answers probe by probe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # a probe's chatter goes nowhere (10 MB of it must not reach the user's terminal)
    os.dup2(devnull, 2)
    from spark_bench import triton_env

    triton_env.configure(device)
    from spark_bench.registry import registry

    reg = registry()
    for op_name, backend_name in keys:
        conn.send(("probing", (op_name, backend_name)))
        try:
            reason = reg.ops[op_name].backends[backend_name].unavailable(device)
        except Exception as exc:  # noqa: BLE001 - the plugin did not load here as it did in the parent
            reason = f"probe failed: {type(exc).__name__}: {exc}"
        conn.send(("done", (op_name, backend_name), None if reason is None else str(reason)[:500]))
    conn.send(("end",))


def _signal_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def probe_isolated(keys: Iterable[Key], device: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[Key, str | None]:
    """Each (op, backend)'s probe result, run in a spawned process; a probe that hangs longer than timeout_s or
    kills the process gets that as its reason, and the others are probed in a fresh process."""
    left = list(dict.fromkeys(keys))
    answers: dict[Key, str | None] = {}
    ctx = spawn_context()
    while left:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, device, left), daemon=True)
        proc.start()
        child.close()
        current: Key | None = None
        deadline = time.monotonic() + STARTUP_S  # the first answer waits for torch and the plugins to import
        failure: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = f"probe timed out after {timeout_s:g} s"
                break
            if parent.poll(min(remaining, 0.25)):
                try:
                    msg = parent.recv()
                except (EOFError, OSError):
                    proc.join(timeout=5)
                    failure = f"probe crashed ({_signal_text(proc.exitcode)})"
                    break
                if msg[0] == "probing":
                    current, deadline = tuple(msg[1]), time.monotonic() + timeout_s
                elif msg[0] == "done":
                    answers[tuple(msg[1])] = msg[2]
                    left.remove(tuple(msg[1]))
                    current = None
                else:
                    break
            elif proc.exitcode is not None and not parent.poll(0):
                failure = f"probe crashed ({_signal_text(proc.exitcode)})"
                break
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
        parent.close()
        if failure is not None:
            if current is None:  # the plugins did not even load in the isolated process
                for key in left:
                    answers[key] = f"probe failed: the isolated prober died before probing ({failure})"
                break
            answers[current] = failure
            left.remove(current)
    return answers


def probe_backends(backends: Iterable[tuple[str, Any]], device: str, isolate: bool = True) -> dict[Key, str | None]:
    """Why each (op name, Backend) cannot run on `device` (None: it can): trusted probes here, the rest isolated
    (isolate=False: all here, for registries built in this process that a spawned prober cannot rebuild)."""
    answers: dict[Key, str | None] = {}
    isolated: list[Key] = []
    for op_name, backend in backends:
        key = (op_name, backend.name)
        if backend.probe is None and not callable(backend.labels):
            answers[key] = None
        elif backend.probe is None or trusted(backend.probe) or not isolate:  # (a labels callable: it may raise)
            answers[key] = backend.unavailable(device)
        else:
            isolated.append(key)
    if isolated:
        sys.stdout.flush()
        answers.update(probe_isolated(isolated, device))
    return answers
