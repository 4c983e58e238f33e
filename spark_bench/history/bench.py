"""The history store's speed and size targets, measured (docs/history.md records the numbers):

    python -m spark_bench.history.bench [--runs 1000] [--cases 200] [--samples 100] [--dir DIR]

1. writes RUNS synthetic run directories of CASES cases with SAMPLES raw samples each (results.jsonl in the exact
   format of RunStore.append), 2. ingests them into a fresh database (`add_runs`, the code `history add` runs),
3. ingests them again (the no-op), 4. times `history trend` of one case over every run, in process and as commands,
5. compares the database's size with the runs' JSON. Prints one JSON object of the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spark_bench.history import detect, query, synthetic
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import connect


def _cases(n: int) -> list[synthetic.SynthCase]:
    ops = ("kda.gate", "kda.short_conv", "kda.chunk_prefill", "moe.router", "moe.experts")
    backends = ("triton", "torch", "torch_compile", "reference")
    per = max(1, -(-n // (len(ops) * len(backends))))
    tokens = tuple(2 ** (i % 14) * (1 + i // 14) for i in range(per))
    out = synthetic.cases(ops=ops, backends=backends, tokens=tokens)
    return out[:n]


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--dir", type=Path, default=None, help="Work directory (default: a temporary one, removed).")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="sb-history-bench-"))
    out: dict[str, object] = {"runs": args.runs, "cases": args.cases, "samples_per_case": args.samples}
    try:
        t = time.perf_counter()
        case_list = _cases(args.cases)
        runs = synthetic.write_history(work / "runs", [hashlib.sha1(b"%d" % i).hexdigest() for i in range(args.runs)],
                                       case_list=case_list, steps={0: (args.runs * 2 // 3, 1.2)},
                                       samples=args.samples, fast=True)
        out["generate_s"] = round(time.perf_counter() - t, 1)
        json_bytes = sum((r / f).stat().st_size for r in runs for f in ("run.json", "results.jsonl"))
        db = work / "history.db"

        t = time.perf_counter()
        counts = add_runs(db, runs)
        out["ingest_s"] = round(time.perf_counter() - t, 1)
        assert counts["added"] == args.runs, counts
        t = time.perf_counter()
        again = add_runs(db, runs)
        out["reingest_noop_s"] = round(time.perf_counter() - t, 1)
        assert again["unchanged"] == args.runs, again

        con = sqlite3.connect(db)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        db_bytes = sum(p.stat().st_size for p in work.glob("history.db*"))
        out.update(json_mb=round(json_bytes / 1e6, 1), db_mb=round(db_bytes / 1e6, 1),
                   db_over_json=round(db_bytes / json_bytes, 3))

        c = case_list[0]
        t = time.perf_counter()
        con = connect(db)
        (case,) = query.select_cases(con, [c.op], [c.backend], [f"{k}={v}" for k, v in c.params.items()], [c.dtype])
        series = detect.all_series([case], query.series_rows(con, [case.id]))
        con.close()
        out["trend_in_process_s"] = round(time.perf_counter() - t, 3)
        out["trend_points"] = len(series[0].points)
        out["trend_steps"] = [(s.index, round(s.ratio, 3)) for s in series[0].steps]
        sel = ["trend", "--db", str(db), "--op", c.op, "--backend", c.backend, "--json",
               *[a for k, v in c.params.items() for a in ("--set", f"{k}={v}")]]
        out["trend_history_module_s"] = round(_timed([sys.executable, "-m", "spark_bench.history", *sel]), 3)
        out["trend_spark_bench_cli_s"] = round(_timed([sys.executable, "-m", "spark_bench", "history", *sel]), 3)
        out["python_startup_s"] = round(_timed([sys.executable, "-c", "pass"]), 3)
        out["import_spark_bench_cli_s"] = round(_timed([sys.executable, "-c", "import spark_bench.cli"]), 3)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
