"""The tuning logic without timing anything: config picks, the store, and the choice among timed candidates."""

import dataclasses
import json

import pytest
from conftest import run_cli

from spark_bench.sweep import Case
from spark_bench.tune import ConfigSpace
from spark_bench.tune.search import select
from spark_bench.tune.space import applied, config_id, recording
from spark_bench.tune.store import TunedStore

SPACE = ConfigSpace("test._k", key=("n", "dtype"), default={"B": 16, "num_warps": 4},
                    buckets=[({"n": 64}, {"B": 8, "num_warps": 2})],
                    candidates=[{"B": b, "num_warps": 8} for b in (32, 64, 128)])
DEVICE = {"type": "cuda", "name": "NVIDIA Test", "capability": "9.0", "sm_count": 8, "memory_bytes": 1}


def _store(entries, device=DEVICE):
    store = TunedStore.new(device, {"triton": "x"})
    for kernel, key, config, measured in entries:
        store.put(kernel, {"key": key, "config": config, "time_us": 1.0,
                           "default": {"config": {"B": 2}, "time_us": 2.0}, "speedup": 2.0, "measured": measured})
    return store


def test_a_bucket_bound_is_an_upper_bound_or_a_range():
    """(lo, hi) bounds a regime from both sides (2-32 experts, not 1): no bucket that repeats the default is needed
    to keep the values below it out."""
    space = ConfigSpace("test._ranged", key=("E", "dtype"), default={"B": 16},
                        buckets=[({"E": (2, 32), "dtype": "bf16"}, {"B": 4}), ({"E": 64}, {"B": 8})])
    picks = [space.declared(E=e, dtype=d)["B"] for e, d in ((1, "bf16"), (2, "bf16"), (32, "bf16"), (32, "fp32"),
                                                              (33, "bf16"), (64, "bf16"), (65, "bf16"))]
    assert picks == [8, 4, 4, 8, 8, 8, 16]


def test_pick_prefers_forced_then_tuned_then_declared_and_logs_each_pick():
    table = _store([("test._k", {"n": 1024, "dtype": "bf16"}, {"B": 64, "num_warps": 8}, "t1"),
                    ("test._k", {"n": 65536, "dtype": "bf16"}, {"B": 128, "num_warps": 8}, "t1")])
    with recording() as log:
        assert SPACE.pick(n=32, dtype="bf16") == {"B": 8, "num_warps": 2}  # the declared bucket
        with applied(table=table):
            # n <= 64 is a bucket of its own: the 1024-token winner (nearest) is not applied there
            assert SPACE.pick(n=32, dtype="bf16") == {"B": 8, "num_warps": 2}
            assert SPACE.pick(n=2000, dtype="bf16")["B"] == 64  # nearest key: 2000 is nearer 1024 than 65536
            assert SPACE.pick(n=40000, dtype="bf16")["B"] == 128
            assert SPACE.pick(n=65536, dtype="bf16")["B"] == 128  # the very key it was tuned at
            assert SPACE.pick(n=2000, dtype="fp32") == {"B": 16, "num_warps": 4}  # no fp32 entry: declared
            with applied({"test._k": {"B": 32, "num_warps": 8}}, table):
                assert SPACE.pick(n=2000, dtype="bf16")["B"] == 32
    # a key never tuned says so: its config comes from the nearest tuned key
    assert [p["source"] for p in log] == ["default", "default", "tuned-nearest", "tuned-nearest", "tuned", "default",
                                          "candidate"]
    assert log[2]["key"] == {"n": 2000, "dtype": "bf16"}
    assert [p["tuned_key"] for p in log] == [None, None, {"n": 1024, "dtype": "bf16"}, {"n": 65536, "dtype": "bf16"},
                                             {"n": 65536, "dtype": "bf16"}, None, None]
    from spark_bench.tune.space import summarize  # what a result records of these picks

    got = summarize(log[2:5])
    assert got["config_source"] == {"test._k": "mixed"} and len(got["config"]["test._k"]) == 2
    assert got["tuned_key"] == {"test._k": [{"n": 1024, "dtype": "bf16"}, {"n": 65536, "dtype": "bf16"}]}
    assert "tuned_key" not in summarize(log[:1])  # no table chose anything
    bucket_table = _store([("test._k", {"n": 16, "dtype": "bf16"}, {"B": 32, "num_warps": 8}, "t1")])
    with applied(table=bucket_table):  # a winner inside the bucket does apply across it
        assert SPACE.pick(n=48, dtype="bf16")["B"] == 32 and SPACE.pick(n=4096, dtype="bf16")["B"] == 16
    assert SPACE.pick(n=2000, dtype="bf16") == {"B": 16, "num_warps": 4}  # nothing leaks out of the contexts


def test_per_target_rules_apply_on_their_gpu_family_only_and_come_before_the_buckets():
    from spark_bench import triton_env
    from spark_bench.kernelgate.targets import TARGETS, family

    space = ConfigSpace("test._t", key=("n",), default={"B": 16, "num_warps": 4},
                        buckets=[({"n": 64}, {"B": 8, "num_warps": 2})],
                        per_target={"sm_80": [({"n": 64}, {"B": 8, "num_warps": 1}), ({}, {"B": 16, "num_warps": 8})]})
    assert {"B": 16, "num_warps": 8} in space.candidates and {"B": 8, "num_warps": 1} in space.candidates
    assert space.declared(target="sm_90a", n=32) == {"B": 8, "num_warps": 2}
    assert space.declared(target="sm_80", n=32) == {"B": 8, "num_warps": 1}
    assert space.declared(target="sm_80", n=4096) == {"B": 16, "num_warps": 8}
    assert space.declared(target=None, n=4096) == {"B": 16, "num_warps": 4}
    triton_env.set_capture_target(TARGETS["sm_80"])  # as `spark-bench kernels --target sm_80` captures launches
    try:
        assert triton_env.target_name() == "sm_80" and triton_env.sm_count(None) == 108
        assert space.pick(n=4096) == {"B": 16, "num_warps": 8}
    finally:
        triton_env.set_capture_target(None)
    assert space.pick(n=4096) == {"B": 16, "num_warps": 4}  # no GPU here: the default
    assert [family("8.6"), family("9.0"), family("10.0"), family("7.5")] == ["sm_80", "sm_90a", "sm_100a", None]
    by_dtype = ConfigSpace("test._d", key=("dtype",), default={"B": 1},
                           per_target={"sm_80": [({"dtype": "torch.float32"}, {"B": 2})]})
    assert by_dtype.declared(target="sm_80", dtype="torch.float32") == {"B": 2}
    assert by_dtype.declared(target="sm_80", dtype="torch.bfloat16") == {"B": 1}  # equal, not "b" <= "f"
    with pytest.raises(ValueError, match="sm_75"):
        ConfigSpace("test._u", key=("n",), default={"B": 1}, per_target={"sm_75": [({}, {"B": 2})]})


def test_a_forced_config_is_part_of_the_case_id():
    base = Case("op", "triton", {"n": 1}, "bf16", "cpu", 0)
    forced = Case("op", "triton", {"n": 1}, "bf16", "cpu", 0, configs={"test._k": {"num_warps": 8, "B": 32}})
    assert forced.case_id == base.case_id + "|test._k:B=32,num_warps=8"
    assert config_id({"num_warps": 8, "B": 32}) == "B=32,num_warps=8"


def _plan(candidates, cases=1):
    items = []
    for i in range(cases):
        case = Case("op", "triton", {"n": 100 + i}, "fp32", "cpu", 0)
        items.append({"case": case.to_dict(), "kernel": "test._k",
                      "keys": [{"key": {"n": 1}, "config": {"B": 16, "num_warps": 4}}],
                      "candidates": [{"config": c, "id": config_id(c), "status": "ok"} for c in candidates]})
    return {"items": items}


def _record(case, status, median, rel_ci=None):
    return {"case_id": case.case_id, "status": status, "labels": [],
            "timing": {"median": median, "rel_ci": rel_ci} if status == "ok" else None}


def _records(plan, times, rel_ci=0.0):
    """times: per case, config id ('default' or a candidate's) -> (status, median); rel_ci: every timing's."""
    out = []
    for item, per_case in zip(plan["items"], times, strict=True):
        base = Case(**item["case"])
        for ident, (status, median) in per_case.items():
            cand = next((c for c in item["candidates"] if c["id"] == ident), None)
            case = base if cand is None else Case(**{**item["case"], "configs": {"test._k": cand["config"]}})
            out.append(_record(case, status, median, rel_ci))
    return out


FAST, SLOW, WRONG = {"B": 32, "num_warps": 8}, {"B": 64, "num_warps": 8}, {"B": 128, "num_warps": 8}


def test_the_fastest_correct_config_wins_and_a_wrong_one_never_does():
    plan = _plan([SLOW, WRONG, FAST])
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0), config_id(SLOW): ("ok", 50.0),
              config_id(WRONG): ("mismatch", None)}]
    [(kernel, entry)] = select(plan, _records(plan, times))
    assert kernel == "test._k" and entry["config"] == FAST and entry["time_us"] == 5.0
    assert entry["default"] == {"config": {"B": 16, "num_warps": 4}, "time_us": 10.0}
    assert entry["runner_up"]["config"] == {"B": 16, "num_warps": 4} and entry["speedup"] == 2.0


def test_a_config_wrong_on_one_case_is_not_chosen_for_the_others():
    plan = _plan([WRONG, FAST], cases=2)
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 8.0), config_id(WRONG): ("ok", 1.0)},
             {"default": ("ok", 10.0), config_id(FAST): ("ok", 8.0), config_id(WRONG): ("error", None)}]
    [(_, entry)] = select(plan, _records(plan, times))
    assert entry["config"] == FAST and entry["cases"] == 2


def test_the_default_stays_when_no_candidate_beats_it():
    plan = _plan([SLOW])
    [(_, entry)] = select(plan, _records(plan, [{"default": ("ok", 10.0), config_id(SLOW): ("ok", 12.0)}]))
    assert entry["config"] == {"B": 16, "num_warps": 4} and entry["speedup"] == 1.0
    assert entry["runner_up"]["config"] == SLOW


@pytest.mark.parametrize("fast_us, rel_ci, chosen", [
    (9.0, 0.01, True),     # 10% faster, CIs of 1% each: a real win
    (9.7, 0.02, False),    # 3% faster, CIs of 2% each (4% together): noise, the default stays
    (9.95, 0.0, False),    # 0.5% faster with CIs of 0: under MIN_GAIN (1%)
    (9.95, None, False),   # 0.5% faster with no CI recorded (a single sample): its noise is unknown
    (7.0, None, False),    # 30% faster, but on single samples: nothing shows it is not noise; the default stays
])
def test_a_win_inside_the_noise_keeps_the_default(fast_us, rel_ci, chosen):
    plan = _plan([FAST])
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", fast_us)}]
    [(_, entry)] = select(plan, _records(plan, times, rel_ci))
    if chosen:
        assert entry["config"] == FAST and entry["within_noise"] is None and entry["speedup"] > 1.1
    else:
        assert entry["config"] == {"B": 16, "num_warps": 4} and entry["speedup"] == 1.0
        assert entry["runner_up"]["config"] == FAST
        assert entry["within_noise"] == {"id": config_id(FAST), "speedup": round(10.0 / fast_us, 4),
                                         "noise": None if rel_ci is None else max(0.01, 2 * rel_ci)}
        assert entry["runner_up"]["config"] == FAST


def test_a_zero_time_is_not_ranked():
    """A graph-timed call no slower than its flush is recorded as 0 us: it cannot win, nor divide by zero."""
    plan = _plan([SLOW, FAST], cases=2)
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 0.0), config_id(SLOW): ("ok", 12.0)},
             {"default": ("ok", 10.0), config_id(FAST): ("ok", 8.0), config_id(SLOW): ("ok", 12.0)}]
    [(_, entry)] = select(plan, _records(plan, times))
    assert entry["config"] == FAST and entry["speedup"] == 1.25  # from the case it has a time for
    zero_default = [{"default": ("ok", 0.0), config_id(FAST): ("ok", 8.0), config_id(SLOW): ("ok", 12.0)}]
    assert select(_plan([SLOW, FAST]), _records(_plan([SLOW, FAST]), zero_default)) == []


def test_no_entry_without_a_passing_default():
    plan = _plan([FAST])
    assert select(plan, _records(plan, [{"default": ("mismatch", None), config_id(FAST): ("ok", 1.0)}])) == []


def test_rounds_time_the_default_first_then_each_surviving_candidate_in_the_plan_order():
    from spark_bench.tune.session import TuneSession

    plan = _plan([FAST, SLOW, WRONG], cases=2)
    plan["items"][0]["candidates"][1]["status"] = "pruned"  # SLOW pruned offline for case 0: never timed there
    session = TuneSession(store=None, spec=None, cfg=None, timeout_s=1.0, tune={"plan": plan})
    rounds = session.rounds()
    assert [len(r) for r in rounds] == [2, 2, 2, 1, 2]
    assert all(c.configs is None and not c.repeat for c in rounds[0])
    assert [c.configs["test._k"] for c in rounds[1]] == [FAST, FAST]
    assert [c.configs["test._k"] for c in rounds[2]] == [WRONG, SLOW]
    # the closing round: the defaults again, so each case's candidates lie between two timings of its default
    assert [(c.configs, c.repeat) for c in rounds[-1]] == [(None, 1), (None, 1)]
    assert [c.case_id for c in rounds[-1]] == [c.case_id + "|repeat:1" for c in rounds[0]]
    plan["items"][1]["candidates"] = []
    assert [len(r) for r in session.rounds()] == [2, 1, 1, 1]  # a case without candidates is not timed again
    plan["items"][0]["candidates"] = []
    assert [len(r) for r in session.rounds()] == [2]


def test_the_budget_cuts_a_round_to_what_the_remaining_time_covers():
    from spark_bench.tune.session import TuneSession

    class Journal:
        def read_results(self):
            return [{"duration_s": 2.0}, {"duration_s": 4.0}]  # 3 s a case so far

    session = TuneSession(store=Journal(), spec=None, cfg=None, timeout_s=1.0, tune={"plan": {"items": []}})
    assert session._fit(10, 10.0) == 3 and session._fit(10, 1000.0) == 10
    assert session._fit(10, 2.0) == 0 and session._fit(10, -5.0) == 0
    assert session._fit(10, 10.0, walls=[(20.0, 4)]) == 2  # this invocation's rounds: 5 s a case, start-up included


def test_a_killed_tunes_timing_counts_against_the_budget_of_its_resume():
    """spent_s is stored when an invocation ends: a killed one's cases are counted from the journal instead."""
    from spark_bench.tune.session import TuneSession

    class Journal:
        def read_results(self):
            return [{"duration_s": 30.0}, {"duration_s": 50.0}]

    killed = TuneSession(store=Journal(), spec=None, cfg=None, timeout_s=1.0,
                         tune={"plan": {"items": []}, "spent_s": 12.0, "planning_s": 12.0})
    assert killed.spent_so_far() == 92.0  # planning + the cases the killed invocation timed
    ended = TuneSession(store=Journal(), spec=None, cfg=None, timeout_s=1.0,
                        tune={"plan": {"items": []}, "spent_s": 130.0, "planning_s": 12.0})
    assert ended.spent_so_far() == 130.0  # what the invocation that ended stored (start-ups included)


def test_run_tuned_auto_finds_this_devices_table_and_warns_of_another_devices(tmp_path):
    from spark_bench.fingerprint import device_info
    from spark_bench.tune.cli import load_tuned
    from spark_bench.tune.store import default_path

    warnings = []
    assert load_tuned("auto", "cpu", tmp_path, warnings.append) is None
    assert "no tuned table for this device" in warnings[-1]
    mine = _store([("test._k", {"n": 1}, {"B": 8}, "t")], device=device_info("cpu"))
    mine.save(default_path(device_info("cpu"), tmp_path), "now")
    got = load_tuned("auto", "cpu", tmp_path, warnings.append)
    assert got["data"]["kernels"]["test._k"][0]["config"] == {"B": 8} and len(warnings) == 1
    _store([]).save(tmp_path / "gpu.json", "now")
    assert load_tuned(str(tmp_path / "gpu.json"), "cpu", tmp_path, warnings.append) is not None
    assert "was tuned on NVIDIA Test (sm 9.0)" in warnings[-1]


def _bad_outs(tmp_path):
    """--out files a tune could never write its table to, and what the one-line error says of each."""
    (tmp_path / "notjson.json").write_text("{")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "a-file").write_text("")
    _store([], device={**DEVICE, "name": "NVIDIA Other"}).save(tmp_path / "other.json", "now")
    return [(tmp_path / "notjson.json", "not valid JSON"), (tmp_path / "dir.json", "is a directory"),
            (tmp_path / "other.json", "measured on NVIDIA Other"),
            (tmp_path / "a-file" / "t.json", "a-file is a file, not a folder")]


def _no_plan(monkeypatch, plan):
    """Planning (the first tuning work) returns `plan`, or fails the test when `plan` is None."""
    def build(*args, **kwargs):
        assert plan is not None, "the tune started before its --out was checked"
        return plan

    monkeypatch.setattr("spark_bench.tune.plan.build", build)


def test_a_bad_tune_out_is_one_line_before_any_tuning(tmp_path, monkeypatch):
    _no_plan(monkeypatch, None)
    for out, needle in _bad_outs(tmp_path):
        code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--out", out, "--run-dir",
                               tmp_path / "tune")
        assert code == 2 and err.strip().count("\n") == 0 and needle in err and str(out) in err, err
        assert not (tmp_path / "tune").exists()


def _first_tune(tmp_path, monkeypatch, out="first.json"):
    """A finished tune of nothing (no tunable launch planned) in tmp_path/tune, to resume."""
    _no_plan(monkeypatch, {"items": [], "untunable": [], "capture_errors": [], "target": None})
    monkeypatch.setattr("spark_bench.results.RunStore.lock", lambda self: None)  # in-process: one tune at a time
    run_dir = tmp_path / "tune"
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--executor", "inprocess", "--run-dir",
                           run_dir, "--out", tmp_path / out)
    assert code == 0, err
    return run_dir


def test_tune_resume_takes_another_out_and_checks_it_first(tmp_path, monkeypatch):
    run_dir = _first_tune(tmp_path, monkeypatch)
    for out, needle in _bad_outs(tmp_path):
        code, _, err = run_cli("tune", "--resume", run_dir, "--out", out)
        assert code == 2 and err.strip().count("\n") == 0 and needle in err, err
    code, _, err = run_cli("tune", "--resume", run_dir, "--executor", "inprocess", "--out", tmp_path / "new.json")
    assert code == 0, err
    assert json.loads((run_dir / "run.json").read_text())["tune"]["out"] == str(tmp_path / "new.json")


def test_candidates_are_timed_with_their_defaults_timer():
    """Under --timer auto each case picks graph or events from a 50 us probe: a default at 52 us (events, launch
    gaps included) and a candidate at 48 us (graph, without them) differ by their timers. Candidates and the
    closing re-timing keep the default's: its timer and, for a graph, its calls per replay."""
    from spark_bench.sweep import Case
    from spark_bench.tune.session import pinned

    base = Case("x.op", "triton", {"n": 1}, "bf16", "cuda", 0)
    other = Case("x.op", "triton", {"n": 2}, "bf16", "cuda", 0)
    records = [{"case_id": base.case_id, "timing": {"timer": "cuda-graph", "calls_per_sample": 24}},
               {"case_id": other.case_id, "timing": {"timer": "cuda-event", "calls_per_sample": 1}}]
    cases = [dataclasses.replace(base, configs={"k": {"B": 64}}), dataclasses.replace(base, repeat=1),
             dataclasses.replace(other, configs={"k": {"B": 32}}),
             dataclasses.replace(Case("x.op", "triton", {"n": 3}, "bf16", "cuda", 0), configs={"k": {"B": 8}})]
    assert [c.timer for c in pinned(cases, records)] == ["graph:24", "graph:24", "events", None]
    assert [c.case_id for c in pinned(cases, records)] == [c.case_id for c in cases]  # the same cases, journaled
