"""spark_bench/tune/search.py: candidates are ranked by their time relative to the default in the same cases (not
by raw times over different case sets), and the noise a win must beat takes the noisier of the default's two
timings. Expected outcomes are worked out by hand from the documented rule (search.py's module comment)."""

from test_tune import _plan, _record

from spark_bench.sweep import Case
from spark_bench.tune.search import select
from spark_bench.tune.space import config_id

A, B = {"B": 32, "num_warps": 8}, {"B": 64, "num_warps": 8}
DEFAULT = {"B": 16, "num_warps": 4}  # the declared config at test_tune._plan's key


def _case(plan, i, config=None):
    base = Case(**plan["items"][i]["case"])
    return base if config is None else Case(**{**plan["items"][i]["case"], "configs": {"test._k": config}})


def test_candidates_are_ranked_by_their_ratio_to_the_default_not_by_raw_time():
    """Case 0 is small (default 10 us), case 1 large (default 1000 us). A is 0.9x the default in case 0 and its case 1
    timing is throttled (not ranked); B is 0.8x in both. B is the faster config (geomean ratio 0.8 < 0.9), though
    its raw times (8, 800 us: geomean 80) dwarf A's single small-case 9 us."""
    plan = _plan([A, B], cases=2)
    records = [_record(_case(plan, 0), "ok", 10.0, 0.0), _record(_case(plan, 0, A), "ok", 9.0, 0.0),
               _record(_case(plan, 0, B), "ok", 8.0, 0.0),
               _record(_case(plan, 1), "ok", 1000.0, 0.0), _record(_case(plan, 1, A), "ok", 500.0, 0.0),
               _record(_case(plan, 1, B), "ok", 800.0, 0.0)]
    records[4]["labels"] = ["throttled"]
    [(_, entry)] = select(plan, records)
    assert entry["config"] == B and entry["runner_up"]["config"] == A
    assert entry["speedup"] == 1.25 and entry["cases"] == 2


def test_the_noise_takes_the_noisier_of_the_defaults_two_timings():
    """The default timed twice at 10 us (CIs 1% and 5%, no drift), a candidate at 9.6 us with a CI of 0: a 4% win is
    inside the 5% the second default timing says it may be off by, so the default stays (noise = 0 + 5% + 0)."""
    plan = _plan([A])
    again = Case(**{**plan["items"][0]["case"], "repeat": 1})
    records = [_record(_case(plan, 0), "ok", 10.0, 0.01), _record(_case(plan, 0, A), "ok", 9.6, 0.0),
               {"case_id": again.case_id, "status": "ok", "labels": [], "repeat": 1,
                "timing": {"median": 10.0, "rel_ci": 0.05}}]
    [(_, entry)] = select(plan, records)
    assert entry["config"] == DEFAULT
    assert entry["within_noise"] == {"id": config_id(A), "speedup": round(10.0 / 9.6, 4), "noise": 0.05}
