"""spark_bench/telemetry: sampled power is integrated by the trapezoid rule, the gross energy of a call is the busy
power times one call's time (also when an invocation replays several calls), and the uncertainty of a window counts
the +-1 invocation its edges may cut. Expected values come from the scripted device's powers and durations."""

import pytest

from spark_bench.telemetry.energy import measure_energy
from spark_bench.telemetry.fake import FakeSource
from spark_bench.telemetry.sampler import integrate_power


def test_sampled_power_is_integrated_by_the_trapezoid_rule():
    """100 W -> 200 W over 1 s, then -> 400 W over 2 s: 150 J + 600 J = 750 J in 3 s, 250 W on average."""
    samples = [{"t": 0.0, "power_w": 100.0}, {"t": 1.0, "power_w": 200.0}, {"t": 2.0, "power_w": None},
               {"t": 3.0, "power_w": 400.0}]
    avg, energy = integrate_power(samples)
    assert energy == pytest.approx(750.0) and avg == pytest.approx(250.0)


def test_gross_energy_per_call_divides_by_the_calls_of_an_invocation():
    """A graph of 8 calls replayed in 8 ms at 400 W: each call takes 1 ms at 400 W, 0.4 J gross, (400 - 60) W x 1 ms
    = 0.34 J net."""
    src = FakeSource(idle_w=60.0, busy_w=400.0)
    r = measure_energy(src.op(0.008), source=src, calls_per_invocation=8)
    assert r["reason"] is None
    assert r["energy_j_per_call_gross"] == pytest.approx(400.0 * 0.001, rel=0.02)
    assert r["energy_j_per_call"] == pytest.approx(340.0 * 0.001, rel=0.02)


def test_the_uncertainty_counts_one_invocation_of_a_short_window():
    """~10 invocations of 0.25 s in the window: besides the meters' own errors (busy and idle W over the net W), the
    window's edges may cut one invocation more or less, a relative 1 / invocations (~10%) on top."""
    src = FakeSource(update_period_s=0.05)
    r = measure_energy(src.op(0.25), source=src)
    invocations = r["calls"] / r["calls_per_invocation"]
    assert 5 <= invocations <= 20
    meters = (r["uncertainty_w"] + r["idle_uncertainty_w"]) / abs(r["net_w"])
    assert r["rel_uncertainty"] - meters == pytest.approx(1.0 / invocations, rel=1e-6)
