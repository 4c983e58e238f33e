"""spark_bench/tune/search.py at its edges: the boundaries of the noise rule, what an entry counts, a 0 µs closing
timing, and a default recorded among several configs. Expected values are worked out by hand from docs/tune.md
("Choice"). Found by a mutation audit of the tuner."""

import pytest
from test_tune import FAST, SLOW, _plan, _records
from test_tune_audit import DEFAULT, _again

from spark_bench.tune.search import _rel_ci, select
from spark_bench.tune.space import config_id


def test_a_win_exactly_as_large_as_the_noise_keeps_the_default():
    """"It also stays when the best candidate is faster by no more than the noise": 25% faster against CIs of 12.5%
    each (from six raw samples: their full range, exact in binary) is not a win."""
    plan = _plan([FAST])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 7.5)}])
    records[0]["timing"]["samples"] = [8.75, 10.0, 10.0, 10.0, 10.0, 11.25]  # (11.25 - 8.75) / 2 / 10 = 12.5%
    records[1]["timing"]["samples"] = [6.5625, 7.5, 7.5, 7.5, 7.5, 8.4375]  # 0.9375 / 7.5 = 12.5%
    [(_, entry)] = select(plan, records)
    assert entry["config"] == DEFAULT and entry["within_noise"] == {"id": config_id(FAST), "speedup": 1.3333,
                                                                    "noise": 0.25}
    records[1]["timing"]["median"] = 7.49
    [(_, entry)] = select(plan, records)
    assert entry["config"] == FAST


def test_six_raw_samples_give_the_order_statistic_ci():
    """From MIN_CI_SAMPLES (6) stored samples on, the median's CI comes from the samples, not the stored rel_ci."""
    import numpy as np

    from spark_bench.stats import MIN_CI_SAMPLES, median_ci

    samples = [10.0, 10.1, 10.2, 10.4, 10.8, 11.6][:MIN_CI_SAMPLES]
    lo, hi = median_ci(np.asarray(samples))
    median = float(np.median(samples))
    assert _rel_ci({"samples": samples, "rel_ci": 0.5}) == pytest.approx((hi - lo) / 2 / median)
    assert _rel_ci({"samples": samples[:-1], "rel_ci": 0.5}) == 0.5  # five: the stored one


def test_a_zero_closing_timing_leaves_the_first_as_the_defaults_time():
    """A closing re-timing of 0 µs (a graph-timed call no slower than its flush) says nothing of drift: the case keeps
    its round-0 default time rather than dropping out."""
    plan = _plan([FAST])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0)}])
    [(_, entry)] = select(plan, [*records, _again(plan, 0.0)])
    assert entry["config"] == FAST and entry["default"]["time_us"] == 10.0 and entry["drift"] is None


def test_the_entry_counts_the_cases_and_candidates_behind_the_choice():
    """`cases`: the cases the chosen config was timed in (not the key's); `candidates_timed`: the configs timed
    besides the default."""
    plan = _plan([SLOW, FAST], cases=2)
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 0.0), config_id(SLOW): ("ok", 12.0)},
             {"default": ("ok", 10.0), config_id(FAST): ("ok", 8.0), config_id(SLOW): ("ok", 12.0)}]
    [(_, entry)] = select(plan, _records(plan, times))
    assert entry["config"] == FAST and entry["cases"] == 1 and entry["candidates_timed"] == 2


def test_the_stored_drift_is_the_largest_change_in_either_direction():
    plan = _plan([FAST], cases=2)
    records = _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0)}] * 2, rel_ci=0.005)
    records += [_again(plan, 8.5, 0.005, case=0), _again(plan, 10.1, 0.005, case=1)]
    [(_, entry)] = select(plan, records)
    assert entry["drift"] == {"max": -0.15, "cases": 2}


def test_a_candidate_pruned_offline_is_not_counted_untimed():
    """Pruned candidates are never timed on purpose: `untimed` counts only those the budget left out."""
    plan = _plan([FAST, SLOW])
    plan["items"][0]["candidates"][1].update(status="pruned", reason="spills")
    [(_, entry)] = select(plan, _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0)}]))
    assert entry["config"] == FAST and entry["untimed"] == 0


def test_the_planned_default_is_known_when_the_default_case_ran_it_among_others():
    """A case that launched the kernel with several configs (two keys) ran the planned one among them: its key's
    entry has a known default."""
    plan = _plan([FAST])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0)}])
    records[0]["config"] = {"test._k": [{"B": 8, "num_warps": 2}, DEFAULT]}
    [(_, entry)] = select(plan, records)
    assert entry["config"] == FAST and entry["default"]["config"] == DEFAULT


def test_a_default_timing_that_cannot_be_ranked_counts_its_case_unranked():
    """A throttled default takes its case out: the default and each candidate timed with it are counted unranked."""
    plan = _plan([FAST, SLOW], cases=2)
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0), config_id(SLOW): ("ok", 12.0)}] * 2
    records = _records(plan, times)
    records[0]["labels"] = ["throttled"]
    [(_, entry)] = select(plan, records)
    assert entry["config"] == FAST and entry["cases"] == 1 and entry["unranked"] == 3


def test_a_default_that_stays_after_a_drift_has_its_bracketed_time_and_no_speedup():
    """The default's time is the geometric mean of its two timings (10 and 8.1 µs: 9 µs), not the first alone, so
    that it stays at speedup 1.0 against itself."""
    plan = _plan([SLOW])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(SLOW): ("ok", 12.0)}], rel_ci=0.005)
    [(_, entry)] = select(plan, [*records, _again(plan, 8.1, rel_ci=0.005)])
    assert entry["config"] == DEFAULT and entry["speedup"] == 1.0
    assert entry["time_us"] == entry["default"]["time_us"] == pytest.approx(9.0)
