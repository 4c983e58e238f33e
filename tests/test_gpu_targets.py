"""The GPU check's issue targets (tests/gpu/targets.py): their runs are valid sweeps, and verdicts follow the rows."""

import sys
from pathlib import Path

import pytest
from conftest import run_cli

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import targets  # noqa: E402


@pytest.mark.parametrize("group", list(targets.GROUPS))
def test_each_group_is_a_valid_sweep_of_its_targets_points(group):
    code, out, err = run_cli("run", "--device", "cpu", "--full", "--dry-run", *targets.group_args(group))
    assert code == 0, err
    listed = [line.split() for line in out.splitlines() if line.startswith("  ")]
    for t in (t for t in targets.TARGETS if t.group == group):
        for backend in ("triton", *t.peers):
            cases = [c for c in listed if c[0] == t.op and c[1] == backend
                     and all(any(f"{a}={v}" in c for v in vals) for a, vals in t.where.items())]
            expected = 1
            for vals in t.where.values():
                expected *= len(vals)
            assert len(cases) >= expected, (t.name, backend, len(cases), expected)


def row(op, backend, status="ok", us=10.0, pct=None, **params):
    return {"op": op, "backend": backend, "dtype": "bf16", "params": params, "status": status, "error": "boom",
            "timing": {"median": us}, "roofline": {"pct_bw_measured": pct}}


PREFILL = next(t for t in targets.TARGETS if t.op == "kda.chunk_prefill" and t.min_ratio)
EXPERTS = next(t for t in targets.TARGETS if t.op == "moe.experts" and t.min_ratio and t.group == "moe-kimi")
GATE = next(t for t in targets.TARGETS if t.op == "kda.gate")


def prefill_rows(ours_us, fla_us):
    base = {"batch": 1, "varlen": "fixed", "fused": True, "head_dim_k": 128, "head_dim_v": 128}
    return [r for T in (4096, 16384, 65536) for H in (32, 4) for r in (
        row("kda.chunk_prefill", "triton", us=ours_us, seq_len=T, heads=H, **base),
        row("kda.chunk_prefill", "fla", us=fla_us, seq_len=T, heads=H, **base))]


def test_a_ratio_target_is_met_only_when_every_point_passes():
    v = targets.verdict(prefill_rows(10.0, 12.0), PREFILL)
    assert v["verdict"] == "met" and len(v["points"]) == 6 and {p["ratio"] for p in v["points"]} == {1.2}
    rows = prefill_rows(10.0, 12.0)
    rows[-1]["timing"]["median"] = 9.0  # fla faster at one point
    assert targets.verdict(rows, PREFILL)["verdict"] == "not met"
    rows = prefill_rows(10.0, 12.0)
    rows[1]["status"] = "error"  # fla failed at one point: that point is not judged, never "not met"
    assert targets.verdict(rows, PREFILL)["verdict"].startswith("partial (5 of 6 values measured")


def test_missing_points_are_partial_and_a_failed_check_is_failed():
    rows = prefill_rows(10.0, 12.0)[:4]  # the budget ran out after two points
    assert targets.verdict(rows, PREFILL)["verdict"] == "partial (2 of 6 points)"
    rows[0]["status"] = "mismatch"
    assert targets.verdict(rows, PREFILL)["verdict"].startswith("failed: mismatch at {")
    assert targets.verdict([], PREFILL)["verdict"] == "not measured"
    skipped = prefill_rows(10.0, 12.0)
    for r in skipped:
        r["status"] = "skipped"
    assert targets.verdict(skipped, PREFILL)["verdict"] == "not measured"


def test_the_peer_falls_back_to_torch_when_vllm_did_not_run_and_roofline_targets_read_pct():
    p = {"hidden": 2304, "experts": 256, "topk": 8, "inter": 1024, "routing": "uniform"}
    rows = [r for T in targets.MOE_T["tokens"] for r in (
        row("moe.experts", "triton", us=5.0, tokens=T, **p),
        row("moe.experts", "vllm", status="skipped", tokens=T, **p),
        row("moe.experts", "torch", us=15.0, tokens=T, **p))]
    v = targets.verdict(rows, EXPERTS)
    assert v["verdict"] == "met" and {(q["peer"], q["ratio"]) for q in v["points"]} == {("torch", 3.0)}
    gate = [row("kda.gate", "triton", pct=79.9, tokens=65536, heads=32, head_dim=128)]
    assert targets.verdict(gate, GATE)["verdict"] == "not met"
    gate[0]["roofline"]["pct_bw_measured"] = 80.0
    assert targets.verdict(gate, GATE)["verdict"] == "met" and "compiled_with" not in targets.verdict(gate, GATE)


def test_verdicts_read_damaged_journals_and_say_what_their_runs_compiled_with(tmp_path):
    """After step 2b of the GPU check the group runs compile without wgmma: each verdict says so (its Triton peers
    lost wgmma too, its torch peers did not); an amendment line or a killed run's partial line is read, not fatal."""
    import json

    run = tmp_path / "kda-decode"
    run.mkdir()
    gate = row("kda.gate", "triton", pct=85.0, tokens=65536, heads=32, head_dim=128)
    gate["case_id"] = "g1"
    amendment = {"schema_version": 1, "amends": "g1", "label": "suspect", "fields": {"suspect": "maybe"}}
    (run / "results.jsonl").write_text(json.dumps(gate) + "\n" + json.dumps(amendment) + "\n" + '{"op": "kda')
    (run / "run.json").write_text(json.dumps({"fingerprint": {"triton_codegen_env": {"DISABLE_MMA_V3": "1"}}}))
    rows = targets.read_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["labels"] == ["suspect"]
    v = targets.verdict(rows, GATE)
    assert v["verdict"] == "met" and v["compiled_with"] == {"DISABLE_MMA_V3": "1"}


def test_the_gpu_check_writes_at_most_8_files():
    # The device tool returns at most 8 files from $OUT (the library's device README): every file the script names.
    import re

    script = (Path(__file__).parent / "gpu" / "run_gpu_check.sh").read_text()
    files = set(re.findall(r"\$OUT/([A-Za-z0-9_.-]+)", script))
    assert "targets.json" in files and "runs.tar.gz" in files and len(files) <= 8, sorted(files)


def test_the_profiled_cases_exist_and_are_in_the_gpu_check():
    import profiles

    assert profiles.main("unused", device="cpu", dry=True) == 0  # every op, backend and axis value resolves
    script = (Path(__file__).parent / "gpu" / "run_gpu_check.sh").read_text()
    assert "tests/gpu/profiles.py /tmp/gpu-profiles" in script and "gpu-profiles" in script.split("tar ")[-1]


def test_the_fault_locator_picks_each_backends_first_cuda_fault(tmp_path):
    """Step 4b re-runs, per (op, backend, dtype), the first case that died of a CUDA fault: named in its error, its
    worker's log or its earlier (unconfirmed) error; a mismatch, a start-up crash or an OOM is no fault to locate."""
    import json

    import locate_faults

    def rec(op, backend, status, params, **extra):
        return {"op": op, "backend": backend, "dtype": "bf16", "status": status, "params": params, **extra}

    rows = [rec("kda.gate", "triton", "mismatch", {"tokens": 1}, error="err_ratio 3"),
            rec("kda.gate", "triton", "crash", {"tokens": 2}, error="worker died during start-up (exit code 1)"),
            rec("kda.gate", "triton", "error", {"tokens": 3},
                error="RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"),
            rec("kda.gate", "triton", "error", {"tokens": 4}, error="CUDA error: an illegal memory access"),
            rec("moe.experts", "torch", "crash", {"tokens": 1}, error="worker killed by SIGABRT",
                worker_log_tail="CUDA error: misaligned address\nAborted"),
            rec("moe.experts", "triton", "oom", {"tokens": 1}, error="CUDA out of memory")]
    ok = rec("kda.gated_rmsnorm", "triton", "ok", {"tokens": 5}, case_id="c5")
    amendment = {"schema_version": 1, "amends": "c5", "label": "suspect", "fields": {"suspect": "the worker died "
                 "during the next case: this case may have left an asynchronous fault"}}
    for name, part in (("a", rows[:3]), ("b", rows[3:] + [ok, amendment])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part)
                                                       + '{"op": "kda.gate", "backend"')  # a killed run's last line
    # a later run of the same backends compiled without wgmma (the GPU check after step 2b): its faults count apart
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.jsonl").write_text(json.dumps(rows[2]) + "\n")
    no_wgmma = {"fingerprint": {"triton_codegen_env": {"DISABLE_MMA_V3": "1"}}}
    (tmp_path / "c" / "run.json").write_text(json.dumps(no_wgmma))
    found = locate_faults.faulting_cases([tmp_path / "a", tmp_path / "b", tmp_path / "missing", tmp_path / "c"])
    assert [(c["op"], c["backend"], c["params"], c["codegen"]) for c in found] == [
        ("kda.gate", "triton", {"tokens": 3}, {}), ("moe.experts", "torch", {"tokens": 1}, {}),
        ("kda.gated_rmsnorm", "triton", {"tokens": 5}, {}),
        ("kda.gate", "triton", {"tokens": 3}, {"DISABLE_MMA_V3": "1"})]
    script = (Path(__file__).parent / "gpu" / "run_gpu_check.sh").read_text()
    assert "tests/gpu/locate_faults.py /tmp/gpu-faults.jsonl /tmp/gpu-correct /tmp/gpu-targets/*" in script


def test_the_fault_locator_reports_the_failing_call_and_its_frames(tmp_path, fault_env, monkeypatch):
    """The re-run itself (here on the CPU, a backend that raises standing in for a faulting launch): one JSON line
    with the error and the frames under plugins/ or kernels/ that led to it."""
    import json

    import locate_faults

    for key in ("PYTHONPATH", "SPARK_BENCH_PLUGINS"):
        monkeypatch.setenv(key, fault_env[key])
    run = tmp_path / "run"
    run.mkdir()
    row = {"op": "fault.scale", "backend": "raises", "dtype": "fp32", "device": "cpu", "status": "error",
           "params": {"rows": 3}, "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    (run / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert locate_faults.main([str(tmp_path / "faults.jsonl"), str(run), "--budget", "120"]) == 0
    (found,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert found["faulted"] is True and found["error"] == "ValueError: deliberate failure in the backend"
    assert any(frame.startswith("fault_plugin.py:") for frame in found["frames"]), found
    assert found["without_wgmma"] == "faulted: ValueError: deliberate failure in the backend"  # not wgmma's fault
    assert locate_faults.main(["--any", str(run)]) == 0 and locate_faults.main(["--any", str(tmp_path)]) == 1


def test_a_fault_is_run_again_without_wgmma(tmp_path, monkeypatch):
    """Triton >= 3.6 faults on sm_90 in some multi-dot kernels with Hopper's wgmma: each faulting case runs once as
    the sweep compiled it (DISABLE_MMA_V3 unset, whatever the caller's environment) and once with DISABLE_MMA_V3=1,
    and the row says whether the fault went away."""
    import json

    import locate_faults

    envs = []

    def fake_run(cmd, timeout, env):
        envs.append(env)
        case = json.loads(cmd[-1])
        faulted = "DISABLE_MMA_V3" not in env  # a wgmma-only fault
        out = {**case, "faulted": faulted, **({"error": "AcceleratorError: illegal memory access"} if faulted else {})}
        return 0, json.dumps(out) + "\n", ""

    monkeypatch.setattr(locate_faults, "_run_group", fake_run)
    monkeypatch.setattr(locate_faults, "sanitizer", lambda: None)
    monkeypatch.setenv("DISABLE_MMA_V3", "1")  # as the GPU check exports it after step 1's fault
    run = tmp_path / "run"
    run.mkdir()
    row = {"op": "kda.chunk_prefill", "backend": "triton", "dtype": "bf16", "status": "crash", "params": {"heads": 2},
           "error": "worker died", "worker_log_tail": "CUDA error: an illegal memory access was encountered"}
    (run / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert locate_faults.main([str(tmp_path / "faults.jsonl"), str(run), "--budget", "60"]) == 0
    (found,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert found["faulted"] is True and found["without_wgmma"] == "ran"
    assert [e.get("DISABLE_MMA_V3") for e in envs] == [None, "1"]  # as compiled, whatever the caller exported
    assert all(e["CUDA_LAUNCH_BLOCKING"] == "1" for e in envs)
    # a fault of a run compiled without wgmma: as compiled first (DISABLE_MMA_V3 kept), then with wgmma
    (run / "run.json").write_text(json.dumps({"fingerprint": {"triton_codegen_env": {"DISABLE_MMA_V3": "1"}}}))
    envs.clear()
    monkeypatch.delenv("DISABLE_MMA_V3")
    assert locate_faults.main([str(tmp_path / "faults.jsonl"), str(run), "--budget", "60"]) == 0
    (found,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert found["faulted"] is False and "with_wgmma" not in found  # no fault as compiled: nothing to flip
    assert [e.get("DISABLE_MMA_V3") for e in envs] == ["1"]


def test_the_first_fault_is_also_run_under_compute_sanitizer(tmp_path, fault_env, monkeypatch):
    """Where compute-sanitizer is installed, the first faulting case runs under its memcheck too; its report's lines
    (here a stand-in tool's) are kept with the row."""
    import json
    import stat

    import locate_faults

    for key in ("PYTHONPATH", "SPARK_BENCH_PLUGINS"):
        monkeypatch.setenv(key, fault_env[key])
    tool = tmp_path / "compute-sanitizer"
    tool.write_text("#!/bin/sh\necho '========= COMPUTE-SANITIZER'\n"
                    "echo '========= Invalid __global__ read of size 2 bytes'\necho 'not a report line'\n"
                    "echo \"========= DISABLE_MMA_V3=${DISABLE_MMA_V3:-unset}\"\nexit 1\n")
    monkeypatch.setenv("DISABLE_MMA_V3", "1")  # exported by the GPU check after step 2's fault
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(locate_faults, "sanitizer", lambda: str(tool))
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"op": "fault.scale", "backend": name, "dtype": "fp32", "device": "cpu", "status": "error",
             "params": {"rows": 3}, "error": "CUDA error: an illegal memory access was encountered"}
            for name in ("raises", "nan")]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    locate_faults.main([str(tmp_path / "faults.jsonl"), str(run), "--budget", "200"])
    found = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert found[0]["sanitizer"] == ("========= COMPUTE-SANITIZER\n"
                                     "========= Invalid __global__ read of size 2 bytes\n"
                                     "========= DISABLE_MMA_V3=unset")  # compiled as the faulting run was
    assert found[1]["faulted"] is False and "sanitizer" not in found[1]  # the nan backend runs: no fault to sanitize


@pytest.mark.parametrize("name", ["run_gpu_check.sh", "run_gpu_tune.sh"])
def test_the_gpu_scripts_call_spark_bench_with_options_it_has(name):
    """A misspelt or removed option would cost a whole device call (exit 2 at the step): every `spark-bench CMD
    --option` of the prepared scripts must be an option of that command."""
    import re

    from spark_bench.cli import main

    script = (Path(__file__).parent / "gpu" / name).read_text().replace("\\\n", " ")
    calls = [m.group(1, 2) for line in script.splitlines() if not line.lstrip().startswith("#")
             for m in re.finditer(r"spark-bench (\w+)([^;|&>']*)", line)]
    assert len(calls) >= 3, calls
    for command, args in calls:
        cmd = main.commands[command]
        known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
        unknown = [a for a in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", args) if a not in known]
        assert not unknown, f"{name}: spark-bench {command} has no {unknown}"


def test_each_target_group_keeps_its_share_of_the_budget(tmp_path, monkeypatch):
    """Groups that use all their time cannot starve the chunk prefill (last): it gets its declared share of the
    budget; what a quick group leaves unused goes to the later ones."""
    limits = {}

    class Proc:
        def __init__(self, cmd):
            self.group = Path(cmd[cmd.index("--out") + 1]).name

        def wait(self, timeout=None):
            limits[self.group] = timeout
            clock[0] += timeout if self.group != "kda-decode" else 1.0  # the decode group is quick
            return 0

    clock = [0.0]
    monkeypatch.setattr(targets.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(targets.subprocess, "Popen", Proc)
    targets.run(tmp_path, 150.0, [])
    assert list(limits) == list(targets.GROUPS)
    assert limits["kda-decode"] == pytest.approx(150 * targets.SHARES["kda-decode"])
    left = 149.0  # after the quick group: shared among the rest
    assert limits["moe-kimi"] == pytest.approx(left * 0.25 / 0.8)
    assert limits["kda-prefill"] == pytest.approx(150 * targets.SHARES["kda-prefill"] + (30 - 1) * 0.35 / 0.8)
    assert sum(targets.SHARES.values()) == pytest.approx(1.0) and set(targets.PRECOMPILE_ORDER) == set(targets.GROUPS)


def test_only_a_fault_that_could_be_wgmma_s_turns_wgmma_off(tmp_path):
    """Step 2b: a fault in an op whose kernels chain dots, compiled with wgmma, and not a misaligned address."""
    import json

    import locate_faults

    def run_with(*rows, codegen=None):
        path = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if codegen:
            (path / "run.json").write_text(json.dumps({"fingerprint": {"triton_codegen_env": codegen}}))
        return str(path)

    def crash(op, error):
        return {"op": op, "backend": "triton", "dtype": "bf16", "status": "crash", "params": {}, "error": error}

    illegal = "CUDA error: an illegal memory access was encountered"
    assert locate_faults.main(["--wgmma-suspect", run_with(crash("kda.chunk_prefill", illegal))]) == 0
    assert locate_faults.main(["--wgmma-suspect", run_with(crash("moe.experts_gguf", "misaligned address"))]) == 1
    in_the_log = {**crash("kda.chunk_prefill", "worker killed by SIGABRT in phase 'check'"),
                  "worker_log_tail": "x" * 400 + "\nRuntimeError: CUDA error: misaligned address"}
    assert locate_faults.main(["--wgmma-suspect", run_with(in_the_log)]) == 1  # past the error's first 300 chars
    assert locate_faults.main(["--wgmma-suspect", run_with(crash("kda.gate", illegal))]) == 1  # no dots
    assert locate_faults.main(["--any", run_with(crash("kda.gate", illegal))]) == 0  # step 4b still locates it
    no_wgmma = run_with(crash("moe.experts", illegal), codegen={"DISABLE_MMA_V3": "1"})
    assert locate_faults.main(["--wgmma-suspect", no_wgmma]) == 1  # already without wgmma


def test_profiles_give_each_case_what_is_left_of_the_budget(monkeypatch, capsys):
    """Step 4c: each case within --timeout and what is left of --budget, so the outer `timeout` never cuts one off;
    with under 3 s left a case is skipped and counted as failed."""
    import profiles

    clock, limits = [0.0], []

    def fake_run(cmd, timeout):
        limits.append(timeout)
        clock[0] += 10.0
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(profiles.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(profiles.subprocess, "run", fake_run)
    assert profiles.main("unused", timeout_s=12.0, budget_s=34.0) == 1
    assert limits == [12.0, 12.0, 12.0, 4.0] and capsys.readouterr().out.count("no time left in the budget") == 1


def test_the_gpu_check_s_step_limits_fit_its_call():
    """The device call runs with timeout_s=540: the steps' own limits (each `timeout N`, the targets' and the sweep's
    budgets; step 2b's precompile is taken from the targets' budget) must leave >= 40 s for the installs, the
    verdicts, the report and the archives."""
    import re

    script = (Path(__file__).parent / "gpu" / "run_gpu_check.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    limits = sum(int(n) for n in re.findall(r"(?<![-\w])timeout (\d+)", code))
    swapped = int(re.search(r"TARGETS_BUDGET_S - (\d+)", code).group(1))
    targets_s = int(re.search(r"TARGETS_BUDGET_S:-(\d+)", code).group(1))
    sweep_s = int(re.search(r"SWEEP_BUDGET_S:-(\d+)", code).group(1)) + 5
    assert limits - swapped + targets_s + sweep_s <= 500, (limits, swapped, targets_s, sweep_s)
    assert "--no-energy" in code.split("== 2. ")[1].split("== 2b.")[0]  # 80 energy windows would not fit in 70 s
    assert code.index("spark-bench calibrate") < code.index("== 2. ")  # measured before any run reads it


def test_the_first_peer_that_ran_is_the_one_compared_and_only_bf16_rows_of_ours_count():
    """Mutation audit 3: G7 (the peer loop not stopped at the first peer: torch judged where vLLM ran), G5 (the
    bf16 filter dropped: an fp32 sweep's failure failed a bf16 target), G9 (a target without a bound said 'met')."""
    import dataclasses

    p = {"hidden": 2304, "experts": 256, "topk": 8, "inter": 1024, "routing": "uniform"}
    rows = [r for T in targets.MOE_T["tokens"] for r in (
        row("moe.experts", "triton", us=5.0, tokens=T, **p),
        row("moe.experts", "vllm", us=6.0, tokens=T, **p),
        row("moe.experts", "torch", us=15.0, tokens=T, **p),
        {**row("moe.experts", "triton", status="mismatch", tokens=T, **p), "dtype": "fp32"})]
    v = targets.verdict(rows, EXPERTS)
    assert v["verdict"] == "met" and {(q["peer"], q["ratio"]) for q in v["points"]} == {("vllm", 1.2)}
    unbounded = dataclasses.replace(GATE, min_pct_bw=None, min_ratio=None)
    gate = [row("kda.gate", "triton", pct=10.0, tokens=65536, heads=32, head_dim=128)]
    assert targets.verdict(gate, unbounded)["verdict"] == "measured"
