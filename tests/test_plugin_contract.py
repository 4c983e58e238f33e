"""A careless third-party plugin (found by a 2026-12-06 plugin author's audit): what it declares wrong fails to load
with one line naming it, one bad plugin never takes another down or replaces a built-in op, and no wrong or
unmeasured number is stored as right (a NaN tolerance, a float reference, a negative cost)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import spark_bench_cmd

from spark_bench import Axis, Backend, Cost, Extension, Op, Tolerance
from spark_bench.check import default_compare
from spark_bench.registry import Registry


def _op(**changes):
    fields = dict(name="pc.double", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.ones(p["rows"])},
                  reference=lambda x: 2 * x.double(), cost=lambda p, d: Cost(p["rows"], 8 * p["rows"]),
                  axes=[Axis("rows", [8], quick=[3])], dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    return Op(**{**fields, **changes})


# --- what an op declares ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(err_ratio=float("nan")), dict(err_ratio=-1), dict(err_ratio=None),
                                 dict(err_ratio=1e-3, max_abs=float("nan")), dict(err_ratio=float("inf"))])
def test_a_tolerance_that_would_pass_anything_or_nothing_is_refused(bad):
    """A NaN bound passed every output (x > nan is False); a negative one failed the right backend."""
    with pytest.raises(ValueError, match="Tolerance: .*finite number >= 0"):
        Tolerance(**bad)
    assert Tolerance(0).err_ratio == 0.0  # an exact op's bound


@pytest.mark.parametrize("flops, nbytes", [(-1e6, 8), (float("nan"), 8), (1, float("inf")), ("512", 8), (10**400, 8)])
def test_a_cost_that_is_not_a_finite_count_is_refused(flops, nbytes):
    """A negative cost gave -8.98 GB/s and a -4.35% roofline with status ok; NaN gave nan."""
    with pytest.raises(ValueError, match="Cost: .*finite number >= 0"):
        Cost(flops, nbytes)


def test_numpy_numbers_become_plain_ones():
    """`np.prod(shape)` costs were stored as strings and made the whole run unreadable; numpy axis values made
    `run` and `list --json` end in a traceback."""
    cost = Cost(np.prod([3, 4]), np.int64(96), tokens=np.int32(3))
    assert (cost.flops, cost.bytes, cost.tokens) == (12.0, 96.0, 3)
    assert all(type(v) is float for v in (cost.flops, cost.bytes)) and type(cost.tokens) is int
    axis = Axis("rows", 2 ** np.arange(3, 5), quick=np.array([3]))
    assert axis.values == [8, 16] and all(type(v) is int for v in [*axis.values, *axis.quick])
    op = _op(presets={"small": {"rows": list(np.arange(1, 3))}, "array": {"rows": np.array([3, 4])}})
    assert [type(v) for v in op.presets["small"]["rows"]] == [int, int] and op.presets["array"]["rows"] == [3, 4]
    with pytest.raises(ValueError, match="a count of tokens"):
        Cost(1, 1, tokens=2.7)


def test_a_cost_model_that_returns_no_cost_fails_naming_the_op():
    op = _op(cost=lambda p, d: {"flops": 1, "bytes": 2})
    with pytest.raises(TypeError, match="pc.double: the cost model returned dict, not a Cost"):
        op.cost({"rows": 3}, "fp32")


@pytest.mark.parametrize("changes, words", [
    (dict(reference=None), "reference must be a callable"),
    (dict(cost=None), "cost must be a callable"),
    (dict(tolerance={"fp32": 1e-6}), "tolerance['fp32'] must be a Tolerance"),
    (dict(dtypes=["bf16", "fp32"]), "no tolerance for dtype bf16"),
    (dict(presets={"small": {"rows": 8}}), "preset 'small' gives rows 8"),
    (dict(presets={"small": {"rows": "rowmajor"}}), "a preset gives a list"),
    (dict(presets={"small": {"dtype": ["fp33"]}}), "fp33"),
    (dict(compare="exact"), "compare must be a callable"),
])
def test_an_op_declared_wrong_fails_when_built_naming_the_field(changes, words):
    """Each of these loaded, was listed as available and failed every case with a raw Python error (or swept
    'rowmajor' as the eight points r, o, w, m, a, j, o, r)."""
    with pytest.raises((TypeError, ValueError)) as info:
        _op(**changes)
    assert words in str(info.value)


@pytest.mark.parametrize("axis, words", [(lambda: Axis("rows", []), "values is empty"),
                                         (lambda: Axis("rows", [8], quick=[]), "quick is empty"),
                                         (lambda: Axis("rows", "8"), "must be a list of values")])
def test_an_axis_without_values_is_refused(axis, words):
    """An empty axis left its op with no case and a message naming neither; `quick=[]` was an IndexError."""
    with pytest.raises(ValueError, match=words):
        axis()


def test_probe_labels_and_setup_that_break_their_contract_are_said_so():
    def boom(device):
        raise RuntimeError("labels exploded")

    assert Backend("b", abs, labels="gpu").labels_for("cpu") == ["gpu"]  # one label, not g, p, u
    assert "labels failed: RuntimeError: labels exploded" in Backend("b", abs, labels=boom).unavailable("cpu")
    assert Backend("b", abs, labels=boom).labels_for("cpu") == []  # `list` shows the backend, unavailable
    assert Backend("b", abs, probe=lambda d: True).unavailable("cpu") is None
    assert "probe returned False" in Backend("b", abs, probe=lambda d: False).unavailable("cpu")
    assert "probe returned int 3" in Backend("b", abs, probe=lambda d: 3).unavailable("cpu")
    assert Backend("b", abs, probe=lambda d: "needs CUDA").unavailable("cpu") == "needs CUDA"
    with pytest.raises(TypeError, match="setup of backend 'b' returned NoneType, not the callable"):
        Backend("b", abs, setup=lambda fn, inputs: None).prepared({})


# --- the check ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out, ref", [(1.0, 2.0), (np.ones(3), np.ones(3) * 2),
                                      ((torch.ones(2), 5.0), (torch.ones(2), 6.0))])
def test_a_reference_with_values_the_check_cannot_compare_fails_every_backend(out, ref):
    """A float or numpy reference was 'ok' for any backend: nothing was compared and nothing said so."""
    metrics, ok, message = default_compare(out, ref, Tolerance(1e-3))
    assert not ok and "compares tensors only" in message


def test_tensor_outputs_are_still_compared():
    assert default_compare((torch.ones(2), None), (torch.ones(2), None), Tolerance(1e-6))[1]
    assert not default_compare(torch.ones(2), torch.ones(2) * 2, Tolerance(1e-3))[1]


# --- loading ------------------------------------------------------------------------------------------------------
@pytest.fixture
def careless_distribution(tmp_path, monkeypatch):
    """An installed distribution (a dist-info on sys.path) whose entry points redefine kda.gate, add a backend
    named like a built-in one to it, exit at import, print at import, and name a function."""
    modules = {
        "acme_gate": '''
            import torch
            from spark_bench import Axis, Cost, Op, Tolerance
            op = Op(name="kda.gate", make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.ones(3)},
                    reference=lambda x: x.double(), cost=lambda p, d: Cost(1, 1), axes=[Axis("rows", [3])],
                    dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
            ''',
        "acme_ext": '''
            from spark_bench import Extension
            ext = Extension("kda.gate")
            @ext.backend("my_fast")
            def my_fast(g, A_log, dt_bias): return g
            @ext.backend("torch")
            def torch_again(g, A_log, dt_bias): return g
            ''',
        "acme_exit": 'import sys\nsys.exit("my plugin needs CUDA 12")\n',
        "acme_banner": 'print("acme plugin v0.1 loaded")\nfrom acme_ext import *  # noqa\n',
        "acme_fn": 'def register():\n    return None\n',
    }
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    dist = tmp_path / "acme-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[spark_bench.plugins]\nacme.gate = acme_gate\nacme.ext = acme_ext\n"
                                           "acme.exit = acme_exit\nacme.fn = acme_fn:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in modules:
        sys.modules.pop(name, None)


def test_a_careless_plugin_costs_only_itself(careless_distribution, capsys):
    import spark_bench.plugins.kda.gate as builtin

    reg = Registry().discover()
    errors = {e.source: e.message for e in reg.errors}
    # the built-in op wins whatever the entry points' names; the message names both plugins
    assert reg.ops["kda.gate"] is builtin.op
    assert errors["acme.gate"] == ("ValueError: op 'kda.gate' is already defined by spark-bench's entry point "
                                   "kda.gate; not loaded")
    # the extension is refused whole (no my_fast), blamed on itself only (before, 13 other plugins 'failed')
    assert errors["acme.ext"] == "backend 'torch' already exists on kda.gate; the extension is not loaded"
    assert "my_fast" not in reg.ops["kda.gate"].backends
    assert errors["acme.exit"] == "SystemExit: my plugin needs CUDA 12"
    assert "it must name a module, an Op, an Extension" in errors["acme.fn"]
    assert set(errors) == {"acme.gate", "acme.ext", "acme.exit", "acme.fn"}
    assert not [name for name in reg.ops if name.startswith("acme")]
    note = r"4 plugin load error\(s\) \(acme.exit, acme.ext, acme.fn, acme.gate: see spark-bench list"
    with pytest.raises(KeyError, match=note):
        reg.match(["acme.*"])


def test_what_a_plugin_prints_at_import_goes_to_stderr(careless_distribution, monkeypatch, capsys):
    """A banner on stdout made `spark-bench list --json` unparsable."""
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "acme_banner")
    Registry().discover()
    out, err = capsys.readouterr()
    assert "acme plugin v0.1 loaded" in err and "acme plugin" not in out


# --- a run of a careless plugin -------------------------------------------------------------------------------------
CARELESS = '''
import numpy as np
import torch
import triton
import triton.language as tl
from spark_bench import Axis, Cost, Op, Tolerance

@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

def make_inputs(p, *, device, dtype, seed):
    return {"x": torch.randn(p["rows"], device=device)}  # no generator: not seeded

op = Op(name="pc.careless", make_inputs_fn=make_inputs, reference=lambda x: 2 * x.double(),
        cost=lambda p, d: Cost(flops=np.prod([p["rows"]]), bytes=8 * np.int64(p["rows"])),
        axes=[Axis("rows", list(2 ** np.arange(3, 5)), quick=list(np.array([5])))], dtypes=["fp32"],
        tolerance={"fp32": Tolerance(1e-6)})

@op.backend("torch")
def torch_double(x):
    return 2 * x

@op.backend("triton")  # no labels=probes.triton_labels: it runs interpreted all the same
def triton_double(x):
    y = torch.empty_like(x)
    _double[(1,)](x, y, x.numel(), BLOCK=16)
    return y
'''


def test_a_run_of_a_careless_plugin_stores_plain_numbers_and_honest_labels(tmp_path):
    """numpy costs and axis values are stored as numbers (the run was unreadable); an unseeded factory and an
    undeclared interpreted Triton backend are labelled ('unseeded-inputs', 'interpreted')."""
    (tmp_path / "careless_plugin.py").write_text(CARELESS)
    env = {**os.environ, "SPARK_BENCH_PLUGINS": "careless_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(spark_bench_cmd("run", "--op", "pc.careless", "--quick", "--out", tmp_path / "r",
                                          "--no-report", "--device", "cpu"),
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    by_backend = {r["backend"]: r for r in records}
    assert set(by_backend) == {"torch", "triton"} and all(r["status"] == "ok" for r in records)
    assert all(r["cost"]["flops"] == 5.0 and r["cost"]["bytes"] == 40.0 and r["params"]["rows"] == 5
               for r in records)
    assert "interpreted" in by_backend["triton"]["labels"] and "interpreted" not in by_backend["torch"]["labels"]
    assert all("unseeded-inputs" in r["labels"] for r in records)
    show = subprocess.run(spark_bench_cmd("show", tmp_path / "r"), capture_output=True, text=True, timeout=300,
                          env=env)
    assert show.returncode == 0 and "pc.careless" in show.stdout, show.stderr


def test_kernels_on_an_op_without_a_triton_backend_is_a_usage_error(tmp_path):
    """It printed '0 specialisations of 0 kernels' and exited 0, a pass on nothing compiled."""
    (tmp_path / "careless_plugin.py").write_text(CARELESS.replace('@op.backend("triton")', '@op.backend("other")'))
    env = {**os.environ, "SPARK_BENCH_PLUGINS": "careless_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(spark_bench_cmd("kernels", "--op", "pc.careless", "--quick"), capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "unknown backend 'triton*'" in proc.stderr, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_an_extension_is_all_or_nothing_even_loaded_before_its_op():
    reg = Registry()
    ext = Extension("pc.double")
    ext.backend("fast")(lambda x: 2 * x)
    ext.backend("torch")(lambda x: 2 * x)
    reg.load_object("ext_first", ext)  # waits for its op
    op = _op()
    op.backend("torch")(lambda x: 2 * x)
    reg.load_object("the_op", op)
    assert set(op.backends) == {"reference", "torch"}
    assert [(e.source, e.message) for e in reg.errors] == [
        ("ext_first", "backend 'torch' already exists on pc.double; the extension is not loaded")]


def test_an_unseeded_factory_is_told_from_a_seeded_one():
    """Unseeded: the inputs differ between two calls with one seed AND a global random state moved; an output buffer
    from torch.empty differs between calls without drawing anything (a review found it labelled unseeded)."""
    from spark_bench.check import factory_is_seeded
    from spark_bench.inputs import generator

    def seeded(p, device, dtype, seed):
        return {"x": torch.randn(p["rows"], generator=generator(device, seed)), "out": torch.empty(p["rows"])}

    def numpy_global(p, device, dtype, seed):
        return {"x": torch.from_numpy(np.random.randn(p["rows"]))}

    def sparse(p, device, dtype, seed):  # bits cannot be compared: the probe says nothing, never raises
        return {"x": torch.eye(3).to_sparse()}

    assert factory_is_seeded(_op(make_inputs_fn=seeded), "cpu")
    assert factory_is_seeded(_op(make_inputs_fn=sparse), "cpu")
    assert not factory_is_seeded(_op(make_inputs_fn=lambda p, device, dtype, seed: {"x": torch.randn(8)}), "cpu")
    assert not factory_is_seeded(_op(make_inputs_fn=numpy_global), "cpu")


def test_a_raising_labels_callable_makes_a_backend_without_probe_unavailable():
    """Only probed backends were asked; one without a probe ran with no labels (a review of this change)."""
    from spark_bench.isolate import probe_backends

    def boom(device):
        raise RuntimeError("labels exploded")

    answers = probe_backends([("pc.double", Backend("noprobe", abs, labels=boom)),
                              ("pc.double", Backend("plain", abs, labels=("x",)))], "cpu")
    assert answers == {("pc.double", "noprobe"): "labels failed: RuntimeError: labels exploded",
                       ("pc.double", "plain"): None}
