"""A hostile test plugin (loaded via $SPARK_BENCH_PLUGINS): backends that defeat a naive harness (issue 15).

Every op computes y = 2 * x like fault_plugin's `fault.scale`. HOSTILE_DIR (a directory) receives the pids of the
processes the backends start, so a test can check that none outlives the sweep.
"""

import ctypes
import os
import secrets
import subprocess
import sys
import time

import torch

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.check import untouched_slots
from spark_bench.inputs import generator, randn


def make_inputs(p, *, device, dtype, seed):
    _fake_sync()
    return {"x": randn((p["rows"], p["cols"]), generator(device, seed), dtype=dtype, device=device)}


def reference(x):
    return 2 * x.double()


def _op(name, rows=(3, 17), **kw):
    kw = {"make_inputs_fn": make_inputs, "reference": reference, **kw}
    return Op(name=name,
              cost=lambda p, dtype: Cost(flops=p["rows"] * p["cols"], bytes=8 * p["rows"] * p["cols"]),
              axes=[Axis("rows", [64], quick=list(rows)), Axis("cols", [64], quick=[5])],
              dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)}, **kw)


def _note_pid(kind, pid):
    folder = os.environ.get("HOSTILE_DIR")
    if folder:
        with open(os.path.join(folder, f"{kind}-{pid}"), "w") as f:
            f.write(str(pid))


# --- item 2: an asynchronous fault that surfaces at the next case's sync (a CUDA illegal memory access) ------------
_POISONED = False


def _fake_sync():
    """What a device sync does after an earlier kernel faulted: the error surfaces now, in whoever syncs."""
    if _POISONED:
        ctypes.string_at(0)


asyncfault = _op("hostile.asyncfault", rows=(3, 5, 7, 9))


@asyncfault.backend("innocent")
def innocent(x):
    _fake_sync()
    return 2 * x


@asyncfault.backend("poisoner")
def poisoner(x):
    """Correct, but leaves the worker poisoned: the next case that syncs (in this process) segfaults."""
    global _POISONED
    _POISONED = True
    return 2 * x


# --- item 3: processes a backend starts ------------------------------------------------------------------------
forks = _op("hostile.forks")


@forks.backend("fork_then_segfault")
def fork_then_segfault(x):
    """Forks a child that keeps the worker's pipe open, then segfaults: a crash, not a timeout."""
    pid = os.fork()
    if pid == 0:
        _note_pid("child", os.getpid())
        time.sleep(3600)
        os._exit(0)
    ctypes.string_at(0)


@forks.backend("leaves_a_sleeper")
def leaves_a_sleeper(x):
    """Correct, but starts a process that would outlive the sweep."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    _note_pid("sleeper", proc.pid)
    return 2 * x


# --- item 5: outputs the value check alone would pass ----------------------------------------------------------
check = _op("hostile.check", rows=(3,))


@check.backend("float64_out")
def float64_out(x):
    return 2 * x.double()


@check.backend("overwrites_input")
def overwrites_input(x):
    """Right answer, but leaves its input doubled: every timed call then runs on different data."""
    x.mul_(2)
    return x.clone()


@check.backend("empty_out")
def empty_out(x):
    return torch.empty(0, x.shape[1], dtype=x.dtype)


@check.backend("fine")
def fine(x):
    return 2 * x


_SCRATCH: dict = {}


@check.backend("stale_scratch")
def stale_scratch(x):
    """Right on its first call only: it accumulates into a cached scratch it never zeroes again."""
    buf = _SCRATCH.setdefault((tuple(x.shape), x.dtype), torch.zeros_like(x))
    buf.add_(2 * x)
    return buf.clone()


@check.backend("jitters")
def jitters(x):
    """Right every time, with other bits each call (as atomics' summation order): each element 0 or 1 ulp up."""
    y = 2 * x
    up = torch.tensor([secrets.randbits(1) for _ in range(y.numel())], dtype=torch.bool).view_as(y)
    return torch.where(up, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


# rotated inputs (a routing per input set, as moe.experts): the redrawn sets have large values
def _large(p, *, device, dtype, seed):
    return {"x": 100.0 + make_inputs(p, device=device, dtype=dtype, seed=seed)["x"]}


rotating = _op("hostile.rotating", rows=(3,), rotate=("x",), redraw=_large)


@rotating.backend("fine")
def rotating_fine(x):
    return 2 * x


@rotating.backend("clips")
def rotating_clips(x):
    """Right on set 0 (values near 0), wrong on the redrawn sets: the timing rotates through all of them."""
    return 2 * x.clamp(max=50.0)


SEEN: list[float] = []  # the input sets `last_wrong` has been called on, in order (a test clears it)


@rotating.backend("last_wrong")
def rotating_last_wrong(x):
    """Right on the first three input sets it is called on, wrong on the fourth: only a check of every set before the
    timing catches it (the timing rotates through all four; the recheck after it takes set 0)."""
    key = float(x.flatten()[0])
    if key not in SEEN:
        SEEN.append(key)
    return 2 * x if SEEN.index(key) < 3 else 3 * x


# an in-place op on a slot pool (kda decode ops): pool[slots] += x, y = 2 * x; the other slots must not change
def _pool_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    rows = p["rows"]
    return {"x": randn((rows, p["cols"]), gen, dtype=dtype, device=device),
            "pool": randn((3 * rows, p["cols"]), gen, dtype=dtype, device=device),
            "slots": torch.randperm(3 * rows, generator=gen, device=device)[:rows]}


def _pool_reference(x, pool, slots):
    pool[slots] += x
    return 2 * x.double()


pool = _op("hostile.pool", rows=(3,), make_inputs_fn=_pool_inputs, reference=_pool_reference,
           outputs=lambda returned, inputs: (returned, inputs["pool"]),
           untouched=untouched_slots("slots", "pool"))


@pool.backend("fine")
def pool_fine(x, pool, slots):
    pool[slots] += x
    return 2 * x


@pool.backend("scribbles")
def pool_scribbles(x, pool, slots):
    """Right slots, right output; and one other slot nudged by one ulp: far below any error-ratio tolerance."""
    pool[slots] += x
    other = next(i for i in range(len(pool)) if i not in set(slots.tolist()))
    pool[other] = torch.nextafter(pool[other], torch.full_like(pool[other], float("inf")))
    return 2 * x


@pool.backend("scales_x")
def pool_scales_x(x, pool, slots):
    """Right pool and output, and x (read-only) scaled in place: every later timed call runs on other data."""
    pool[slots] += x
    y = 2 * x
    x.mul_(0.5)
    return y


# --- item 4: plugin code the parent needs (probes, constraints) -------------------------------------------------
def _raising_constraint(p):
    if p["rows"] == 17:
        raise ZeroDivisionError("a buggy constraint")
    return None


probes = _op("hostile.probes", constraints=[_raising_constraint])


def _probe_hangs(device):
    time.sleep(3600)


def _probe_segfaults(device):
    ctypes.string_at(0)


def _probe_chatty(device):
    sys.stdout.write("chatter " * (10 << 17))  # 10 MB
    sys.stdout.flush()
    return None


@probes.backend("probe_hangs", probe=_probe_hangs)
def probe_hangs(x):
    return 2 * x


@probes.backend("probe_segfaults", probe=_probe_segfaults)
def probe_segfaults(x):
    return 2 * x


@probes.backend("probe_chatty", probe=_probe_chatty)
def probe_chatty(x):
    return 2 * x


@probes.backend("plain")
def plain(x):
    return 2 * x


# --- item 8: a worker that dies while it starts; output a backend writes -----------------------------------------
def _die_once_at_startup():
    """With HOSTILE_DIE_AT_STARTUP=FILE and FILE present: the first worker process that loads this plugin removes
    FILE and dies (SIGKILL) before it is ready."""
    import multiprocessing

    marker = os.environ.get("HOSTILE_DIE_AT_STARTUP")
    if marker and multiprocessing.current_process().name != "MainProcess" and os.path.exists(marker):
        os.remove(marker)
        os.kill(os.getpid(), 9)


_die_once_at_startup()
logs = _op("hostile.logs", rows=(3, 5, 7))


@logs.backend("noisy")
def noisy(x):
    """Correct; writes to stderr and 1 MB to stdout on every call."""
    sys.stderr.write("NOISE from the noisy backend\n")
    sys.stdout.write("stdout-noise " * 80_000)
    return 2 * x


@logs.backend("quiet_segfault")
def quiet_segfault(x):
    ctypes.string_at(0)


# --- item 1: a run that lasts exactly as long as a test wants -----------------------------------------------------
gate = _op("hostile.gate", rows=(3, 5))


@gate.backend("wait_for_file")
def wait_for_file(x):
    """Correct; blocks while the file HOSTILE_GATE exists (the test removes it to let the run finish)."""
    marker = os.environ.get("HOSTILE_GATE")
    while marker and os.path.exists(marker):
        time.sleep(0.05)
    return 2 * x
