"""Hooks into Triton's interpreter shared by the tools that watch kernels run on the CPU: `traffic` (bytes per kernel)
and `memcheck` (out-of-bounds accesses). Both see every masked load, store and atomic with its addresses, and both
run the kernels with the block sizes and grids they would launch on a GPU (the wrappers' interpreter widening off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# on_access(kind, pointer handle, mask array or None, element bytes); kind: "load", "store" or "atomic"
AccessHook = Callable[[str, Any, Any, int], None]


def itemsize(handle) -> int:
    from triton.runtime.interpreter import _get_np_dtype

    return np.dtype(_get_np_dtype(handle.get_element_ty())).itemsize


def access_hooks(on_access: AccessHook) -> dict[str, Callable]:
    """Replacements for the interpreter builder's memory operations that call `on_access` first (a plain load or
    store goes through the masked one; an atomic load or store too). The arguments after the mask differ between
    Triton releases (3.9: cache_policy, is_volatile; 3.6: cache_modifier, eviction_policy, is_volatile) and are passed
    through as given."""
    from triton.runtime.interpreter import InterpreterBuilder as builder

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def masked_load(self, ptrs, mask, *rest):
        on_access("load", ptrs, mask.data, itemsize(ptrs))
        return load(self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        on_access("store", ptrs, mask.data, itemsize(ptrs))
        return store(self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, sem, scope):
        on_access("atomic", ptr, mask.data, itemsize(ptr))
        return rmw(self, op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        on_access("atomic", ptr, None, itemsize(ptr))
        return cas(self, ptr, cmp, val, sem, scope)

    return {"create_masked_load": masked_load, "create_masked_store": masked_store,
            "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas}


@contextlib.contextmanager
def patched(obj: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """Set `obj`'s attributes for the block, then restore them."""
    saved = {name: getattr(obj, name) for name in replacements}
    for name, value in replacements.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def as_on_gpu() -> contextlib.AbstractContextManager[None]:
    """The wrappers launch their declared block sizes, not the whole rows they widen to when interpreting."""
    from spark_bench.kernels import common

    return patched(common, {"WIDEN_WHEN_INTERPRETING": False})
