"""History store edges the other history tests leave open (found by mutation testing of spark_bench/history/store.py):
prune's --keep counts per fingerprint and branch, a transaction interrupted by Ctrl-C rolls back, and a database
another process migrated meanwhile is no newer one."""

from __future__ import annotations

import pytest
from test_history_edges import GATE, _db_of, _timed
from test_history_query_edges import _branches_db

from spark_bench.history import query, store


def test_keep_counts_the_newest_runs_of_each_branch(tmp_path):
    db = _branches_db(tmp_path, dev_fingerprint="fp-a")
    con = store.connect(db)
    try:
        assert store.prune(con, keep=1) == ["r0"]  # r1 is main's newest, r2 dev's
        assert [r["run_id"] for r in query.runs(con)] == ["r2", "r1"]
    finally:
        con.close()


def test_a_transaction_interrupted_by_ctrl_c_rolls_back(tmp_path):
    con = _db_of(tmp_path, [("r", "fp", [_timed(GATE, 50.0)])])
    try:
        with pytest.raises(KeyboardInterrupt), store.transaction(con):
            con.execute("DELETE FROM results")
            raise KeyboardInterrupt
        assert not con.in_transaction and con.execute("SELECT COUNT(*) FROM results").fetchone() == (1,)
        with store.transaction(con):  # the connection is usable again
            pass
    finally:
        con.close()


def test_a_database_migrated_meanwhile_by_another_process_is_no_newer_one(tmp_path):
    con = _db_of(tmp_path, [("r", "fp", [_timed(GATE, 50.0)])])
    try:  # what `connect` finds when another process migrated between its read and its write lock
        assert store.migrate(con, tmp_path / "h.db") == store.SCHEMA_VERSION
    finally:
        con.close()
