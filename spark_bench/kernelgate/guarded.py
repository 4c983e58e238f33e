"""The memory a memcheck'd launch may touch: each tensor argument's view, copied between guard zones.

`guarded` moves every tensor view of a launch into a copy of the bytes it spans, in the middle of a buffer
GUARD_BYTES larger on each side, and returns the `Region`s the launch may touch. Views of one storage that share a
byte share a copy (in place stays in place, a tensor passed twice stays one); views that share none get a copy each
(q, k and v split from one fused qkv tensor), so a read of `k` that lands in `q`'s columns falls outside every
region. A region's `allowed` bytes are those its views have an element in (None: all of its span), so a column
slice read past its width is caught too. `restore` writes what the launch wrote back into the caller's storages,
only the bytes the views cover. Without the guard zones a read past the end of one argument that lands in the next
allocation (the CPU allocator packs them) passed as in bounds; without per-view copies, any byte of the storage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

GUARD_BYTES = 1 << 16  # bytes that belong to no argument on each side of every copy during a launch
ALIGN = 16  # a copy starts at a multiple of this many bytes of its storage (a multiple of every element size)


@dataclasses.dataclass
class Region:
    """A copy at addresses [lo, hi) of bytes [start, start + hi - lo) of a storage of `total` bytes; `allowed` (one
    bool per byte, None: all) marks the bytes its argument views have an element in."""

    lo: int
    hi: int
    name: str
    allowed: np.ndarray | None
    views: list[tuple]  # (shape, strides, storage offset) of each argument view placed in it
    start: int
    total: int
    copy: Any = dataclasses.field(repr=False, default=None)  # the copy's untyped storage

    def describe_views(self) -> str:
        return "; ".join(f"shape {list(s)}, strides {list(st)}, offset {o}" for s, st, o in self.views)


def tensors(name: str, arg) -> list[tuple[str, Any]]:
    """(name, tensor) of an argument: a tensor, the tensors of a tuple, a TensorDescriptor's or a TensorWrapper's
    (triton.reinterpret) base."""
    if hasattr(arg, "untyped_storage"):
        return [(name, arg)]
    if isinstance(arg, tuple):
        return [t for i, a in enumerate(arg) for t in tensors(f"{name}[{i}]", a)]
    base = getattr(arg, "base", None)
    return tensors(f"{name}.base", base) if base is not None and hasattr(base, "untyped_storage") else []


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of the view's elements in its storage (empty for an empty view)."""
    size, first = t.element_size(), t.storage_offset()
    if t.numel() == 0:
        return first * size, first * size
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return first * size, (last + 1) * size


def _fills_span(t: torch.Tensor) -> bool:
    """Whether the view's elements are every element of its span, each once (contiguous up to a permutation)."""
    expect = 1
    for stride, n in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride != expect:
            return False
        expect *= n
    return True


def _bytes_of(t: torch.Tensor, lo: int, hi: int) -> np.ndarray:
    """One bool per byte of [lo, hi) (lo a multiple of the element size): True where the view has an element."""
    size = t.element_size()
    elements = torch.zeros(-(-(hi - lo) // size), dtype=torch.bool)
    if t.numel():
        elements.as_strided(t.size(), t.stride(), t.storage_offset() - lo // size).fill_(True)
    return np.repeat(elements.numpy(), size)[:hi - lo]


@dataclasses.dataclass
class _Group:
    """Views of one storage that will share one copy: their byte span [lo, hi) and mask (None: they fill it)."""

    storage: Any
    lo: int
    hi: int
    mask: np.ndarray | None
    names: list[str]
    members: list[Any]

    def mask_over(self, lo: int, hi: int) -> np.ndarray:
        """Its mask over bytes [lo, hi) (False outside its span)."""
        out = np.zeros(hi - lo, dtype=bool)
        a, b = max(lo, self.lo), min(hi, self.hi)
        if a < b:
            out[a - lo:b - lo] = True if self.mask is None else self.mask[a - self.lo:b - self.lo]
        return out


def _join(group: _Group, other: _Group) -> None:
    """Merge `other` into `group` (one copy for both)."""
    lo, hi = min(group.lo, other.lo), max(group.hi, other.hi)
    mask = group.mask_over(lo, hi) | other.mask_over(lo, hi)
    group.lo, group.hi, group.mask = lo, hi, None if mask.all() else mask
    group.names += [n for n in other.names if n not in group.names]
    group.members += other.members


def _shares_a_byte(group: _Group, other: _Group) -> bool:
    if other.lo >= group.hi or group.lo >= other.hi:
        return False
    if group.mask is None and other.mask is None:
        return True
    lo, hi = max(group.lo, other.lo), min(group.hi, other.hi)
    return bool((group.mask_over(lo, hi) & other.mask_over(lo, hi)).any())


def _groups(found: list[tuple[str, Any]]) -> list[_Group]:
    groups: list[_Group] = []
    for label, t in found:
        lo, hi = _span(t)
        if hi == lo:
            continue  # an empty view: nothing to copy, nothing it may touch
        new = _Group(t.untyped_storage(), lo, hi, None if _fills_span(t) else _bytes_of(t, lo, hi), [label], [t])
        ptr = new.storage.data_ptr()
        for g in [g for g in groups if g.storage.data_ptr() == ptr and _shares_a_byte(g, new)]:
            groups.remove(g)
            _join(g, new)
            new = g
        groups.append(new)
    return groups


def guarded(names: list[str], args: list, keep: list) -> tuple[list, list[Region]]:
    """The launch's host arguments with every tensor view moved into its group's guarded copy (`keep` holds the
    buffers), and the regions the launch may touch, sorted by address."""
    from triton.runtime import interpreter

    found = [(label, interpreter._unwrap_tensor(t)) for name, arg in zip(names, args, strict=True)
             for label, t in tensors(name, arg)]
    regions, placed = [], {}  # id(tensor) -> (copy storage, first byte copied)
    for g in _groups(found):
        total = g.storage.nbytes()
        start, end = g.lo // ALIGN * ALIGN, min(total, -(-g.hi // ALIGN) * ALIGN)
        allowed = g.mask_over(start, end) if (start, end) != (g.lo, g.hi) or g.mask is not None else None
        buffer = torch.empty(end - start + 2 * GUARD_BYTES, dtype=torch.uint8)
        keep.append(buffer)
        copy = buffer.untyped_storage()[GUARD_BYTES:GUARD_BYTES + end - start]
        copy.copy_(g.storage[start:end])
        views = [(tuple(t.size()), tuple(t.stride()), t.storage_offset()) for t in g.members]
        regions.append(Region(copy.data_ptr(), copy.data_ptr() + end - start, " / ".join(g.names), allowed,
                              list(dict.fromkeys(views)), start, total, copy))
        placed.update({id(t): (copy, start) for t in g.members})

    def one(arg):
        if isinstance(arg, tuple):
            return type(arg)(*map(one, arg)) if hasattr(arg, "_fields") else tuple(map(one, arg))
        tensor = interpreter._unwrap_tensor(arg)  # a TensorWrapper (triton.reinterpret) moves with its base
        if not hasattr(tensor, "untyped_storage"):
            base = getattr(arg, "base", None)
            if base is not None and hasattr(base, "untyped_storage"):  # a host TensorDescriptor
                return dataclasses.replace(arg, base=one(base)) if dataclasses.is_dataclass(arg) else arg
            return arg
        if id(tensor) not in placed:  # an empty view
            return arg
        copy, start = placed[id(tensor)]
        moved = tensor.new_empty(0).set_(copy, tensor.storage_offset() - start // tensor.element_size(),
                                         tensor.size(), tensor.stride())
        return interpreter._rewrap_tensor(moved, original_tensor=arg)

    return [one(a) for a in args], sorted(regions, key=lambda r: r.lo)


def restore(args_dev: list, args_hst: list, regions: list[Region]) -> None:
    """Write each copy's allowed bytes back into the storage of the caller's tensor it was made from."""
    from triton.runtime import interpreter

    by_copy = {r.copy.data_ptr(): r for r in regions}
    done = set()
    for dev, hst in zip(args_dev, args_hst, strict=True):
        for (_, d), (_, h) in zip(tensors("", dev), tensors("", hst), strict=True):
            region = by_copy.get(interpreter._unwrap_tensor(h).untyped_storage().data_ptr())
            target = interpreter._unwrap_tensor(d).untyped_storage()
            if region is None or (id(region), target.data_ptr()) in done:
                continue
            done.add((id(region), target.data_ptr()))
            n = region.hi - region.lo
            if region.allowed is None:
                target[region.start:region.start + n].copy_(region.copy)
                continue
            into = torch.empty(0, dtype=torch.uint8, device=target.device).set_(target)[region.start:region.start + n]
            src = torch.empty(0, dtype=torch.uint8).set_(region.copy)
            allowed = torch.from_numpy(region.allowed)
            into[allowed.to(into.device)] = src[allowed].to(into.device)


def where(address: int, regions: list[Region]) -> str:
    """Where a bad address points: before, past or inside (outside its views) the nearest argument's storage."""
    if not regions:
        return "the launch has no tensor arguments"
    r = min(regions, key=lambda r: min(abs(address - r.lo), abs(address - r.hi)))
    at = r.start + address - r.lo  # the byte of r's storage the address stands for
    if at >= r.total:
        return f"{at - r.total} bytes past the end of `{r.name}` ({r.total} bytes)"
    if at < 0:
        return f"{-at} bytes before `{r.name}` ({r.total} bytes)"
    if r.lo <= address < r.hi and (r.allowed is None or r.allowed[address - r.lo]):
        return f"at byte {at} of `{r.name}` ({r.total} bytes), its element crossing the end of its view"
    return f"at byte {at} of `{r.name}`'s storage ({r.total} bytes), outside its view ({r.describe_views()})"
