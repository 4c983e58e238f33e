"""Change detection: a synthetic 30-run history (a real git repository of 30 commits, runs written through the real
results store, one case stepping 15% slower at a known commit, pure noise on the others) yields exactly that step at
that commit; `history check` gates on it; the statistics hold on noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import run_cli

from spark_bench.history import detect, synthetic
from spark_bench.history.ingest import add_runs

STEP_CASE, STEP_AT, FACTOR = 3, 17, 1.15  # kda.gate torch tokens=256, 15% slower from the 18th commit on


@pytest.fixture(scope="module")
def hist(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    shas = synthetic.git_repo(root / "repo", 30)
    runs = synthetic.write_history(root / "runs", shas, steps={STEP_CASE: (STEP_AT, FACTOR)}, seed=7)
    db = root / "history.db"
    counts = add_runs(db, runs, repo=root / "repo")
    assert counts["added"] == 30
    return {"db": db, "repo": root / "repo", "shas": shas, "runs": runs, "case": synthetic.cases()[STEP_CASE]}


def trend(hist, c, *extra):
    code, out, err = run_cli("history", "trend", "--db", hist["db"], "--op", c.op, "--backend", c.backend,
                             "--set", f"tokens={c.params['tokens']}", "--json", "--repo", hist["repo"], *extra)
    assert code == 0, err
    (series,) = json.loads(out)
    return series


def test_the_injected_step_is_found_at_its_commit_and_nowhere_else(hist):
    for k, c in enumerate(synthetic.cases()):
        series = trend(hist, c)
        assert [p["commit"] for p in series["points"]] == hist["shas"]  # commit order, from the repository
        if k != STEP_CASE:
            assert series["steps"] == [], (c, series["steps"])
            continue
        (step,) = series["steps"]
        assert step["index"] == STEP_AT and step["direction"] == "slower"
        assert step["first_bad_commit"] == hist["shas"][STEP_AT]
        assert step["last_good_commit"] == hist["shas"][STEP_AT - 1]
        assert step["first_bad_runs"] == [hist["runs"][STEP_AT].name]
        assert abs(step["ratio"] - FACTOR) < 0.03 and step["confidence"] > 0.999
        assert step["points_before"] == STEP_AT and step["points_after"] == 30 - STEP_AT
        assert step["suspects"] == [f"{hist['shas'][STEP_AT][:7]} dev: change {STEP_AT}"]  # git log good..bad


def test_trend_prints_the_series_and_its_step(hist):
    c = hist["case"]
    code, out, err = run_cli("history", "trend", "--db", hist["db"], "--op", c.op, "--backend", c.backend, "--set",
                             "tokens=256", "--repo", hist["repo"], "--last", "5")
    assert code == 0, err
    assert "30 points" in out and "slower +1" in out and f"change {STEP_AT}" in out
    assert hist["shas"][29][:10] in out and hist["shas"][20][:10] not in out.split("step slower")[0]


def test_trend_of_two_runs_says_it_cannot_tell_the_noise(tmp_path):
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 3)])
    add_runs(tmp_path / "h.db", runs)
    c = synthetic.cases()[0]
    sets = [a for k, v in c.params.items() for a in ("--set", f"{k}={v}")]
    code, out, err = run_cli("history", "trend", "--db", tmp_path / "h.db", "--op", c.op, "--backend", c.backend, *sets)
    assert code == 0, err
    assert "2 points" in out and "too few timed points" in out and "noise ±" not in out  # not "±0.00%"
    code, out, err = run_cli("history", "check", "--db", tmp_path / "h.db", "--since", "2026-01-01")
    n = len(synthetic.cases())
    assert code == 0 and f"({n} series, {n} with runs after it; {n} of them with fewer than 3 timed points, which " \
        "cannot show a step)" in out


@pytest.mark.parametrize("since, code", [
    (0, 1), (STEP_AT - 1, 1),  # the last good commit: the step came after it
    (STEP_AT, 0), (29, 0),     # `--since COMMIT` is exclusive, like `git log COMMIT..`
    # run 17 was made 2026-09-18T02:00Z (its commit is of 2026-09-17T23:00Z): a date is inclusive, of the run
    ("2026-09-01", 1), ("2026-09-18", 1), ("2026-09-18T02:00:00Z", 1), ("2026-09-18T03:00", 0), ("2026-09-19", 0),
])
def test_check_gates_on_steps_after_since(hist, since, code):
    ref = hist["shas"][since][:12] if isinstance(since, int) else since
    got, out, err = run_cli("history", "check", "--db", hist["db"], "--since", ref, "--repo", hist["repo"])
    assert got == code, out + err
    if code == 1:
        assert "REGRESSED: 1 case(s)" in err and "kda.gate torch bf16 heads=4 tokens=256" in err
        assert f"change {STEP_AT}" in err
    else:
        assert "no case stepped slower" in out


def test_check_json_threshold_and_usage_errors(hist):
    code, out, _ = run_cli("history", "check", "--db", hist["db"], "--since", hist["shas"][0], "--json")
    assert code == 1
    (found,) = json.loads(out)
    assert found["verdict"] == "slower" and found["first_bad_commit"] == hist["shas"][STEP_AT]
    code, _, _ = run_cli("history", "check", "--db", hist["db"], "--since", hist["shas"][0], "--threshold", "20%")
    assert code == 0  # a 15% step is below a 20% threshold
    code, _, _ = run_cli("history", "check", "--db", hist["db"], "--since", hist["shas"][0], "--op", "moe.*")
    assert code == 0
    code, _, err = run_cli("history", "check", "--db", hist["db"], "--since", "deadbeef", "--repo", hist["repo"])
    assert code == 2 and "no stored run" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("history", "check", "--db", hist["db"], "--since", "2026-09-01", "--threshold", "lots")
    assert code == 2 and "not a number" in err


def test_a_regression_in_todays_run_alone_fails_the_gate(tmp_path):
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 21)],
                                   steps={0: (19, 1.12), 5: (19, 0.8)}, seed=3)
    db = tmp_path / "h.db"
    add_runs(db, runs)
    code, out, err = run_cli("history", "check", "--db", db, "--since", f"{18:040x}", "--json")
    assert code == 1, out + err
    (found,) = json.loads(out)  # the improvement on case 5 is no regression
    assert found["op"] == "kda.gate" and found["backend"] == "triton" and found["points_after"] == 1
    assert found["suspects"] is None  # no repository knows these commits
    for since, needle in (("", "at least 4 characters"), ("000", "at least 4 characters"),
                          ("0000", "is ambiguous: 000000000000"), (f"{1:039x}", "is ambiguous")):
        code, out, err = run_cli("history", "check", "--db", db, "--since", since)  # '' matched every commit: exit 0
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (since, out + err)
    code, out, _ = run_cli("history", "trend", "--db", db, "--op", "moe.experts", "--backend", "triton", "--set",
                           "tokens=256", "--json")
    (series,) = json.loads(out)
    assert [s["direction"] for s in series["steps"]] == ["faster"] and series["steps"][0]["index"] == 19


def test_a_case_that_stops_passing_is_a_regression(tmp_path):
    commits = [f"{i:040x}" for i in range(1, 11)]
    runs = synthetic.write_history(tmp_path / "runs", commits[:-1], seed=4)
    c = synthetic.cases()
    recs = [synthetic.record(x, synthetic.draw(np.random.default_rng(k), x.base_us, 40, 0.03)) for k, x in
            enumerate(c[1:])]
    recs.append(synthetic.record(c[0], None, status="mismatch", error="outputs differ: err_ratio 0.4 > 0.01"))
    last = synthetic.write_run(tmp_path / "runs" / "last", recs, run_id="last", commit=commits[-1],
                               created=synthetic.START.replace(month=10))
    db = tmp_path / "h.db"
    add_runs(db, [*runs, last])
    code, out, err = run_cli("history", "check", "--db", db, "--since", commits[-2])
    assert code == 1 and "broken" in err and "outputs differ" in err


def test_noise_alone_shows_no_step():
    """200 series of 30 commits of pure noise (1% run-to-run drift, 3% within-run spread): no step at the default
    threshold, and about alpha of them at threshold 0."""
    rng = np.random.default_rng(11)
    found_default = found_any = 0
    for _ in range(200):
        medians = 10.0 * np.exp(rng.normal(0.0, 0.01, 30))
        points = [detect.Point(commit=str(i), time=None, run_ids=[str(i)], status="ok", median=m, ci_low=m * 0.993,
                               ci_high=m * 1.007, n=40) for i, m in enumerate(medians)]
        found_default += bool(detect.find_steps(points)[0])
        found_any += bool(detect.find_steps(points, threshold=0.0)[0])
    assert found_default == 0
    assert found_any <= 8  # alpha = 1%: 2 expected, 8 is far in the tail


def test_segmentation_and_t_distribution():
    y = np.array([0.0] * 10 + [1.0] * 10 + [0.3] * 1)
    assert detect.segment(y + np.tile([0.01, -0.01], 11)[:21], beta=0.05) == [10, 20]
    assert detect.segment(np.zeros(12), beta=0.05) == []
    from scipy import stats

    for df in (1, 2, 3, 7, 28, 200):
        for t in (0.3, 1.5, 3.0, 6.0):
            assert math.isclose(detect.t_two_sided(t, df), 2 * stats.t.sf(t, df), rel_tol=1e-9, abs_tol=1e-15)


def test_reruns_of_a_commit_are_one_point():
    rows = [{"commit": c, "run_id": f"r{i}", "commit_time": "t", "created": "t", "status": "ok", "median": m,
             "ci_low": m - 1, "ci_high": m + 1, "n": 10, "dirty": False, "branch": "main", "error": None}
            for i, (c, m) in enumerate([("a", 10.0), ("a", 12.0), ("a", 11.0), (None, 50.0), ("b", 20.0)])]
    points = detect.points_of(rows)
    assert [(p.commit, p.median, p.run_ids, p.n) for p in points] == [
        ("a", 11.0, ["r0", "r1", "r2"], 30), (None, 50.0, ["r3"], 10), ("b", 20.0, ["r4"], 10)]
    assert points[1].label == "no commit"


def test_a_step_where_the_timer_changed_says_so():
    """`--timer auto` picks events or a graph per run from a probe: a case near the line can switch, and events
    inflate small kernels, so the step must name the switch; a step with one timer throughout names none."""
    def rows(timer_after):
        rng = np.random.default_rng(3)
        return [{"commit": f"c{i:02d}", "run_id": f"r{i}", "status": "ok", "median": m, "ci_low": m * 0.99,
                 "ci_high": m * 1.01, "n": 50, "dirty": False, "commit_time": None, "created": None, "branch": None,
                 "error": None, "timer": "cuda-graph" if i < 10 else timer_after}
                for i, m in enumerate([3.0 * (1 + 0.005 * rng.standard_normal()) * (1 if i < 10 else 3)
                                       for i in range(20)])]
    (step,), _ = detect.find_steps(detect.points_of(rows("cuda-event")))
    assert step.index == 10 and step.timer_change == "cuda-graph -> cuda-event"
    assert step.to_dict()["timer_change"] == "cuda-graph -> cuda-event"
    (step,), _ = detect.find_steps(detect.points_of(rows("cuda-graph")))
    assert step.timer_change is None
