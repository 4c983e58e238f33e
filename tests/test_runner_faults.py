"""The sweep survives every kind of backend failure, records each one correctly, and measures every good case."""

import json
import subprocess

from conftest import spark_bench_cmd

EXPECTED = {
    "good": "ok", "slow": "ok", "raises": "error", "segfault": "crash", "abort": "crash", "hang": "timeout",
    "wrong": "mismatch", "nan": "mismatch", "unwritten": "mismatch", "oom": "oom", "hang_in_timing": "timeout",
    "unavailable": "skipped",
}


def test_fault_injection_sweep(tmp_path, fault_env):
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "fault.*", "--quick", "--timeout", "4", "--out", out,
                                          "--no-report"), env=fault_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some cases failed
    assert "Traceback" not in proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_case = {(r["backend"], r["params"]["rows"]): r for r in records}
    assert len(records) == len(by_case) == len(EXPECTED) * 2  # two points, no duplicates
    for (backend, _rows), rec in by_case.items():
        assert rec["status"] == EXPECTED[backend], (backend, rec["status"], rec["error"])
    for rows in (3, 17):
        good = by_case[("good", rows)]
        assert good["timing"]["n"] >= 3 and good["timing"]["median"] > 0 and good["check"]["err_ratio"] == 0
        assert good["gbps"] > 0 and good["timing"]["timer"] == "cpu-perf_counter"
        assert "SIGSEGV" in by_case[("segfault", rows)]["error"]
        assert "Segmentation fault" in by_case[("segfault", rows)]["worker_log_tail"]  # faulthandler's report
        assert "SIGABRT" in by_case[("abort", rows)]["error"]
        assert "deliberate failure" in by_case[("raises", rows)]["error"]
        assert by_case[("hang", rows)]["phase"] == "check"
        assert by_case[("hang_in_timing", rows)]["phase"] == "timing"
        assert "error ratio" in by_case[("wrong", rows)]["error"]
        assert "NaN" in by_case[("nan", rows)]["error"]
        assert "NaN" in by_case[("unwritten", rows)]["error"]  # the poisoned allocation shows the unwritten rows
        assert by_case[("unavailable", rows)]["error"] == "needs a device nobody has"
        for bad in ("wrong", "nan", "unwritten", "raises", "oom"):
            assert by_case[(bad, rows)]["timing"] is None and by_case[(bad, rows)]["gbps"] is None
    run = json.loads((out / "run.json").read_text())
    assert run["summary"]["ok"] == 4 and run["summary"]["crash"] == 4 and run["summary"]["timeout"] == 4
    assert run["finished"] is not None
