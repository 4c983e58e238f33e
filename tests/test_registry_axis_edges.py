"""What a plugin declares and how a command-line value is read (found by a mutation audit of registry.py,
op_contract.py, axis.py and selection.py): each test names the mutant it was written against."""

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from spark_bench import Axis, Cost, Op, Tolerance
from spark_bench.op_contract import json_default
from spark_bench.registry import Registry
from spark_bench.results import ResultsError
from spark_bench.selection import select_records


def _op(**changes):
    fields = dict(name="mt3.double", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.ones(p["rows"])},
                  reference=lambda x: 2 * x.double(), cost=lambda p, d: Cost(p["rows"], 8 * p["rows"]),
                  axes=[Axis("rows", [8], quick=[3])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    return Op(**{**fields, **changes})


# --- registry.py ------------------------------------------------------------------------------------------------
def test_one_plugin_defining_an_op_twice_is_refused_whole():
    """Mutant: the 'defined twice in it' check dropped (the second silently replaced the first)."""
    reg = Registry()
    with pytest.raises(ValueError, match="op 'mt3.double' is defined twice in it"):
        reg.load_object("twice", [_op(), _op()])
    assert reg.ops == {}


def test_plugins_named_in_the_variable_load_with_spaces_and_an_unknown_extension_is_an_error(tmp_path, monkeypatch):
    """Mutants: the names in $SPARK_BENCH_PLUGINS not stripped (' mt3_mod ' fails to import); the 'extends unknown
    op' error dropped (an extension of a misspelt op vanished without a word)."""
    (tmp_path / "mt3_mod.py").write_text(textwrap.dedent('''
        import torch
        from spark_bench import Axis, Cost, Op, Tolerance

        op = Op(name="mt3.plugin", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.ones(p["rows"])},
                reference=lambda x: 2 * x.double(), cost=lambda p, d: Cost(p["rows"], 8 * p["rows"]),
                axes=[Axis("rows", [8])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    '''))
    (tmp_path / "mt3_ext.py").write_text(textwrap.dedent('''
        from spark_bench import Extension

        ext = Extension("kda.gatee")

        @ext.backend("mine")
        def mine(g, A_log, dt_bias):
            return g
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", " mt3_mod , mt3_ext,")
    try:
        reg = Registry().discover()
    finally:
        for name in ("mt3_mod", "mt3_ext"):
            sys.modules.pop(name, None)
    assert "mt3.plugin" in reg.ops and reg.sources["mt3.plugin"] == "mt3_mod"
    mine = [(e.source, e.message) for e in reg.errors if e.source.startswith("mt3")]
    assert mine == [("mt3_ext", "extends unknown op 'kda.gatee'")]


def test_ops_matched_by_several_globs_come_sorted_by_name_once_each():
    """Mutant: the matched ops returned in the order of the patterns (run and list follow this order)."""
    reg = Registry()
    reg.load_object("three", [_op(name="zz.a"), _op(name="aa.b"), _op(name="mm.c")])
    assert [op.name for op in reg.match(["zz.*", "mm.*", "aa.*", "z*"])] == ["aa.b", "mm.c", "zz.a"]


# --- op_contract.py ---------------------------------------------------------------------------------------------
def test_a_bool_or_an_array_is_no_count():
    """Mutants: `not isinstance(value, bool)` dropped (Cost(True, 8) stored 1 flop); the ndim == 0 test dropped
    from `plain` (an array became numpy's own error, or a one-element array a number)."""
    with pytest.raises(ValueError, match=r"Cost: flops=True \(must be a finite number >= 0\)"):
        Cost(True, 8)
    with pytest.raises(ValueError, match=r"Cost: flops=array\(\[3, 4\]\)"):
        Cost(np.array([3, 4]), 8)
    with pytest.raises(ValueError, match=r"Cost: bytes=tensor\(\[8\.\]\)"):
        Cost(1, torch.tensor([8.0]))
    assert Cost(np.float32(2.0), torch.tensor(8)).bytes == 8.0  # 0-d: numbers


def test_a_value_json_cannot_store_is_stored_as_its_text():
    """Mutant: json_default returns the object itself (json.dumps then fails on every such record)."""
    assert json.dumps({"p": Path("/x/y"), "n": np.int64(3)}, default=json_default) == '{"p": "/x/y", "n": 3}'


def test_a_quick_dtype_without_a_tolerance_is_refused():
    """Mutant: only `dtypes` checked for a tolerance (a --quick run checked bf16 against no bound)."""
    with pytest.raises(ValueError, match="mt3.double: no tolerance for dtype bf16"):
        _op(quick_dtypes=["bf16"])


def test_a_preset_with_no_value_for_an_axis_names_the_op():
    """Mutant: the empty-preset check dropped (the later error named neither the op nor that a preset is wrong)."""
    with pytest.raises(ValueError, match="mt3.double: preset 'small' gives rows no value"):
        _op(presets={"small": {"rows": []}})


# --- axis.py ----------------------------------------------------------------------------------------------------
def test_the_quick_sweep_only_when_asked():
    """Mutant: `quick and` dropped from Axis.sweep (every full run swept the CPU sizes)."""
    axis = Axis("rows", [8, 16], quick=[3])
    assert axis.sweep(False) == [8, 16] and axis.sweep(True) == [3]
    assert Axis("rows", [8, 16]).sweep(True) == [8, 16]


def test_a_bool_axis_takes_yes_and_no():
    """Mutant: 'yes' dropped from the true words."""
    axis = Axis("fused", [False, True])
    assert [axis.parse(t) for t in ("yes", "YES", "1", "true", "no", "0", "False")] == [True] * 4 + [False] * 3
    with pytest.raises(ValueError, match="takes true/false, not 'y'"):
        axis.parse("y")


def test_a_size_axis_refuses_zero_and_negatives_but_an_axis_declaring_zero_takes_it():
    """Mutants: `value < 1` -> `value < 0`; `min(declared) >= 1` -> `> 1`; the quick values left out of what the
    axis declares (an axis whose quick sweep holds 0 refused --set 0)."""
    sizes = Axis("rows", [1, 2], quick=[1])
    for text in ("0", "-1"):
        with pytest.raises(ValueError, match=f"axis 'rows' takes positive integers, not '{text}'"):
            sizes.parse(text)
    assert sizes.parse("7") == 7 and sizes.parse("064") == 64
    assert Axis("shift", [4, 8], quick=[0]).parse("0") == 0
    assert Axis("offset", [-1, 4]).parse("-3") == -3


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_float_axis_refuses_what_is_not_finite(text):
    """Mutant: the isfinite check dropped (a typo ran, and the backends were blamed for its NaNs)."""
    with pytest.raises(ValueError, match=f"axis 'scale' takes finite numbers, not '{text}'"):
        Axis("scale", [0.5, 2.0]).parse(text)
    assert Axis("scale", [0.5]).parse("1e-3") == 1e-3


# --- selection.py -----------------------------------------------------------------------------------------------
def test_a_filter_that_matches_nothing_names_what_the_earlier_filters_left():
    """Mutant: the message lists the backends of the whole run, not of the ops --op kept."""
    recs = [{"op": "kda.gate", "backend": "torch", "dtype": "bf16", "params": {}},
            {"op": "moe.experts", "backend": "triton", "dtype": "bf16", "params": {}}]
    with pytest.raises(ResultsError, match=r"no case matches --backend vllm; the run has: torch$"):
        select_records(recs, ops=("kda.*",), backends=("vllm",))
    assert select_records(recs, ops=("kda.*",)) == recs[:1]
