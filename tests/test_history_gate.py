"""`history check`, the nightly gate, on histories built to trip it: a failed re-run of an already passing commit, a
late run of an old commit under `--since DATE`, a fingerprint that cannot place `--since COMMIT`, a threshold that is
not a whole percent."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
from conftest import run_cli

from spark_bench.history import synthetic
from spark_bench.history.ingest import add_runs

COMMITS = [f"{i:040x}" for i in range(1, 11)]


def _records(status_of_first: str = "ok", seed: int = 0) -> list[dict]:
    cases = synthetic.cases()
    recs = [synthetic.record(c, synthetic.draw(np.random.default_rng(seed + k), c.base_us, 40, 0.03))
            for k, c in enumerate(cases)]
    if status_of_first != "ok":
        recs[0] = synthetic.record(cases[0], None, status=status_of_first, error="outputs differ: err_ratio 0.4")
    return recs


def _check(db, since, *extra):
    return run_cli("history", "check", "--db", db, "--since", since, *extra)


def test_a_failed_rerun_of_a_commit_that_passed_fails_the_gate(tmp_path):
    """A point is `ok` when any of its runs passed: tonight's failed re-run of HEAD was hidden by last night's pass,
    so a nightly without a new commit could never fail on a broken kernel."""
    db = tmp_path / "h.db"
    add_runs(db, synthetic.write_history(tmp_path / "runs", COMMITS))
    tonight = synthetic.START + dt.timedelta(days=len(COMMITS) + 3)
    add_runs(db, [synthetic.write_run(tmp_path / "rerun", _records("mismatch"), run_id="rerun", commit=COMMITS[-1],
                                      created=tonight)])
    for since in (COMMITS[-2], COMMITS[-1], tonight.date().isoformat()):  # the re-run of SINCE itself counts too
        code, out, err = _check(db, since)
        assert code == 1, (since, out + err)
        assert "kda.gate triton bf16" in err and "broken (mismatch: outputs differ: err_ratio 0.4)" in err
    code, out, _ = _check(db, COMMITS[-2], "--json")
    (found,) = json.loads(out)
    assert found["verdict"] == "broken" and found["status"] == "mismatch" and found["unit"] == "us"
    code, out, _ = _check(db, (tonight + dt.timedelta(days=1)).date().isoformat())
    assert code == 0 and "0 with runs after it" in out  # nothing after that date: said, not a silent pass


def test_since_a_date_counts_steps_first_measured_after_it_not_late_runs_of_old_commits(tmp_path):
    shas = synthetic.git_repo(tmp_path / "repo", 31)
    kept = shas[:3] + shas[4:]  # commit 3 is not measured with the others...
    runs = synthetic.write_history(tmp_path / "runs", kept, steps={3: (17, 1.2)}, seed=2)
    db = tmp_path / "h.db"
    add_runs(db, runs, repo=tmp_path / "repo")
    late = dt.datetime(2026, 12, 4, 2, 0, tzinfo=dt.timezone.utc)  # ...but months later: an old commit, a new run
    add_runs(db, [synthetic.write_run(tmp_path / "late", _records(), run_id="late", commit=shas[3], created=late)],
             repo=tmp_path / "repo")
    code, out, err = _check(db, "2026-12-04", "--repo", tmp_path / "repo")
    assert code == 0, out + err  # the step was first measured in September, before that date
    code, out, err = _check(db, "2026-09-15", "--repo", tmp_path / "repo")
    assert code == 1 and "REGRESSED: 1 case(s)" in err


def test_series_that_cannot_place_the_since_commit_are_said_not_skipped(tmp_path):
    db = tmp_path / "h.db"
    add_runs(db, synthetic.write_history(tmp_path / "h200", COMMITS[:6]))
    other = [f"{i:040x}" for i in range(101, 107)]  # another GPU, commits the H200 never ran
    add_runs(db, synthetic.write_history(tmp_path / "h100", other, fingerprint_id="fp-h100", seed=5,
                                         device={**synthetic.H200, "name": "NVIDIA H100"}))
    code, out, err = _check(db, COMMITS[3], "--threshold", "2.5%")
    assert code == 0, out + err
    n = len(synthetic.cases())
    assert f"note: {n} series not checked: NVIDIA H100 [fp-h100] never ran {COMMITS[3]}" in err
    assert "no case stepped slower than 2.5% since" in out and f"({n} series, {n} with runs after it" in out


def test_a_step_says_why_it_may_not_be_the_codes_and_how_many_suspects_it_cut():
    from spark_bench.history.detect import Point, Step

    def point(commit, dirty=False, timers=("cuda-graph",)):
        return Point(commit=commit, time=None, run_ids=["r"], status="ok", median=1.0, ci_low=1.0, ci_high=1.0, n=5,
                     dirty=dirty, timers=timers)

    st = Step(index=3, last_good=point("a" * 40), first_bad=point("b" * 40, dirty=True, timers=("cuda-event",)),
              before=1.0, after=1.2, ratio=1.2, p_value=1e-4, n_before=3, n_after=2,
              suspects=[f"dev: change {i}" for i in range(25)])
    assert st.cautions() == [
        "the timer changed at this step (cuda-graph -> cuda-event): maybe the measurement's step; re-run both commits "
        "with one --timer to tell",
        "bbbbbbbbbb (dirty) had uncommitted changes: the step may be in code no commit holds"]
    shown = st.suspects_shown(20)
    assert len(shown) == 21 and shown[-1] == "... 5 more: git log aaaaaaaaaa..bbbbbbbbbb"
    d = st.to_dict()
    assert d["points_before"] == 3 and d["points_after"] == 2 and d["first_bad_dirty"] and not d["last_good_dirty"]
    assert "runs_before" not in d  # they count commits, not runs


def test_trend_gives_each_points_timer_and_a_failed_points_error(tmp_path):
    db = tmp_path / "h.db"
    add_runs(db, synthetic.write_history(tmp_path / "runs", COMMITS[:4]))
    add_runs(db, [synthetic.write_run(tmp_path / "bad", _records("mismatch"), run_id="bad", commit=COMMITS[4],
                                      created=synthetic.START + dt.timedelta(days=9))])
    c = synthetic.cases()[0]
    sets = [a for k, v in c.params.items() for a in ("--set", f"{k}={v}")]
    code, out, _ = run_cli("history", "trend", "--db", db, "--op", c.op, "--backend", c.backend, *sets, "--json")
    (series,) = json.loads(out)
    assert code == 0 and [p["timers"] for p in series["points"][:4]] == [["cuda-event"]] * 4
    assert series["points"][4]["status"] == "mismatch" and "outputs differ" in series["points"][4]["error"]
    code, out, _ = run_cli("history", "trend", "--db", db, "--op", c.op, "--backend", c.backend, *sets)
    assert "timer" in out and out.count("cuda-event") >= 4


def test_the_trend_pages_links_tell_two_fingerprints_apart(tmp_path):
    import re

    db = tmp_path / "h.db"
    add_runs(db, synthetic.write_history(tmp_path / "a", COMMITS[:4], case_list=synthetic.cases(ops=("kda.gate",))))
    add_runs(db, synthetic.write_history(tmp_path / "b", COMMITS[4:8], case_list=synthetic.cases(ops=("kda.gate",)),
                                         fingerprint_id="fp-h200-driver2"))
    code, _, err = run_cli("history", "report", "--db", db, "-o", tmp_path / "t.html")
    assert code == 0, err
    links = re.findall(r'<a href="#trend-[^"]+">([^<]+)</a>', (tmp_path / "t.html").read_text())
    assert sorted(links) == ["kda.gate · NVIDIA H200 fp-h200", "kda.gate · NVIDIA H200 fp-h200-driv"]
