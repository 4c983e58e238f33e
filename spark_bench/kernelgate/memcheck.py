"""Out-of-bounds loads and stores of Triton kernels, found without a GPU: the interpreter with every access checked.

Under `memcheck()`, each interpreted launch records the elements its tensor arguments view (a view's, not its
storage's: `k` split from a fused qkv tensor may not read `q`'s columns), and every load, store and atomic checks that
each address its mask lets through lies, with its element's bytes, inside one of them. A violation raises
`OutOfBounds`, naming the kernel, the program, the access and where the address points (bytes past or before the
nearest argument's storage, or the view it falls outside of). This is the interpreter's compute-sanitizer: stricter
than a GPU, which faults only outside mapped memory (an out-of-bounds read inside the caching allocator's pool goes
unnoticed there).

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


@dataclasses.dataclass
class Region:
    """Memory a launch may touch: a guarded copy of an argument's storage at [lo, hi), and which of its bytes the
    arguments placed in it view (`allowed`, one bool per byte; None: all of them)."""

    lo: int
    hi: int
    name: str
    allowed: np.ndarray | None = None
    views: list = dataclasses.field(default_factory=list)  # (shape, strides, offset) of each argument view in it


def _view_bytes(tensor, nbytes: int) -> np.ndarray | None:
    """One bool per byte of the tensor's storage: True where the view has an element; None when it covers it all."""
    size = tensor.element_size()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.numel() * size == nbytes:
        return None
    elements = torch.zeros(nbytes // size, dtype=torch.bool)
    if tensor.numel():
        elements.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset()).fill_(True)
    allowed = np.zeros(nbytes, dtype=bool)
    allowed[:elements.numel() * size] = np.repeat(elements.numpy(), size)
    return allowed


def _union(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    return None if a is None or b is None else a | b


def _overlap(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is None or b is None or bool((a & b).any())


def guarded(names: list[str], args: list, keep: list) -> tuple[list, list[Region]]:
    """The launch's host arguments with every tensor view moved into a copy of its storage in the middle of a buffer
    GUARD_BYTES larger on each side (`keep` holds the buffers), and the regions the launch may touch. Views of one
    storage that share a byte share a copy (in-place and aliased arguments stay aliased); views that do not each get
    their own (q, k and v split from one fused qkv tensor), so a read of `k` that lands in `q`'s columns is out of
    bounds, as is any byte of a storage outside every view placed in its copy. Without the guards, a read past the
    end of one argument that lands in the next allocation (the CPU allocator packs them) passed as in bounds.
    `restore` copies the host copies back into the caller's tensors after the launch."""
    from triton.runtime import interpreter

    found: list[tuple[str, Any]] = []  # (name, unwrapped tensor) of every tensor view, in order

    def collect(name, arg):
        for label, tensor in _tensors(name, arg):
            tensor = interpreter._unwrap_tensor(tensor)
            if tensor.untyped_storage().nbytes():
                found.append((label, tensor))

    for name, arg in zip(names, args, strict=True):
        collect(name, arg)
    groups: list[dict] = []  # {"storage", "allowed", "names", "views"}: one copy each
    slot: dict[int, dict] = {}  # id(tensor) -> its group
    for label, tensor in found:
        storage = tensor.untyped_storage()
        allowed = _view_bytes(tensor, storage.nbytes())
        mates = [g for g in groups if g["storage"].data_ptr() == storage.data_ptr() and _overlap(g["allowed"], allowed)]
        group = mates[0] if mates else {"storage": storage, "allowed": allowed, "names": [], "views": []}
        if not mates:
            groups.append(group)
        for other in mates[1:]:  # this view joins groups that were disjoint until now
            group["allowed"] = _union(group["allowed"], other["allowed"])
            group["names"] += other["names"]
            group["views"] += other["views"]
            groups.remove(other)
            for key, g in list(slot.items()):
                if g is other:
                    slot[key] = group
        if mates:
            group["allowed"] = _union(group["allowed"], allowed)
        if label not in group["names"]:
            group["names"].append(label)
        group["views"].append((tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()))
        slot[id(tensor)] = group
    regions = []
    for group in groups:
        nbytes = group["storage"].nbytes()
        buffer = torch.empty(nbytes + 2 * GUARD_BYTES, dtype=torch.uint8)
        keep.append(buffer)
        group["copy"] = buffer.untyped_storage()[GUARD_BYTES:GUARD_BYTES + nbytes]
        group["copy"].copy_(group["storage"])
        lo = group["copy"].data_ptr()
        regions.append(Region(lo, lo + nbytes, " / ".join(group["names"]), group["allowed"], group["views"]))

    def one(arg):
        if isinstance(arg, tuple):
            return type(arg)(*map(one, arg)) if hasattr(arg, "_fields") else tuple(map(one, arg))
        if not hasattr(arg, "untyped_storage"):
            base = getattr(arg, "base", None)
            if base is not None and hasattr(base, "untyped_storage"):  # a host TensorDescriptor
                return dataclasses.replace(arg, base=one(base)) if dataclasses.is_dataclass(arg) else arg
            return arg
        tensor = interpreter._unwrap_tensor(arg)
        group = slot.get(id(tensor))
        if group is None:  # an empty storage
            return arg
        moved = tensor.new_empty(0).set_(group["copy"], tensor.storage_offset(), tensor.size(), tensor.stride())
        return interpreter._rewrap_tensor(moved, original_tensor=arg)

    return [one(a) for a in args], sorted(regions, key=lambda r: r.lo)


def restore(args_dev: list, args_hst: list) -> None:
    """Copy what the launch wrote back into the caller's tensors: a storage with one copy whole, one split into
    several copies (disjoint views) view by view."""
    from triton.runtime import interpreter

    pairs: dict[int, list] = {}
    for dev, hst in zip(args_dev, args_hst, strict=True):
        for (_, d), (_, h) in zip(_tensors("", dev), _tensors("", hst), strict=True):
            d, h = interpreter._unwrap_tensor(d), interpreter._unwrap_tensor(h)
            pairs.setdefault(d.untyped_storage().data_ptr(), []).append((d, h))
    for views in pairs.values():
        copies = {h.untyped_storage().data_ptr() for _, h in views}
        if len(copies) == 1:
            views[0][0].untyped_storage().copy_(views[0][1].untyped_storage())
        else:
            for d, h in views:
                d.copy_(h)


def _where(address: int, regions: list[Region]) -> str:
    """Where a bad address points, relative to the nearest argument's storage or view."""
    if not regions:
        return "the launch has no tensor arguments"
    r = min(regions, key=lambda r: min(abs(address - r.lo), abs(address - r.hi)))
    if address >= r.hi:
        return f"{address - r.hi} bytes past the end of `{r.name}` ({r.hi - r.lo} bytes)"
    if address < r.lo:
        return f"{r.lo - address} bytes before `{r.name}` ({r.hi - r.lo} bytes)"
    views = "; ".join(f"shape {list(s)}, strides {list(st)}, offset {o}" for s, st, o in r.views)
    if r.allowed is not None and not r.allowed[address - r.lo]:
        return (f"at byte {address - r.lo} of `{r.name}`'s storage ({r.hi - r.lo} bytes), outside its view "
                f"({views})")
    return f"at byte {address - r.lo} of `{r.name}` ({r.hi - r.lo} bytes), its element crossing the end of its view"


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
                          f"bounds; the first {_where(int(bad[0]), regions)}")


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
        restore([*args_dev, *(kwargs[k] for k in kwargs_hst)], [*args_hst, *kwargs_hst.values()])

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
