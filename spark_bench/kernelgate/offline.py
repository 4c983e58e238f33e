"""Compile captured specialisations for a GPU target on this machine (no GPU) and read what decides whether they run
well: `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))` gives the TTGIR, the PTX
and the cubin; Triton's own `ptxas -v` run (its log, printed with knobs.nvidia.dump_ptxas_log) gives registers and
spills; `metadata.shared` the dynamic shared memory, checked against the target's per-block limit.

Compiles run in parallel worker processes (each compile is single-threaded) with TRITON_ALWAYS_COMPILE=1, so the
ptxas log is never lost to Triton's cache; our own result cache (JSON per specialisation and target, keyed by the
kernel's source hash) makes a second run instant. `triton_cache` names a Triton cache directory to fill instead (a
precompiled cache for a GPU machine with the same Triton, or that machine's own cache filled in parallel before a
sweep): there kernels already cached are not compiled again and their registers and local memory come from the
cubin (`cuobjdump -res-usage`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from spark_bench.isolate import spawn_context
from spark_bench.kernelgate.capture import Spec
from spark_bench.kernelgate.targets import TARGETS

VERDICTS = ("ok", "spills", "launch-resources", "compile-error")


@dataclasses.dataclass
class Compiled:
    """What one specialisation compiles to on one target."""

    key: str  # Spec.key
    kernel: str
    target: str
    verdict: str  # one of VERDICTS
    error: str | None = None
    regs: int | None = None  # per thread
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    stack: int | None = None  # bytes of stack frame
    shared: int | None = None  # bytes of dynamic shared memory per CTA
    num_warps: int | None = None
    num_stages: int | None = None
    ctas_per_sm: int | None = None
    dots: int = 0  # tt.dot / warp_group_dot ops in the TTGIR
    mma: list[str] = dataclasses.field(default_factory=list)  # the tensor-core instructions the dots became
    seconds: float | None = None  # compile time on this machine
    triton: str = ""

    @property
    def tensor_core(self) -> str:
        """wgmma / mma.sync / none (dots on CUDA cores) / - (no dot)."""
        if not self.dots:
            return "-"
        kinds = sorted({m.split()[0] for m in self.mma})
        return "+".join(kinds) if kinds else "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+?)\.(\w+?)\.(\w+)")
_MMA = re.compile(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col\.(\w+?)\.(\w+?)\.(\w+?)\.(\w+)")


def tensor_core_instructions(ptx: str) -> list[str]:
    """'wgmma m64n64k16 bf16' / 'mma.sync m16n8k8 tf32' for every distinct MMA instruction in the PTX."""
    found = {f"wgmma {m.group(1)} {m.group(3)}" for m in _WGMMA.finditer(ptx)}
    found |= {f"mma.sync {m.group(1)} {m.group(3)}" for m in _MMA.finditer(ptx)}
    return sorted(found)


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers (max over the entry functions), spill stores / loads and stack (summed) from `ptxas -v`."""
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs:
        raise ValueError("no `ptxas -v` output (was the kernel taken from Triton's cache?)")
    return {"regs": max(regs), "stack": sum(int(p[0]) for p in props),
            "spill_stores": sum(int(p[1]) for p in props), "spill_loads": sum(int(p[2]) for p in props)}


def cubin_resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local memory (bytes per thread: spills and stack arrays) of a cubin, from the `cuobjdump
    -res-usage` that Triton ships: the fallback when Triton took the kernel from its cache and ran no ptxas."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return parse_res_usage(text)


def parse_res_usage(text: str) -> dict[str, int]:
    """`cuobjdump -res-usage` -> registers and local memory. Spills show there as STACK, not LOCAL (a kernel whose
    ptxas log said "8 bytes stack frame, 4 bytes spill stores" reads "REG:80 STACK:8 ... LOCAL:0"), and the
    counts cannot be told apart from other stack use, so any stack or local memory counts as spill stores."""
    regs = [int(r) for r in re.findall(r"REG:(\d+)", text)]
    stack = sum(int(r) for r in re.findall(r"STACK:(\d+)", text))
    local = sum(int(r) for r in re.findall(r"LOCAL:(\d+)", text))
    if not regs:
        raise ValueError(f"no resource usage in cuobjdump's output: {text[:200]!r}")
    return {"regs": max(regs), "stack": stack, "spill_stores": stack + local, "spill_loads": 0}


def _constexpr_value(value: Any) -> Any:
    if isinstance(value, dict) and "repr" in value:
        raise ValueError(f"constexpr {value['repr']} ({value['type']}) cannot be rebuilt offline")
    return value


def _jit_function(kernel: str):
    module, _, qualname = kernel.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def compile_one(spec: dict[str, Any], target_name: str) -> dict[str, Any]:
    """Compile one specialisation (a Spec as a dict) for a target; never raises: errors become the verdict."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    target = TARGETS[target_name]
    spec_obj = Spec.from_dict(spec)
    result = Compiled(key=spec_obj.key, kernel=spec_obj.kernel, target=target_name, verdict="compile-error",
                      num_warps=spec_obj.options.get("num_warps"), num_stages=spec_obj.options.get("num_stages"),
                      triton=triton.__version__)
    start = time.perf_counter()
    try:
        fn = _jit_function(spec_obj.kernel)
        index = {p.name: i for i, p in enumerate(fn.params)}
        constexprs = {(index[k],): _constexpr_value(v) for k, v in spec_obj.constexprs.items()}
        attrs = {(index[k],): [tuple(a) for a in v] for k, v in spec_obj.attrs.items()}
        src = ASTSource(fn, dict(spec_obj.signature), constexprs, attrs)
        knobs.nvidia.dump_ptxas_log = True
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=target.gpu_target(), options=dict(spec_obj.options))
        result.seconds = time.perf_counter() - start
        log_text = log.getvalue()
        usage = parse_ptxas_log(log_text) if "Used" in log_text else cubin_resource_usage(kernel.asm["cubin"])
    except Exception as exc:  # a compile error is a result, not a crash
        result.seconds = time.perf_counter() - start
        result.error = _error_line(exc)
        return result.to_dict()
    result.regs, result.stack = usage["regs"], usage["stack"]
    result.spill_stores, result.spill_loads = usage["spill_stores"], usage["spill_loads"]
    meta = kernel.metadata
    result.shared, result.num_warps, result.num_stages = meta.shared, meta.num_warps, meta.num_stages
    result.dots = len(re.findall(r"\b(?:tt\.dot|ttng\.warp_group_dot)\b", kernel.asm.get("ttgir", "")))
    result.mma = tensor_core_instructions(kernel.asm.get("ptx", ""))
    result.ctas_per_sm = target.ctas_per_sm(result.regs, result.num_warps, result.shared)
    threads = result.num_warps * 32
    if result.shared > target.smem_per_block:
        result.verdict = "launch-resources"
        result.error = f"out of resource: shared memory, required {result.shared} B, limit {target.smem_per_block} B"
    elif threads > target.max_threads_per_block:
        result.verdict = "launch-resources"
        result.error = f"{threads} threads per block exceed the limit of {target.max_threads_per_block}"
    elif result.ctas_per_sm == 0:
        result.verdict = "launch-resources"
        result.error = f"{result.regs} registers x {threads} threads exceed the SM's {target.regs_per_sm}"
    elif result.spill_stores or result.spill_loads:
        result.verdict = "spills"
        result.error = f"spills {result.spill_stores} B stores / {result.spill_loads} B loads"
    else:
        result.verdict = "ok"
    return result.to_dict()


def _error_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Triton's CompilationError starts with the source position; the cause is on a later line
    useful = [line for line in lines if not line.startswith("^")]
    return " | ".join(useful[:1] + [line for line in useful[1:] if "rror" in line][:2])[:400]


def _worker_init(env: dict[str, str], paths: list[str]) -> None:
    os.environ.update(env)
    sys.path[:0] = [p for p in paths if p not in sys.path]


class ResultCache:
    """One JSON file per (specialisation, target, Triton version, Triton code-generation switches set: a result
    compiled with DISABLE_MMA_V3=1 is not another's)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def _path(self, key: str, target: str) -> Path | None:
        if self.root is None:
            return None
        import triton

        from spark_bench.fingerprint import triton_codegen_env

        switches = "".join(f"-{k}={v}" for k, v in triton_codegen_env().items())
        return self.root / f"triton-{triton.__version__}{switches}" / target / f"{key}.json"

    def get(self, key: str, target: str) -> dict[str, Any] | None:
        path = self._path(key, target)
        if path is None or not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, record: dict[str, Any]) -> None:
        path = self._path(record["key"], record["target"])
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spark-bench" / "kernelgate"


def compile_all(specs: Iterable[Spec], targets: Iterable[str], *, jobs: int | None = None,
                cache_dir: Path | None = None, triton_cache: Path | None = None,
                progress: Callable[[int, int, Compiled], None] | None = None,
                deadline_s: float | None = None) -> list[Compiled]:
    """Compile every spec for every target (cached results first); returns results in spec x target order.
    `progress(done, total, result)` is called as each one finishes. After `deadline_s` seconds the compiles still
    running are killed and reported as compile errors "compile worker died: not finished within N s" (not cached)."""
    cache = ResultCache(None if triton_cache else cache_dir)
    work = [(spec, target) for spec in specs for target in targets]
    done: dict[tuple[str, str], Compiled] = {}
    todo = []
    for spec, target in work:
        hit = cache.get(spec.key, target)
        if hit is not None:
            done[(spec.key, target)] = Compiled(**hit)
        else:
            todo.append((spec, target))
    total = len(work)
    if progress:
        for i, result in enumerate(done.values(), 1):
            progress(i, total, result)
    if todo:
        env = {"TRITON_INTERPRET": "0", "TRITON_ALWAYS_COMPILE": "1"}
        if triton_cache is not None:  # the keys must be the ones the GPU's JIT computes: no extra knobs
            env = {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(triton_cache), "TRITON_ALWAYS_COMPILE": "0"}
        elif "TRITON_DEFAULT_FP_FUSION" not in os.environ:
            env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, said explicitly to silence its warning
        jobs = jobs or max(1, os.cpu_count() or 1)
        # slowest first: long compiles (many dots, big tiles) should not start last
        todo.sort(key=lambda st: -len(json.dumps(st[0].constexprs)))
        ctx = spawn_context()
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init,
                                         initargs=(env, list(sys.path))) as pool:
            running = {pool.submit(compile_one, spec.to_dict(), target): (spec, target) for spec, target in todo}

            def finish(fut) -> None:
                spec, target = running[fut]
                try:
                    if not fut.done():
                        raise TimeoutError(f"not finished within {deadline_s:g} s")
                    record = fut.result()
                except Exception as exc:  # the worker died (ptxas segfault, out of memory) or ran out of time
                    record = Compiled(key=spec.key, kernel=spec.kernel, target=target, verdict="compile-error",
                                      error=f"compile worker died: {_error_line(exc)}").to_dict()
                if record["verdict"] != "compile-error" or "worker died" not in (record["error"] or ""):
                    cache.put(record)
                result = Compiled(**record)
                done[(spec.key, target)] = result
                if progress:
                    progress(len(done), total, result)

            finished: set = set()
            try:
                for fut in futures.as_completed(running, timeout=deadline_s):
                    finish(fut)
                    finished.add(fut)
            except futures.TimeoutError:
                for proc in list(getattr(pool, "_processes", {}).values()):  # stuck in a compile: end it
                    proc.kill()
                for fut in running:
                    if fut not in finished:
                        finish(fut)
    return [done[(spec.key, target)] for spec, target in work]
