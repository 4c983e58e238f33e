"""spark_bench/history/report.py edges the browser tests leave open (found by mutation testing): regressions first in
the steps table with their change in percent, the CI band between its bounds, skipped commits not drawn as failures,
▲ for slower, combinations with a step first, and `--last N` drawing N points and only the steps among them. Series
built in memory."""

from __future__ import annotations

from spark_bench.history.detect import Point, Series, Step
from spark_bench.history.query import CaseKey
from spark_bench.history.report import TrendFigure, steps_table


def _point(i: int, median: float | None, status: str = "ok") -> Point:
    return Point(commit=f"{i:040x}", time=f"2026-09-{i + 1:02d}T02:00:00+00:00", run_ids=[f"run-{i}"], status=status,
                 median=median, ci_low=median and median * 0.9, ci_high=median and median * 1.2, n=40)


def _series(medians: list[float | None], steps_at: dict[int, float] | None = None, tokens: int = 16,
            skipped: tuple[int, ...] = ()) -> Series:
    points = [_point(i, m, "skipped" if i in skipped else ("ok" if m else "mismatch")) for i, m in enumerate(medians)]
    steps = [Step(index=i, last_good=points[i - 1], first_bad=points[i], before=10.0, after=10.0 * ratio, ratio=ratio,
                  p_value=1e-4, n_before=i, n_after=len(points) - i) for i, ratio in (steps_at or {}).items()]
    case = CaseKey(tokens, "kda.gate", "triton", "bf16", {"tokens": tokens})
    return Series(case, "fp-h200", "NVIDIA H200", "us", points, steps, sigma=0.01)


def test_regressions_come_first_with_their_change_in_percent():
    table = steps_table([_series([10.0] * 3 + [5.0] * 3, {3: 0.5}, tokens=1),
                         _series([10.0] * 3 + [11.0] * 3, {3: 1.1}, tokens=2)])
    change = [c["name"] for c in table["columns"]].index("change_%")
    assert [(row[0], round(row[change], 6)) for row in table["rows"]] == [("slower", 10.0), ("faster", -50.0)]


def test_the_band_runs_from_the_ci_low_to_the_ci_high():
    band, line = TrendFigure("kda.gate", "H200", [_series([10.0, 20.0])], {}, []).traces()[:2]
    assert band["y"] == [12.0, 24.0, 18.0, 9.0] and line["y"] == [10.0, 20.0]  # highs forth, lows back


def test_a_skipped_commit_is_no_failure_mark_and_a_failing_one_is():
    traces = TrendFigure("kda.gate", "H200", [_series([10.0, None, None, 10.0], skipped=(1,))], {}, []).traces()
    failing = [t for t in traces if t["name"].endswith("failing")]
    assert len(failing) == 1 and failing[0]["x"] == ["2026-09-03 02:00:00"]


def test_a_slower_step_is_an_up_triangle_and_combinations_with_a_step_come_first():
    fig = TrendFigure("kda.gate", "H200", [_series([10.0] * 4, tokens=1),
                                           _series([10.0] * 2 + [20.0] * 2, {2: 2.0}, tokens=2)], {}, [])
    assert fig.combos == ["tokens=2 bf16", "tokens=1 bf16"]
    (mark,) = [t for t in fig.traces() if t["name"].endswith(" slower")]
    assert mark["marker"]["symbol"] == "triangle-up" and mark["meta"]["combo"] == 0


def test_last_n_draws_the_newest_n_points_and_only_their_steps():
    s = _series([10.0, 20.0, 20.0, 40.0, 40.0], {1: 2.0, 3: 2.0})
    traces = TrendFigure("kda.gate", "H200", [s], {}, [], last=2).traces()
    assert traces[1]["y"] == [40.0, 40.0]  # the line: points 3 and 4
    (mark,) = [t for t in traces if t["name"].endswith(" slower")]
    assert mark["x"] == ["2026-09-04 02:00:00"]  # the step at point 3; the one at point 1 is out of view
