"""The offline GPU gate (spark_bench/kernelgate): every Triton kernel the GPU sweep and the model presets launch
compiles for sm_90a, fits and does not spill; and the gate does report kernels that are broken for a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spark_bench.kernelgate import compare, gate
from spark_bench.kernelgate.capture import Spec
from spark_bench.kernelgate.offline import compile_all, parse_ptxas_log, parse_res_usage, tensor_core_instructions
from spark_bench.kernelgate.targets import TARGETS

pytest.importorskip("triton")
H200 = TARGETS["sm_90a"]
BROKEN = "kernelgate.broken_kernels"
ROOT = Path(__file__).resolve().parents[1]


def _spec(kernel, signature, constexprs, options, attrs=None):
    return Spec(kernel=f"{BROKEN}:{kernel}", source_key=kernel, signature=signature, constexprs=constexprs,
                attrs=attrs or {}, options={"num_ctas": 1, **options})


@pytest.fixture(scope="session")
def gate_cache(tmp_path_factory):
    """One compile-result cache for the whole test session (each specialisation compiles once per CI run)."""
    return tmp_path_factory.mktemp("kernelgate-cache")


def test_ptxas_log_and_ptx_are_read():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert parse_ptxas_log(log) == {"regs": 255, "stack": 8, "spill_stores": 24, "spill_loads": 20}
    with pytest.raises(ValueError):
        parse_ptxas_log("")  # a cache hit prints nothing: never read it as zero spills
    ptx = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...}\n"
           "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {...}\n")
    assert tensor_core_instructions(ptx) == ["mma.sync m16n8k8 tf32", "wgmma m64n64k16 bf16"]


def test_res_usage_of_a_cached_cubin_counts_its_spills():
    """A Triton cache hit runs no ptxas, so the gate reads the cubin with cuobjdump. The recorded case (GGUF
    _decode_down, ptxas: 4 B spill stores, 8 B stack frame) reads LOCAL:0 there: the stack must count."""
    text = (" Function _decode_down:\n"
            "  REG:80 STACK:8 SHARED:1024 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert parse_res_usage(text) == {"regs": 80, "stack": 8, "spill_stores": 8, "spill_loads": 0}
    clean = "  REG:96 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    assert parse_res_usage(clean)["spill_stores"] == 0
    with pytest.raises(ValueError):
        parse_res_usage("")


def test_occupancy_follows_registers_warps_and_shared_memory():
    assert H200.ctas_per_sm(regs=32, warps=4, shared=0) == 16  # threads: 2048 / 128
    assert H200.ctas_per_sm(regs=255, warps=8, shared=0) == 1  # 256 regs x 256 threads = the whole file
    assert H200.ctas_per_sm(regs=128, warps=4, shared=0) == 4
    assert H200.ctas_per_sm(regs=32, warps=4, shared=100 * 1024) == 2  # 228 KB per SM
    assert H200.ctas_per_sm(regs=32, warps=4, shared=H200.smem_per_block + 1) == 0


def test_cover_compiles_every_constexpr_and_option_value_at_least_once():
    def spec(bt, warps, flag):
        return _spec("fits", {"x": "*bf16", "y": "*bf16", "n": "i32", "B": "constexpr"},
                     {"B": bt, "FLAG": flag}, {"num_warps": warps, "num_stages": 3})

    specs = [spec(bt, w, f) for bt in (16, 32, 64) for w in (4, 8) for f in (True, False)]
    cover = gate.select(specs, "cover")
    assert len(cover) < len(specs)
    assert {s.constexprs["B"] for s in cover} == {16, 32, 64}
    assert {s.options["num_warps"] for s in cover} == {4, 8}
    assert {s.constexprs["FLAG"] for s in cover} == {True, False}
    assert len(gate.select(specs, "classes")) == len(specs)


def test_broken_kernels_are_reported_as_failures(gate_cache):
    """A mismatched-branch kernel fails to compile; an over-budget num_stages kernel cannot launch; a small one
    passes (so the failures are not an artefact of the harness)."""
    ptr = [["tt.divisibility", 16]]
    specs = [
        _spec("mismatched_branches", {"x": "*fp32", "y": "*fp32", "n_blocks": "i32", "B": "constexpr"},
              {"B": 32}, {"num_warps": 4, "num_stages": 3}, {"x": ptr, "y": ptr}),
        _spec("staged_too_deep", {"a": "*fp32", "b": "*fp32", "c": "*fp32", "K": "i32", "BM": "constexpr",
                                  "BN": "constexpr", "BK": "constexpr"},
              {"BM": 128, "BN": 128, "BK": 64}, {"num_warps": 8, "num_stages": 4}, {"a": ptr, "b": ptr, "c": ptr}),
        _spec("fits", {"x": "*bf16", "y": "*bf16", "n": "i32", "B": "constexpr"}, {"B": 256},
              {"num_warps": 4, "num_stages": 3}, {"x": ptr, "y": ptr}),
    ]
    results = {r.kernel.rpartition(":")[2]: r for r in compile_all(specs, ["sm_90a"], jobs=2, cache_dir=gate_cache)}
    assert results["mismatched_branches"].verdict == "compile-error"
    assert "Mismatched type" in results["mismatched_branches"].error
    staged = results["staged_too_deep"]
    assert staged.verdict == "launch-resources", staged
    assert staged.shared > H200.smem_per_block and staged.ctas_per_sm == 0
    assert results["fits"].verdict == "ok" and results["fits"].spill_stores == 0
    assert {r.kernel for r in gate.failures(list(results.values()))} == {specs[0].kernel, specs[1].kernel}


def test_every_kernel_of_the_gpu_sweep_and_presets_compiles_fits_and_does_not_spill_on_sm_90a(gate_cache):
    """The CI gate: a covering set of the specialisations `spark-bench run --device cuda` (and every model preset)
    would launch, compiled offline for the H200, and none of them worse (CTAs per SM, spills, wgmma) than the
    committed table of this Triton version."""
    presets = [None, *gate.presets_of([])]
    assert {"kimi-linear", "deepseek-v3", "glm-4.5"} <= set(presets)
    captured = gate.capture_sweeps([], ["triton*"], presets, {}, [], False, "sm_90a")
    assert not captured.errors, captured.errors[:3]
    kernels = {s.name for s in captured.specs}
    assert {"_chunk_intra", "_chunk_state", "_chunk_output", "_short_conv_prefill", "_grouped_down",
            "_recurrent_decode", "_router_logits"} <= kernels
    chosen = gate.select(captured.specs, "cover")
    results = compile_all(chosen, ["sm_90a"], cache_dir=gate_cache)
    bad = [f"{r.kernel.rpartition(':')[2]} {r.verdict}: {r.error}" for r in gate.failures(results)]
    assert not bad, "\n".join(bad)
    assert all(r.regs and r.ctas_per_sm >= 1 for r in results)
    # and none worse than the committed table of this Triton (docs/kernels.md, "Compare"): a change that costs
    # occupancy or wgmma on purpose regenerates it, `spark-bench kernels --json > results/kernels/<that file>`
    import triton

    table = ROOT / "results" / "kernels" / f"sm_90a-triton-{'.'.join(triton.__version__.split('.')[:2])}.json"
    if table.is_file():
        base = compare.load(table)
        result = compare.diff(base["rows"], gate.rows(chosen, results))
        assert result["matched"] > len(chosen) // 2, compare.summary(result, table, base["triton"], triton.__version__)
        worse = [f"{c['kernel']} {c['dtypes']} {c['constexprs']}: {'; '.join(c['worse'])}" for c in result["changed"]
                 if c["worse"]]
        assert not worse, f"worse than {table}:\n" + "\n".join(worse)


def test_kernels_command_prints_the_table_and_exits_1_on_failure(tmp_path):
    """The user-facing command on one op: a table and a summary line; a bad target is a one-line usage error."""
    cmd = [sys.executable, "-m", "spark_bench", "kernels", "--op", "kda.gate", "--dtype", "bf16", "--set",
           "tokens=64", "--set", "heads=4", "--preset", "kimi-linear", "--json", "--cache-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["rows"] and all(r["verdict"] == "ok" and r["target"] == "sm_90a" for r in data["rows"])
    assert {r["kernel"] for r in data["rows"]} == {"_kda_gate_fwd"}
    bad = subprocess.run([sys.executable, "-m", "spark_bench", "kernels", "--target", "sm_75"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "sm_90a" in bad.stderr


def test_declared_candidates_are_compiled_and_an_unlaunchable_one_fails_the_gate(tmp_path, fault_env):
    """`--candidates`: every declared config of each kernel and key, not only the defaults the sweep launches. The
    tunable test plugin declares one that needs 2,048 threads per block (tests/plugins/tunable_plugin.py)."""
    env = {**fault_env, "SPARK_BENCH_PLUGINS": "tunable_plugin", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "spark_bench", "kernels", "--op", "tunable.scale", "--candidates", "--json",
           "--cache-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["candidates"]
    by_config = {r["config"]: r for r in rows}
    assert len(rows) == 4 and all(r["space"] == "tunable._scale" and r["keys"] == [{"n": 4096}] for r in rows)
    rejected = by_config["BLOCK=1024,REPEAT=0,WRONG=0,num_warps=64"]
    assert rejected["status"] == "pruned" and "launch-resources" in rejected["reason"]
    assert all(r["status"] == "ok" for c, r in by_config.items() if r is not rejected)


def test_a_compile_that_does_not_finish_in_time_is_ended_and_reported(tmp_path):
    ptr = [["tt.divisibility", 16]]
    slow = _spec("unrolled_forever", {"x": "*fp32", "y": "*fp32", "T": "constexpr"}, {"T": 20000},
                 {"num_warps": 4, "num_stages": 1}, {"x": ptr, "y": ptr})
    [result] = compile_all([slow], ["sm_90a"], jobs=1, cache_dir=tmp_path, deadline_s=5)
    assert result.verdict == "compile-error" and "not finished within 5 s" in result.error
    assert not list(tmp_path.rglob("*.json"))  # not cached: another attempt may have more time


def test_the_result_cache_keeps_results_compiled_with_triton_switches_apart(tmp_path, monkeypatch):
    """A result compiled with DISABLE_MMA_V3=1 (no wgmma) is not served for the default compile, nor the reverse."""
    from spark_bench.kernelgate.offline import ResultCache

    cache = ResultCache(tmp_path)
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    plain = cache._path("k", "sm_90a")
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    assert cache._path("k", "sm_90a") != plain and "DISABLE_MMA_V3=1" in str(cache._path("k", "sm_90a"))
    monkeypatch.setenv("DISABLE_MMA_V3", "0")
    assert cache._path("k", "sm_90a") == plain
