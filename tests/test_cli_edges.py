"""`spark-bench show`, `list` and `run` edges the other CLI tests leave open (found by mutation testing of
spark_bench/cli.py): `show --failed` keeps the skipped cases, `list` cuts an axis after 6 values (not at 6) and says
which backends run only when asked, `run --resume` with `--like` is refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import run_cli
from report_fixtures import case, draw, write_run


def test_show_failed_lists_the_skipped_cases_too(tmp_path):
    rng = np.random.default_rng(0)
    run = write_run(tmp_path / "run", [case("kda.gate", "torch", {"tokens": 1}, samples=draw(rng, 5.0)),
                                       case("kda.gate", "triton", {"tokens": 1}, status="mismatch", error="err 0.4"),
                                       case("kda.gate", "peer", {"tokens": 1}, status="skipped",
                                            error="peer not installed")])
    code, out, _ = run_cli("show", run, "--failed")
    assert code == 0 and "2 cases, 1 mismatch, 1 skipped (selected of the run's 3)" in out, out
    assert "peer not installed" in out and "err 0.4" in out


@pytest.fixture(scope="module")
def listed():
    """`spark-bench list`'s lines, every backend taken as available (no probe processes)."""
    from spark_bench import isolate

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolate, "probe_backends", lambda pairs, device: {(op, b.name): None for op, b in pairs})
        code, out, err = run_cli("list", "--device", "cpu")
    assert code == 0, err
    return out.splitlines()


def _axis(lines: list[str], op: str, axis: str) -> list[str]:
    (line,) = [x for x in lines if x.startswith(op + " ")]
    return line.split(f" {axis}=")[1].split(",")[0].split()[0].split("/")


def _backends(lines: list[str], op: str) -> list[str]:
    start = [i for i, x in enumerate(lines) if x.startswith(op + " ")][0] + 1
    return list(itertools.takewhile(lambda x: x.startswith("    "), lines[start:]))


def test_list_cuts_an_axis_after_six_values_not_at_six(listed):
    assert len(_axis(listed, "kda.gate", "tokens")) == 6 and "…" not in "".join(_axis(listed, "kda.gate", "tokens"))
    router = _axis(listed, "moe.router", "tokens")  # eighteen values: six, then '…'
    assert len(router) == 6 and router[-1].endswith("…")


def test_list_says_which_backends_run_only_when_asked(listed):
    asked = [x.split()[0] for x in _backends(listed, "kda.gate") if "only when asked" in x]
    assert asked == ["reference"]  # the default backends say nothing
    (reference,) = [x for x in _backends(listed, "kda.gate") if x.split()[0] == "reference"]
    assert reference.endswith("(only when asked: --backend reference)"), reference


def test_resume_and_like_together_are_refused(tmp_path):
    code, _, err = run_cli("run", "--resume", tmp_path / "a", "--like", tmp_path / "b")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--resume finishes a run, --like starts a new one; pass one" in err, err
