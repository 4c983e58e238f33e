"""`history check`'s since/broken decisions at their boundaries (found by a mutation audit of history/gate.py and
history/detect.py): each test names the mutant it was written against."""

import datetime as dt
from types import SimpleNamespace

import pytest

from spark_bench.history import gate
from spark_bench.history.detect import Point

T0 = "2026-11-30T10:00:00+00:00"


def _point(commit, status="ok", time=None, newest=None):
    return Point(commit=commit, time=time, run_ids=["r"], status=status, median=1.0 if status == "ok" else None,
                 ci_low=None, ci_high=None, n=5, newest=newest or (status, None, time))


def _series(*points):
    return SimpleNamespace(points=list(points), device="NVIDIA H200")


def test_a_commit_made_at_since_commits_own_time_is_not_after_it(monkeypatch):
    """Mutant: `p.time > when` -> `>=` (SINCE, placed by the repository's time, is exclusive as in git log A..)."""
    monkeypatch.setattr(gate.gitinfo, "commit_time_of", lambda repo, rev: T0)
    s = _series(_point("a" * 40, time="2026-11-29T10:00:00+00:00"), _point("b" * 40, time=T0),
                _point("c" * 40, time="2026-12-01T10:00:00+00:00"))
    assert gate.since_index(s, "dddd", None) == 2


def test_a_skipped_newest_run_is_not_broken():
    """Mutant: 'skipped' dropped from the statuses that are no failure (a nightly without the GPU's library failed)."""
    s = _series(_point("a" * 40), _point("b" * 40, status="skipped"))
    assert gate._broken(s, "aaaa", 1, None) is False
    s = _series(_point("a" * 40), _point("b" * 40, status="mismatch"))
    assert gate._broken(s, "aaaa", 1, None) is True


def test_a_failed_rerun_of_the_only_commit_that_passed_is_broken():
    """Mutant: only earlier points count as having passed (a one-commit history's failed re-run passed the gate)."""
    only = _point("a" * 40, status="ok", newest=("mismatch", "outputs differ", T0))
    assert gate._broken(_series(only), "aaaa", 1, None) is True
    never = _point("a" * 40, status="error", newest=("error", "boom", T0))
    assert gate._broken(_series(never), "aaaa", 1, None) is False  # it never passed: no regression


def test_a_run_made_at_the_since_date_itself_counts():
    """Mutant: `created >= when` -> `>` (a run stamped exactly at the --since time fell outside the window)."""
    s = _series(_point("a" * 40), _point("b" * 40, status="ok", newest=("mismatch", None, T0)))
    assert gate._broken(s, T0, 0, T0) is True
    assert gate._broken(s, T0, 0, "2026-11-30T10:00:01+00:00") is False


@pytest.mark.parametrize("text, days", [("90d", 90), ("2w", 14), ("1m", 30), ("6m", 180), ("1y", 365)])
def test_ages_count_months_of_30_days(text, days):
    """Mutant: a month of 31 days (`prune --older-than 6m` kept or dropped six days of runs it should not)."""
    cut = dt.datetime.fromisoformat(gate.parse_age(text))
    expected = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)
    assert abs((cut - expected).total_seconds()) < 3600
    assert gate.parse_age("2026-01-02") == "2026-01-02T00:00:00+00:00"


def _row(run_id, created, status="ok", median=10.0, commit="a" * 40):
    return {"commit": commit, "run_id": run_id, "status": status, "median": median, "ci_low": None, "ci_high": None,
            "n": 5, "dirty": False, "branch": None, "error": None, "created": created, "commit_time": None,
            "timer": "cuda-event"}


def test_a_point_is_created_when_its_first_run_was_and_a_zero_median_is_no_pass():
    """Mutants: `created` from the newest run (a late re-run made an old step look new to `check --since DATE`);
    a median of 0 counted among the passing runs (a timer that read nothing halved the point's median)."""
    from spark_bench.history.detect import points_of

    (p,) = points_of([_row("r1", "2026-09-01T00:00:00+00:00"), _row("r2", "2026-12-04T00:00:00+00:00")])
    assert p.created == "2026-09-01T00:00:00+00:00" and p.newest[2] == "2026-12-04T00:00:00+00:00"
    (p,) = points_of([_row("r1", T0, median=0.0), _row("r2", T0, median=12.0)])
    assert p.status == "ok" and p.median == 12.0 and p.n == 5
