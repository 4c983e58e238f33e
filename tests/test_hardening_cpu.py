"""Issue 15 items 10 and 15 on a CPU: the dry-run knows that interpreted Triton time grows with the work, and
`profile` says when it profiled the interpreter."""

from __future__ import annotations

import dataclasses
import json

from click.testing import CliRunner

from spark_bench.executors.plan import INTERPRETED_BYTES_PER_S, estimate, interpreted_bytes, print_plan
from spark_bench.registry import registry
from spark_bench.sweep import Case

SMALL = {"tokens": 1, "heads": 4, "head_dim": 128}
BIG = {"tokens": 8192, "heads": 32, "head_dim": 128}


def _stored(root, cases):
    (root / "old").mkdir(parents=True)
    op = registry().get("kda.gate")
    lines = [{"case_id": c.case_id, "op": c.op, "backend": c.backend, "device": "cpu", "status": "ok",
              "duration_s": seconds, "cost": {"bytes": op.cost(c.params, c.dtype).bytes}} for c, seconds in cases]
    (root / "old" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_dry_run_scales_interpreted_cases_by_their_bytes(tmp_path):
    small = {b: Case("kda.gate", b, SMALL, "bf16", "cpu", 0) for b in ("triton", "torch")}
    big = {b: Case("kda.gate", b, BIG, "bf16", "cpu", 0) for b in ("triton", "torch")}
    nbytes = interpreted_bytes(big["triton"])
    ratio = nbytes / interpreted_bytes(small["triton"])
    assert ratio > 1000 and interpreted_bytes(big["torch"]) is None  # torch is not interpreted
    _stored(tmp_path, [(small["triton"], 2.0), (small["torch"], 1.0)])
    lines: list[str] = []
    wall = print_plan(list(big.values()), list(big.values()), "local", 1, tmp_path, echo=lines.append)
    text = "\n".join(lines)
    assert f"~{2.0 * ratio:.2f}s (interpreted: op+backend x{ratio:.3g} the bytes)" in text  # not the 2 s it once took
    assert "kda.gate torch tokens=8192 heads=32 head_dim=128 bf16  ~1.00s (op+backend)" in text
    assert wall == 2.0 * ratio + 1.0
    assert "1 case(s) run in the Triton interpreter" in text
    # no history here: the reference machine's quick sweep, scaled by the bytes for an interpreted case
    from spark_bench.executors.reference import CPU_QUICK

    median, ref_bytes, ref_s = CPU_QUICK[("kda.gate", "triton")]
    assert estimate(big["triton"], {}, nbytes) == (ref_s * nbytes / ref_bytes,
                                                   f"interpreted: reference x{nbytes / ref_bytes:.3g} the bytes")
    assert estimate(big["torch"], {}, None) == (CPU_QUICK[("kda.gate", "torch")][0], "reference")
    assert estimate(dataclasses.replace(big["torch"], device="cuda"), {}, None) == (5.0, "default")  # CPU only
    # an op the reference does not know: the interpreter's rate, never the 5 s default of a model-size point
    unknown = dataclasses.replace(big["triton"], op="x.new_op")
    assert estimate(unknown, {}, nbytes) == (nbytes / INTERPRETED_BYTES_PER_S, "interpreted: from its bytes")


def test_profile_of_an_interpreted_call_says_so(tmp_path):
    from spark_bench.telemetry.cli import profile as profile_cmd

    res = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "triton", "--set", "tokens=1", "--set",
                                           "head_dim=60", "--device", "cpu", "--iters", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[0]
    assert "interpreted" in head and "Triton interpreter" in head, head
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["labels"] == ["interpreted"] and "interpreter" in saved["what"]


def test_a_prestarted_worker_is_adopted_with_its_start_up_log(tmp_path, monkeypatch):
    """Issue 15 item 14: `run` starts its worker before it discovers the plugins (the two start-ups overlap); the
    run adopts that worker, which moves its log, start-up output included, into the run's logs/."""
    from conftest import TESTS

    from spark_bench import results
    from spark_bench.executors.local import LocalExecutor
    from spark_bench.runner import Runner
    from spark_bench.timing import TimingConfig

    monkeypatch.syspath_prepend(str(TESTS / "plugins"))
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "fault_plugin")
    executor = LocalExecutor()
    executor.prestart("cpu")
    early = executor.early["cpu"]
    assert executor.own_pids() == {early.process.pid}  # what the preflight must not call another GPU process
    park = early.log_path
    with open(park, "a") as f:  # what the worker wrote while the parent was still preparing the run
        f.write("early start-up line\n")
    store = results.RunStore(tmp_path / "run")
    store.create({"run_id": "run"})
    cfg = TimingConfig(warmup_s=0.0, min_samples=2, max_samples=2, min_time_s=0.0, max_time_s=0.0)
    (rec,) = Runner(store, cfg, timeout_s=120, device="cpu", executor=executor).run(
        [Case("fault.scale", "good", {"rows": 3, "cols": 5}, "fp32", "cpu", 0)])
    assert rec["status"] == "ok" and rec["worker_pid"] == early.process.pid
    (log,) = (tmp_path / "run" / "logs").iterdir()
    assert log.name == park.name and not park.exists()
    assert "early start-up line" in log.read_text()
    assert executor.early == {}


def test_a_killed_runs_worker_logs_are_removed_by_the_next_prestart(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from spark_bench.executors.local import PARK_PREFIX, LocalExecutor

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{PARK_PREFIX}{gone.stdout.strip()}-abc"  # a run killed by SIGKILL left it
    stale.mkdir()
    (stale / "worker-cpu-1.log").write_text("start-up")
    live = tmp_path / f"{PARK_PREFIX}{os.getpid()}-def"  # a run still going keeps its own
    live.mkdir()
    executor = LocalExecutor()
    executor.prestart("cpu")
    try:
        assert not stale.exists() and live.exists()
        assert executor.early["cpu"].log_path.parent.name.startswith(f"{PARK_PREFIX}{os.getpid()}-")
    finally:
        for worker in executor.early.values():
            worker.kill()
