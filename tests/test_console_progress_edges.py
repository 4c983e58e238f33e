"""Console edges the other console tests leave open (found by mutation testing of spark_bench/console.py): the
terminal's bar and its failure lines, a budget already spent, and the one `× fastest` ratio highlighted."""

import io
import re

from rich.console import Console
from test_console import _case, _progress, _rec

from spark_bench.console import SweepProgress, failures_table, results_table


def test_a_spent_budget_reads_zero_seconds_not_a_negative_eta(monkeypatch):
    progress, buf = _progress({_case("torch", n).case_id: 1.0 for n in range(3)}, total=3, monkeypatch=monkeypatch,
                              elapsed=45.0)
    progress.deadline = progress.started + 30.0  # the budget ran out 15 s ago; the points begun still finish
    progress.result(_case("torch", 0), {"status": "ok", "timing": None})
    assert "eta 0s budget]" in buf.getvalue(), buf.getvalue()


def _live(total):
    buf = io.StringIO()
    return SweepProgress(total, Console(file=buf, width=160, force_terminal=True)), buf


def test_the_terminal_bar_counts_the_cases_that_run_and_prints_each_failure():
    progress, buf = _live(4)
    with progress:
        progress.result(_case("vllm", 1), {"status": "skipped", "error": "vllm not installed", "timing": None})
        progress.result(_case("torch", 1), {"status": "ok", "timing": None})
        progress.result(_case("triton", 1), {"status": "mismatch", "error": "err ratio 0.3 > 0.01", "timing": None})
        task = progress.progress.tasks[0]
        assert (task.completed, task.total) == (2, 3)  # the skipped case left the bar's total
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # no terminal codes
    assert "x.op triton n=1 fp32: err ratio 0.3 > 0.01" in text and "vllm not installed" not in text


def test_only_the_fastest_row_s_ratio_is_highlighted():
    buf = io.StringIO()
    records = [_rec("x.op", "fast", {"n": 1}, 10.0), _rec("x.op", "slow", {"n": 1}, 20.0)]
    Console(file=buf, width=220, force_terminal=True, color_system="standard").print(results_table(records))
    text = buf.getvalue()
    assert "\x1b[1;32m1\x1b[0m" in text and "\x1b[1;32m2\x1b[0m" not in text


def test_a_multi_line_error_is_one_line_in_the_log_and_the_table():
    error = "ImportError: no module named vllm\n  File \"plugin.py\", line 3, in load"
    progress, buf = _progress(None, total=1)
    with progress:
        progress.result(_case("vllm", 1), {"status": "skipped", "error": error, "timing": None})
    assert buf.getvalue().splitlines() == ["[1/1] skipped  1 case of backend vllm: ImportError: no module named vllm"]
    table = io.StringIO()
    failed = {**_rec("x.op", "triton", {"n": 1}, None, status="error"), "error": error}
    Console(file=table, width=200, force_terminal=False).print(failures_table([failed]))
    assert "no module named vllm" in table.getvalue() and "plugin.py" not in table.getvalue()
