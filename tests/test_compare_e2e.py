"""`spark-bench compare` on real stored runs: a faster re-run passes, an injected 2x slowdown fails."""

import subprocess

from conftest import spark_bench_cmd

# the `slow` backend sleeps FAULT_SLOW_S per call. The runs' sleeps are far apart (50 ms, then 20 ms and 100 ms): a
# loaded machine oversleeps by a few ms per call, which a same-vs-same run cannot absorb at a 10% threshold (that
# verdict is tested on fixed samples in test_compare.py); only the verdicts are asserted
SWEEP = ["--op", "fault.scale", "--backend", "slow", "--quick", "--min-samples", "20",
         "--max-time", "3", "--no-report"]


def sweep(out, env, slow_s):
    proc = subprocess.run(spark_bench_cmd("run", *SWEEP, "--out", out), env={**env, "FAULT_SLOW_S": slow_s},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def compare(base, new, env):
    return subprocess.run(spark_bench_cmd("compare", base, new, "--threshold", "10%"), env=env, capture_output=True,
                          text=True, timeout=300)


def test_compare_gates_a_real_regression(tmp_path, fault_env):
    base = sweep(tmp_path / "base", fault_env, "0.050")
    faster = sweep(tmp_path / "faster", fault_env, "0.020")
    slower = sweep(tmp_path / "slower", fault_env, "0.100")

    rerun = compare(base, faster, fault_env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    regressed = compare(base, slower, fault_env)
    assert regressed.returncode == 1, regressed.stdout + regressed.stderr
    assert "slower" in regressed.stdout and "slow" in regressed.stdout
