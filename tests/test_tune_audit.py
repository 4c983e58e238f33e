"""Defects found by the tuning audit (docs/known-issues.md, "Tuning"): each test fails without its fix."""

import json

import pytest
from conftest import run_cli
from test_tune import DEVICE, FAST, SLOW, _first_tune, _no_plan, _plan, _records, _store

from spark_bench.sweep import Case
from spark_bench.tune import ConfigSpace
from spark_bench.tune.search import select
from spark_bench.tune.space import SPACES, applied, config_id, recording, stale_entries
from spark_bench.tune.store import TunedStore

DEFAULT = {"B": 16, "num_warps": 4}  # the declared config of test_tune._plan's kernel


def test_a_stale_tuned_config_the_space_no_longer_declares_is_not_launched():
    """A table tuned before the kernel's space changed (a constexpr renamed, a candidate dropped) must not launch
    its old config (a missing constexpr, or a config no longer vetted offline), nor label the run "tuned"."""
    space = ConfigSpace("audit._stale", key=("n",), default={"BLOCK": 16, "num_warps": 4},
                        candidates=[{"BLOCK": 64, "num_warps": 4}])
    renamed = _store([("audit._stale", {"n": 1024}, {"B": 64, "num_warps": 4}, "t")])
    dropped = _store([("audit._stale", {"n": 1024}, {"BLOCK": 128, "num_warps": 4}, "t")])
    current = _store([("audit._stale", {"n": 1024}, {"BLOCK": 64, "num_warps": 4}, "t")])
    with recording() as log:
        for table in (renamed, dropped):
            with applied(table=table):
                assert space.pick(n=1024) == {"BLOCK": 16, "num_warps": 4}
        with applied(table=current):
            assert space.pick(n=1024) == {"BLOCK": 64, "num_warps": 4}
    assert [p["source"] for p in log] == ["default", "default", "tuned"]


def test_stale_entries_are_named_by_tuned_show_and_run(tmp_path, monkeypatch):
    """Skipped at launch, but not silently: `tuned show` and `run --tuned` name the entries a space dropped."""
    space = ConfigSpace("audit._stale", key=("n",), default={"BLOCK": 16, "num_warps": 4},
                        candidates=[{"BLOCK": 64, "num_warps": 4}])
    monkeypatch.setitem(SPACES, space.kernel, space)
    table = _store([("audit._stale", {"n": 1024}, {"BLOCK": 128, "num_warps": 4}, "t"),
                    ("audit._stale", {"n": 64}, {"BLOCK": 64, "num_warps": 4}, "t"),
                    ("audit._unknown", {"n": 64}, {"X": 1}, "t")])  # no space declared here: not judged
    assert stale_entries(table) == {"audit._stale": 1}
    table.save(tmp_path / "t.json", "now")
    code, out, _ = run_cli("tuned", "show", tmp_path / "t.json")
    assert code == 0 and "stale: audit._stale: 1 tuned entry with a config the kernel no longer declares" in out


def test_a_key_that_is_not_json_still_finds_its_tuned_entry(tmp_path):
    """`tune` stores keys through JSON (a torch.dtype as its name, a tuple as a list); a launch passing the raw value
    must still find its entry rather than silently running the declared config."""
    import torch

    space = ConfigSpace("audit._key", key=("shape", "dtype"), default={"B": 16}, candidates=[{"B": 64}])
    table = _store([("audit._key", {"shape": [4, 8], "dtype": "torch.float32"}, {"B": 64}, "t")])
    table.save(tmp_path / "t.json", "now")
    with applied(table=TunedStore.load(tmp_path / "t.json")):
        assert space.pick(shape=(4, 8), dtype=torch.float32) == {"B": 64}


def test_a_candidate_pruned_offline_in_one_case_is_never_chosen():
    """Pruned in one case of a kernel (it spills or cannot launch there) but fast in another: chosen, the table
    would launch it where it spills, or fails to launch (docs: candidates must be valid at every key)."""
    plan = _plan([FAST, SLOW], cases=2)
    plan["items"][1]["candidates"][0].update(status="pruned", reason="launch-resources in k: too many threads")
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0), config_id(SLOW): ("ok", 12.0)},
             {"default": ("ok", 10.0), config_id(SLOW): ("ok", 12.0)}]
    [(_, entry)] = select(plan, _records(plan, times))
    assert entry["config"] == DEFAULT and entry["runner_up"]["config"] == SLOW


def test_the_stored_default_is_the_config_the_default_case_ran():
    """The plan's capture picks for the pruning target (sm_90a with --target none or on a CPU), while round 0 runs
    the device's own rules (sm_80's per_target config on an A100). When the default wins, the table must hold what
    ran, not a config never timed on this device."""
    ran = {"B": 8, "num_warps": 8}  # what the device's rules picked (and recorded) for the default case
    plan = _plan([ran, SLOW])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(ran): ("ok", 10.05), config_id(SLOW): ("ok", 12.0)}])
    records[0]["config"] = {"test._k": ran}
    [(_, entry)] = select(plan, records)
    assert entry["config"] == ran and entry["default"]["config"] == ran and entry["runner_up"]["config"] == SLOW
    several = _records(plan, [{"default": ("ok", 10.0), config_id(SLOW): ("ok", 12.0)}])
    several[0]["config"] = {"test._k": [ran, {"B": 2, "num_warps": 1}]}  # two configs ran, neither the planned one
    assert select(plan, several) == []  # unknown default: no entry rather than a wrong one


def test_a_tune_resumed_on_another_device_is_refused(tmp_path, monkeypatch):
    run_dir = _first_tune(tmp_path, monkeypatch)
    run_file = run_dir / "run.json"
    run = json.loads(run_file.read_text())
    run["fingerprint"]["device"] = {**DEVICE, "type": "cpu"}
    run_file.write_text(json.dumps(run))
    code, _, err = run_cli("tune", "--resume", run_dir, "--executor", "inprocess")
    assert code == 2 and err.strip().count("\n") == 0 and "was tuned on NVIDIA Test" in err, err


@pytest.mark.parametrize("case", ["unwritable", "holds-results"])
def test_a_bad_run_dir_is_one_line_before_any_planning(tmp_path, monkeypatch, case):
    if case == "unwritable":
        (tmp_path / "a-file").write_text("")
        run_dir, needle = tmp_path / "a-file" / "tune", "cannot create the run directory (Not a directory)"
    else:
        run_dir, needle = _first_tune(tmp_path, monkeypatch), "already holds results"
        (run_dir / "results.jsonl").write_text('{"case_id": "x"}\n')
        monkeypatch.undo()
    _no_plan(monkeypatch, None)
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--run-dir", run_dir, "--out",
                           tmp_path / "new.json")
    assert code == 2 and err.strip().count("\n") == 0 and needle in err and "Traceback" not in err, err


def test_two_tunes_writing_one_table_at_once_keep_both_entries(tmp_path, monkeypatch):
    """Two tunes of one device (other ops) finishing together both read-merge-write results/tuned/<device>.json:
    without a lock around that, the second to save drops the entries the first wrote."""
    import threading

    from spark_bench.tune.session import TuneSession

    out = tmp_path / "tuned" / "t.json"
    run = {"fingerprint": {"device": DEVICE, "versions": {}}}
    entry = {"key": {"n": 1}, "config": {"B": 8}, "time_us": 1.0, "default": {"config": {"B": 2}, "time_us": 2.0},
             "speedup": 2.0, "measured": "t"}
    first_saving, release = threading.Event(), threading.Event()
    save = TunedStore.save

    def slow_save(self, path, updated):  # the first writer is between its read and its write
        if "a._k" in self.kernels and not first_saving.is_set():
            first_saving.set()
            release.wait(5)
        return save(self, path, updated)

    monkeypatch.setattr(TunedStore, "save", slow_save)

    def write(kernel):
        session = TuneSession(store=type("S", (), {"path": tmp_path / kernel})(), spec=None, cfg=None,
                              timeout_s=1.0, tune={"out": str(out)})
        session._write([(kernel, dict(entry))], run)

    a = threading.Thread(target=write, args=("a._k",))
    a.start()
    assert first_saving.wait(5)
    b = threading.Thread(target=write, args=("b._k",))
    b.start()
    b.join(0.5)  # with the lock, b waits for a; without it, b reads the table without a's entry and writes
    release.set()
    a.join(5)
    b.join(5)
    assert sorted(TunedStore.load(out).kernels) == ["a._k", "b._k"]


def _again(plan, median, rel_ci=0.0, case=0):
    """The closing round's record of case `case`'s default (repeat 1)."""
    again = Case(**{**plan["items"][case]["case"], "repeat": 1})
    return {"case_id": again.case_id, "status": "ok", "labels": [], "repeat": 1,
            "timing": {"median": median, "rel_ci": rel_ci}}


def test_a_drift_between_the_rounds_is_not_taken_for_a_speedup():
    """The default timed at 10 us, a candidate at 9 us later, the default again at 8.5 us: the machine sped up
    (clocks, thermals) by about as much as the candidate 'won'. Against the default's bracketed time (9.22 us) the
    candidate is 2.4% faster, inside the 1% CIs plus half the 15% drift: the default stays, the drift is stored."""
    plan = _plan([FAST])
    records = _records(plan, [{"default": ("ok", 10.0), config_id(FAST): ("ok", 9.0)}], rel_ci=0.005)
    [(_, without)] = select(plan, records)
    assert without["config"] == FAST and without["drift"] is None  # no closing timing: a 10% win, drift unknown
    [(_, entry)] = select(plan, [*records, _again(plan, 8.5, rel_ci=0.005)])
    assert entry["config"] == DEFAULT and entry["within_noise"]["id"] == config_id(FAST)
    assert entry["within_noise"]["noise"] == pytest.approx(0.01 + 0.075, abs=1e-4)
    assert entry["drift"] == {"max": -0.15, "cases": 1}
    from spark_bench.tune.report import _drift  # the tables' drift column

    assert _drift(entry) == "-15.0% (1)" and _drift(without) == "-"
    assert entry["default"]["time_us"] == pytest.approx((10.0 * 8.5) ** 0.5, abs=1e-4)
    [(_, steady)] = select(plan, [*records, _again(plan, 10.1, rel_ci=0.005)])  # no drift: the win stands
    assert steady["config"] == FAST and steady["drift"] == {"max": 0.01, "cases": 1}


def test_the_best_of_many_candidates_must_beat_a_wider_noise():
    """A 3% win with CIs of 1.2% each (2.4% summed) is shown for one candidate, but not as the best of eight: the
    chance that one of eight equal configs looks 3% faster is far above 5% (Bonferroni: z(1 - 0.05/16) / z(0.975)
    = 1.395 times the CI)."""
    from spark_bench.stats import Z95
    from spark_bench.tune.search import _z

    others = [{"B": b, "num_warps": w} for b in (32, 64, 128, 256) for w in (2, 8)][1:]
    others.remove(FAST)
    others.append({"B": 512, "num_warps": 8})
    assert len(others) == 7 and FAST not in others
    one, eight = _plan([FAST]), _plan([FAST, *others])
    times = {"default": ("ok", 10.0), config_id(FAST): ("ok", 9.7)}
    [(_, alone)] = select(one, _records(one, [times], rel_ci=0.012))
    assert alone["config"] == FAST
    slow = {config_id(c): ("ok", 10.0 + i / 10) for i, c in enumerate(others)}
    [(_, among)] = select(eight, _records(eight, [{**times, **slow}], rel_ci=0.012))
    assert among["config"] == DEFAULT and among["within_noise"]["id"] == config_id(FAST)
    assert among["within_noise"]["noise"] == pytest.approx(0.024 * _z(8) / Z95, abs=1e-4)  # stored CIs, scaled
    assert _z(1) == pytest.approx(Z95) and _z(8) / Z95 == pytest.approx(1.395, abs=1e-3)


def test_with_raw_samples_the_corrected_ci_is_the_samples_own():
    """Stored raw samples give the median's order-statistic CI at the corrected level itself (no normal scaling of
    a skewed timing's CI); without them the stored 95% CI is scaled."""
    import numpy as np

    from spark_bench.stats import Z95, median_ci
    from spark_bench.tune.search import _rel_ci, _z

    rng = np.random.default_rng(3)
    samples = sorted((10.0 + rng.exponential(0.5, 40)).tolist())  # skewed, as timings are
    timing = {"median": float(np.median(samples)), "rel_ci": 0.02, "samples": samples}
    for z in (Z95, _z(8)):
        lo, hi = median_ci(np.asarray(samples), z)
        assert _rel_ci(timing, z) == pytest.approx((hi - lo) / 2 / float(np.median(samples)))
    assert _rel_ci(timing, _z(8)) > _rel_ci(timing, Z95)
    assert _rel_ci({"rel_ci": 0.02}, _z(8)) == pytest.approx(0.02 * _z(8) / Z95)
    assert _rel_ci({"rel_ci": None, "samples": [1.0]}) == float("inf")


@pytest.mark.parametrize("label", ["throttled", "recompiled-in-timing"])
def test_a_throttled_or_recompiled_timing_is_not_ranked(label):
    """A candidate timed while the GPU throttled (or recompiling) looks faster or slower for reasons not its own."""
    plan = _plan([FAST, SLOW])
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0), config_id(SLOW): ("ok", 12.0)}]
    records = _records(plan, times)
    fast = next(r for r in records if config_id(FAST) in r["case_id"])
    fast["labels"] = [label]
    [(_, entry)] = select(plan, records)
    assert entry["config"] == DEFAULT and entry["runner_up"]["config"] == SLOW and entry["unranked"] == 1
    fast["labels"], records[0]["labels"] = [], [label]  # the default's own timing: nothing to rank against
    assert select(plan, records) == []


def test_a_kernel_tuned_in_bf16_is_not_given_that_config_in_fp32():
    """Every KDA op sweeps bf16 and fp32 (or runs in one dtype but could be called in another): each KDA kernel's key
    holds the dtype (or the element size), so one tune's bf16 winner is not launched for fp32 inputs."""
    import spark_bench.kernels.kda.block_decode  # noqa: F401  (each module declares its spaces at import)
    import spark_bench.kernels.kda.chunk_intra  # noqa: F401
    import spark_bench.kernels.kda.chunk_output  # noqa: F401
    import spark_bench.kernels.kda.chunk_state  # noqa: F401
    import spark_bench.kernels.kda.gated_rmsnorm  # noqa: F401
    import spark_bench.kernels.kda.recurrent_decode  # noqa: F401
    import spark_bench.kernels.kda.short_conv  # noqa: F401
    from spark_bench.kernels.kda import gate

    kda = {name: space for name, space in SPACES.items() if name.startswith("kda.")}
    assert len(kda) == 10 and all({"dtype", "elem"} & set(space.key) for space in kda.values()), \
        {name: space.key for name, space in kda.items()}
    declared = gate.CONFIGS.declared(T=64, K=128)
    other = next(c for c in gate.CONFIGS.candidates if c != declared)
    table = _store([("kda.gate._kda_gate_fwd", {"T": 64, "K": 128, "dtype": "torch.bfloat16"}, other, "t")])
    with applied(table=table), recording() as log:
        assert gate.CONFIGS.pick(T=64, K=128, dtype="torch.bfloat16") == other
        assert gate.CONFIGS.pick(T=64, K=128, dtype="torch.float32") == declared
    assert [p["source"] for p in log] == ["tuned", "default"]


def test_a_candidate_the_budget_left_untimed_in_one_case_of_a_key_is_not_chosen():
    """Timed (and fast) in one case of a key, never timed in the other: it might mismatch or be slow there."""
    plan = _plan([FAST, SLOW], cases=2)
    times = [{"default": ("ok", 10.0), config_id(FAST): ("ok", 5.0), config_id(SLOW): ("ok", 9.0)},
             {"default": ("ok", 10.0), config_id(SLOW): ("ok", 9.0)}]
    [(_, entry)] = select(plan, _records(plan, times, rel_ci=0.01))
    assert entry["config"] == SLOW and entry["untimed"] == 1 and entry["cases"] == 2
    from spark_bench.tune.report import _cases

    assert _cases(entry) == "2 (1 untimed)" and _cases({**entry, "unranked": 3}) == "2 (3 unranked, 1 untimed)"
    times[1][config_id(FAST)] = ("ok", 5.0)  # resumed with a larger budget: now timed in both
    [(_, entry)] = select(plan, _records(plan, times, rel_ci=0.01))
    assert entry["config"] == FAST and entry["untimed"] == 0


def test_a_tuned_table_is_searched_once_per_kernel_and_key():
    """pick runs on every launch, timed calls included: the table's nearest-key search (a JSON round trip and a
    scan of the entries) happens once per kernel and key within one applied table, not per launch."""
    from test_tune import SPACE

    table = _store([("test._k", {"n": 1024, "dtype": "bf16"}, {"B": 64, "num_warps": 8}, "t1")])
    searched, real = [], table.nearest
    table.nearest = lambda kernel, key: searched.append(dict(key)) or real(kernel, key)
    with applied(table=table), recording() as log:
        for _ in range(5):
            assert SPACE.pick(n=2000, dtype="bf16")["B"] == 64 and SPACE.pick(n=32, dtype="bf16")["B"] == 8
    assert len(searched) == 2 and len(log) == 10  # each launch still recorded
    assert [p["source"] for p in log[:2]] == ["tuned-nearest", "default"]
    with applied(table=table):  # a new table context searches again
        SPACE.pick(n=2000, dtype="bf16")
    assert len(searched) == 3
