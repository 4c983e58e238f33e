"""A shared expert stored in a type the MoE ops do not take (known-issues, Weights): Q6_K, as in mixed "XL" GGUFs, is
dequantized to bf16 at load with the gguf package (the oracle here) for moe.layer and moe.shared_expert, and their
cases say so; a type gguf cannot dequantize refuses only the ops that run the shared expert. The ops that do not use
it (router, align, routed experts) are never refused because of it."""

import gguf
import pytest
import torch
from conftest import run_cli
from weight_files import gguf_file

from spark_bench.check import check_outputs
from spark_bench.registry import registry
from spark_bench.weights import make_spec, source, using
from spark_bench.weights.label import case_label
from spark_bench.weights.plan import fixed_point

SHEXP = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
NOT_SHARED = ["moe.router", "moe.align", "moe.experts_gguf"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    return {"q6_k": gguf_file(root / "xl.gguf", layers=1, types=dict.fromkeys(SHEXP, "q6_k")),
            "down_q6_k": gguf_file(root / "mixed.gguf", layers=1, types={"ffn_down_shexp": "q6_k"}),
            "q8_k": gguf_file(root / "q8k.gguf", layers=1, types={"ffn_down_shexp": "q8_k"})}


def _point(op, spec, **sets):
    fixed = fixed_point(op, spec, {k: str(v) for k, v in sets.items()})
    return {a.name: a.sweep(True)[0] for a in op.axes} | fixed | {"tokens": 5} | sets


def _dequantized(path, name):
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["q6_k", "down_q6_k"])
def test_a_q6_k_shared_expert_is_dequantized_for_the_ops_that_run_it(files, kind):
    reg, path = registry(), files[kind]
    spec = make_spec(str(path), 0, None)
    src = source(spec)
    assert src.shapes("moe")["format"] == "q2k_q3k" and src.shapes("moe")["shared_format"] == "bf16"
    layer, shared = reg.get("moe.layer"), reg.get("moe.shared_expert")
    assert fixed_point(shared, spec, {})["format"] == "bf16"
    assert fixed_point(layer, spec, {})["format"] == "q2k_q3k"
    with using(spec):
        p = _point(layer, spec)
        inputs = layer.make_inputs(p, seed=2)
        w1, w3, w2 = (_dequantized(path, f"blk.0.{n}.weight") for n in SHEXP)
        assert torch.equal(inputs["shared_w13"][0], torch.cat([w1, w3])) and torch.equal(inputs["shared_w2"][0], w2)
        assert inputs["shared_format"] == "bf16" and inputs["w13"].dtype == torch.uint8
        check = check_outputs(layer, layer.backends["torch"].fn(**inputs), layer.reference(**inputs), inputs, "bf16")
        assert check["ok"], check["message"]
        s_inputs = shared.make_inputs(_point(shared, spec), seed=2)
        assert torch.equal(s_inputs["w13"], inputs["shared_w13"]) and s_inputs["format"] == "bf16"
        check = check_outputs(shared, shared.backends["torch"].fn(**s_inputs), shared.reference(**s_inputs), s_inputs,
                              "bf16")
        assert check["ok"], check["message"]
        assert p["shared_format"] == "bf16"  # the file fixes the axis: the case id says what ran
        with_q = layer.cost(p, "bf16").bytes
    # the cost is a function of the point (not of the active source): the dequantized shared expert at 2 B a weight
    D, I = p["hidden"], p["inter"]
    assert layer.cost(p, "bf16").bytes == with_q
    assert with_q - layer.cost({**p, "shared_format": "routed"}, "bf16").bytes == \
        pytest.approx(3 * I * D * (2 - (2 * 84 + 110) / 3 / 256))
    stored = "Q6_K" if kind == "q6_k" else "Q2_K/Q6_K"
    assert f"shared expert {stored} dequantized to bf16" in case_label(src, layer, p)
    assert "shared expert" not in case_label(src, reg.get("moe.router"), _point(reg.get("moe.router"), spec))


def test_ops_that_do_not_run_the_shared_expert_ignore_its_type(files):
    code, out, err = run_cli("run", "--weights", files["q8_k"], "--op", "moe.*", "--backend", "torch", "--dry-run")
    assert code == 0, err
    for name in NOT_SHARED:
        assert f"{name} torch" in out, (name, out)
    note = " ".join(err.split())
    assert "moe.layer (runs the shared expert, but its shared expert is " in note and "q8_k" in note, err
    assert "moe.shared_expert torch" not in out and "moe.layer torch" not in out


@pytest.mark.parametrize("op", ["moe.layer", "moe.shared_expert"])
def test_an_undequantizable_shared_expert_refuses_only_its_ops_by_name(files, op):
    code, out, err = run_cli("run", "--weights", files["q8_k"], "--op", op, "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, err
    assert f"{op}: runs the shared expert, but its shared expert is " in lines[0]
    assert "nor a type the gguf package dequantizes" in lines[0]


def test_the_routed_experts_of_a_q6_k_shared_expert_file_run(files):
    reg = registry()
    spec = make_spec(str(files["q6_k"]), 0, None)
    for name in NOT_SHARED:
        op = reg.get(name)
        with using(spec):
            p = _point(op, spec)
            inputs = op.make_inputs(p, seed=4)
            check = check_outputs(op, op.backends["torch"].fn(**inputs), op.reference(**inputs), inputs, "bf16")
        assert check["ok"], (name, check["message"])
