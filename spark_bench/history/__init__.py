"""Performance history across runs and commits (docs/history.md).

    add_runs(db, run_dirs, repo=None, branch=None) -> counts   ingest runs into the SQLite history database
    connect(db) -> sqlite3.Connection                          open (and migrate) it; HistoryError when it is not one
    `spark-bench history add|list|show|trend|check|report|prune`  the command group (spark_bench.history.cli)
"""

from spark_bench.history.ingest import add_runs
from spark_bench.history.store import DEFAULT_DB, SCHEMA_VERSION, HistoryError, connect

__all__ = ["DEFAULT_DB", "SCHEMA_VERSION", "HistoryError", "add_runs", "connect"]
