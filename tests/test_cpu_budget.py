"""The timing budget of a CPU run (issue 15 item 14, docs/overhead.md): `run` on a CPU takes quick shapes AND quick
timing unless --full; an interpreted backend is not warmed up (its check has just run the same call) and its stages
are not timed; a composite backend's stages share the case's budget instead of each taking all of it."""

import dataclasses
import json

import torch
from conftest import run_cli

from spark_bench import Axis, Backend, Cost, Op, Tolerance
from spark_bench.registry import Registry
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig, config_for, for_interpreted, for_stages, time_cpu
from spark_bench.worker import CaseRunner


def test_cpu_run_without_full_times_with_the_quick_budget(tmp_path, fault_env, monkeypatch):
    import sys

    for key in ("PYTHONPATH", "SPARK_BENCH_PLUGINS"):
        monkeypatch.setenv(key, fault_env[key])
    # a registry of its own with the fault plugin, the process's own back afterwards (other tests list the ops)
    monkeypatch.setattr(sys.modules["spark_bench.registry"], "_REGISTRY", None)
    monkeypatch.syspath_prepend(fault_env["PYTHONPATH"].split(":")[0])
    common = ["--op", "fault.scale", "--backend", "good", "--set", "rows=3", "--set", "cols=5",
              "--executor", "inprocess", "--no-report"]
    code, out, err = run_cli("run", *common, "--out", tmp_path / "default" / ("long" * 30))  # the header: one line
    assert code == 0, err
    spec = json.loads((tmp_path / "default" / ("long" * 30) / "run.json").read_text())["spec"]
    assert spec["quick"] and TimingConfig(**spec["timing"]) == TimingConfig.quick()
    assert "(quick shapes and timing; Triton interpreted)" in out + err
    code, _, err = run_cli("run", *common, "--full", "--out", tmp_path / "full")
    assert code == 0, err
    spec = json.loads((tmp_path / "full" / "run.json").read_text())["spec"]
    assert not spec["quick"] and TimingConfig(**spec["timing"]) == config_for("cpu", quick=False)
    code, out, err = run_cli("run", *common, "--max-time", "0.2", "--out", tmp_path / "capped")
    assert code == 0, err
    capped = json.loads((tmp_path / "capped" / "run.json").read_text())["spec"]["timing"]
    assert TimingConfig(**capped).max_time_s == 0.2
    assert "(quick shapes; Triton interpreted)" in out + err  # not quick timing any more: the header does not say it is


def test_an_interpreted_call_is_not_warmed_up_and_still_sampled():
    quick = dataclasses.replace(TimingConfig.quick(), flush=False)
    cfg = for_interpreted(quick)
    assert cfg.warmup_s == 0 and cfg.max_time_s == quick.max_time_s and cfg.min_samples == quick.min_samples
    calls = []
    rec = time_cpu([lambda: calls.append(1)], cfg)
    assert len(calls) == rec["n"] >= cfg.min_samples  # every call is a sample: no warm-up
    warmed = []
    rec = time_cpu([lambda: warmed.append(1)], quick)
    assert len(warmed) > rec["n"]  # the ordinary budget warms up first


def test_stages_share_the_case_budget():
    cfg = config_for("cpu", quick=False)
    shared = for_stages(cfg, 5)
    assert shared.max_time_s * 5 == cfg.max_time_s and shared.warmup_s * 5 == cfg.warmup_s
    assert shared.min_samples == cfg.min_samples and for_stages(cfg, 0) == cfg


def _composite_registry(label):
    op = Op(name="test.two_stages", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.randn(p["rows"], 8)},
            reference=lambda x: 2 * x.double() + 1, cost=lambda p, d: Cost(16 * p["rows"], 64 * p["rows"]),
            axes=[Axis("rows", [5], quick=[5])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    op.add_backend(Backend("composite", lambda x: 2 * x + 1, labels=[label] if label else (),
                           stages=lambda inputs: [("double", lambda: 2 * inputs["x"]),
                                                  ("add", lambda: inputs["x"] + 1)]))
    reg = Registry()
    reg.load_object("test", op)
    return reg


def test_the_worker_applies_both_rules(monkeypatch):
    import spark_bench.timing as timing

    seen = []
    real = timing.measure
    monkeypatch.setattr(timing, "measure", lambda calls, device, cfg: seen.append(cfg) or real(calls, device, cfg))
    cfg = dataclasses.replace(TimingConfig.quick(), flush=False)
    case = Case("test.two_stages", "composite", {"rows": 5}, "fp32", "cpu", 0)
    rec = CaseRunner(_composite_registry(None)).run(case, cfg, n_sets=1)
    assert rec["status"] == "ok", rec["error"]
    assert [s["name"] for s in rec["stages"]] == ["double", "add"]
    case_cfg, *stage_cfgs = seen
    assert case_cfg == cfg and [c.max_time_s for c in stage_cfgs] == [cfg.max_time_s / 2] * 2
    assert all(c.warmup_s == cfg.warmup_s / 2 for c in stage_cfgs)
    seen.clear()  # interpreted: no warm-up, and no per-stage timing (the interpreter's breakdown means nothing)
    rec = CaseRunner(_composite_registry("interpreted")).run(case, cfg, n_sets=1)
    assert rec["status"] == "ok" and rec["timing"]["n"] >= cfg.min_samples and rec["stages"] is None
    assert len(seen) == 1 and seen[0].warmup_s == 0.0 and seen[0].max_time_s == cfg.max_time_s
