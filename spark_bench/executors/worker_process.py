"""One spawned worker process (spark_bench/worker.py) and its pipe, as the local executor's slots see it: start-up,
messages, death noticed from the exit status, the log tail a crash keeps, and the process group killed with it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from pathlib import Path

from spark_bench.isolate import spawn_context

STARTUP_TIMEOUT_S = 300.0  # the default; SPARK_BENCH_STARTUP_TIMEOUT overrides it (startup_timeout)
STARTUP_NOTICE_S = 30.0  # a start-up that takes longer is announced (on stderr) this often
EXIT_POLL_S = 0.25  # how often a waiting parent checks the worker's exit status
_SPAWN_LOCK = threading.Lock()  # the worker's environment is the parent's at spawn time


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name`, else `default`; anything else is a
    UsageError naming the variable (one line, exit code 2 from the CLI)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        from spark_bench.sweep import UsageError

        raise UsageError(f"{name}={raw!r} is not a positive number of seconds")
    return value


def startup_timeout() -> float:
    """How long a worker may take to start (import torch and the plugins, open the device) before it counts as
    hung: SPARK_BENCH_STARTUP_TIMEOUT seconds, else STARTUP_TIMEOUT_S. The run stops after GIVE_UP_AFTER_STARTS
    failed start-ups in a row, so a hung device costs about twice this."""
    return env_seconds("SPARK_BENCH_STARTUP_TIMEOUT", STARTUP_TIMEOUT_S)


class WorkerStartError(RuntimeError):
    """A worker died (or hung) before it was ready; the message's first line says how, the rest is its log's tail."""


class WorkersCannotStart(Exception):
    """A slot's worker failed to start several times in a row: the environment is broken (an import, the device), not
    a case. The sweep stops instead of charging every case a crash; the message is one line (with the log's last
    line, the exception when it raised) and names the log. The CLI prints it, exit code 1."""

    @classmethod
    def after(cls, device: str, error: WorkerStartError, log_path: Path) -> WorkersCannotStart:
        first, *tail = str(error).splitlines()
        cause = next((line.strip() for line in reversed(tail) if line.strip()), "(nothing)")
        return cls(f"workers cannot start on {device}: {first.removeprefix('worker ')}; its log ends: {cause} "
                   f"(log: {log_path})")


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def log_tail(path: Path, lines: int = 25, start: int = 0) -> str:
    """The last lines the worker wrote to its log since byte `start` (where the case began): never another case's."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, start))
            data = f.read()
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Worker:
    """One spawned worker process and its pipe."""

    def __init__(self, device: str, log_dir: Path, env: dict[str, str] | None = None, label: str = "") -> None:
        ctx = spawn_context()  # never fork a process that may hold a CUDA context
        self.conn, child = ctx.Pipe()
        tag = "".join(c if c.isalnum() else "_" for c in label)
        self.log_path = log_dir / f"worker-{tag + '-' if tag else ''}{time.time_ns()}.log"
        from spark_bench import worker

        self.process = ctx.Process(target=worker.main, args=(child, device, str(self.log_path)), daemon=True)
        with _SPAWN_LOCK:
            # spawned with SIGINT blocked, then ignored (worker.main): Ctrl-C is the parent's, which stops the workers;
            # no worker traceback while it imports torch. The resource tracker first: starting it unblocks SIGINT
            resource_tracker.ensure_running()
            saved = {k: os.environ.get(k) for k in env or {}}
            os.environ.update(env or {})
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self.process.start()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C held meanwhile is raised here
        child.close()
        self.pid: int | None = None
        self._close_lock = threading.Lock()

    def _close(self) -> None:
        """Close the pipe once: the sweep's end (SIGTERM, on the main thread) and a slot's own clean-up may race."""
        with self._close_lock:
            if not self.conn.closed:
                self.conn.close()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S,
                   notice: Callable[[float], None] = lambda waited: None) -> None:
        """Wait for the worker's 'ready'; `notice(seconds waited)` is called after min(STARTUP_NOTICE_S, timeout / 2)
        without an answer and every STARTUP_NOTICE_S after that."""
        started = time.monotonic()
        step = min(STARTUP_NOTICE_S, timeout / 2)
        while (msg := self.receive(min(step, timeout - (time.monotonic() - started)))) is None:
            waited = time.monotonic() - started
            if waited >= timeout:
                break
            notice(waited)
            step = STARTUP_NOTICE_S
        if msg is None or msg[0] != "ready":
            detail = log_tail(self.log_path)
            self.kill()
            if msg is None:
                why = f"hung: no answer within {timeout:g} s"
            elif msg[0] == "dead":
                why = (f"killed by {signal_name(msg[1])}" if msg[1] is not None and msg[1] < 0
                       else f"exit code {msg[1]}")
            else:
                why = f"unexpected message {str(msg)[:100]}"
            raise WorkerStartError(f"worker died during start-up ({why})\n{detail}")
        self.pid = msg[1]

    def move_log(self, log_dir: Path, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """A worker started before its run directory existed logs into `log_dir` from now on, what it wrote so far
        included (it copies its log there and acknowledges before any case is sent)."""
        target = log_dir / self.log_path.name
        self.conn.send(("log", str(target)))
        msg = self.receive(timeout)
        if msg is None or msg[0] != "log":
            self.kill()
            raise RuntimeError(f"worker did not move its log to {target} ({msg})\n{log_tail(self.log_path)}")
        self.log_path = target

    def receive(self, timeout: float) -> tuple | None:
        """The next message, None on timeout, ('dead', exitcode) when the process died.

        Death is noticed from the exit status (waitpid), not only from the pipe and sentinel: a process the backend
        forked inherits both and keeps them open after the worker dies, which would turn a crash into a timeout."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            left = deadline - time.monotonic()
            ready = wait([self.conn, self.process.sentinel], timeout=max(0.0, min(left, EXIT_POLL_S)))
            if self.conn in ready or (not ready and self.conn.poll(0)):
                try:
                    return self.conn.recv()
                except (EOFError, OSError):
                    break
            if ready or self.process.exitcode is not None:  # exitcode polls waitpid(WNOHANG)
                if self.conn.poll(0):  # a last message sent before it exited
                    try:
                        return self.conn.recv()
                    except (EOFError, OSError):
                        pass
                break
            if left <= 0:
                return None
        self.process.join(timeout=5)
        return ("dead", self.process.exitcode)

    def _kill_group(self) -> None:
        """End every process the worker's backends started: the worker leads its own process group."""
        pgid = self.process.pid
        if pgid is None:
            return
        try:
            if os.getpgid(pgid) != pgid:
                return  # not (yet, or no longer) the leader of its own group
        except ProcessLookupError:
            pass  # the leader is gone; its group may live on
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self._kill_group()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self._kill_group()
        self._close()

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the worker to leave; kill it (and its process group) if it has not left within grace_s."""
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout=grace_s)
        self.kill()  # if it is still alive; and what its backends started must not outlive the sweep
