"""spark_bench/tune/plan.py without a compiler: the launch capture and the offline compiles are faked, so each rule of
the plan (which candidates a case gets, why one is pruned, the order survivors are timed in) is checked on its own.
Found by a mutation audit of the tuner."""

from types import SimpleNamespace

import pytest

from spark_bench.sweep import Case
from spark_bench.tune import plan as planning
from spark_bench.tune.space import config_id

KERNEL = "x._k"
DEFAULT, WIDE = {"B": 16, "num_warps": 4}, {"B": 64, "num_warps": 4}
CASES = [Case("x.op", "triton", {"n": n}, "fp32", "cpu", 0) for n in (1, 2)]


def _spec(key, grids=(), case=0, name=None):
    """A captured specialisation: its cache key and its launches' grids in case `case`."""
    return SimpleNamespace(key=key, name=name or key, launches=[{"case": case, "grid": list(g)} for g in grids])


def _verdict(key, verdict="ok", error=None, ctas_per_sm=1, regs=32):
    return SimpleNamespace(key=key, verdict=verdict, error=error, ctas_per_sm=ctas_per_sm, regs=regs)


def _fake(monkeypatch, picks, candidates, per_candidate=None, verdicts=()):
    """Capture: each base case launches `picks` ([(key, config)]) with `candidates` declared; a request forcing a
    candidate gets per_candidate[its id] = (error or None, [specs]). compile_all answers `verdicts`."""
    per_candidate = per_candidate or {}

    def run_capture(request):
        if all(r["configs"] is None for r in request["cases"]):
            cases = [{"error": None, "picks": [{"kernel": KERNEL, "key": k, "config": c} for k, c in picks],
                      "spaces": {KERNEL: {"candidates": candidates}}} for _ in request["cases"]]
            return {"cases": cases, "specs": [_spec("base")]}
        outcomes, specs = [], [_spec("base")]  # the unchanged kernels' specs come back too: never compiled again
        for index, r in enumerate(request["cases"]):
            error, cand_specs = per_candidate.get(config_id(r["configs"][KERNEL]), (None, []))
            outcomes.append({"error": error, "picks": []})
            specs += [_spec(s.key, [launch["grid"] for launch in s.launches], index, s.name) for s in cand_specs]
        return {"cases": outcomes, "specs": specs}

    compiled = []
    monkeypatch.setattr("spark_bench.kernelgate.capture.run_capture", run_capture)
    monkeypatch.setattr("spark_bench.kernelgate.offline.compile_all",
                        lambda specs, targets, **kw: compiled.extend(s.key for s in specs) or list(verdicts))
    return compiled


def test_the_offline_target_follows_the_device_and_the_request():
    assert planning.prune_target("cpu", "none", {})[0] is None
    assert planning.prune_target("cuda", "none", {"capability": "9.0"})[0] is None  # none beats this GPU's target
    assert planning.prune_target("cpu", "sm_80", {})[0] == "sm_80"
    assert planning.prune_target("cuda:1", None, {"capability": "8.6"})[0] == "sm_80"
    assert planning.prune_target("cpu", None, {})[0] == "sm_90a"  # a CPU tune prunes for the gate's target
    target, why = planning.prune_target("cuda", None, {"capability": "7.5"})
    assert target is None and "7.5" in why


def test_a_kernel_launched_with_several_declared_configs_keeps_them_as_candidates(monkeypatch):
    """A case launching the kernel at two keys (two buckets) runs a mix; forcing either bucket's config over the
    whole case is a different config, so both stay candidates. Only a single declared config is the default itself."""
    _fake(monkeypatch, [({"n": 1}, DEFAULT)], [DEFAULT, WIDE])
    [item, _] = planning.build(CASES, None)["items"]
    assert [c["config"] for c in item["candidates"]] == [WIDE]
    _fake(monkeypatch, [({"n": 1}, DEFAULT), ({"n": 4096}, WIDE)], [DEFAULT, WIDE])
    [item, _] = planning.build(CASES, None)["items"]
    assert [c["config"] for c in item["candidates"]] == [DEFAULT, WIDE]
    assert item["keys"] == [{"key": {"n": 1}, "config": DEFAULT}, {"key": {"n": 4096}, "config": WIDE}]


def test_one_per_key_keeps_the_first_case_of_each_kernel_and_keys(monkeypatch):
    _fake(monkeypatch, [({"n": 1}, DEFAULT)], [DEFAULT, WIDE])
    items = planning.build(CASES, None, one_per_key=True)["items"]
    assert [i["case"]["params"] for i in items] == [{"n": 1}]


def test_pruning_reasons_and_what_is_timed_unjudged(monkeypatch):
    """A capture error and a bad verdict prune, each with its reason; a compile worker that died says nothing of the
    config, so the candidate is timed (with a note) rather than dropped; the base specs are never compiled again."""
    cands = [{"B": b, "num_warps": 4} for b in (32, 128, 256, 512)]
    compiled = _fake(monkeypatch, [({"n": 1}, DEFAULT)], [DEFAULT, *cands], {
        config_id(cands[0]): ("boom: no such constexpr", []),
        config_id(cands[1]): (None, [_spec("s128", [[132]], name="k_128")]),
        config_id(cands[2]): (None, [_spec("s256", [[132]])]),
        config_id(cands[3]): (None, [_spec("s512", [[132]])])},
        [_verdict("s128", "spills", "3 spill stores"), _verdict("s256", "error", "compile worker died (signal 9)"),
         _verdict("s512")])
    [item] = planning.build(CASES[:1], "sm_90a")["items"]
    assert "base" not in compiled
    by_id = {c["id"]: c for c in item["candidates"]}
    assert by_id[config_id(cands[0])]["status"] == "pruned"
    assert by_id[config_id(cands[0])]["reason"] == "capture: boom: no such constexpr"
    assert by_id[config_id(cands[1])]["status"] == "pruned"
    assert by_id[config_id(cands[1])]["reason"] == "spills in k_128: 3 spill stores"
    unjudged = by_id[config_id(cands[2])]
    assert unjudged["status"] == "ok" and unjudged["reason"] == "not checked offline (compile worker died (signal 9))"
    assert [c["status"] for c in item["candidates"]] == ["ok", "ok", "pruned", "pruned"]  # pruned ones last
    lines = planning.summary_lines({"items": [item]})
    assert lines[0] == f"  {KERNEL}: 4 candidate launch(es) besides the default, 2 pruned offline"
    assert f"    pruned {config_id(cands[1])}: spills in k_128: 3 spill stores" in lines


def test_survivors_are_ordered_by_fuller_last_wave_then_more_ctas_then_fewer_registers(monkeypatch):
    """sm_90a has 132 SMs: at one CTA per SM, 132 CTAs fill one wave and 133 leave the second nearly empty (fill
    133/264); at two, a wave holds 264."""
    cands = {name: {"B": b, "num_warps": 4} for name, b in
             (("ragged", 8), ("fewer_ctas", 24), ("more_regs", 32), ("best", 64), ("two_waves", 128))}
    specs = {"ragged": [[133]], "fewer_ctas": [[132]], "more_regs": [[264]], "best": [[264]],
             "two_waves": [[264], [133]]}  # its worst launch decides: the 133-CTA one
    verdicts = {"ragged": _verdict("ragged"), "fewer_ctas": _verdict("fewer_ctas", ctas_per_sm=1),
                "more_regs": _verdict("more_regs", ctas_per_sm=2, regs=128), "best": _verdict("best", ctas_per_sm=2),
                "two_waves": _verdict("two_waves")}
    _fake(monkeypatch, [({"n": 1}, DEFAULT)], [DEFAULT, *cands.values()],
          {config_id(cands[n]): (None, [_spec(n, specs[n])]) for n in cands}, verdicts.values())
    [item] = planning.build(CASES[:1], "sm_90a")["items"]
    order = {config_id(c): n for n, c in cands.items()}
    assert [order[c["id"]] for c in item["candidates"]] == ["best", "more_regs", "fewer_ctas", "ragged", "two_waves"]
    scores = {order[c["id"]]: c["score"] for c in item["candidates"]}
    assert scores["ragged"] == {"fill": pytest.approx(0.504), "ctas_per_sm": 1, "regs": 32}
    assert scores["two_waves"]["fill"] == pytest.approx(0.504)
