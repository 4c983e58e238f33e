"""Bytes each Triton kernel moves, counted from its loads and stores in Triton's interpreter (a model, not a
measurement): `spark-bench kernels --traffic`.

Every masked-in element of every `tl.load` / `tl.store` (and atomic) of a launch is counted twice over:
- `issued`: each access, as often as the kernel makes it. What the SMs ask of L1/L2: a tile re-read by many programs
  is counted each time.
- `unique`: the distinct bytes of the launch, not counting reads of what the launch itself wrote before (those stay
  in L1/L2). What DRAM would serve if L2 kept everything a launch touches: the floor of its DRAM traffic.
A GPU's DRAM traffic lies between the two (nearer `unique` when the re-reads are close in time, as in a grouped tile
order). Both are compared with the op's cost model (its minimum bytes). The wrappers' interpreter widening
(`kernels.common.WIDEN_WHEN_INTERPRETING`) is switched off while counting, so the kernels run with the block sizes
and grids they would launch on the GPU (their declared configs); an interpreter-only branch that changes what a
kernel loads would be counted as the interpreter runs it.
`transcendentals` counts the elements of every exp / exp2 / log / log2 / rsqrt / sqrt / sin / cos a launch
evaluates, masked lanes included as on the GPU: its SFU (MUFU) work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from typing import Any

import click
import numpy as np

from spark_bench.sweep import UsageError, runnable


@dataclasses.dataclass
class KernelTraffic:
    kernel: str
    launches: int = 0
    read_issued: int = 0
    read_unique: int = 0
    written_issued: int = 0
    written_unique: int = 0
    transcendentals: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Launch:
    """The addresses one launch touched, per element size; reads of addresses it has written are left out."""

    def __init__(self) -> None:
        self.read: dict[int, list[np.ndarray]] = {}
        self.written: dict[int, list[np.ndarray]] = {}
        self.own: set[int] = set()  # every address this launch has stored to so far

    def add(self, into: dict[int, list[np.ndarray]], ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int) -> int:
        addresses = np.asarray(ptrs[mask.astype(bool)] if mask is not None else ptrs, dtype=np.uint64).reshape(-1)
        if into is self.written:
            self.own.update(addresses.tolist())
            kept = addresses
        elif self.own:
            kept = np.unique(addresses)
            kept = kept[np.fromiter((a not in self.own for a in kept.tolist()), dtype=bool, count=kept.size)]
        else:
            kept = addresses
        into.setdefault(itemsize, []).append(kept)
        return int(addresses.size) * itemsize

    @staticmethod
    def unique_bytes(touched: dict[int, list[np.ndarray]]) -> int:
        return sum(int(np.unique(np.concatenate(parts)).size) * size for size, parts in touched.items() if parts)


_TRANSCENDENTALS = ("create_exp", "create_exp2", "create_log", "create_log2", "create_rsqrt", "create_sqrt",
                    "create_precise_sqrt", "create_sin", "create_cos")


@contextlib.contextmanager
def counting() -> Iterator[dict[str, KernelTraffic]]:
    """Count the traffic of every interpreted launch inside the block: {kernel name: KernelTraffic}."""
    import triton.runtime.interpreter as interp

    from spark_bench.kernelgate.interpreter_hooks import access_hooks, as_on_gpu, patched

    builder, executor = interp.InterpreterBuilder, interp.GridExecutor
    special = {name: getattr(builder, name) for name in _TRANSCENDENTALS}
    saved_call = executor.__call__
    totals: dict[str, KernelTraffic] = {}
    current: list[tuple[KernelTraffic, _Launch]] = []

    def on_access(kind: str, ptrs, mask, size: int) -> None:
        if current:
            row, launch = current[-1]
            if kind != "store":  # an atomic reads and writes
                row.read_issued += launch.add(launch.read, ptrs.data, mask, size)
            if kind != "load":
                row.written_issued += launch.add(launch.written, ptrs.data, mask, size)

    def transcendental(name):
        def counted(self, x, *args, **kwargs):
            if current:
                current[-1][0].transcendentals += int(np.asarray(x.data).size)
            return special[name](self, x, *args, **kwargs)
        return counted

    def call(self, *args, **kwargs):
        name = getattr(self.fn, "__name__", "kernel")
        row = totals.setdefault(name, KernelTraffic(name))
        row.launches += 1
        launch = _Launch()
        current.append((row, launch))
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            current.pop()
            row.read_unique += launch.unique_bytes(launch.read)
            row.written_unique += launch.unique_bytes(launch.written)

    hooks = access_hooks(on_access) | {name: transcendental(name) for name in special}
    with patched(builder, hooks), patched(executor, {"__call__": call}), as_on_gpu():
        yield totals


def traffic_of(op, backend: str, params: dict[str, Any], dtype: str, seed: int = 0) -> dict[str, Any]:
    """Run `backend` of `op` once on CPU inputs under the interpreter and count each kernel's bytes; with the cost
    model's bytes at the same point. The process must interpret Triton (TRITON_INTERPRET=1 before triton loads)."""
    from spark_bench.check import clone_inputs

    inputs = op.make_inputs(params, device="cpu", dtype=dtype, seed=seed)
    fn = op.backends[backend].prepared(clone_inputs(inputs))  # its setup (a compile) is not the call's traffic
    with counting() as kernels:
        fn(**clone_inputs(inputs))
    rows = sorted(kernels.values(), key=lambda r: -(r.read_unique + r.written_unique))
    issued = sum(r.read_issued + r.written_issued for r in rows)
    unique = sum(r.read_unique + r.written_unique for r in rows)
    model = op.cost(params, dtype).bytes
    ratio = model and rows  # no ratio of nothing counted (a backend that launches no Triton kernel) or of 0 bytes
    return {"op": op.name, "backend": backend, "params": params, "dtype": dtype,
            "kernels": [r.to_dict() for r in rows], "issued_bytes": issued, "unique_bytes": unique,
            "model_bytes": model, "unique_over_model": unique / model if ratio else None,
            "issued_over_model": issued / model if ratio else None}


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g}"


def _summary(r: dict[str, Any]) -> str:
    """The first line of a case: its bytes against the cost model's, or that no kernel launch was counted."""
    head = f"{r['op']} {r['backend']} {' '.join(f'{k}={v}' for k, v in r['params'].items())} {r['dtype']}"
    if "error" in r:
        return f"{head}: failed, nothing counted: {r['error']}"
    model = f"the cost model's {_mb(r['model_bytes'])} MB"
    if not r["kernels"]:
        return f"{head}: no Triton kernel launch was counted (the backend launched none); {model}"
    if r["unique_over_model"] is None:  # a cost model of 0 bytes
        return f"{head}: unique {_mb(r['unique_bytes'])} MB, {model}; issued {_mb(r['issued_bytes'])} MB"
    return (f"{head}: unique {_mb(r['unique_bytes'])} MB = {r['unique_over_model']:.3g}x {model}; issued "
            f"{_mb(r['issued_bytes'])} MB = {r['issued_over_model']:.3g}x")


@click.command("traffic")
@click.option("--op", "ops", multiple=True, required=True, help="Op name or glob (repeatable).")
@click.option("--backend", "backends", multiple=True, default=("triton*",), show_default=True,
              help="Backends (globs) whose kernels are counted.")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2",
              help="Override an axis, as for `run` (the default points are the quick sweep's: the interpreter runs "
                   "every program in Python, so keep them small).")
@click.option("--dtype", "dtypes", multiple=True, help="Only these dtypes.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(-(2**63), 2**64 - 1),  # torch.manual_seed's
              help="Seed of the input factory (as run --seed).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def traffic_cmd(ops, backends, sets, dtypes, seed, as_json) -> None:
    """Bytes each Triton kernel loads and stores, counted in the interpreter on CPU inputs, against the op's cost
    model (a model of DRAM traffic, not a measurement): `unique` = distinct bytes per launch (the floor, as if L2
    kept everything), `issued` = every access. Exit 1 when a case fails (its row says why; the others are counted)."""
    from spark_bench import triton_env
    from spark_bench.session import Session
    from spark_bench.sweep import SweepSpec, dtype_list, merge_sets

    triton_env.configure("cpu")
    if not triton_env.interpreting():
        raise UsageError("traffic counts in Triton's interpreter: unset TRITON_INTERPRET=0")
    spec = SweepSpec(ops=list(ops), backends=list(backends), overrides=merge_sets(sets),
                     dtypes=dtype_list(dtypes), quick=True, device="cpu", seed=seed)
    from spark_bench.registry import registry

    reg = registry()
    rows = []
    cases = runnable(Session._cases(spec), "nothing to count: no selected backend can run here",
                     lambda line: click.echo(line, err=True))
    for case in cases:
        try:
            rows.append(traffic_of(reg.get(case.op), case.backend, case.params, case.dtype, seed=seed))
        except Exception as exc:  # noqa: BLE001 - the case's failure is its row; the others are still counted
            rows.append({"op": case.op, "backend": case.backend, "params": case.params, "dtype": case.dtype,
                         "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300], "kernels": []})
    failed = sum("error" in r for r in rows)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        sys.exit(1 if failed else 0)
    for r in rows:
        click.echo(_summary(r))
        for k in r["kernels"]:
            click.echo(f"  {k['kernel']:<32} x{k['launches']:<3} read {_mb(k['read_unique'])} MB unique / "
                       f"{_mb(k['read_issued'])} issued, written {_mb(k['written_unique'])} / "
                       f"{_mb(k['written_issued'])}, {k['transcendentals']:,} transcendentals")
    sys.exit(1 if failed else 0)
