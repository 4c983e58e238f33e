"""A test plugin with a tunable Triton kernel (loaded via $SPARK_BENCH_PLUGINS) for the `spark-bench tune` tests.

Op `tunable.scale`: y = 2 * x through `_scale`, whose declared space holds one candidate of each kind the tuner must
tell apart (tests/test_tune*.py):
  fast:     BLOCK=128               -> a quarter of the default's (32) programs: faster, correct: the one to choose
  slow:     BLOCK=128, REPEAT=200   -> the same result after 200 extra passes: slower on purpose, never chosen
  wrong:    BLOCK=512, WRONG=1      -> the fastest, but writes x instead of 2x: fails the check, never chosen
  rejected: BLOCK=1024, num_warps=64 -> 2,048 threads per block cannot launch on any GPU: pruned before timing
$TUNABLE_SLEEP_S (seconds) slows every call, so a test can kill a tune mid-way.
"""

import os
import time

import torch
import triton
import triton.language as tl

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.inputs import generator, randn
from spark_bench.tune import ConfigSpace, declare, split

BASE = {"BLOCK": 32, "REPEAT": 0, "WRONG": 0, "num_warps": 1}
FAST = {**BASE, "BLOCK": 128}
SLOW = {**BASE, "BLOCK": 128, "REPEAT": 200}
WRONG = {**BASE, "BLOCK": 512, "WRONG": 1}
REJECTED = {**BASE, "BLOCK": 1024, "num_warps": 64}
SPACE = declare(ConfigSpace("tunable._scale", key=("n",), default=BASE, candidates=[SLOW, WRONG, REJECTED, FAST]))


@triton.jit
def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr, REPEAT: tl.constexpr, WRONG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = x * 2.0
    for _ in range(REPEAT):
        y = (y + x) - x
    if WRONG:
        y = x
    tl.store(y_ptr + offs, y, mask=mask)


def scale(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    meta, options = split(SPACE.pick(n=n))
    _scale[(triton.cdiv(n, meta["BLOCK"]),)](x, y, n, **meta, **options)
    delay = float(os.environ.get("TUNABLE_SLEEP_S", "0"))
    if delay:
        time.sleep(delay)
    return y


def make_inputs(p, *, device, dtype, seed):
    return {"x": randn((p["n"],), generator(device, seed), dtype=dtype, device=device)}


op = Op(
    name="tunable.scale",
    make_inputs_fn=make_inputs,
    reference=lambda x: 2 * x.double(),
    cost=lambda p, dtype: Cost(flops=p["n"], bytes=8 * p["n"]),
    axes=[Axis("n", [4096], quick=[1024])],
    dtypes=["fp32"],
    tolerance={"fp32": Tolerance(1e-6)},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_backend(x):
    return scale(x)


@op.backend("torch")
def torch_backend(x):
    return 2 * x
