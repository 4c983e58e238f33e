"""`spark-bench kernels --compare BASE.json` (spark_bench/kernelgate/compare.py): the specialisations whose offline
figures changed since a stored `kernels --json`, matched by what the launch asks for (not the source hash), and
exit 1 when one got worse: fewer CTAs per SM, a new spill, no longer compiling, wgmma or tensor cores lost."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from spark_bench.kernelgate import compare
from spark_bench.sweep import UsageError

ONE_POINT = ("--op", "kda.gate", "--quick", "--no-presets", "--set", "tokens=1", "--set", "head_dim=60")


def row(kernel="_k", verdict="ok", regs=64, spill=0, shared=0, ctas=8, tensor_core="-", **constexprs):
    return {"module": "kernels.mod", "kernel": kernel, "target": "sm_90a", "dtypes": "bf16,fp32",
            "all_constexprs": constexprs or {"BM": 64}, "options": {"num_warps": 4, "num_stages": 3},
            "verdict": verdict, "regs": regs, "spill_stores": spill, "spill_loads": 0, "shared": shared,
            "ctas_per_sm": ctas, "tensor_core": tensor_core}


@pytest.mark.parametrize("new, worse", [
    (row(), None),
    (row(regs=72), ""),  # more registers, same occupancy: shown, not judged
    (row(regs=96, ctas=5), "CTA/SM 8 -> 5"),
    (row(spill=12, verdict="spills"), "spills 12 B"),
    (row(verdict="compile-error", regs=None, ctas=None), "ok -> compile-error"),
    (row(tensor_core="mma.sync"), "tensor core wgmma -> mma.sync"),
])
def test_each_kind_of_change_against_a_wgmma_base(new, worse):
    base = row(tensor_core="wgmma")
    new = {**new, "tensor_core": new["tensor_core"] if new["tensor_core"] != "-" else "wgmma"}
    result = compare.diff([base], [new])
    assert result["matched"] == 1 and result["only_in_base"] == result["only_in_new"] == 0
    if worse is None:
        assert result["changed"] == [] and result["worse"] == 0
    else:
        (changed,) = result["changed"]
        assert "; ".join(changed["worse"]) == worse and result["worse"] == bool(worse)


def test_losing_every_tensor_core_instruction_is_worse_and_a_better_figure_is_not():
    result = compare.diff([row(tensor_core="mma.sync"), row(BM=128, ctas=2)],
                          [row(tensor_core="-"), row(BM=128, ctas=4, regs=32)])
    worse = {json.dumps(c["constexprs"]): c["worse"] for c in result["changed"]}
    assert worse == {'{"BM": 64}': ["tensor core mma.sync -> none"], '{"BM": 128}': []} and result["worse"] == 1


def test_alignment_variants_are_pooled_at_their_worst():
    """`--select all` keeps one row per alignment of the same launch: the worst of them stands for it."""
    base = [row(regs=64, ctas=8), row(regs=64, ctas=8)]
    new = [row(regs=64, ctas=8), row(regs=80, ctas=6, spill=4, verdict="spills")]
    (changed,) = compare.diff(base, new)["changed"]
    assert (changed["regs"], changed["ctas_per_sm"], changed["spill"], changed["verdict"]) == (80, 6, 4, "spills")
    assert changed["worse"] == ["spills 4 B", "CTA/SM 8 -> 6"]


def test_alignment_variants_recorded_on_both_sides_are_matched_one_to_one():
    """Tables since 2026-12-07 record each launch's alignment (attrs): a classes table compiled one variant, a later
    run may pick another as its representative; that one is new, not 'worse'."""
    a16, a8 = '{"tt.divisibility":[[0],[1]]}', '{"tt.divisibility":[[0]]}'
    base = [{**row(), "attrs": a16}]
    new = [{**row(regs=80, ctas=6), "attrs": a8}]
    result = compare.diff(base, new)
    assert (result["matched"], result["worse"], result["only_in_new"], result["aligned"]) == (0, 0, 1, True)
    result = compare.diff(base, [{**row(regs=80, ctas=6), "attrs": a16}, {**row(), "attrs": a8}])
    assert (result["matched"], result["worse"], result["only_in_new"]) == (1, 1, 1)
    assert compare.diff(base, [row(regs=80, ctas=6)])["aligned"] is False  # a side without attrs: pooled


def test_a_constexpr_added_since_the_base_is_left_out_of_the_match_and_named():
    """A kernel edit that adds a constexpr (here FAST) must not make every specialisation 'only here': the match
    uses the constexprs both sides have, and the new one's variants pool (worst figures)."""
    base = [row(BM=64, T=1), row(BM=64)]  # T: an int argument equal to 1 is a constexpr to Triton, else absent
    new = [row(BM=64, T=1, FAST=0, regs=40), row(BM=64, T=1, FAST=1, regs=48), row(BM=64, FAST=1)]
    result = compare.diff(base, new)
    assert result["matched"] == 2 and result["constexprs_not_matched"] == {"mod._k": ["FAST"]}
    (changed,) = result["changed"]
    assert changed["constexprs"] == {"T": 1} and (changed["regs_base"], changed["regs"]) == (64, 48)
    line = compare.summary(result, "base.json", "3.6.0", "3.9.0")
    assert "constexprs on one side only, pooled: mod._k FAST" in line and "compiled by triton 3.6.0" in line
    assert "alignment variants" not in line
    assert "the base is --select classes, this all: a specialisation's alignment variants" in \
        compare.summary(result, "base.json", "3.9.0", "3.9.0", "classes", "all")
    assert "alignment" not in compare.summary(result, "base.json", "3.9.0", "3.9.0", "classes", "cover")


def test_kernels_on_one_side_only_are_counted_not_judged():
    result = compare.diff([row(kernel="_gone")], [row(kernel="_new"), row(kernel="_new", BM=32)])
    assert (result["matched"], result["only_in_base"], result["only_in_new"], result["worse"]) == (0, 1, 2, 0)
    assert result["kernels_only_in_base"] == ["mod._gone (sm_90a)"]
    assert result["kernels_only_in_new"] == ["mod._new (sm_90a)"]


@pytest.mark.parametrize("text, message", [
    ("{", "cannot read it as JSON"),
    ('{"rows": []}', 'not the output of `spark-bench kernels --json` (no "rows" list)'),
    ('[1, 2]', 'no "rows" list'),
    ('{"rows": [{"kernel": "_k"}]}', "row 0 lacks module, target, dtypes"),
    (json.dumps({"rows": [{**row(), "all_constexprs": [1]}]}), "row 0 has all_constexprs of the wrong type ([1])"),
    (json.dumps({"rows": [{**row(), "regs": "64"}]}), "row 0 has regs of the wrong type ('64')"),
])
def test_a_file_that_is_not_a_kernels_json_is_one_line(tmp_path, text, message):
    path = tmp_path / "base.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="^--compare .*base.json: ") as info:
        compare.load(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bad_base_is_refused_before_any_capture(tmp_path):
    code, out, err = run_cli("kernels", *ONE_POINT, "--compare", str(tmp_path / "missing.json"))
    assert code == 2 and "Traceback" not in err and "capturing" not in err, err
    assert err.strip().splitlines()[-1].startswith("spark-bench: error: --compare "), err


def test_compare_end_to_end_with_a_real_compile(tmp_path):
    """A base written by `kernels --json` itself compares clean; the same base claiming more CTAs per SM and wgmma
    makes the run exit 1 and name both."""
    cache = ("--cache-dir", str(tmp_path / "cache"))
    code, out, err = run_cli("kernels", *ONE_POINT, *cache, "--json")
    assert code == 0, err
    base = json.loads(out)
    (tmp_path / "same.json").write_text(json.dumps(base))
    code, out, err = run_cli("kernels", *ONE_POINT, *cache, "--compare", str(tmp_path / "same.json"))
    assert code == 0 and f"against {tmp_path / 'same.json'}: 1 specialisations in both, 0 changed, 0 worse" in \
        " ".join(out.split()), out + err
    claimed = base["rows"][0]
    claimed.update(ctas_per_sm=claimed["ctas_per_sm"] + 1, tensor_core="wgmma")
    (tmp_path / "better.json").write_text(json.dumps(base))
    code, out, err = run_cli("kernels", *ONE_POINT, *cache, "--compare", str(tmp_path / "better.json"), "--json")
    assert code == 1, err
    (changed,) = json.loads(out)["compare"]["changed"]
    assert changed["worse"] == [f"CTA/SM {claimed['ctas_per_sm']} -> {claimed['ctas_per_sm'] - 1}",
                                "tensor core wgmma -> -"]
