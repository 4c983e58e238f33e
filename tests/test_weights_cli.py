"""Weights from model files on the command line (issue 16): each broken file or conflicting option is one line on
stderr naming the problem and exit 2; `run --weights` end to end records the file in the fingerprint and `compare`
refuses runs on different weights; `profile --weights` and `pytest --spark-weights` take the layer too."""

import json
import shutil
import subprocess

import numpy as np
import pytest
from conftest import run_cli, spark_bench_cmd
from weight_files import deepseek_checkpoint, gguf_file, kimi_checkpoint, routing_npy

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-cli")
    out = {"kimi": kimi_checkpoint(root / "kimi"), "gguf": gguf_file(root / "deepseek.gguf"),
           "deepseek": deepseek_checkpoint(root / "deepseek")}
    for corrupt in ("swap", "missing", "dtype"):
        out[corrupt] = kimi_checkpoint(root / corrupt, corrupt=corrupt)
    truncated = root / "truncated" / "model.safetensors"
    truncated.parent.mkdir()
    data = out["deepseek"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    out["truncated"] = truncated
    gguf_cut = root / "cut.gguf"
    data = out["gguf"].read_bytes()
    gguf_cut.write_bytes(data[:-1000])
    out["gguf_cut"] = gguf_cut
    fake = root / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    out["fake"] = fake
    out["bad_ids"] = routing_npy(root / "bad.npy", [[0, 1], [2, 8]])
    return out


ERRORS = [
    ("swap", ["--layer", 1, "--op", "kda.gate"],
     "model.layers.1.self_attn.dt_bias has shape [2] and model.layers.1.self_attn.A_log [32]"),
    ("swap", ["--layer", 1, "--op", "kda.gate"], "dt_bias is per channel [H*K] = [32] and A_log per head [H] = [2]"),
    ("missing", ["--layer", 1, "--op", "kda.*"], "missing tensor model.layers.1.self_attn.o_norm.weight"),
    ("dtype", ["--layer", 1, "--op", "kda.gate"], "model.layers.1.self_attn.A_log is bf16, but a_log must be float32"),
    ("truncated", ["--op", "moe.router"], "not a valid safetensors file"),
    ("gguf_cut", ["--layer", 1, "--op", "moe.router"], "truncated: tensor blk.1."),
    ("fake", ["--op", "moe.router"], "not a GGUF file"),
    ("kimi", ["--layer", 1, "--op", "kda.gate", "--set", "heads=4"],
     "the weight file fixes kda.gate's heads to 2"),
    ("kimi", ["--op", "kda.gate"], "holds layers 0..1: pick one with --layer N"),
    ("kimi", ["--layer", 7, "--op", "kda.gate"], "no layer 7 (the file holds layers 0..1)"),
    ("kimi", ["--layer", 0, "--op", "quant.dequant"], "quant.dequant: does not take its weights from a file"),
    ("gguf", ["--layer", 0, "--op", "moe.experts"], "the layer's are q2k_q3k (use moe.experts_gguf)"),
    ("gguf", ["--layer", 0, "--op", "kda.gate"], "has no KDA block"),
    ("kimi", ["--layer", 0, "--op", "moe.router", "--preset", "kimi-linear"], "drop --preset"),
    ("kimi", ["--layer", 0, "--op", "moe.experts", "--routing", "@bad_ids"],
     "token 1 has expert id 8, out of range for 8 experts"),
    ("kimi", ["--layer", 0, "--op", "moe.experts", "--set", "routing=file"], "routing=file needs --routing FILE"),
]


@pytest.mark.parametrize("name, args, needle", ERRORS)
def test_weight_errors_are_one_line_exit_2(files, name, args, needle):
    args = [files[a[1:]] if isinstance(a, str) and a.startswith("@") else a for a in args]
    code, out, err = run_cli("run", "--weights", files[name], *args, "--out", files["kimi"].parent / "never")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("spark-bench: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("name, args, needle", [ERRORS[0], ERRORS[6]])
def test_tune_takes_the_weights_and_refuses_the_same_errors(files, name, args, needle, tmp_path):
    code, out, err = run_cli("tune", "--weights", files[name], *args, "--run-dir", tmp_path / "never")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("args, needle", [
    (["--op", "moe.experts", "--set", "routing=model"], "routing=model needs --weights"),
    (["--op", "kda.gate", "--layer", "3"], "--layer needs --weights PATH"),
    (["--op", "moe.experts", "--routing", "/nonexistent/ids.npy"], "routing file /nonexistent/ids.npy: no such file"),
    (["--op", "kda.gate", "--weights", "/nonexistent/model.safetensors"], "no such weight file"),
])
def test_option_errors_are_one_line_exit_2(args, needle):
    code, _, err = run_cli("run", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_run_on_a_layer_records_the_file_and_compare_refuses_other_weights(files, tmp_path):
    # spawned workers (the default executor) load the layer themselves
    code, out, err = run_cli("run", "--weights", files["kimi"], "--layer", 0, "--op", "moe.router", "--op",
                             "kda.gate", "--backend", "torch", "--set", "tokens=5", "--out", tmp_path / "a",
                             "--no-report")
    assert code == 0, out + err
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    w = run["fingerprint"]["weights"]
    assert w["path"] == str(files["kimi"].resolve()) and w["layer"] == 0 and w["format"] == "safetensors"
    assert w["family"] == "kimi-linear" and len(w["sha256"]) == 64 and w["size_bytes"] > w["layer_bytes"] > 0
    assert run["spec"]["weights"] == {"path": str(files["kimi"].resolve()), "layer": 0, "routing": None}
    records = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    assert {r["op"] for r in records} == {"moe.router", "kda.gate"} and all(r["status"] == "ok" for r in records)
    assert all(r["params"].get("heads", 2) == 2 and r["params"].get("hidden", 64) == 64 for r in records)
    # the same ops on layer 1: the weights differ, compare refuses unless asked
    code, out, err = run_cli("run", "--weights", files["kimi"], "--layer", 1, "--op", "moe.router", "--op",
                             "kda.gate", "--backend", "torch", "--set", "tokens=5", "--out", tmp_path / "b",
                             "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    code, _, err = run_cli("compare", tmp_path / "a", tmp_path / "b")
    assert code == 2 and "different weights" in err and "layer 0 vs" in err and "--allow-different-weights" in err
    code, out, err = run_cli("compare", tmp_path / "a", tmp_path / "b", "--allow-different-weights",
                             "--threshold", "900%")
    assert code in (0, 1) and "different weights" not in err
    code, _, err = run_cli("compare", tmp_path / "a", tmp_path / "a")
    assert code == 0, err
    # the report names the weight file
    code, out, err = run_cli("report", tmp_path / "a", "-o", tmp_path / "r.html")
    assert code == 0, err
    assert str(files["kimi"].resolve()) in (tmp_path / "r.html").read_text()


def test_run_with_a_routing_file_and_routing_model(files, tmp_path):
    ids = np.array([[e % 8, (e + 3) % 8] for e in range(20)])
    trace = routing_npy(tmp_path / "ids.npy", ids)
    code, out, err = run_cli("run", "--weights", files["kimi"], "--layer", 0, "--routing", trace, "--op",
                             "moe.experts", "--backend", "torch", "--set", "tokens=5", "--set", "routing=file,model",
                             "--out", tmp_path / "run", "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["params"]["routing"] for r in records) == ["file", "model"]
    routing = json.loads((tmp_path / "run" / "run.json").read_text())["fingerprint"]["weights"]["routing"]
    assert routing["path"] == str(trace.resolve()) and routing["tokens"] == 20 and routing["topk"] == 2


def test_profile_takes_the_layer(files, tmp_path):
    code, out, err = run_cli("profile", "--op", "moe.shared_expert", "--backend", "torch", "--weights", files["gguf"],
                             "--layer", 1, "--set", "tokens=3", "--iters", 1, "--out", tmp_path / "prof")
    assert code == 0, out + err
    summary = json.loads((tmp_path / "prof" / "kernels.json").read_text())
    assert summary["params"]["format"] == "q2k_q3k" and summary["params"]["inter"] == 256
    assert summary["weights"]["layer"] == 1
    code, _, err = run_cli("profile", "--op", "moe.shared_expert", "--backend", "torch", "--weights", files["gguf"],
                           "--layer", 1, "--set", "inter=512")
    assert code == 2 and "fixes moe.shared_expert's inter to 256" in err


def test_pytest_plugin_takes_the_layer(pytester, files, tmp_path):
    ckpt = tmp_path / "kimi"
    shutil.copytree(files["kimi"].parent, ckpt)
    result = pytester.runpytest("--spark-op", "kda.gate", "--spark-backend", "torch", "--spark-weights", str(ckpt),
                                "--spark-layer", "1", "--spark-set", "tokens=5", "--spark-max-time", "0.05",
                                "--benchmark-json", "bench.json", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*gate?torch-bf16-T5-H2-Dh16?*PASSED*"])
    extra = json.loads((pytester.path / "bench.json").read_text())["benchmarks"][0]["extra_info"]
    assert extra["weights"] == "kimi L1"  # the case's label, as `spark-bench run` records it
    result = pytester.runpytest("--spark-op", "kda.gate", "--spark-weights", str(ckpt), "--spark-layer", "1",
                                "--spark-set", "heads=4", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*the weight file fixes kda.gate's heads to 2*"])


def test_resume_reuses_the_weight_spec(files, tmp_path):
    out = tmp_path / "run"
    def spark_bench(*args):  # each in its own process: a run holds its directory's lock until its process ends
        return subprocess.run(spark_bench_cmd(*args), capture_output=True, text=True, timeout=600)

    done = spark_bench("run", "--weights", files["gguf"], "--layer", 0, "--op", "moe.router", "--backend", "torch",
                       "--set", "tokens=1,5", "--out", out, "--no-report", "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(lines[0] + "\n")  # as if killed after the first case
    done = spark_bench("run", "--resume", out, "--no-report", "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["status"] == "ok" and r["params"]["hidden"] == 256 for r in records)
    done = spark_bench("run", "--resume", out, "--weights", files["kimi"])
    assert done.returncode == 2 and "drop --weights" in done.stderr


def test_resume_refuses_weights_that_changed_since_the_run_started(tmp_path):
    ckpt, out = kimi_checkpoint(tmp_path / "kimi"), tmp_path / "run"

    def spark_bench(*args):  # each in its own process: a run holds its directory's lock until its process ends
        return subprocess.run(spark_bench_cmd(*args), capture_output=True, text=True, timeout=600)

    done = spark_bench("run", "--weights", ckpt, "--layer", 0, "--op", "moe.router", "--backend", "torch",
                       "--set", "tokens=1,5", "--out", out, "--no-report", "--executor", "inprocess")
    assert done.returncode == 0, done.stderr
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(lines[0] + "\n")  # as if killed after the first case

    def scale_first_tensor(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] * 2

    kimi_checkpoint(tmp_path / "kimi", edit=scale_first_tensor)  # the same files, other values
    done = spark_bench("run", "--resume", out, "--no-report", "--executor", "inprocess")
    code, err = done.returncode, done.stderr
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "the layer file" in err and "changed since this run started" in err
    assert len((out / "results.jsonl").read_text().splitlines()) == 1  # nothing appended


@pytest.mark.filterwarnings("ignore:Benchmark machine_info is different")  # other weights, on purpose
def test_pytest_baseline_on_other_weights_is_flagged(pytester, files, tmp_path):
    ckpt = tmp_path / "kimi"
    shutil.copytree(files["kimi"].parent, ckpt)
    args = ["--spark-op", "kda.gate", "--spark-backend", "torch", "--spark-weights", str(ckpt), "--spark-set",
            "tokens=5", "--spark-max-time", "0.05", "-p", "no:cacheprovider"]
    pytester.runpytest(*args, "--spark-layer", "0", "--benchmark-save", "base").assert_outcomes(passed=1)
    saved = json.loads(next((pytester.path / ".benchmarks").glob("*/0001_base.json")).read_text())
    assert saved["machine_info"]["spark_bench"]["weights"]["layer"] == 0
    same = pytester.runpytest(*args, "--spark-layer", "0", "--benchmark-compare", "0001")
    assert "fingerprint mismatch" not in same.stdout.str()
    other = pytester.runpytest(*args, "--spark-layer", "1", "--benchmark-compare", "0001",
                               "--spark-fingerprint-mismatch", "fail")
    assert other.ret != 0 and "layer 0" in other.stderr.str() and "layer 1" in other.stderr.str()


def test_run_with_captured_activations(files, tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32))
    code, out, err = run_cli("run", "--weights", files["kimi"], "--layer", 1, "--activations", tmp_path / "x.npy",
                             "--op", "kda.gate", "--op", "moe.router", "--backend", "torch", "--set", "tokens=5",
                             "--out", tmp_path / "run", "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    w = json.loads((tmp_path / "run" / "run.json").read_text())["fingerprint"]["weights"]
    assert w["activations"]["shape"] == [16, 64] and len(w["activations"]["sha256"]) == 64
    code, _, err = run_cli("run", "--activations", tmp_path / "x.npy", "--op", "kda.gate")
    assert code == 2 and "--activations needs --weights" in err
