"""spark_bench/executors/base.py: a case that crashed once and then ran ok records its 2 attempts and the earlier
error (a flaky case must not read as a clean first-time run); a case ok at once records neither."""

from spark_bench.executors.base import CaseQueue, parse_devices
from spark_bench.sweep import Case


def test_one_crash_then_ok_records_two_attempts_and_the_crash():
    case = Case("op", "x", {}, "fp32", "cpu", 0)
    slot = parse_devices("cpu0", "cpu")[0]
    queue = CaseQueue([case], retries=2, energy=False)
    assert queue.take(slot) == case
    assert queue.finish(slot, case, {"status": "crash", "error": "worker died"}) is False
    assert queue.take(slot) == case
    record = {"status": "ok"}
    assert queue.finish(slot, case, record) is True
    assert record["attempts"] == 2 and record["earlier_errors"] == ["worker died"]
    assert queue.take(slot) is None
    first = {"status": "ok"}
    fresh = CaseQueue([case], retries=2, energy=False)
    fresh.take(slot)
    assert fresh.finish(slot, case, first) and "attempts" not in first and "earlier_errors" not in first
