"""`spark-bench profile` on CPU: trace, per-kernel breakdown, profiler timer, and one-line errors."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from spark_bench.telemetry.cli import profile as profile_cmd
from spark_bench.telemetry.profile import (
    ProfileError,
    kernel_rows,
    parse_ncu_csv,
    profile_case,
    profiler_time,
    record,
    resolve_case,
)


def test_profile_kda_gate_torch_on_cpu(tmp_path):
    summary = profile_case("kda.gate", "torch", sets=["tokens=67", "head_dim=60"], dtype="fp32", device="cpu",
                           out_dir=tmp_path, iters=3, warmup=1)
    assert summary["params"] == {"tokens": 67, "heads": 4, "head_dim": 60} and summary["dtype"] == "fp32"
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::softplus" in names and "spark_bench.call" in names
    saved = json.loads((tmp_path / "kernels.json").read_text())
    rows = saved["kernels"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["aten::softplus"]["calls"] == 3 and by_name["aten::exp"]["calls"] == 3
    assert "spark_bench.call" not in by_name  # our marker is not a kernel
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [r["total_us"] for r in rows] == sorted((r["total_us"] for r in rows), reverse=True)
    for r in rows:
        assert r["mean_us"] == pytest.approx(r["total_us"] / r["calls"])
    assert saved["kernel_us_per_call"] == pytest.approx(sum(r["total_us"] for r in rows) / 3)
    assert "aten::softplus" in (tmp_path / "kernels.txt").read_text()


def test_profiler_time_counts_the_ops():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    prof = record(lambda: a @ b @ b, "cpu", iters=4, warmup=1)
    rows = {r["name"]: r for r in kernel_rows(prof, "cpu", 4)}
    assert rows["aten::mm"]["calls"] == 8
    seconds = profiler_time(lambda: a @ b, "cpu", iters=4, warmup=1)
    assert 0 < seconds < 1.0


def test_resolve_errors_name_the_choices():
    with pytest.raises(ProfileError, match="unknown op 'kda.nope'"):
        resolve_case("kda.nope", "torch")
    with pytest.raises(ProfileError, match="no backend 'cuda_magic'; choose from .*torch"):
        resolve_case("kda.gate", "cuda_magic")
    with pytest.raises(ProfileError, match="no axis 'experts'; choose from tokens, heads, head_dim"):
        resolve_case("kda.gate", "torch", ["experts=8"])
    with pytest.raises(ProfileError, match="takes integers"):
        resolve_case("kda.gate", "torch", ["tokens=many"])
    with pytest.raises(ProfileError, match="one value per axis"):
        resolve_case("kda.gate", "torch", ["tokens=1,2"])
    with pytest.raises(ProfileError, match="does not take dtype fp64"):
        resolve_case("kda.gate", "torch", [], "fp64")
    with pytest.raises(ProfileError, match="cannot run on cpu"):
        resolve_case("kda.gate", "fla", [], None, "cpu")
    op, backend, params, dtype = resolve_case("kda.gate", "torch", ["dtype=float32", "tokens=5"])
    assert (op.name, backend.name, params["tokens"], dtype) == ("kda.gate", "torch", 5, "fp32")


@pytest.mark.parametrize("args,needle", [
    (["--op", "kda.nope", "--backend", "torch"], "unknown op"),
    (["--op", "kda.gate", "--backend", "nope"], "has no backend"),
    (["--op", "kda.gate", "--backend", "torch", "--set", "bogus=3"], "has no axis"),
    (["--op", "kda.gate", "--backend", "torch", "--set", "tokens"], "malformed --set"),
    (["--op", "kda.gate", "--backend", "torch", "--device", "tpu"], "unknown device"),
    (["--op", "kda.gate", "--backend", "torch", "--set", "tokens=1", "--set", "tokens=2"], "--set tokens given twice"),
    (["--op", "kda.gate", "--backend", "torch", "--set", "dtype=bf16", "--set", "dtype=fp32"], "--set dtype given"),
    (["--op", "moe.router", "--backend", "torch", "--ncu", "--weights", "w.gguf"], "--ncu profiles synthetic inputs"),
])
def test_cli_errors_are_one_line_exit_2(args, needle):
    result = CliRunner().invoke(profile_cmd, [*args, "--device", "cpu"] if "--device" not in args else args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_ncu_absent_is_one_line_exit_2():
    if shutil.which("ncu"):
        pytest.skip("ncu is installed here")
    result = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "torch", "--device", "cpu", "--ncu"])
    assert result.exit_code == 2 and "ncu (Nsight Compute) is not on PATH" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_profile_writes_files(tmp_path):
    out = tmp_path / "prof"
    result = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "torch", "--set", "tokens=33",
                                              "--device", "cpu", "--out", str(out), "--iters", "2"])
    assert result.exit_code == 0, result.output
    assert "tokens=33" in result.stdout and "aten::softplus" in result.stdout
    wall = float(result.stdout.split("us wall per call on the host")[0].rsplit(";", 1)[1])
    summary = json.loads((out / "kernels.json").read_text())
    assert wall == pytest.approx(summary["wall_us_per_call"], abs=0.01) and wall >= summary["kernel_us_per_call"]
    assert {p.name for p in out.iterdir()} >= {"trace.json", "kernels.json", "kernels.txt"}


def test_parse_ncu_csv():
    text = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
        '"0","1","python","h","kda_gate_kernel","1","7","(128, 1, 1)","(67, 1, 1)","0","9.0","Command line profiler '
        'metrics","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","%","61.25"',
        '"0","1","python","h","kda_gate_kernel","1","7","(128, 1, 1)","(67, 1, 1)","0","9.0","Command line profiler '
        'metrics","gpu__time_duration.sum","nsecond","4,512"',
        '"1","1","python","h","other","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics",'
        '"sm__warps_active.avg.pct_of_peak_sustained_active","%","n/a"',
    ])
    kernels = parse_ncu_csv(text)
    assert kernels[0]["kernel"] == "kda_gate_kernel" and kernels[0]["dram_throughput_pct"] == 61.25
    assert kernels[0]["duration"] == 4512.0 and kernels[0]["duration_unit"] == "nsecond"
    assert kernels[1]["achieved_occupancy_pct"] == "n/a"
    assert parse_ncu_csv("no csv here") == []


def test_an_interpreted_kernels_profile_says_its_rows_miss_the_interpreters_work(tmp_path):
    """On a CPU the interpreter's Python/numpy work is no aten op: the rows summed to ~1/300 of a call. The wall
    time per call is printed beside them, and the label says what the rows leave out."""
    out = tmp_path / "prof"
    result = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "triton", "--set", "tokens=3",
                                              "--device", "cpu", "--out", str(out), "--iters", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "kernels.json").read_text())
    assert "interpreted" in summary["labels"] and "not an aten op" in summary["what"]
    assert summary["wall_us_per_call"] > summary["kernel_us_per_call"]
    assert "us wall per call on the host" in result.stdout


def test_profile_and_calibrate_make_their_device_current(tmp_path, monkeypatch):
    """Triton launches, events and syncs go to the current CUDA device: `profile --device cuda:1` and `calibrate
    --device cuda:1` ran on device 0 with device 1's tensors (found by reading; no multi-GPU host here)."""
    import contextlib

    from spark_bench import timing
    from spark_bench.telemetry import calibrate as cal

    made_current = []

    def recording(device):
        made_current.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(timing, "on_device", recording)
    profile_case("kda.gate", "torch", sets=["tokens=1", "head_dim=60"], dtype="fp32", device="cpu",
                 out_dir=tmp_path, iters=1, warmup=0)
    monkeypatch.setattr(cal, "CPU", {**cal.CPU, "copy_bytes": 1 << 20, "matmul_n": {"fp32": 64}, "budget_s": 0.01,
                                     "warmup_s": 0.0})
    cal.calibrate("cpu")
    assert made_current == ["cpu", "cpu"]
