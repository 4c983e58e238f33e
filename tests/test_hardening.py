"""Issue 15: hardening from outside (unit-level checks; the end-to-end ones are in test_hardening_e2e.py)."""

import json
import os

import pytest
import torch

import spark_bench


def test_backends_are_callable_with_the_inputs_as_keywords():
    op = spark_bench.get_op("kda.gate")
    inputs = op.make_inputs({"tokens": 5, "heads": 2, "head_dim": 8}, device="cpu", dtype="fp32", seed=0)
    out = op.backends["torch"](**inputs)
    assert torch.equal(out, op.backends["torch"].fn(**inputs))


def test_one_process_owns_a_run_directory(tmp_path):
    from spark_bench.results import ResultsError, RunStore

    first, second = RunStore(tmp_path / "run"), RunStore(tmp_path / "run")
    first.lock()
    with pytest.raises(ResultsError, match=rf"in use by pid {os.getpid()} on "):
        second.lock()
    first.unlock()
    second.lock()  # released: the next owner gets it (the kernel also releases it when the owner dies)
    second.unlock()


def test_out_pointing_at_a_file_is_one_line(tmp_path):
    from spark_bench.results import ResultsError, RunStore

    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ResultsError, match="is a file"):
        RunStore(path).lock()


def _cli(*args):
    from click.testing import CliRunner

    from spark_bench.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _assert_one_line(code, out, err, needle):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("spark-bench"), (code, out, err)
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out + err


GATE = ["run", "--op", "kda.gate", "--no-report"]


@pytest.mark.parametrize("args, needle", [
    ([*GATE, "--timeout", "nan"], "--timeout must be a finite number of seconds above 0"),
    ([*GATE, "--timeout", "inf"], "--timeout must be a finite number"),
    ([*GATE, "--timeout", "0"], "--timeout must be"),
    ([*GATE, "--timeout", "-1"], "--timeout must be"),
    ([*GATE, "--max-time", "-1"], "--max-time must be"),
    ([*GATE, "--min-samples", "-5"], "--min-samples must be 1 or more"),
    ([*GATE, "--target-ci", "nan"], "--target-ci must be a fraction above 0"),
    ([*GATE, "--target-ci", "-1"], "--target-ci must be a fraction above 0"),
    ([*GATE, "--set", "heads=0"], "axis 'heads' takes positive integers, not '0'"),
    ([*GATE, "--set", "heads=-1"], "axis 'heads' takes positive integers"),
    ([*GATE, "--set", "tokens=-1"], "axis 'tokens' takes positive integers"),
    ([*GATE, "--devices", "garbage"], "'garbage' is not a CPU worker label"),
    ([*GATE, "--quick", "--full"], "--quick and --full contradict each other"),
    ([*GATE, "--dtype", "fp16"], "no selected op supports dtype fp16; the selected ops have: bf16, fp32"),
    (["run", "--resume", "/nonexistent/run", "--op", "kda.gate", "--set", "heads=4"],
     "runs the sweep stored in its run.json; drop --op, --set"),
    (["run", "--resume", "/nonexistent/run", "--quick"], "drop --quick"),
    (["list", "--device", "garbage"], "unknown device 'garbage'"),
    (["run", "--op", "moe.router", "--set", "routed_scaling_factor=nan"], "takes finite numbers, not 'nan'"),
    (["run", "--op", "moe.router", "--set", "routed_scaling_factor=inf"], "takes finite numbers"),
    (["kernels", "--quick", "--no-presets", "--op", "kda.gate", "--backend", "nosuch"], "unknown backend 'nosuch'"),
    (["profile", "--op", "kda.gate", "--backend", "torch", "--dtype", "fp16"], "does not take dtype fp16"),
])
def test_bad_run_options_are_one_line(args, needle):
    _assert_one_line(*_cli(*args), needle)


def test_resuming_a_gpu_run_without_the_gpu_is_one_line(tmp_path):
    """It journaled a worker crash for every case, which a resume on the GPU machine then skipped."""
    code, _, _ = _cli("run", "--op", "kda.gate", "--backend", "torch", "--set", "tokens=1", "--set", "heads=2",
                      "--dtype", "fp32", "--no-report", "--max-time", "0.01", "--out", tmp_path / "r")
    run_dir = tmp_path / "r"
    assert code == 0
    run = json.loads((run_dir / "run.json").read_text())
    run["spec"]["device"] = "cuda"
    (run_dir / "run.json").write_text(json.dumps(run))
    (run_dir / "results.jsonl").write_text("")
    (run_dir / ".lock").unlink()  # this process's first run holds it until the process exits
    _assert_one_line(*_cli("run", "--resume", run_dir), "cuda")
    assert (run_dir / "results.jsonl").read_text() == ""


def test_show_of_a_run_stopped_before_its_first_case_ended(tmp_path):
    code, _, _ = _cli("run", "--op", "kda.gate", "--backend", "torch", "--set", "tokens=1", "--set", "heads=2",
                      "--dtype", "fp32", "--no-report", "--max-time", "0.01", "--out", tmp_path / "r")
    (tmp_path / "r" / "results.jsonl").write_text("")  # what Ctrl-C in the first case leaves
    code, out, err = _cli("show", tmp_path / "r")
    assert code == 0 and "Traceback" not in out + err, err  # was exit 2: "no case matches --op ; the run has: "


def test_repeated_and_duplicate_set_values_make_each_point_once():
    from spark_bench.options import sweep_spec

    spec = sweep_spec(ops=("kda.gate",), backends=(), preset=None, dtypes=("fp32,fp32",), device="cpu", quick=True,
                      full=False, seed=0, sets=("tokens=1,8", "tokens=8", "tokens=1,1,64"))
    assert spec.overrides == {"tokens": ["1", "8", "64"]} and spec.dtypes == ["fp32"]


def test_a_report_never_overwrites_a_runs_files(tmp_path):
    from spark_bench.report import ResultsError, write_report

    code, _, _ = _cli("run", "--op", "kda.gate", "--backend", "torch", "--set", "tokens=1", "--set", "heads=2",
                      "--dtype", "fp32", "--no-report", "--max-time", "0.01", "--out", tmp_path / "r")
    run_dir = tmp_path / "r"
    assert code == 0
    before = (run_dir / "results.jsonl").read_text()
    with pytest.raises(ResultsError, match="never overwritten"):
        write_report([run_dir], run_dir / "results.jsonl")
    assert (run_dir / "results.jsonl").read_text() == before
    assert write_report([run_dir], run_dir / "report.html").exists()


def test_out_pointing_at_a_file_is_one_line_from_run(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    _assert_one_line(*_cli(*GATE, "--set", "tokens=5", "--set", "heads=2", "--out", path), "is a file")
    _assert_one_line(*_cli(*GATE, "--set", "tokens=5", "--set", "heads=2", "--out", path / "run"),
                     "cannot create the run directory (Not a directory)")  # was a FileExistsError traceback


def test_report_with_an_unknown_baseline_is_one_line(tmp_path):
    from report_fixtures import standard_run

    run = standard_run(tmp_path / "a")
    _assert_one_line(*_cli("report", run, "-o", tmp_path / "r.html", "--baseline", "nosuch"),
                     "unknown --baseline 'nosuch'; the runs have: ")


def _record(**kw):
    return {"schema_version": 1, "case_id": "x.y|b|{}|fp32|cpu", "op": "x.y", "backend": "b", "params": {},
            "dtype": "fp32", "device": "cpu", "status": "ok", **kw}


def _run_dir(tmp_path, run=None, lines=None, raw_run=None, raw_results=None):
    import json

    path = tmp_path / "run"
    path.mkdir()
    run = {"schema": "spark-bench/run", "schema_version": 1, "run_id": "r", "spec": None} if run is None else run
    (path / "run.json").write_bytes(raw_run if raw_run is not None else json.dumps(run).encode())
    body = raw_results if raw_results is not None else "".join(json.dumps(x) + "\n" for x in lines or []).encode()
    (path / "results.jsonl").write_bytes(body)
    return path


@pytest.mark.parametrize("kind, needle", [
    ("run-bytes", "run.json: not UTF-8 text"),
    ("results-bytes", "results.jsonl: not UTF-8 text"),
    ("missing-key", "results.jsonl:1: missing required field 'backend'"),
    ("params-string", "results.jsonl:1: field 'params' must be an object, not a string"),
    ("markup-status", "results.jsonl:1: unknown status '[/]weird[bold'"),
    ("timing-string", "field 'timing' must be an object or null, not a string"),
    ("run-spec-list", "run.json: field 'spec' must be an object or null, not a list"),
])
def test_malformed_files_are_one_line_in_show(tmp_path, kind, needle):
    lines = {"missing-key": [{k: v for k, v in _record().items() if k != "backend"}],
             "params-string": [_record(params="oops")], "markup-status": [_record(status="[/]weird[bold")],
             "timing-string": [_record(timing="fast")]}.get(kind, [_record()])
    path = _run_dir(tmp_path, lines=lines, raw_run=b'{"schema": "\xff\xfe"}' if kind == "run-bytes" else None,
                    raw_results=b'{"case_id": "\xff"}\n' if kind == "results-bytes" else None,
                    run={"schema": "spark-bench/run", "schema_version": 1, "run_id": "r", "spec": []}
                    if kind == "run-spec-list" else None)
    _assert_one_line(*_cli("show", path), needle)


def test_resume_of_a_run_without_a_spec_is_one_line(tmp_path):
    path = _run_dir(tmp_path, lines=[_record()])
    _assert_one_line(*_cli("run", "--resume", path), "no usable sweep spec")



def test_progress_params_are_cut_between_items_only():
    from spark_bench.console import clip_params

    params = {"tokens": 4096, "heads": 32, "head_dim": 128, "varlen": "mixed-long-pattern", "experts": 256}
    text = clip_params(params, width=40)
    assert text.endswith(" …") and len(text) <= 42
    assert all(item in [f"{k}={v}" for k, v in params.items()] for item in text[:-2].split())


def test_log_mode_lines_do_not_wrap_and_skipped_cases_do_not_speed_up_the_eta():
    import io
    import re

    from rich.console import Console

    from spark_bench.console import SweepProgress
    from spark_bench.sweep import Case

    buf = io.StringIO()
    out = Console(file=buf, width=160, force_terminal=False, highlight=False)
    params = {f"axis_number_{i}": 10 ** i for i in range(12)}
    cases = [Case("x.op", f"b{i}", params, "fp32", "cpu", 0) for i in range(4)]
    progress = SweepProgress(4, out)
    progress.started -= 10.0  # as if 10 s went by
    progress.result(cases[0], {"status": "skipped", "timing": None})
    progress.result(cases[1], {"status": "ok", "timing": None})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/4] skipped  1 case of backend b0")
    assert len(lines[1]) > 160  # one line per case, never wrapped
    eta = int(re.search(r"eta (\d+)s", lines[1]).group(1))
    assert eta >= 19  # 10 s for the one measured case, two to go (not 10 / 2 * 2)


def test_not_measured_table_lists_each_failure_and_folds_skipped_cases_by_reason():
    import io

    from rich.console import Console

    from spark_bench.console import failures_table

    def rec(backend, tokens, status, error):
        return {"op": "x.op", "backend": backend, "params": {"tokens": tokens}, "dtype": "bf16", "status": status,
                "error": error}

    records = [rec("peer", t, "skipped", "peer not installed (pip install peer)") for t in (1, 8, 64)]
    records += [rec("other", 1, "skipped", "needs CUDA"), rec("triton", 8, "mismatch", "err ratio 0.2\ntrace"),
                rec("triton", 64, "error", "RuntimeError: boom"), rec("torch", 1, "ok", None)]
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False).print(failures_table(records))
    rows = [line for line in buf.getvalue().splitlines() if "x.op" in line]
    assert len(rows) == 4, rows  # two failures, each on its row; two skip reasons, one row each
    assert any("x.op peer (3 cases)" in r and "peer not installed" in r for r in rows)
    assert any("x.op other (1 case)" in r and "needs CUDA" in r for r in rows)
    assert any("mismatch" in r and "tokens=8" in r and "err ratio 0.2" in r and "trace" not in r for r in rows)
    assert failures_table([rec("torch", 1, "ok", None)]) is None


def test_help_and_error_prefixes():
    code, out, _ = _cli("run", "--help")
    assert code == 0 and "95% CI" in out and "95%%" not in out
    _assert_one_line(*_cli("report", "/nonexistent/run"), "spark-bench: error: report: ")


def test_compare_of_a_run_with_itself_is_all_same_and_an_empty_new_run_fails_the_gate(tmp_path):
    from report_fixtures import standard_run, write_run

    run = standard_run(tmp_path / "a", spread=0.3, n=10)  # CPU-like noise: each case alone would be `noisy`
    code, out, err = _cli("compare", run, run, "--all")
    assert code == 0 and "noisy" not in out, out
    empty = write_run(tmp_path / "empty", [], run_id="empty")
    code, out, err = _cli("compare", run, empty)
    assert code == 1 and "missing" in err, (out, err)
    code, _, _ = _cli("compare", run, empty, "--allow-missing")
    assert code == 0


def test_model_size_points_on_a_cpu_get_a_memory_estimate_first():
    from spark_bench.memory import MEMORY_FACTOR, guard
    from spark_bench.registry import registry
    from spark_bench.sweep import SweepSpec, build_cases

    reg = registry()
    cases = build_cases(reg, SweepSpec(ops=["moe.experts"], preset="kimi-linear", device="cpu", quick=True))
    kept, warning = guard(reg, cases, available=4 * 10**9)
    skipped = [c for c in kept if c.skip and "GB available" in c.skip]
    assert len(kept) == len(cases) and skipped and len(skipped) < len(cases)
    op = reg.get("moe.experts")
    assert {c.case_id for c in skipped} == {c.case_id for c in cases  # all of them (unavailable ones stay so)
                                            if not c.skip and op.cost(c.params, c.dtype).bytes * MEMORY_FACTOR > 4e9}
    assert "4.0 GB available" in warning and f"{len(skipped)} case(s) skipped" in warning
    assert guard(reg, cases, available=10**15) == (list(cases), None)


def test_the_header_does_not_call_preset_shapes_quick():
    from spark_bench.session import shapes_note
    from spark_bench.sweep import SweepSpec
    from spark_bench.timing import config_for

    assert shapes_note(SweepSpec(quick=True)) == "  (quick shapes and timing; Triton interpreted)"
    assert shapes_note(SweepSpec(quick=True, device="cuda")) == "  (quick shapes and timing)"
    assert shapes_note(SweepSpec(quick=True), config_for("cpu", quick=False)) == "  (quick shapes; Triton interpreted)"
    assert "quick shapes" not in shapes_note(SweepSpec(quick=True, preset="kimi-linear"))
    assert "preset kimi-linear shapes" in shapes_note(SweepSpec(quick=True, preset="kimi-linear"))
    # a preset's shapes with the CPU's default budget (run --full): the header must not say the timing is quick
    cpu_default = shapes_note(SweepSpec(quick=True, preset="kimi-linear"), config_for("cpu", quick=False))
    assert cpu_default == "  (preset kimi-linear shapes; Triton interpreted)"
    assert "quick timing" in shapes_note(SweepSpec(quick=True, preset="kimi-linear"), config_for("cpu", quick=True))


def test_the_report_says_that_cpu_triton_numbers_are_interpreted(tmp_path):
    from report_fixtures import case, write_run

    from spark_bench.report import write_report

    rec = case("kda.gate", "triton", {"tokens": 64, "heads": 4, "head_dim": 128})
    rec["labels"] = ["interpreted"]
    run = write_run(tmp_path / "a", [rec, case("kda.gate", "torch", {"tokens": 64, "heads": 4, "head_dim": 128})])
    html = write_report([run], tmp_path / "r.html").read_text()
    summary = html[html.index('<section id="summary">'):html.index("</section>", html.index('<section id="summary">'))]
    assert "Interpreted:</b> triton ran in the Triton interpreter" in summary
    env = html[html.index('<section id="env">'):]
    assert "interpreted (TRITON_INTERPRET=1): triton" in env
