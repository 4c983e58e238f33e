"""A test plugin whose backends fail in every way the runner must survive (loaded via $SPARK_BENCH_PLUGINS).

Op `fault.scale`: y = 2 * x. Each backend name says how it misbehaves.
"""

import ctypes
import os
import time

import torch

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.inputs import generator, randn


def make_inputs(p, *, device, dtype, seed):
    return {"x": randn((p["rows"], p["cols"]), generator(device, seed), dtype=dtype, device=device)}


def reference(x):
    return 2 * x.double()


op = Op(
    name="fault.scale",
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=lambda p, dtype: Cost(flops=p["rows"] * p["cols"], bytes=8 * p["rows"] * p["cols"]),
    axes=[Axis("rows", [64], quick=[3, 17]), Axis("cols", [64], quick=[5])],
    dtypes=["fp32"],
    tolerance={"fp32": Tolerance(1e-6)},
)


@op.backend("good")
def good(x):
    return 2 * x


_met = False


def _meet_another_process(meet_dir: str, deadline_s: float = 40.0) -> None:
    """Leave this process's mark in `meet_dir`, then wait (at most `deadline_s`) until another process has left one:
    two workers are then inside a case at the same time, however late a loaded machine starts the second."""
    global _met
    if _met:
        return
    mine = os.path.join(meet_dir, str(os.getpid()))
    open(mine, "w").close()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not any(name != str(os.getpid()) for name in os.listdir(meet_dir)):
        time.sleep(0.01)
    _met = True


_HELD: list = []  # what a library would hold for the life of the process


@op.backend("slow")
def slow(x):
    """Sleeps $FAULT_SLOW_S per call; with $FAULT_MEET_DIR set, its first call per process waits for a partner; with
    $FAULT_SEMAPHORE set, it holds a semaphore registered with the resource tracker, as torch.compile's pools do."""
    if os.environ.get("FAULT_MEET_DIR"):
        _meet_another_process(os.environ["FAULT_MEET_DIR"])
    if os.environ.get("FAULT_SEMAPHORE") and not _HELD:
        import multiprocessing

        _HELD.append(multiprocessing.get_context("spawn").Semaphore())
    time.sleep(float(os.environ.get("FAULT_SLOW_S", "0.01")))
    return 2 * x


@op.backend("raises")
def raises(x):
    raise ValueError("deliberate failure in the backend")


@op.backend("segfault")
def segfault(x):
    ctypes.string_at(0)


@op.backend("abort")
def abort(x):
    os.abort()


@op.backend("hang")
def hang(x):
    time.sleep(3600)


@op.backend("wrong")
def wrong(x):
    return 2.5 * x


@op.backend("nan")
def nan(x):
    y = 2 * x
    y[0, 0] = float("nan")
    return y


@op.backend("unwritten")
def unwritten(x):
    """Allocates its output with torch.empty and writes only the first row."""
    y = torch.empty_like(x)
    y[:1] = 2 * x[:1]
    return y


@op.backend("oom")
def oom(x):
    return torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # 1 PiB: the allocator refuses at once


@op.backend("hang_in_timing")
def hang_in_timing(x):
    """Correct on its first call (the check), then hangs: a timeout in the timing phase."""
    marker = f"/tmp/spark-bench-hang-{os.getpid()}"
    if os.path.exists(marker):
        time.sleep(3600)
    open(marker, "w").close()
    return 2 * x


@op.backend("unavailable", probe=lambda device: "needs a device nobody has")
def unavailable(x):
    return 2 * x
