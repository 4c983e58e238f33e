"""History query, store and command edges the other history tests leave open (found by mutation testing): an
ambiguous fingerprint or an unknown run is a one-line error, and text from the run files is never rich markup."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from conftest import run_cli
from test_history_edges import DAY, GATE, _db_of, _timed

from spark_bench.history import query, store, synthetic
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import HistoryError


def _one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err


def test_a_fingerprint_prefix_two_share_is_refused_naming_them(tmp_path):
    con = _db_of(tmp_path, [("a", "ab1", [_timed(GATE, 50.0)]), ("b", "ab2", [_timed(GATE, 50.0)])])
    try:
        with pytest.raises(HistoryError, match=r"'ab' matches 2 fingerprints; stored: ab1 .*, ab2 "):
            query.resolve_fingerprint(con, "ab")
        assert query.resolve_fingerprint(con, "ab2") == "ab2"
    finally:
        con.close()


def test_an_unknown_run_is_a_one_line_error(tmp_path):
    con = _db_of(tmp_path, [("nightly", "fp", [_timed(GATE, 50.0)])])
    try:
        with pytest.raises(HistoryError, match="'weekly' matches no stored runs"):
            query.run(con, "weekly")
    finally:
        con.close()
    code, _, err = run_cli("history", "show", "weekly", "--db", tmp_path / "h.db")
    _one_line_error(code, err, "'weekly' matches no stored runs", "history list --runs")


def test_a_fingerprint_and_a_database_path_are_printed_as_text_not_markup(tmp_path):
    db = tmp_path / "[/db].db"
    add_runs(db, [synthetic.write_run(tmp_path / f"r{i}", [_timed(GATE, 50.0, seed=i)], run_id=f"r{i}", commit=None,
                                      created=DAY, fingerprint_id="[/odd]") for i in range(2)])
    for args, shown in ((("list",), ["[/db].db", "[/odd]"]), (("list", "--runs"), ["[/db].db", "r0", "r1"]),
                        (("trend", "--op", "kda.gate"), ["([/odd]): 2 points"])):
        code, out, err = run_cli("history", *args, "--db", db)
        assert code == 0 and all(text in out for text in shown), (args, out, err)


def test_a_run_s_failed_count_is_every_status_that_failed_and_no_skipped_one(tmp_path):
    statuses = ("ok", "mismatch", "error", "crash", "timeout", "oom", "skipped")
    cases = [synthetic.SynthCase("kda.gate", "triton", {"tokens": t}, 50.0) for t in range(len(statuses))]
    records = [_timed(c, 50.0) if s == "ok" else synthetic.record(c, None, status=s, error=s)
               for c, s in zip(cases, statuses, strict=True)]
    con = _db_of(tmp_path, [("r", "fp", records)])
    try:
        (run,) = query.runs(con)
    finally:
        con.close()
    assert (run["cases"], run["failed"]) == (7, 5)


def _branches_db(tmp_path, dev_fingerprint="fp-b"):
    """r0, r1 on main (fingerprint fp-a), r2 on dev (`dev_fingerprint`), a day apart from DAY."""
    db = tmp_path / "h.db"
    for i, (branch, fp) in enumerate((("main", "fp-a"), ("main", "fp-a"), ("dev", dev_fingerprint))):
        run = synthetic.write_run(tmp_path / f"r{i}", [_timed(GATE, 50.0, seed=i)], run_id=f"r{i}", commit=None,
                                  created=DAY + dt.timedelta(days=i), fingerprint_id=fp)
        add_runs(db, [run], branch=branch)
    return db


def _stored(db) -> list[str]:
    return sorted(r["run_id"] for r in json.loads(run_cli("history", "list", "--runs", "--json", "--db", db)[1]))


def test_prune_keep_zero_is_refused_and_drops_nothing(tmp_path):
    db = _branches_db(tmp_path)
    code, _, err = run_cli("history", "prune", "--keep", "0", "--db", db)
    _one_line_error(code, err, "--keep must be at least 1")
    assert _stored(db) == ["r0", "r1", "r2"]


def test_prune_of_one_branch_by_command_and_its_dry_run_says_would(tmp_path):
    db = _branches_db(tmp_path)
    code, out, _ = run_cli("history", "prune", "--older-than", "2030-01-01", "--branch", "dev", "--dry-run", "--db", db)
    assert code == 0 and out.splitlines() == ["would drop r2", f"history {db}: 1 run(s) would be pruned"], out
    assert _stored(db) == ["r0", "r1", "r2"]
    code, out, _ = run_cli("history", "prune", "--older-than", "2030-01-01", "--branch", "dev", "--db", db)
    assert code == 0 and out.splitlines() == ["dropped r2", f"history {db}: 1 run(s) pruned"], out
    assert _stored(db) == ["r0", "r1"]


def test_list_of_one_fingerprint_lists_its_runs_and_of_one_branch_its_fingerprints(tmp_path):
    db = _branches_db(tmp_path)
    code, out, _ = run_cli("history", "list", "--fingerprint", "fp-b", "--json", "--db", db)
    assert code == 0 and [(r["run_id"], r["branch"]) for r in json.loads(out)] == [("r2", "dev")]
    code, out, _ = run_cli("history", "list", "--branch", "main", "--json", "--db", db)
    assert code == 0 and [(r["fingerprint_id"], r["runs"]) for r in json.loads(out)] == [("fp-a", 2)], out


def test_a_trend_of_two_cases_is_refused_naming_both_and_a_backend_is_matched_whole(tmp_path):
    torch, compiled = (synthetic.SynthCase("kda.gate", b, GATE.params, 90.0) for b in ("torch", "torch_compile"))
    _db_of(tmp_path, [("r", "fp", [_timed(torch, 90.0), _timed(compiled, 60.0)])]).close()
    code, _, err = run_cli("history", "trend", "--op", "kda.gate", "--db", tmp_path / "h.db")
    _one_line_error(code, err, "matches 2 cases", "kda.gate torch bf16", "kda.gate torch_compile bf16", "--backend")
    code, out, _ = run_cli("history", "trend", "--op", "kda.gate", "--backend", "torch", "--json", "--db",
                           tmp_path / "h.db")
    assert code == 0 and [s["backend"] for s in json.loads(out)] == ["torch"], out


def test_show_failed_keeps_skipped_cases_and_sums_up_the_whole_run(tmp_path):
    cases = [synthetic.SynthCase("kda.gate", "triton", {"tokens": t}, 50.0) for t in (1, 2, 3)]
    records = [_timed(cases[0], 50.0), synthetic.record(cases[1], None, status="mismatch", error="err ratio 0.3"),
               synthetic.record(cases[2], None, status="skipped", error="peer not installed")]
    _db_of(tmp_path, [("r", "fp", records)]).close()
    code, out, _ = run_cli("history", "show", "r", "--failed", "--json", "--db", tmp_path / "h.db")
    assert code == 0 and [r["status"] for r in json.loads(out)["results"]] == ["mismatch", "skipped"]
    code, out, _ = run_cli("history", "show", "r", "--failed", "--db", tmp_path / "h.db")
    assert code == 0 and out.splitlines()[-1] == "3 cases, 1 ok, 1 mismatch, 1 skipped", out


def test_cases_whose_axis_mixes_none_numbers_and_text_are_listed_in_order(tmp_path):
    """A plugin's axis may hold None ('auto') beside numbers: comparing None with 64 was a TypeError traceback."""
    cases = [synthetic.SynthCase("p.op", "triton", {"chunk": v}, 50.0) for v in ("auto", 64, None, 8, True)]
    _db_of(tmp_path, [("r", "fp", [_timed(c, 50.0) for c in cases])]).close()
    con = store.connect(tmp_path / "h.db")
    try:
        assert [c.params["chunk"] for c in query.select_cases(con)] == [True, 8, 64, None, "auto"]
    finally:
        con.close()
    code, _, err = run_cli("history", "trend", "--op", "p.op", "--db", tmp_path / "h.db")
    _one_line_error(code, err, "matches 5 cases")


def test_trend_last_prints_exactly_the_newest_n_points(tmp_path):
    db = tmp_path / "h.db"
    add_runs(db, [synthetic.write_run(tmp_path / f"r{i}", [_timed(GATE, 50.0, seed=i)], run_id=f"r{i}", commit=None,
                                      created=DAY + dt.timedelta(days=i)) for i in range(5)])
    code, out, _ = run_cli("history", "trend", "--op", "kda.gate", "--last", "2", "--db", db)
    assert code == 0 and "the newest 2 of 5 points" in out, out
    assert [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")] == ["3", "4"], out
