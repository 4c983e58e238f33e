"""spark_bench/session.py edges a mutation audit found untested: the exit code says whether any case failed,
whatever the failure; a resume refuses another device even when only its fingerprint id differs, and a tune
directory; the run.json summary and end time after a run and after a resume that ran nothing."""

import json

import pytest
from test_journal_edges import Scripted, _case

from spark_bench import results
from spark_bench.results_schema import FAILED
from spark_bench.session import Session
from spark_bench.stored_run import check_same_device
from spark_bench.sweep import SweepSpec
from spark_bench.timing import TimingConfig


def _session(tmp_path, cases, name="run"):
    store = results.RunStore(tmp_path / name)
    store.create({"run_id": name, "created": results.now(), "finished": None, "fingerprint": {}, "summary": None})
    return Session(store, SweepSpec(device="cpu"), TimingConfig(), 60.0, cases)


@pytest.mark.parametrize("status", [*FAILED, "ok", "skipped"])
def test_the_exit_code_is_1_when_any_case_failed_however(tmp_path, monkeypatch, status):
    monkeypatch.chdir(tmp_path)  # the ETA reads ./results
    cases = [_case(backend="good"), _case(backend="bad")]
    session = _session(tmp_path, cases)
    code = session.execute(report=False, executor=Scripted({"bad": status}))
    assert code == (1 if status in FAILED else 0)
    run = session.store.read_run()
    assert run["summary"]["cases"] == 2 and run["summary"][status] == (2 if status == "ok" else 1)
    assert run["finished"] is not None


def test_a_resume_with_nothing_left_keeps_the_runs_end_and_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = [_case(backend="good")]
    first = _session(tmp_path, cases)
    assert first.execute(report=False, executor=Scripted()) == 0
    run = first.store.read_run()
    run["finished"] = "2000-01-01T00:00:00+00:00"  # as if it ended long ago
    first.store.write_run(run)
    again = Session(first.store, first.spec, first.cfg, first.timeout_s, cases)
    executor = Scripted()
    assert again.execute(report=False, executor=executor) == 0
    assert executor.given == [] and again.store.read_run()["finished"] == "2000-01-01T00:00:00+00:00"


def test_a_resume_on_a_device_whose_fingerprint_id_differs_is_refused(tmp_path):
    """Same stack, another fingerprint (another GPU model, another CPU): the id alone must refuse the resume."""
    from spark_bench.fingerprint import fingerprint

    here = fingerprint("cpu")
    check_same_device(tmp_path, {"fingerprint": here}, "cpu")  # the same machine: resumes
    other = json.loads(json.dumps(here))
    other["fingerprint_id"] = "0" * 16
    with pytest.raises(results.ResultsError, match="would mix two devices' timings"):
        check_same_device(tmp_path, {"fingerprint": other}, "cpu")


def test_a_tune_directory_is_not_resumed_as_a_run(tmp_path):
    store = results.RunStore(tmp_path / "tune")
    store.create({"run_id": "tune", "kind": "tune", "fingerprint": {}})
    with pytest.raises(results.ResultsError, match="is a tune directory; resume it with `spark-bench tune --resume"):
        Session.resume(store.path)
    with pytest.raises(results.ResultsError, match="is a tune directory, not a sweep"):
        Session.stored(store.path)


def test_a_resume_of_a_run_killed_after_its_last_case_writes_its_end(tmp_path, monkeypatch):
    """Killed between the last case's record and run.json's closing write: nothing is left to run, but the resume
    still writes the end time and the summary (else the run reads as unfinished forever)."""
    monkeypatch.chdir(tmp_path)
    cases = [_case(backend="good"), _case(backend="bad")]
    session = _session(tmp_path, cases)
    for case in cases:
        session.store.append({**case.record_fields(), "status": "ok" if case.backend == "good" else "error"})
    executor = Scripted()
    assert session.execute(report=False, executor=executor) == 1
    run = session.store.read_run()
    assert executor.given == [] and run["finished"] is not None
    assert run["summary"]["cases"] == 2 and run["summary"]["error"] == 1


@pytest.mark.parametrize("part", ["layer", "routing", "activations"])
def test_a_resume_refuses_any_weight_file_that_changed(tmp_path, monkeypatch, part):
    """The layer, the routing trace and the captured activations are each hashed in run.json: any of them changed
    since the run started would mix two weight sets in one run."""
    import spark_bench.weights
    from spark_bench.stored_run import check_weights_unchanged

    stored = {"path": "layer.gguf", "sha256": "L", "routing": {"path": "trace.npy", "sha256": "R"},
              "activations": {"path": "x.npy", "sha256": "A"}}
    now = json.loads(json.dumps(stored))
    spec = SweepSpec(device="cpu", weights={"path": "layer.gguf"})
    monkeypatch.setattr(spark_bench.weights, "describe", lambda weights: now)
    check_weights_unchanged(tmp_path, {"fingerprint": {"weights": stored}}, spec)  # unchanged: resumes
    (now if part == "layer" else now[part])["sha256"] = "changed"
    with pytest.raises(results.ResultsError, match=f"the {part} file .* changed since this run started"):
        check_weights_unchanged(tmp_path, {"fingerprint": {"weights": stored}}, spec)


def test_only_a_measured_case_gets_percentages_of_the_roofline():
    from spark_bench.session import add_roofline

    roofline = {"measured": {"bandwidth_gbps": 100.0}}
    ok = {"status": "ok", "gbps": 50.0, "tflops": None, "dtype": "fp32", "roofline": None}
    add_roofline(ok, roofline)
    assert ok["roofline"]["pct_bw_measured"] == 50.0
    failed = {"status": "mismatch", "gbps": None, "tflops": None, "dtype": "fp32", "roofline": None}
    add_roofline(failed, roofline)
    assert failed["roofline"] is None
