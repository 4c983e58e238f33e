import json

import pytest

from spark_bench.results import ResultsError, RunStore, load_run


def rec(case_id, status):
    return {"case_id": case_id, "op": "x.y", "backend": "b", "params": {"n": 1}, "dtype": "fp32", "device": "cpu",
            "status": status}


def make_run(tmp_path):
    store = RunStore(tmp_path / "r")
    store.create({"run_id": "r", "spec": {}})
    return store


def test_roundtrip_and_torn_line(tmp_path):
    store = make_run(tmp_path)
    store.append(rec("a", "ok"))
    store.append(rec("b", "error"))
    with open(store.results_file, "a") as f:
        f.write('{"schema_version": 1, "case_id": "c", "sta')  # killed mid-write
    run, records = load_run(store.path)
    assert run["run_id"] == "r" and [r["case_id"] for r in records] == ["a", "b"]
    store.repair_tail()
    store.append(rec("c", "ok"))
    assert [r["case_id"] for r in store.read_results()] == ["a", "b", "c"]


@pytest.mark.parametrize("content, needle", [
    ("not json\n{}\n", "malformed line"),
    ('{"schema_version": 99, "case_id": "x"}\n', "not a spark-bench v1 result"),
])
def test_malformed_results_one_line_error(tmp_path, content, needle):
    store = make_run(tmp_path)
    store.results_file.write_text(content)
    with pytest.raises(ResultsError, match=needle) as info:
        load_run(store.path)
    assert "\n" not in str(info.value)


def test_foreign_run_file(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ResultsError, match="not a spark-bench run file"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"schema": "spark-bench/run", "schema_version": 7}))
    with pytest.raises(ResultsError, match="schema version 7"):
        load_run(tmp_path)


def test_create_refuses_to_overwrite(tmp_path):
    store = make_run(tmp_path)
    store.append(rec("a", "ok"))
    with pytest.raises(ResultsError, match="--resume"):
        store.create({"run_id": "r"})


def test_an_output_that_is_a_symlink_is_written_through(tmp_path):
    """`report -o page.html` where page.html links into a published folder: the page lands there and the link stays
    (the atomic write replaced the link with a file)."""
    from conftest import run_cli

    from spark_bench.results import write_text_atomic

    (tmp_path / "site").mkdir()
    target, link = tmp_path / "site" / "page.html", tmp_path / "page.html"
    target.write_text("old")
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "later.html"
    dangling.symlink_to(tmp_path / "site" / "later.html")
    run = RunStore(tmp_path / "r")
    run.create({"run_id": "r", "created": "2026-12-01T00:00:00+00:00", "finished": None, "fingerprint": {},
                "command": [], "spec": None, "roofline": None, "summary": None})
    code, _, err = run_cli("report", tmp_path / "r", "-o", dangling)
    assert code == 0, err
    assert dangling.is_symlink() and "<html" in (tmp_path / "site" / "later.html").read_text().lower()
