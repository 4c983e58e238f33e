"""Entry-point discovery: third-party ops and backends load like the built-in ones; a broken plugin is reported."""

import sys
import textwrap

import pytest

from spark_bench.registry import Registry


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """An installed distribution (a dist-info on sys.path) with three spark_bench.plugins entry points."""
    (tmp_path / "thirdparty_ops.py").write_text(textwrap.dedent('''
        import torch
        from spark_bench import Axis, Cost, Extension, Op, Tolerance

        op = Op(name="third.double", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.ones(p["rows"])},
                reference=lambda x: 2 * x.double(), cost=lambda p, d: Cost(p["rows"], 8 * p["rows"]),
                axes=[Axis("rows", [8], quick=[3])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})

        @op.backend("torch")
        def double(x):
            return 2 * x

        gate_ext = Extension("kda.gate")

        @gate_ext.backend("thirdparty_gate")
        def thirdparty_gate(g, A_log, dt_bias):
            return g
    '''))
    (tmp_path / "broken_ops.py").write_text("raise ImportError('needs libfoo.so')\n")
    dist = tmp_path / "thirdparty_ops-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-ops\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[spark_bench.plugins]\nthird = thirdparty_ops\nbroken = broken_ops\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("thirdparty_ops", "broken_ops"):
        sys.modules.pop(name, None)


def test_third_party_op_and_backend_extension(fake_distribution):
    reg = Registry().discover()
    assert "third.double" in reg.ops and "kda.gate" in reg.ops
    assert set(reg.get("third.double").backends) == {"reference", "torch"}
    assert "thirdparty_gate" in reg.get("kda.gate").backends
    broken = [e for e in reg.errors if e.source == "broken"]
    assert len(broken) == 1 and "needs libfoo.so" in broken[0].message


def test_match_globs_and_unknown():
    reg = Registry().discover()
    assert [op.name for op in reg.match(["*.gate"])] == ["kda.gate"]
    assert all(op.family == "kda" for op in reg.match(["kda.*"]))
    with pytest.raises(KeyError, match="no op matches"):
        reg.match(["nope.*"])


def test_set_values_replace_an_axis_whole():
    """`--set tokens=1,7,9` sweeps all three (a mutation keeping only the first value was caught only by a 5-minute
    kill-and-resume test, indirectly)."""
    from spark_bench import get_op

    points = get_op("kda.gate").points({"tokens": [1, 7, 9]}, quick=True)
    assert sorted({p["tokens"] for p in points}) == [1, 7, 9]
