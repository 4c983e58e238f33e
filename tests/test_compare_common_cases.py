"""`spark-bench compare` with nothing to compare is a usage error, whatever the reason: runs that share no case (other
ops, or the same op at other parameter points, backends or dtypes), a base run with no results, a filter that leaves
the base run nothing. Each is exit 2 and one line saying why. A new run with no case stays a gate failure (missing)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import run_cli

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report.cli import compare  # noqa: E402


def _refused(*args) -> str:
    """The one stderr line of a `compare` refused with exit 2."""
    res = CliRunner().invoke(compare, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 2 and "REGRESSED" not in res.output and "Traceback" not in res.output, res.output
    assert res.stdout == "", res.stdout  # no table of nothing
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("spark-bench: error: compare: "), line
    return line


def _run(path, cases, run_id):
    rng = np.random.default_rng(0)
    return fx.write_run(path, [fx.case(op, backend, params, dtype, samples=fx.draw(rng, 5.0))
                               for op, backend, params, dtype in cases], run_id=run_id)


@pytest.mark.parametrize("other, needle", [
    ([("kda.gate", "triton", {"tokens": 64}, "bf16")], "no parameter point matches (tokens = 1, 17 in "),
    ([("kda.gate", "torch", {"tokens": 1}, "bf16")], "no backend matches (triton in "),
    ([("kda.gate", "triton", {"tokens": 1}, "fp32")], "no dtype matches (bf16 in "),
    ([("kda.gate", "triton", {"tokens": 1, "heads": 8}, "bf16")], "no parameter point matches (heads = unset in "),
])
def test_the_same_op_at_other_points_names_the_axis_that_differs(tmp_path, other, needle):
    a = _run(tmp_path / "a", [("kda.gate", "triton", {"tokens": t}, "bf16") for t in (1, 17)], "run-a")
    b = _run(tmp_path / "b", other, "run-b")
    line = _refused(a, b)
    assert "no case in common: both have kda.gate, but " in line and needle in line, line
    assert f" in {b})" in line and "kda.gate has kda.gate" not in line


def test_a_base_run_without_results_or_left_empty_by_the_filter_is_nothing_to_compare(tmp_path):
    a = _run(tmp_path / "a", [("kda.gate", "triton", {"tokens": 1}, "bf16")], "run-a")
    m = _run(tmp_path / "m", [("moe.align", "triton", {"tokens": 1}, "bf16")], "run-m")
    empty = fx.write_run(tmp_path / "empty", [], run_id="empty")
    line = _refused(empty, a)  # was exit 0: every case 'new', nothing compared
    assert f"nothing to compare: the base run {empty} has no results ({a} has kda.gate)" in line
    line = _refused(a, m, "--op", "moe.*")  # was exit 0: "0 in both runs"
    assert f"nothing to compare: the base run {a} has no case selected by --op moe.* ({m} has moe.align)" in line
    line = _refused(empty, empty)
    assert f"the base run {empty} has no results (nor has {empty})" in line
    line = _refused(a, m)
    assert f"no case in common: {a} has kda.gate; {m} has moe.align" in line
    res = CliRunner().invoke(compare, [str(m), str(a), "--op", "moe.*"], catch_exceptions=False)
    assert res.exit_code == 1 and "1 missing" in res.output  # the new run lacks the base's cases: a gate failure


def test_cases_skipped_in_both_runs_are_nothing_to_compare(tmp_path):
    skipped = [fx.case("kda.gate", "triton", {"tokens": 1}, status="skipped", error="needs CUDA")]
    a = fx.write_run(tmp_path / "a", skipped, run_id="run-a")
    b = fx.write_run(tmp_path / "b", skipped, run_id="run-b")
    assert "nothing to compare: the 1 case(s) both runs have were skipped in both" in _refused(a, b)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Two tiny real CPU runs of kda.gate (torch) at tokens=1 and tokens=2, and a copy of the first without results."""
    root = tmp_path_factory.mktemp("real")
    for name, tokens in (("a", 1), ("t2", 2)):
        code, out, err = run_cli("run", "--op", "kda.gate", "--quick", "--backend", "torch", "--set",
                                 f"tokens={tokens}", "--out", root / name)
        assert code == 0, err
    shutil.copytree(root / "a", root / "emptyres")
    (root / "emptyres" / "results.jsonl").write_text("")
    return root


def test_real_runs_with_nothing_to_compare_are_refused_alike(real_runs):
    a, t2, empty = real_runs / "a", real_runs / "t2", real_runs / "emptyres"
    assert "no parameter point matches (tokens = 1 in " in _refused(a, t2)
    assert f"the base run {empty} has no results ({a} has kda.gate)" in _refused(empty, a)
    line = _refused(a, t2, "--op", "kda.*", "--backend", "torch")
    assert "no case in common (--op kda.* --backend torch): both have kda.gate, but no parameter point" in line
    assert f"the base run {empty} has no results ({a} has kda.gate)" in _refused(
        empty, a, "--op", "kda.gate")
