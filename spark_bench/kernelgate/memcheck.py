"""Out-of-bounds loads and stores of Triton kernels, found without a GPU: the interpreter with every access checked.

Under `memcheck()`, each interpreted launch records the storages its tensor arguments live in, and every load, store
and atomic checks that each address its mask lets through lies, with its element's bytes, inside one of them. A
violation raises `OutOfBounds`, naming the kernel, the program, the access and where the address points (bytes past
or before the nearest argument's storage). This is the interpreter's compute-sanitizer: stricter than a GPU, which
faults only outside mapped memory (an out-of-bounds read inside the caching allocator's pool goes unnoticed there).

With `target` (a `kernelgate.targets.Target`), wrappers size their grids and pick their configs as on that GPU
(`triton_env.set_capture_target`): its SM count, its per-target config rules. So the launches checked are the ones the
GPU would run, not the interpreter's one-program-per-SM defaults. The first H200 run (2026-12-05) met an illegal
memory access in the chunk prefill at 64k tokens that no interpreted test had shown; this is how to look for such a
fault here. `spark-bench memcheck` (memcheck_cli.py) runs it over the sweep's points (CPU, slow: small shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_state = threading.local()  # the launch being interpreted: (kernel, [(lo, hi, arg)], los, his, () -> program id)


class OutOfBounds(RuntimeError):
    """An interpreted kernel touched memory outside every tensor argument's storage."""


def out_of_bounds_in(exc: BaseException) -> OutOfBounds | None:
    """The OutOfBounds an exception carries (the interpreter wraps it in InterpreterError), or None."""
    for _ in range(6):
        if exc is None or isinstance(exc, OutOfBounds):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _tensors(name: str, arg) -> list[tuple[str, object]]:
    """(name, tensor) of an argument: a tensor, the tensors of a tuple, a host TensorDescriptor's base."""
    if hasattr(arg, "untyped_storage"):
        return [(name, arg)]
    if isinstance(arg, tuple):
        return [t for i, a in enumerate(arg) for t in _tensors(f"{name}[{i}]", a)]
    base = getattr(arg, "base", None)
    return _tensors(f"{name}.base", base) if base is not None and hasattr(base, "untyped_storage") else []


GUARD_BYTES = 1 << 16  # unmapped-to-any-argument bytes on each side of every argument's storage during a launch


def guarded(args: list, keep: list) -> list:
    """The launch's host arguments with every tensor's storage copied into the middle of a buffer GUARD_BYTES larger
    on each side (views of one storage stay views of one copy; `keep` holds the buffers). Without it, a read past the
    end of one argument that lands in the next allocation (the CPU allocator packs them) passed as in bounds. The
    interpreter copies each host storage back into the caller's after the launch (`_restore_args_dev`)."""
    from triton.runtime import interpreter

    copies: dict[int, Any] = {}

    def one(arg):
        if isinstance(arg, tuple):
            return type(arg)(*map(one, arg)) if hasattr(arg, "_fields") else tuple(map(one, arg))
        if not hasattr(arg, "untyped_storage"):
            base = getattr(arg, "base", None)
            if base is not None and hasattr(base, "untyped_storage"):  # a host TensorDescriptor
                return dataclasses.replace(arg, base=one(base)) if dataclasses.is_dataclass(arg) else arg
            return arg
        tensor = interpreter._unwrap_tensor(arg)
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return arg
        if storage.data_ptr() not in copies:
            buffer = torch.empty(storage.nbytes() + 2 * GUARD_BYTES, dtype=torch.uint8)
            keep.append(buffer)
            copy = buffer.untyped_storage()[GUARD_BYTES:GUARD_BYTES + storage.nbytes()]
            copy.copy_(storage)
            copies[storage.data_ptr()] = copy
        moved = tensor.new_empty(0).set_(copies[storage.data_ptr()], tensor.storage_offset(), tensor.size(),
                                         tensor.stride())
        return interpreter._rewrap_tensor(moved, original_tensor=arg)

    return [one(a) for a in args]


def _ranges(names: list[str], args: list) -> list[tuple[int, int, str]]:
    """[(lo, hi, argument)] of every tensor argument's storage (views of one storage share it)."""
    out, seen = [], set()
    for name, arg in zip(names, args, strict=False):
        for label, tensor in _tensors(name, arg):
            storage = tensor.untyped_storage()
            lo = storage.data_ptr()
            if lo in seen or storage.nbytes() == 0:
                continue
            seen.add(lo)
            out.append((lo, lo + storage.nbytes(), label))
    return sorted(out)


def _where(address: int, ranges: list[tuple[int, int, str]]) -> str:
    """Where a bad address points, relative to the nearest argument's storage."""
    if not ranges:
        return "the launch has no tensor arguments"
    lo, hi, name = min(ranges, key=lambda r: min(abs(address - r[0]), abs(address - r[1])))
    if address >= hi:
        return f"{address - hi} bytes past the end of `{name}` ({hi - lo} bytes)"
    if address < lo:
        return f"{lo - address} bytes before `{name}` ({hi - lo} bytes)"
    return f"at byte {address - lo} of `{name}` ({hi - lo} bytes), its element crossing the end"


def check(kind: str, ptrs, mask, itemsize: int) -> None:
    """Raise OutOfBounds when an address that `mask` lets through (all, when None) is outside the launch's storages."""
    launch = getattr(_state, "launch", None)
    if launch is None:
        return
    name, ranges, los, his, grid_idx = launch
    addresses = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    addresses = addresses.ravel().astype(np.int64, copy=False)  # user-space addresses fit in 63 bits
    if addresses.size == 0:
        return
    index = np.searchsorted(los, addresses, side="right") - 1
    inside = ((index >= 0) & (addresses + itemsize <= his[np.maximum(index, 0)]) if ranges
              else np.zeros(addresses.shape, dtype=bool))  # no tensor argument: nothing is in bounds
    if not inside.all():
        bad = addresses[~inside]
        raise OutOfBounds(f"{name} program {grid_idx()}: {kind} of {bad.size} of {addresses.size} elements out of "
                          f"bounds; the first {_where(int(bad[0]), ranges)}")


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
        moved = guarded([*args_hst, *kwargs_hst.values()], _state.buffers)
        args_hst, kwargs_hst = moved[:len(args_hst)], dict(zip(kwargs_hst, moved[len(args_hst):], strict=True))
        names = [*self.arg_names[:len(args_hst)], *kwargs_hst]
        ranges = _ranges(names, [*args_hst, *kwargs_hst.values()])
        bounds = (np.array([r[0] for r in ranges], dtype=np.int64), np.array([r[1] for r in ranges], dtype=np.int64))
        _state.launch = (self.fn.__name__, ranges, *bounds, lambda: tuple(interpreter.interpreter_builder.grid_idx))
        return args_hst, kwargs_hst

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
        with (patched(builder, hooks), patched(executor, {"__call__": call, "_init_args_hst": init_args}),
              as_on_gpu()):
            yield counts
    finally:
        triton_env.set_capture_target(before)
