"""The GPU preflight's warnings at their boundaries (found by a mutation audit of telemetry/clocks.py's preflight):
each test names the mutant it was written against."""

from spark_bench.telemetry import preflight
from spark_bench.telemetry.fake import FakeSource


def test_clocks_at_half_their_default_are_not_idle():
    """Mutant: `sm < 0.5 * default` -> `<=`."""
    assert preflight(source=FakeSource(sm_mhz=990.0, default_sm_mhz=1980.0))["ok"] is True
    low = preflight(source=FakeSource(sm_mhz=989.0, default_sm_mhz=1980.0))
    assert low["ok"] is False and "clocks look idle (SM 989 MHz of default 1980 MHz)" in low["warnings"][0]


def test_a_power_limit_within_half_a_watt_of_its_default_is_not_a_cap():
    """Mutant: the half-watt allowance dropped (NVML's milliwatts read 699.8 W for a 700 W default: a false cap)."""
    assert preflight(source=FakeSource(power_limit_w=699.8, default_power_limit_w=700.0))["ok"] is True
    capped = preflight(source=FakeSource(power_limit_w=699.0, default_power_limit_w=700.0))
    assert capped["warnings"] == ["power limit 699 W is below the default 700 W: results are power-capped "
                                  "(spark-bench never changes it)"]


def test_an_idle_gpus_reason_is_no_cap():
    """Mutant: every clock reason read as a cap (gpu_idle, set on any GPU between runs, warned of before each run)."""
    assert preflight(source=FakeSource(reasons=0x1))["ok"] is True
    held = preflight(source=FakeSource(reasons=0x1 | 0x20))
    assert held["warnings"] == ["clocks already held down before the run: sw_thermal_slowdown"]


def test_a_mig_slice_is_said_and_the_check_is_not_clean():
    """Mutant: the MIG note left out of `ok` (a run on a shared slice recorded as a clean preflight)."""
    check = preflight(source=FakeSource(mig=True))
    assert check["ok"] is False and len(check["warnings"]) == 1 and check["records"]["mig"] is True
