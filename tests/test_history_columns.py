"""History ingest writes each of a record's numbers into its own column of `results`: every timing statistic
(CI bounds included), n, GB/s, TFLOP/s and the raw samples; the series query reads the CI bounds back unswapped."""

from __future__ import annotations

import sqlite3

import numpy as np

from spark_bench.history import query, synthetic
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import connect

SAMPLES = [8.0, 9.0, 10.0, 11.0, 20.0]
# Every value distinct, so a value written into a neighbour's column cannot go unnoticed.
TIMING = {"median": 10.0, "mean": 11.5, "min": 8.0, "max": 20.0, "p10": 8.25, "p90": 17.0, "iqr": 2.5,
          "ci_low": 9.125, "ci_high": 10.875, "n": 5}
GBPS, TFLOPS = 321.5, 0.0625
COLUMNS = ("status", "timer", "unit", *TIMING, "gbps", "tflops")


def one_run(tmp_path):
    c = synthetic.SynthCase("kda.gate", "triton", {"tokens": 16, "heads": 4}, 10.0)
    rec = synthetic.record(c, np.array(SAMPLES))
    rec["timing"].update(TIMING)  # the hand-picked stats replace the ones computed from the samples
    rec.update(gbps=GBPS, tflops=TFLOPS)
    return synthetic.write_run(tmp_path / "run-1", [rec], run_id="run-1", commit="a" * 40, created=synthetic.START)


def test_every_results_column_holds_its_own_value(tmp_path):
    """One ingested record, read back with SQL by column name: median ... ci_low, ci_high, n, gbps, tflops each
    equal the record's value, and the samples blob decodes to the samples (little-endian float64)."""
    db = tmp_path / "h.db"
    assert add_runs(db, [one_run(tmp_path)])["added"] == 1
    con = sqlite3.connect(db)
    try:
        rows = con.execute(f"SELECT {', '.join(COLUMNS)}, samples FROM results").fetchall()
    finally:
        con.close()
    assert len(rows) == 1
    row = dict(zip((*COLUMNS, "samples"), rows[0], strict=True))
    assert (row["status"], row["timer"], row["unit"]) == ("ok", "cuda-event", "us")
    for k, v in TIMING.items():
        assert row[k] == v, f"column {k}: {row[k]} != {v}"
    assert isinstance(row["n"], int)
    assert row["gbps"] == GBPS
    assert row["tflops"] == TFLOPS
    assert np.frombuffer(row["samples"], dtype="<f8").tolist() == SAMPLES


def test_series_query_returns_ci_bounds_in_order(tmp_path):
    """query.series_rows (what `history show` and detection read): median, ci_low < ci_high, p10, p90 and n of the
    one stored point are the record's."""
    db = tmp_path / "h.db"
    add_runs(db, [one_run(tmp_path)])
    con = connect(db)
    try:
        (case,) = query.select_cases(con)
        (point,) = query.series_rows(con, [case.id])
    finally:
        con.close()
    assert case.op == "kda.gate" and case.backend == "triton"
    assert point["run_id"] == "run-1"
    for k in ("median", "ci_low", "ci_high", "p10", "p90", "n"):
        assert point[k] == TIMING[k], f"{k}: {point[k]} != {TIMING[k]}"
    assert point["ci_low"] < point["median"] < point["ci_high"]
