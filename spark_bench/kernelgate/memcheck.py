"""Out-of-bounds loads and stores of Triton kernels, found without a GPU: the interpreter with every access checked.

Under `memcheck()`, each interpreted launch records the elements its tensor arguments view (a view's, not its
storage's: `k` split from a fused qkv tensor may not read `q`'s columns; guarded.py makes the copies), and every load,
store and atomic checks that each address its mask lets through lies, with its element's bytes, inside one of them. A
violation raises `OutOfBounds`, naming the kernel, the program, the access and where the address points (bytes past
or before the nearest argument's storage, or the view it falls outside of). This is the interpreter's
compute-sanitizer: stricter than a GPU, which faults only outside mapped memory (an out-of-bounds read inside the
caching allocator's pool goes unnoticed there).

With `target` (a `kernelgate.targets.Target`), wrappers size their grids and pick their configs as on that GPU
(`triton_env.set_capture_target`): its SM count, its per-target config rules. So the launches checked are the ones the
GPU would run, not the interpreter's one-program-per-SM defaults. The first H200 run (2026-12-05) met an illegal
memory access in the chunk prefill at 64k tokens that no interpreted test had shown; this is how to look for such a
fault here. `spark-bench memcheck` (memcheck_cli.py) runs it over the sweep's points (CPU, slow: small shapes).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np

from spark_bench.kernelgate.guarded import guarded, restore, where

_state = threading.local()  # the launch being interpreted: (kernel, [Region], los, his, () -> program id)


class OutOfBounds(RuntimeError):
    """An interpreted kernel touched memory outside every tensor argument's view."""


def out_of_bounds_in(exc: BaseException) -> OutOfBounds | None:
    """The OutOfBounds an exception carries (the interpreter wraps it in InterpreterError), or None."""
    for _ in range(6):
        if exc is None or isinstance(exc, OutOfBounds):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def check(kind: str, ptrs, mask, itemsize: int) -> None:
    """Raise OutOfBounds when an address that `mask` lets through (all, when None) is outside the launch's views."""
    launch = getattr(_state, "launch", None)
    if launch is None:
        return
    name, regions, los, his, grid_idx = launch
    addresses = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    addresses = addresses.ravel().astype(np.int64, copy=False)  # user-space addresses fit in 63 bits
    if addresses.size == 0:
        return
    index = np.searchsorted(los, addresses, side="right") - 1
    inside = ((index >= 0) & (addresses + itemsize <= his[np.maximum(index, 0)]) if regions
              else np.zeros(addresses.shape, dtype=bool))  # no tensor argument: nothing is in bounds
    for i in np.unique(index[inside]):
        allowed = regions[i].allowed
        if allowed is not None:
            at = np.flatnonzero(inside & (index == i))
            offsets = addresses[at] - regions[i].lo
            inside[at] = allowed[offsets] & allowed[offsets + itemsize - 1]
    if not inside.all():
        bad = addresses[~inside]
        raise OutOfBounds(f"{name} program {grid_idx()}: {kind} of {bad.size} of {addresses.size} elements out of "
                          f"bounds; the first {where(int(bad[0]), regions)}")


def edge_programs(index: tuple, grid: tuple, width: int = 2) -> bool:
    """The first and last `width` programs along every grid axis at once (the corners of the grid)."""
    return all(i < width or i >= n - width for i, n in zip(index, grid, strict=False))


@contextlib.contextmanager
def memcheck(target=None, programs=None, on_launch=None) -> Iterator[dict[str, int]]:
    """Check every interpreted launch's memory accesses in this block (TRITON_INTERPRET=1 must be set before the
    kernels were decorated), with the block sizes the wrappers declare for a GPU (no interpreter widening); with
    `target`, launch as on that GPU. `programs(index, grid) -> bool` runs only the programs it picks (the others'
    outputs stay unwritten, and kernels whose programs elect a last one, which then does the rest, are only partly
    checked): a full-size launch, too slow to interpret whole, checked at its grid's edges (`edge_programs`). A
    persistent grid's last items can run on a program between them: give it one item per program (`target` with
    more SMs) to check those. `on_launch(kernel, programs run, grid, seconds)` hears of each finished launch (progress
    on long work). Yields {"launches": n}: how many interpreted launches it checked."""
    from triton.runtime import interpreter

    from spark_bench import triton_env
    from spark_bench.kernelgate.interpreter_hooks import access_hooks, as_on_gpu, patched
    from spark_bench.kernels import common

    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved_idx, saved_call, saved_init = builder.set_grid_idx, executor.__call__, executor._init_args_hst
    counts = {"launches": 0}

    def on_access(kind: str, ptrs, mask, size: int) -> None:
        check(kind, ptrs.data, mask, size)

    def init_args(self, args_dev, kwargs):  # the host copies the kernel's pointers point into, guarded
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        _state.buffers = []  # the guarded copies live until the next launch of this thread
        names = [*self.arg_names[:len(args_hst)], *kwargs_hst]
        moved, regions = guarded(names, [*args_hst, *kwargs_hst.values()], _state.buffers)
        args_hst, kwargs_hst = moved[:len(args_hst)], dict(zip(kwargs_hst, moved[len(args_hst):], strict=True))
        bounds = (np.array([r.lo for r in regions], dtype=np.int64), np.array([r.hi for r in regions], dtype=np.int64))
        _state.launch = (self.fn.__name__, regions, *bounds, lambda: tuple(interpreter.interpreter_builder.grid_idx))
        return args_hst, kwargs_hst

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        restore([*args_dev, *(kwargs[k] for k in kwargs_hst)], [*args_hst, *kwargs_hst.values()], _state.launch[1])

    def call(self, *args, **kwargs):
        previous, grid = getattr(_state, "launch", None), self.grid
        counts["launches"] += 1
        shape = {"real": None, "ran": None}

        def picked(real_grid) -> tuple:  # run only the picked programs, with their real ids
            real = tuple(real_grid) + (1,) * (3 - len(real_grid))
            _state.picks = [i for i in itertools.product(*map(range, real)) if programs(i, real)]
            _state.real = shape["real"] = real
            shape["ran"] = len(_state.picks)
            return (len(_state.picks), 1, 1)

        if programs is not None:
            self.grid = (lambda meta: picked(grid(meta))) if callable(grid) else picked(grid)
        start = time.monotonic()
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            _state.launch, self.grid, _state.picks = previous, grid, None
            if programs is not None:  # unrun programs never reset the tickets they share: zero them for later calls
                for buf in common._TICKETS.values():
                    buf.zero_()
            if on_launch is not None:
                real = shape["real"] or (None if callable(grid) else tuple(grid))
                ran = shape["ran"] if shape["ran"] is not None else (int(np.prod(real)) if real else None)
                on_launch(self.fn.__name__, ran, real or grid, time.monotonic() - start)

    def set_grid_dim(self, nx, ny, nz):
        self.grid_dim = _state.real if getattr(_state, "picks", None) is not None else (nx, ny, nz)

    def set_grid_idx(self, x, y, z):
        picks = getattr(_state, "picks", None)
        saved_idx(self, *picks[x]) if picks is not None else saved_idx(self, x, y, z)

    hooks = access_hooks(on_access) | {"set_grid_dim": set_grid_dim, "set_grid_idx": set_grid_idx}
    before = triton_env._capture_target
    if target is not None:
        triton_env.set_capture_target(target)
    try:
        with (patched(builder, hooks), patched(executor, {"__call__": call, "_init_args_hst": init_args,
                                      "_restore_args_dev": restore_args}),
              as_on_gpu()):
            yield counts
    finally:
        triton_env.set_capture_target(before)
