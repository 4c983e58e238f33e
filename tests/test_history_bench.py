"""The history store's benchmark (spark_bench/history/bench.py) on a tiny history, its commands not timed: it writes
as many cases as asked, finds the step it planted, prints its numbers, and leaves a --dir it was given in place."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import run_cli

from spark_bench.history import bench


@pytest.mark.parametrize("n", [1, 7, 20, 21, 30])
def test_as_many_distinct_cases_as_asked(n):
    cases = bench._cases(n)
    assert len({(c.op, c.backend, c.dtype, c.params["tokens"]) for c in cases}) == len(cases) == n


def test_a_tiny_run_reports_every_point_and_keeps_the_directory_it_was_given(tmp_path, monkeypatch, capsys):
    timed: list[list[str]] = []

    def run_in_process(cmd: list[str]) -> float:  # no subprocess, no wall time; the trend commands must work
        timed.append(cmd)
        if "trend" in cmd:
            code, out, _ = run_cli("history", *cmd[cmd.index("trend"):])
            assert code == 0 and len(json.loads(out)[0]["points"]) == 6, out
        return 0.0

    monkeypatch.setattr(bench, "_timed", run_in_process)
    argv = ["bench", "--runs", "6", "--cases", "3", "--samples", "30", "--dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert (out["runs"], out["cases"], out["samples_per_case"], out["trend_points"]) == (6, 3, 30, 6)
    assert [index for index, _ratio in out["trend_steps"]] == [4]  # planted at run 6 * 2 // 3 = 4, x1.2
    assert out["trend_steps"][0][1] == pytest.approx(1.2, rel=0.05)
    assert len(timed) == 4 and sum("trend" in c for c in timed) == 2
    assert (tmp_path / "history.db").is_file() and len(list((tmp_path / "runs").iterdir())) == 6  # not removed
