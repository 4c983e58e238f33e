"""Test-side byte accounting for interpreted Triton kernels: every tl.load and tl.store of a launch is recorded
(through the interpreter's builder), and each kernel's traffic is counted as the unique bytes it reads (not
counting its re-reads of what it wrote itself, which stay in L1/L2) plus the unique bytes it writes. That is the
DRAM traffic of a kernel with a perfect cache inside one launch and none across launches: each input read once,
each output written once, as the ops' cost models count the minimum."""

import contextlib
from collections import defaultdict

import numpy as np
import triton.runtime.interpreter as interp


@contextlib.contextmanager
def count_bytes():
    """Yields {kernel name: {"read": bytes, "write": bytes}}, filled as the launches run."""
    builder = interp.interpreter_builder
    books = defaultdict(lambda: {"read": {}, "write": {}})
    current = ["?"]
    run, masked_load, masked_store = (interp.InterpretedFunction.run, builder.create_masked_load,
                                      builder.create_masked_store)

    def traced_run(self, *args, **kwargs):
        current[0] = self.fn.__name__
        return run(self, *args, **kwargs)

    def record(kind, ptrs, mask):
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        book = books[current[0]]
        for a in np.unique(ptrs.data[mask.data.astype(bool)]).tolist():
            if kind == "write" or a not in book["write"]:  # a re-read of its own output is a cache hit
                book[kind][a] = size

    def traced_load(ptrs, mask, *rest, **kw):
        record("read", ptrs, mask)
        return masked_load(ptrs, mask, *rest, **kw)

    def traced_store(ptrs, value, mask, *rest, **kw):
        record("write", ptrs, mask)
        return masked_store(ptrs, value, mask, *rest, **kw)

    result = {}
    interp.InterpretedFunction.run = traced_run
    builder.create_masked_load, builder.create_masked_store = traced_load, traced_store
    try:
        yield result
    finally:
        interp.InterpretedFunction.run = run
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        for name, book in books.items():
            result[name] = {kind: sum(book[kind].values()) for kind in ("read", "write")}
