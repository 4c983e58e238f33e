"""spark_bench/kernelgate/offline.py without ptxas: the verdict of a compile from what it reports (Triton's compile
faked: its ptxas log, shared memory and warps), the error line of a compile error, the result cache (per target,
a damaged file, XDG_CACHE_HOME) and compile_all's order and progress."""

from __future__ import annotations

import concurrent.futures
import types

import pytest
import triton
from test_kernel_gate import _spec

from spark_bench.kernelgate import offline
from spark_bench.kernelgate.capture import Spec
from spark_bench.kernelgate.offline import Compiled, ResultCache, compile_all, compile_one
from spark_bench.kernelgate.targets import TARGETS

H200 = TARGETS["sm_90a"]
SIG = {"x": "*bf16", "y": "*bf16", "n": "i32", "B": "constexpr"}


@pytest.fixture
def compiles_to(monkeypatch):
    """compiles_to(regs=, spills=(stores, loads), shared=, warps=) -> compile_one's record for a spec whose compile
    reports those (the ptxas log printed, the metadata returned)."""
    monkeypatch.setattr(triton.knobs.nvidia, "dump_ptxas_log", False)
    monkeypatch.setattr(offline, "_jit_function",
                        lambda kernel: types.SimpleNamespace(params=[types.SimpleNamespace(name=n) for n in SIG]))
    monkeypatch.setattr(triton.compiler, "ASTSource", lambda *args: args)

    def compiled(regs=40, spills=(0, 0), shared=0, warps=4):
        def fake_compile(src, target, options):
            print(f"ptxas info    : Function properties for fits\n    0 bytes stack frame, {spills[0]} bytes spill "
                  f"stores, {spills[1]} bytes spill loads\nptxas info    : Used {regs} registers, used 1 barriers")
            meta = types.SimpleNamespace(shared=shared, num_warps=warps, num_stages=3)
            return types.SimpleNamespace(metadata=meta, asm={"ttgir": "", "ptx": ""})

        monkeypatch.setattr(triton, "compile", fake_compile)
        spec = _spec("fits", SIG, {"B": 64}, {"num_warps": warps, "num_stages": 3})
        return compile_one(spec.to_dict(), "sm_90a")

    return compiled


def test_spill_loads_alone_are_spills(compiles_to):
    record = compiles_to(spills=(0, 8))
    assert record["verdict"] == "spills" and record["error"] == "spills 0 B stores / 8 B loads"
    assert compiles_to()["verdict"] == "ok"


def test_the_whole_shared_memory_of_a_block_launches_and_a_byte_more_does_not(compiles_to):
    assert compiles_to(shared=H200.smem_per_block)["verdict"] == "ok"
    record = compiles_to(shared=H200.smem_per_block + 1)
    assert record["verdict"] == "launch-resources" and f"limit {H200.smem_per_block} B" in record["error"]


def test_a_block_whose_registers_do_not_fit_one_sm_cannot_launch(compiles_to):
    """255 registers x 512 threads = 130560 > 65536: not a single CTA fits, though 512 threads are allowed."""
    record = compiles_to(regs=255, warps=16)
    assert record["verdict"] == "launch-resources" and record["ctas_per_sm"] == 0
    assert record["error"] == "255 registers x 512 threads exceed the SM's 65536"


def test_a_block_of_too_many_threads_is_blamed_on_its_threads_not_its_registers(compiles_to):
    """64 warps of 32 registers: 65536 registers fit the SM, but 2048 threads exceed a block's 1024."""
    record = compiles_to(regs=32, warps=64)
    assert record["verdict"] == "launch-resources"
    assert record["error"] == "2048 threads per block exceed the limit of 1024"


def test_a_compile_error_line_keeps_the_cause_not_the_source_caret():
    exc = RuntimeError("at 12:8:\n        p = x + o\n        ^\nValueError: Mismatched type for p between then/else")
    assert offline._error_line(exc) == ("RuntimeError: at 12:8: | ValueError: Mismatched type for p between "
                                        "then/else")


def test_the_result_cache_keeps_targets_apart_and_recompiles_a_damaged_entry(tmp_path):
    cache = ResultCache(tmp_path)
    record = Compiled("k", "m:f", "sm_90a", "ok", regs=40).to_dict()
    cache.put(record)
    assert cache.get("k", "sm_90a") == record and cache.get("k", "sm_80") is None
    cache._path("k", "sm_90a").write_text('{"key": ')  # a run killed while writing another tool's copy
    assert cache.get("k", "sm_90a") is None


def test_the_default_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert offline.default_cache_dir() == tmp_path / "spark-bench" / "kernelgate"


class _InlinePool(concurrent.futures.ThreadPoolExecutor):
    """The worker pool in this process (no spawn, no environment change)."""

    def __init__(self, max_workers, mp_context, initializer, initargs):
        super().__init__(max_workers=1)


def test_compile_all_answers_in_spec_order_and_counts_cached_results_from_one(monkeypatch, tmp_path):
    """Cached results first, then compiles as they finish: progress counts 1..n; results keep the specs' order."""
    specs = [_spec("fits", SIG, {"B": b}, {"num_warps": 4}) for b in (16, 32, 64)]
    cache = ResultCache(tmp_path)
    for spec in specs[1:]:
        cache.put(Compiled(spec.key, spec.kernel, "sm_90a", "ok", regs=99).to_dict())
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _InlinePool)
    monkeypatch.setattr(offline, "compile_one",
                        lambda spec, target: Compiled(Spec.from_dict(spec).key, spec["kernel"], target, "ok",
                                                      regs=7).to_dict())
    heard = []
    results = compile_all(specs, ["sm_90a"], jobs=1, cache_dir=tmp_path,
                          progress=lambda done, total, r: heard.append((done, total)))
    assert [r.key for r in results] == [s.key for s in specs] and [r.regs for r in results] == [7, 99, 99]
    assert heard == [(1, 3), (2, 3), (3, 3)]


def test_a_compile_error_is_cached_but_a_worker_that_died_is_not(monkeypatch, tmp_path):
    specs = [_spec("fits", SIG, {"B": b}, {"num_warps": 4}) for b in (16, 32)]
    errors = {16: "CompilationError: at 1:2: | ValueError: Mismatched type", 32: "compile worker died: boom"}
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _InlinePool)
    monkeypatch.setattr(offline, "compile_one", lambda spec, target: Compiled(
        Spec.from_dict(spec).key, spec["kernel"], target, "compile-error", errors[spec["constexprs"]["B"]]).to_dict())
    compile_all(specs, ["sm_90a"], jobs=1, cache_dir=tmp_path)
    cache = ResultCache(tmp_path)
    assert cache.get(specs[0].key, "sm_90a")["error"] == errors[16] and cache.get(specs[1].key, "sm_90a") is None
