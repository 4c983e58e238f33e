"""The dry run's estimate (found by a mutation audit of executors/plan.py): which stored durations count, which
is preferred, how an interpreted case is scaled, and the budget's count. Each test names its mutant."""

import json

from spark_bench.executors.plan import DEFAULT_CASE_S, estimate, print_plan, stored_durations, to_run_text
from spark_bench.sweep import Case


def _case(op="x.op", backend="b", device="cpu", skip=None, n=4):
    return Case(op, backend, {"n": n}, "fp32", device, 0, skip=skip)


def _store(tmp_path, *recs):
    run = tmp_path / "run1"
    run.mkdir(exist_ok=True)
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _rec(case, seconds, status="ok", device=None, nbytes=None):
    return {"case_id": case.case_id, "op": case.op, "backend": case.backend, "device": device or case.device,
            "status": status, "duration_s": seconds, **({"cost": {"bytes": nbytes}} if nbytes else {})}


def test_a_skipped_cases_duration_is_no_estimate(tmp_path):
    """Mutant: skipped records' durations stored (a skip's 0.01 s made the op's every case look instant)."""
    c = _case()
    _store(tmp_path, _rec(c, 0.01, status="skipped"), _rec(_case(n=8), 6.0))
    stored = stored_durations(tmp_path)
    assert c.case_id not in stored and stored[("x.op", "b")] == [6.0]
    assert estimate(c, stored) == (6.0, "op+backend")


def test_the_same_device_type_is_preferred_to_any_device(tmp_path):
    """Mutant: (op, backend) asked before (op, backend, device type) (a GPU's 0.1 s estimated a CPU case)."""
    _store(tmp_path, _rec(_case(n=8), 8.0), _rec(_case(n=8, device="cuda"), 0.1), _rec(_case(n=9, device="cuda"),
                                                                                         0.1))
    assert estimate(_case(), stored_durations(tmp_path)) == (8.0, "op+backend")


def test_an_interpreted_case_scales_only_up_from_the_largest_stored_one(tmp_path):
    """Mutants: scaled also for fewer bytes than the largest stored case; the max with the median dropped; the
    floor of DEFAULT_CASE_S dropped for an interpreted case without history."""
    _store(tmp_path, _rec(_case(n=8), 2.0, nbytes=1000), _rec(_case(n=9), 10.0, nbytes=100))
    stored = stored_durations(tmp_path)
    assert estimate(_case(), stored, 500.0) == (6.0, "op+backend")  # below the largest: the median
    assert estimate(_case(), stored, 2000.0) == (6.0, "interpreted: op+backend x2 the bytes")  # 4 s < median 6 s
    assert estimate(_case(), stored, 8000.0) == (16.0, "interpreted: op+backend x8 the bytes")
    assert estimate(_case(op="y.op"), {}, 16.0) == (DEFAULT_CASE_S, "interpreted: from its bytes")


def test_the_budget_counts_the_cases_that_end_within_it_and_skips_cost_nothing(tmp_path):
    """Mutants: `end <= budget` -> `<` (a case ending on the budget not counted); skipped cases counted among the
    cases that fit; the skipped count dropped from '2 to run, 1 skipped'."""
    _store(tmp_path, _rec(_case(n=1), 5.0), _rec(_case(n=2), 5.0))
    todo = [_case(n=1), _case(n=2), _case(n=3, skip="no GPU")]
    lines = []
    wall = print_plan(todo, todo, "local", 1, tmp_path, echo=lines.append, budget_s=10.0)
    assert wall == 10.0
    assert lines[0].endswith("3 cases on cpu, 2 to run, 1 skipped, executor local")
    assert any(line.startswith("--budget 10.0s: about 2 of 2 cases fit") for line in lines), lines
    assert to_run_text(todo[:2]) == "2 to run"
