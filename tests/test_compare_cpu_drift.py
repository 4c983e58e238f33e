"""`spark-bench compare` of runs timed on a CPU carries the note on run-to-run drift whenever a case changed
significantly, 'faster' as much as 'slower' (a CPU's drift makes either look significant); not when nothing moved, and
never for GPU runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report.cli import compare  # noqa: E402

CPU = {"type": "cpu", "name": "AMD EPYC 9654"}


def _compare(a, b):
    res = CliRunner().invoke(compare, [str(a), str(b)], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize("scale, code", [(0.8, 0), (1.2, 1)])
def test_a_significant_change_on_a_cpu_carries_the_drift_note_either_way(tmp_path, scale, code):
    a = fx.standard_run(tmp_path / "a", seed=0, device=CPU, fingerprint_id="fp-cpu")
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", scale={"triton": scale}, device=CPU,
                        fingerprint_id="fp-cpu")
    exit_code, out, err = _compare(a, b)
    verdict = "faster" if scale < 1 else "slower"
    assert exit_code == code and f"16 {verdict}" in out, (out, err)
    assert err.strip().splitlines()[-1].startswith("note: timed on a CPU"), err
    assert "note: timed on a CPU" not in out  # on stderr, with the other notes


def test_no_drift_note_without_a_significant_change_or_on_a_gpu(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0, device=CPU, fingerprint_id="fp-cpu")
    exit_code, out, err = _compare(a, a)  # the same samples: every case 'same'
    assert exit_code == 0 and "2 failing, 64 same" in out.splitlines()[-1] and "timed on a CPU" not in err, out
    gpu_a = fx.standard_run(tmp_path / "ga", seed=0)
    gpu_b = fx.standard_run(tmp_path / "gb", seed=1, run_id="run-b", scale={"triton": 0.8})
    exit_code, out, err = _compare(gpu_a, gpu_b)
    assert exit_code == 0 and "16 faster" in out and "timed on a CPU" not in out + err, (out, err)
