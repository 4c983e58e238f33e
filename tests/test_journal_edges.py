"""The journal (results.jsonl) and the runner that writes it: edges a mutation audit found untested. A case listed
twice runs once; a budgeted run takes every op's first points first; skipped cases are journalled, never run; the
suspect case is amended, not the one that ran after it; an amendment's label is added once; a directory whose run
died before its first case can be started again; the default per-phase timeouts."""

import time

import pytest

from spark_bench import results
from spark_bench.executors.base import Executor, failed_record
from spark_bench.executors.plan import interleave_ops
from spark_bench.runner import Runner, default_timeout, pending
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig


def _case(op="a", n=1, backend="x", skip=None):
    return Case(op, backend, {"n": n}, "fp32", "cpu", 0, skip=skip)


class Scripted(Executor):
    """Reports each case it is given with the status `statuses` names for its backend (default ok); keeps the order it
    was given the cases in. `extra(case)`: fields added to the record."""

    name = "scripted"

    def __init__(self, statuses=None, extra=None):
        self.statuses, self.extra, self.given = statuses or {}, extra or (lambda case: {}), []

    def run(self, cases, ctx, sink):
        self.given.append(list(cases))
        for case in cases:
            sink.phase(case, "start")
            sink.result(case, failed_record(case, self.statuses.get(case.backend, "ok"), None, **self.extra(case)))


def _store(tmp_path, name="run"):
    store = results.RunStore(tmp_path / name)
    store.create({"run_id": name})
    return store


def _runner(store, executor, **kw):
    return Runner(store, TimingConfig(), timeout_s=60, device="cpu", executor=executor, energy=False, **kw)


def test_a_case_listed_twice_runs_and_is_journalled_once(tmp_path):
    store = _store(tmp_path)
    a, b = _case(n=1), _case(n=2)
    assert pending(store, [a, b, a]) == [a, b]
    executor = Scripted()
    _runner(store, executor).run([a, b, a, b])
    assert executor.given == [[a, b]]
    assert [r["case_id"] for r in store.read_results()] == [a.case_id, b.case_id]
    assert pending(store, [a, b]) == []


def test_a_budget_takes_every_ops_first_points_first_and_no_budget_keeps_the_sweep_order(tmp_path):
    cases = [_case("a", n, b) for n in (1, 2, 3) for b in ("x", "y")] + [_case("b", 1, b) for b in ("x", "y")]
    budgeted = Scripted()
    _runner(_store(tmp_path, "budget"), budgeted, deadline=time.monotonic() + 3600).run(cases)
    assert budgeted.given == [interleave_ops(cases)] and budgeted.given[0] != cases
    plain = Scripted()
    _runner(_store(tmp_path, "plain"), plain).run(cases)
    assert plain.given == [cases]


def test_skipped_cases_are_journalled_and_never_handed_to_the_executor(tmp_path):
    store = _store(tmp_path)
    skipped, ran = _case(backend="missing", skip="needs a device nobody has"), _case(backend="x")
    executor, phases = Scripted(), []
    records = _runner(store, executor, on_phase=lambda c, p: phases.append((c.backend, p))).run([skipped, ran])
    assert executor.given == [[ran]]
    assert [(r["backend"], r["status"], r["error"]) for r in records] == [
        ("missing", "skipped", "needs a device nobody has"), ("x", "ok", None)]
    assert all(r["executor"] == "scripted" for r in store.read_results())
    assert ("missing", "start") in phases
    only_skipped = Scripted()
    _runner(_store(tmp_path, "skips"), only_skipped).run([skipped])
    assert only_skipped.given == []  # nothing to run: the executor (its workers) is not even started


def test_the_suspect_is_amended_and_the_case_after_it_keeps_its_record(tmp_path):
    """A worker died during case B, which then passed in a fresh worker: A (the case before it in that worker) is
    marked suspect in the journal; B keeps `suspect_previous` naming A and is not labelled."""
    store = _store(tmp_path)
    a, b = _case(backend="x"), _case(backend="y")
    executor = Scripted(extra=lambda case: {"suspect_previous": a.case_id} if case is b else {})
    _runner(store, executor).run([a, b])
    by_backend = {r["backend"]: r for r in store.read_results()}
    assert "suspect" in by_backend["x"]["labels"] and b.case_id in by_backend["x"]["suspect"]
    assert by_backend["y"]["labels"] == [] and by_backend["y"]["suspect_previous"] == a.case_id
    assert "suspect" not in by_backend["y"]


def test_an_amendments_label_is_added_once(tmp_path):
    store = _store(tmp_path)
    store.append({**_case().record_fields(), "status": "ok", "labels": ["suspect"]})
    store.amend(_case().case_id, label="suspect", note="first")
    store.amend(_case().case_id, label="suspect", note="second")
    (rec,) = store.read_results()
    assert rec["labels"] == ["suspect"] and rec["note"] == "second"


def test_a_directory_whose_run_died_before_its_first_case_can_be_started_again(tmp_path):
    """`create` then killed before any case ended: an empty results.jsonl holds nothing to lose, so `--out` of the
    same directory starts anew; one record in it and a new run is refused (it would mix two runs)."""
    store = _store(tmp_path)
    assert store.results_file.read_bytes() == b""
    store.create({"run_id": "again"})
    assert store.read_run()["run_id"] == "again"
    store.append({**_case().record_fields(), "status": "ok"})
    with pytest.raises(results.ResultsError, match="already holds results"):
        store.create({"run_id": "third"})


def test_a_result_with_an_amends_key_of_another_schema_version_is_refused(tmp_path):
    store = _store(tmp_path)
    store.results_file.write_text('{"schema_version": 99, "amends": "x", "fields": {}, "label": null}\n')
    with pytest.raises(results.ResultsError, match="not a spark-bench v1 result"):
        store.read_results()


def test_the_default_phase_timeouts(monkeypatch):
    """Interpreted Triton on a CPU gets 600 s a phase, a GPU 300 s; SPARK_BENCH_TIMEOUT overrides both."""
    monkeypatch.delenv("SPARK_BENCH_TIMEOUT", raising=False)
    assert (default_timeout("cpu"), default_timeout("cuda"), default_timeout("cuda:1")) == (600.0, 300.0, 300.0)
    monkeypatch.setenv("SPARK_BENCH_TIMEOUT", "42")
    assert default_timeout("cpu") == default_timeout("cuda") == 42.0


def test_each_record_is_reported_once_as_it_is_journalled(tmp_path):
    """The progress display (on_result) hears of every case, skipped ones included, each once."""
    store, heard = _store(tmp_path), []
    cases = [_case(backend="x"), _case(backend="missing", skip="no GPU"), _case(n=2)]
    records = _runner(store, Scripted(), on_result=lambda case, record: heard.append((case, record))).run(cases)
    assert [c.case_id for c, _ in heard] == [r["case_id"] for r in records] == [r["case_id"] for r in
                                                                                 store.read_results()]
    assert sorted(c.case_id for c, _ in heard) == sorted(c.case_id for c in cases)


def test_a_write_that_runs_out_of_space_leaves_no_partial_line(tmp_path, monkeypatch):
    import errno
    import os

    store = _store(tmp_path)
    store.append({**_case().record_fields(), "status": "ok"})
    before = store.results_file.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills up in the middle of the record
        if len(data) > 8:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "write", half_then_full)
    with pytest.raises(results.DiskFullError, match="no space left writing"):
        store.append({**_case(n=2).record_fields(), "status": "ok"})
    monkeypatch.undo()
    assert store.results_file.read_bytes() == before
    store.append({**_case(n=3).record_fields(), "status": "ok"})
    assert [r["params"]["n"] for r in store.read_results()] == [1, 3]


@pytest.mark.parametrize("field, value", [("gbps", True), ("duration_s", False), ("recompiles_during_timing", True)])
def test_true_or_false_is_not_a_number_in_a_record(tmp_path, field, value):
    """JSON true/false parse as Python bools, which are ints: a number field holding one is refused by name."""
    store = _store(tmp_path)
    store.append({**_case().record_fields(), "status": "ok", field: value})
    with pytest.raises(results.ResultsError, match=f"field '{field}' must be a number or null, not true/false"):
        store.read_results()


def test_a_run_file_write_that_runs_out_of_space_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    store = _store(tmp_path)
    before = store.run_file.read_text()

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "replace", full)
    with pytest.raises(results.DiskFullError, match="no space left writing"):
        store.write_run({"run_id": "new"})
    monkeypatch.undo()
    assert store.run_file.read_text() == before and not list(store.path.glob("*.tmp"))
