"""spark_bench/kernelgate without compiling: which specialisations the gate picks (gate.select), what its rows and
markdown say (grid CTAs, dtypes, varying constexprs, KB), which verdicts fail it, target parsing, what tells
specialisations apart (Spec.key / class_key), and the capture process's merge of presets and its error line."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from test_kernel_gate import _spec

from spark_bench.kernelgate import capture, gate
from spark_bench.kernelgate.offline import Compiled
from spark_bench.kernelgate.targets import TARGETS, parse_targets

H200 = TARGETS["sm_90a"]
SIG = {"x": "*bf16", "y": "*bf16", "n": "i32", "B": "constexpr"}


def _launch(grid, op="kda.gate"):
    return {"op": op, "backend": "triton", "params": {"tokens": 1}, "dtype": "bf16", "grid": grid}


def test_cover_compiles_each_argument_type_signature_on_its_own():
    """A block size that only an fp32 specialisation launches is not covered by a bf16 one with that block size."""
    fp32 = {**SIG, "x": "*fp32", "y": "*fp32"}
    specs = [_spec("fits", SIG, {"B": 64}, {"num_warps": 4}), _spec("fits", fp32, {"B": 64}, {"num_warps": 4})]
    assert {s.signature["x"] for s in gate.select(specs, "cover")} == {"*bf16", "*fp32"}


def test_a_spill_fails_the_gate_as_a_compile_error_and_a_launch_overflow_do():
    results = [Compiled("k", "m:k", "sm_90a", verdict) for verdict in ("ok", "spills", "launch-resources",
                                                                        "compile-error")]
    assert [r.verdict for r in gate.failures(results)] == ["spills", "launch-resources", "compile-error"]


def test_grid_ctas_span_the_launches_and_a_callable_grid_has_none():
    spec = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
    spec.launches = [_launch([8, 2]), _launch([3]), _launch([40, 1, 1])]
    assert gate.grid_ctas(spec) == (3, 40)
    spec.launches.insert(1, _launch("callable"))
    assert gate.grid_ctas(spec) is None  # not the span of the others: the callable's grid is unknown


def test_rows_name_the_dtypes_in_argument_order_and_only_the_constexprs_that_vary():
    sig = {"out": "*fp32", "x": "*bf16", "idx": "*i32", "w": "*bf16", "n": "i32", "B": "constexpr"}
    a = _spec("fits", sig, {"B": 64, "EVEN": True}, {"num_warps": 4})
    b = _spec("fits", sig, {"B": 128, "EVEN": True}, {"num_warps": 4})
    a.launches, b.launches = [_launch([2])], [_launch([1]), _launch([4], op="moe.router")]
    results = [Compiled(s.key, s.kernel, "sm_90a", "ok", regs=40, shared=0, num_warps=4) for s in (a, b)]
    rows = {r["constexprs"]["B"]: r for r in gate.rows([a, b], results)}
    assert rows[64]["dtypes"] == "fp32,bf16,i32"
    assert rows[64]["constexprs"] == {"B": 64} and rows[64]["all_constexprs"] == {"B": 64, "EVEN": True}
    assert rows[128]["grid_ctas"] == (1, 4) and rows[128]["ops"] == ["kda.gate", "moe.router"]


def test_the_markdown_table_gives_kilobytes_of_1024_bytes_and_one_value_when_all_agree():
    spec = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
    spec.launches = [_launch([7])]
    results = [Compiled(spec.key, spec.kernel, "sm_90a", "ok", regs=40, spill_stores=0, spill_loads=0,
                        shared=100 * 1024, num_warps=4, num_stages=3, ctas_per_sm=2, seconds=1.5)]
    table = gate.markdown(gate.rows([spec], results), "<!-- head -->")
    row = table.splitlines()[-1]
    assert row == "| `broken_kernels.fits` | sm_90a | 1 | 1 ok | 40 | 0 | 100 | 2 | 4 | 3 | - | 7 | 1.5 |", row


def test_target_lists_without_a_name_are_refused_and_repeats_compile_once():
    """An empty --target compiled nothing and passed."""
    for text in ("", " , "):
        with pytest.raises(ValueError, match="choose from sm_80, sm_90a, sm_100a"):
            parse_targets(text)
    assert [t.name for t in parse_targets("sm_90a, sm_80,sm_90a")] == ["sm_90a", "sm_80"]


def test_the_largest_block_and_the_whole_shared_memory_still_launch():
    """1024 threads and exactly the per-block opt-in maximum are the limits, not past them."""
    assert H200.ctas_per_sm(regs=32, warps=32, shared=0) == 2
    assert H200.ctas_per_sm(regs=32, warps=4, shared=H200.smem_per_block) == 1


def test_alignment_attributes_split_specialisations_but_not_classes_and_options_split_both():
    a = _spec("fits", SIG, {"B": 64}, {"num_warps": 4}, {"x": [["tt.divisibility", 16]]})
    b = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
    c = _spec("fits", SIG, {"B": 64}, {"num_warps": 8})
    assert a.key != b.key and a.class_key == b.class_key
    assert b.key != c.key and b.class_key != c.class_key
    assert len(gate.select([a, b, c], "classes")) == 2 and len(gate.select([a, b, c], "all")) == 3


def test_tuple_values_are_recorded_as_lists():
    assert capture._jsonable((1, (2, "a"), None)) == [1, [2, "a"], None]
    assert capture._jsonable(object())["type"] == "object"


def test_a_capture_error_is_one_line_with_where_it_was_raised():
    try:
        raise ValueError("first line\nsecond line")
    except ValueError as exc:
        line = capture._one_line(exc)
    assert line.startswith("ValueError: first line (test_kernel_gate_edges.py:") and "\n" not in line, line


def test_the_capture_process_merges_a_specialisation_over_presets(monkeypatch, capsys):
    """A specialisation launched by the plain sweep and by a preset is one spec holding both presets' launches."""
    def fake_capture(ops, backends, preset, overrides, dtypes, quick, target):
        spec = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
        spec.launches = [_launch([1 if preset is None else 2])]
        errors = [capture.CaptureError("kda.gate", "triton", {}, "bf16", "boom")] if preset else []
        return [spec], errors, 3

    monkeypatch.setattr(capture, "capture", fake_capture)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"presets": [None, "kimi-linear"]})))
    capture.main()
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    (spec,) = out["specs"]
    assert [(launch["grid"], launch["preset"]) for launch in spec["launches"]] == [([1], None), ([2], "kimi-linear")]
    assert out["cases"] == 6 and [e["preset"] for e in out["errors"]] == ["kimi-linear"]


def test_a_failed_capture_process_is_reported_by_its_last_line(monkeypatch):
    stderr = "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'no op nope'\n"
    monkeypatch.setattr(capture.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 3, stdout="", stderr=stderr))
    with pytest.raises(RuntimeError, match=r"^launch capture failed \(exit 3\): KeyError: 'no op nope'$"):
        capture.run_capture({"ops": ["nope"]})


def test_each_launched_case_is_named_once_for_the_candidate_plan():
    """`kernels --candidates` plans each case that launched a kernel once, however many specialisations it launched."""
    a = _spec("fits", SIG, {"B": 64}, {"num_warps": 4})
    b = _spec("fits", SIG, {"B": 128}, {"num_warps": 4})
    a.launches, b.launches = [_launch([1]), _launch([2])], [_launch([1]), _launch([1], op="moe.router")]
    assert [c.op for c in gate.launched_cases([a, b])] == ["kda.gate", "moe.router"]
