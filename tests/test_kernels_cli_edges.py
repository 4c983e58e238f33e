"""`spark-bench kernels` with the capture and the compiles faked (spark_bench/kernelgate/cli.py): exit 1 on a capture
error (and how many the table leaves out), cases summed over targets, the summary's counts, the table's grid CTAs,
and a bad --target or a capture that runs out of time as one line."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_cli
from test_kernel_gate import _spec
from test_kernel_gate_edges import SIG, _launch

from spark_bench.kernelgate import capture, cli, gate
from spark_bench.kernelgate.offline import Compiled

ONE_POINT = ("--op", "kda.gate", "--quick", "--no-presets", "--set", "tokens=1", "--set", "head_dim=60")


@pytest.fixture
def faked(monkeypatch):
    """faked(errors=) -> the command captures one spec (grids of 2 and 6 CTAs, 5 cases per target), with these
    capture errors, and compiles it fine."""
    def fake(errors=()):
        spec = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
        spec.launches = [_launch([2]), _launch([6, 1])]

        def capture_sweeps(ops, backends, presets, overrides, dtypes, quick, target):
            return gate.Capture([spec], [dict(e) for e in errors], 5, ["(GPU sweep)"])

        def compile_all(specs, targets, **kwargs):
            return [Compiled(s.key, s.kernel, t, "ok", regs=40, spill_stores=0, spill_loads=0, shared=0,
                             num_warps=4, num_stages=3, ctas_per_sm=16) for s in specs for t in targets]

        monkeypatch.setattr(gate, "capture_sweeps", capture_sweeps)
        monkeypatch.setattr(cli, "compile_all", compile_all)

    return fake


def test_a_launch_that_could_not_be_captured_fails_the_gate(faked):
    faked(errors=[{"op": "kda.gate", "backend": "triton", "params": {"tokens": 1}, "dtype": "bf16",
                   "message": "ValueError: boom"}])
    code, out, err = run_cli("kernels", *ONE_POINT)
    assert code == 1 and "capture failed" in out and "ValueError: boom" in out, out + err


def test_more_capture_errors_than_the_table_lists_are_counted(faked):
    faked(errors=[{"op": "kda.gate", "backend": "triton", "params": {"tokens": i}, "dtype": "bf16",
                   "message": "ValueError: boom"} for i in range(23)])
    code, out, err = run_cli("kernels", *ONE_POINT)
    assert code == 1 and out.count("ValueError: boom") == 20, out + err
    assert "capture failed for 3 more cases (--json lists every one)" in out, out


def test_a_capture_that_does_not_finish_in_time_is_one_line(monkeypatch):
    def too_slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(capture.subprocess, "run", too_slow)
    code, _, err = run_cli("kernels", *ONE_POINT)
    assert code == 2 and err.strip().splitlines()[-1] == "spark-bench: error: launch capture did not finish within " \
        "900 s" and "Traceback" not in err, err


def test_json_counts_the_cases_of_every_target(faked):
    faked()
    code, out, err = run_cli("kernels", *ONE_POINT, "--target", "sm_90a,sm_80", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["cases"] == 10 and sorted(r["target"] for r in data["rows"]) == ["sm_80", "sm_90a"]


def test_the_table_shows_the_span_of_grid_ctas(faked):
    faked()
    code, out, err = run_cli("kernels", *ONE_POINT)
    assert code == 0 and "2-6" in out, out


def test_the_summary_counts_each_failing_verdict_apart():
    rows = [{"target": "sm_90a", "module": "m", "kernel": k, "verdict": v}
            for k, v in [("a", "ok"), ("b", "spills"), ("c", "spills"), ("d", "compile-error")]]
    assert cli.summary(rows, ["sm_90a"], "3.9") == ("triton 3.9; sm_90a: 4 specialisations of 4 kernels, 1 ok, "
                                                    "1 compile errors, 0 launch-resource failures, 2 with spills")


def test_an_unknown_target_is_one_usage_line_before_any_work(faked):
    code, _, err = run_cli("kernels", *ONE_POINT, "--target", "sm_75")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "choose from sm_80, sm_90a, sm_100a" in err, err


def test_the_plain_gpu_sweep_comes_first_and_an_unknown_preset_is_refused(faked, monkeypatch):
    faked()
    heard = []
    capture_sweeps = gate.capture_sweeps
    monkeypatch.setattr(gate, "capture_sweeps", lambda ops, backends, presets, *rest: (
        heard.append(list(presets)), capture_sweeps(ops, backends, presets, *rest))[1])
    code, out, err = run_cli("kernels", "--op", "kda.gate", "--quick", "--set", "tokens=1", "--set", "head_dim=60")
    presets = gate.presets_of(["kda.gate"])
    assert code == 0 and "kimi-linear" in presets and heard == [[None, *presets]], out + err
    code, _, err = run_cli("kernels", "--op", "kda.gate", "--preset", "nope")
    assert code == 2 and f"unknown preset 'nope'; the selected ops have: {', '.join(presets)}" in err, err
    assert len(heard) == 1


def test_a_candidates_capture_that_fails_is_one_line(faked, monkeypatch):
    """`--candidates` captures again through the tuner's planning; its capture process dying was a traceback."""
    faked()

    def dies(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\nImportError: no triton")

    monkeypatch.setattr(capture.subprocess, "run", dies)
    code, _, err = run_cli("kernels", *ONE_POINT, "--candidates")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("spark-bench: error: launch capture failed (exit 1): ImportError: no "
                                            "triton"), err
