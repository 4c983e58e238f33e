"""Bad input gives one clear line on stderr and exit code 2, never a traceback."""

import json

import pytest
from conftest import run_cli


@pytest.mark.parametrize("args, needle", [
    (["run", "--op", "nope"], "no op matches 'nope'; choose from kda.block_decode, kda.block_prefill"),
    (["run", "--op", "kda.gate", "--backend", "nope"], "unknown backend 'nope'"),
    (["run", "--op", "kda.gate", "--set", "nope=1"], "unknown axis 'nope'"),
    (["run", "--op", "kda.gate", "--set", "heads"], "malformed --set 'heads'"),
    (["run", "--op", "kda.gate", "--set", "heads=four"], "takes integers"),
    (["run", "--op", "kda.gate", "--set", "moe.*:tokens=1"], "--set moe.*:tokens: no selected op matches 'moe.*'"),
    (["run", "--op", "kda.*", "--set", "kda.gate:topk=1"], "unknown axis 'topk' for kda.gate; it has: head_dim,"),
    (["run", "--op", "kda.gate", "--set", "kda.gate:tokens=x"], "takes integers"),
    (["run", "--op", "kda.gate", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["run", "--op", "kda.gate", "--preset", "nope"], "unknown preset 'nope'"),
    (["run", "--op", "kda.gate", "--device", "tpu"], "unknown device 'tpu'"),
    (["run", "--bogus"], "No such option"),
    (["show", "/nonexistent/run"], "no such run directory"),
    (["list", "--op", "nope"], "no op matches 'nope'; choose from kda.block_decode"),
    (["run", "--resume", "/nonexistent/run"], "not a spark-bench run directory"),
    (["run", "--op", "kda.gate", "--budget", "1h30m"], "--budget '1h30m': give seconds or one number with a unit"),
    (["run", "--op", "kda.gate", "--budget", "1_0m"], "give seconds or one number with a unit, e.g. 90, 90s, 30m"),
    (["run", "--op", "kda.gate", "--budget", "\u0663m"], "give seconds or one number with a unit"),
    (["run", "--op", "kda.gate", "--budget", "0s"], "--budget '0s': give a duration above zero"),
    (["tune", "--op", "kda.gate", "--budget", "soon"], "--budget 'soon': give seconds or one number with a unit"),
])
def test_usage_errors_are_one_line(args, needle):
    code, out, err = run_cli(*args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in out + err


def test_cuda_device_unavailable_here():
    code, _, err = run_cli("run", "--op", "kda.gate", "--device", "cuda")
    assert code == 2 and "not available" in err and len(err.strip().splitlines()) == 1


def test_list_json_reports_backends_and_reasons():
    code, out, _ = run_cli("list", "--json", "--device", "cpu")
    assert code == 0
    data = json.loads(out)
    gate = data["ops"]["kda.gate"]["backends"]
    assert gate["torch"]["available"] and gate["triton"]["available"]
    assert gate["triton"]["labels"] == ["interpreted"]
    assert not gate["fla"]["available"] and "needs a GPU" in gate["fla"]["reason"]
    assert gate["reference"]["default"] is False


def test_list_of_selected_ops_shows_every_axis_value():
    code, out, _ = run_cli("list", "--op", "moe.al*", "--device", "cpu")
    assert code == 0 and out.startswith("moe.align ") and "kda." not in out and "moe.experts" not in out
    assert "tokens=1/2/4/5/6/7/8/16/" in out and "/16384," in out  # not cut after 6 values
    assert "presets deepseek-v3, glm-4.5, kimi-linear" in out  # what --preset takes for it
    code, out, _ = run_cli("list", "--op", "moe.layer", "--device", "cpu")
    assert code == 0 and "shared_format=routed (--set also: bf16)" in " ".join(out.split())  # not swept, accepted
    code, out, _ = run_cli("list", "--op", "moe.layer", "--device", "cpu", "--json")
    assert json.loads(out)["ops"]["moe.layer"]["also"] == {"shared_format": ["bf16"]}


def test_env_json_has_fingerprint():
    code, out, _ = run_cli("env", "--json", "--device", "cpu")
    fp = json.loads(out)
    assert code == 0 and fp["device"]["type"] == "cpu" and len(fp["fingerprint_id"]) == 16
    assert fp["versions"]["torch"]


def test_an_op_qualified_set_applies_to_its_ops_only_and_wins_there():
    from spark_bench.registry import registry
    from spark_bench.sweep import SweepSpec, build_cases

    spec = SweepSpec(ops=["kda.gate", "kda.gated_rmsnorm", "moe.experts"], backends=["torch"], device="cpu",
                     quick=True, overrides={"tokens": ["7"], "kda.gate:tokens": ["3", "5"], "moe.*:tokens": ["2"],
                                            "kda.gate*:heads": ["2"]})
    points = {}
    for case in build_cases(registry(), spec):
        points.setdefault(case.op, set()).add((case.params["tokens"], case.params.get("heads")))
    assert {t for t, _ in points["kda.gate"]} == {3, 5} and {h for _, h in points["kda.gate"]} == {2}
    assert {t for t, _ in points["kda.gated_rmsnorm"]} == {7} and {h for _, h in points["kda.gated_rmsnorm"]} == {2}
    assert {t for t, _ in points["moe.experts"]} == {2}


@pytest.mark.parametrize("command", [["tune", "--op", "kda.gate", "--quick"], ["run", "--resume", "RUN"]])
def test_a_bad_timeout_variable_stops_tune_and_resume_before_they_write(tmp_path, monkeypatch, command):
    """Checked at the command's start: a Ray actor or a worker slot reading it later journaled every case as a crash,
    and tune had already planned and written its journal."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    if "RUN" in command:
        assert run_cli("run", "--op", "kda.gate", "--backend", "torch", "--quick", "--out", run, "--no-report")[0] == 0
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setenv("SPARK_BENCH_STARTUP_TIMEOUT", "soon")
    code, out, err = run_cli(*[str(run) if a == "RUN" else a for a in command])
    assert code == 2 and err.strip() == "spark-bench: error: SPARK_BENCH_STARTUP_TIMEOUT='soon' is not a positive " \
        "number of seconds" and not out, out + err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
