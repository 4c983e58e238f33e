"""The router settings a weight file implies (known-issues, Weights): a config keeping every expert group
(topk_group == n_group > 1) is plain top-k after the group step, checked against an independent fp64 computation; a
file that states no routed scaling factor gets one value, its family's default, for routing=model and for the ops
with a routed_scaling_factor axis alike, and its cases say which."""

import math

import numpy as np
import pytest
import torch
from conftest import run_cli
from weight_files import MOE, deepseek_checkpoint, gguf_file, kimi_checkpoint

from spark_bench.registry import registry
from spark_bench.weights import make_spec, source, using
from spark_bench.weights.label import case_label
from spark_bench.weights.plan import fixed_point

ROUTER = "moe.router"


def plain_topk(x, gate_w, gate_bias, topk, scale):
    """fp64 numpy, one token at a time: sigmoid scores, + bias to choose, the top `topk` ids (no groups), their
    unbiased scores renormalised and scaled."""
    logits = x.double().numpy() @ gate_w.double().numpy().T
    ids, weights = [], []
    for row in logits:
        scores = 1 / (1 + np.exp(-row))
        chosen = sorted(range(len(row)), key=lambda e: -(scores[e] + float(gate_bias[e])))[:topk]
        w = scores[chosen]
        ids.append(chosen)
        weights.append(w / w.sum() * scale)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("groups, experts, topk", [(4, 16, 3), (8, 32, 8), (2, 8, 4)])
def test_all_groups_kept_is_plain_topk(groups, experts, topk):
    op = registry().get(ROUTER)
    p = {"tokens": 7, "hidden": 40, "experts": experts, "topk": topk, "groups": groups, "topk_groups": groups,
         "routed_scaling_factor": 2.5}
    assert op.invalid_reason(p) is None
    inputs = op.make_inputs(p, seed=3)
    ref_ids, ref_w = plain_topk(inputs["x"], inputs["gate_w"], inputs["gate_bias"], topk, 2.5)
    for name in ("torch", "host", "reference"):
        w, ids = op.backends[name].fn(**inputs)
        order = ids.long().argsort(-1)
        assert (ids.long().gather(1, order).numpy() == np.sort(ref_ids, -1)).all(), name
        ref_sorted = np.take_along_axis(ref_w, ref_ids.argsort(-1), -1)
        assert np.allclose(w.double().gather(1, order).numpy(), ref_sorted, rtol=1e-5), name
        metrics, ok, why = op.compare((w, ids), op.reference(**inputs), inputs, "bf16")
        assert ok and metrics["mismatched_tokens"] == 0, (name, why)
    assert op.invalid_reason({**p, "topk_groups": groups + 1}) is not None


def test_a_file_keeping_every_group_runs_moe_router(tmp_path):
    index = kimi_checkpoint(tmp_path, layers=1, config_patch={"num_expert_group": 2, "topk_group": 2})
    point = fixed_point(registry().get(ROUTER), make_spec(str(index), 0, None), {})
    assert (point["groups"], point["topk_groups"]) == (2, 2)
    code, out, err = run_cli("run", "--weights", index, "--op", "moe.*", "--dry-run")
    assert code == 0 and "moe.router torch" in out and "moe.router (" not in err, out + err


def _files(root):
    """(path, layer, expected scaling, origin words) of files that state no routed scaling factor, and one that does."""
    kimi = kimi_checkpoint(root / "kimi", layers=1, config_patch={"routed_scaling_factor": None})
    ds = deepseek_checkpoint(root / "ds", groups=1)
    cfg = (root / "ds" / "config.json")
    cfg.write_text(cfg.read_text().replace('"routed_scaling_factor": 2.5', '"routed_scaling_factor": null'))
    return [(kimi, 0, 1.0, "kimi-linear default, not in the file"),
            (ds, 3, 2.5, "deepseek-v3 default, not in the file"),
            (gguf_file(root / "g.gguf", meta={"expert_weights_scale": None}), 1, 1.0,
             "not in the file, gguf default unknown"),
            (gguf_file(root / "s.gguf", meta={"expert_weights_scale": 1.75}), 1, 1.75, "file")]


def test_unstated_scaling_is_one_value_for_routing_model_and_the_router_axis(tmp_path):
    reg = registry()
    for path, layer, scale, origin in _files(tmp_path):
        spec = make_spec(str(path), layer, None)
        src = source(spec)
        assert src.scaling[0] == scale
        for name in (ROUTER, "moe.layer"):
            assert fixed_point(reg.get(name), spec, {})["routed_scaling_factor"] == scale, (path, name)
        experts = reg.get("moe.experts_gguf" if path.suffix == ".gguf" else "moe.experts")
        fixed = fixed_point(experts, spec, {"routing": "model"})
        p = {a.name: a.sweep(True)[0] for a in experts.axes} | fixed | {"tokens": 5, "routing": "model"}
        with using(spec):
            inputs = experts.make_inputs(p, seed=1)
            assert torch.allclose(inputs["topk_weights"].sum(-1), torch.full((5,), scale)), path
            router_p = {a.name: a.sweep(True)[0] for a in reg.get(ROUTER).axes} | fixed_point(reg.get(ROUTER),
                                                                                            spec, {})
            w, _ = reg.get(ROUTER).backends["torch"].fn(**reg.get(ROUTER).make_inputs(router_p, seed=1))
            assert torch.allclose(w.sum(-1), torch.full((w.shape[0],), scale))
        label = case_label(src, experts, p)
        assert f"routed scaling {scale:g} ({origin})" in label, label
        assert f"routed scaling {scale:g} ({origin})" in case_label(src, reg.get(ROUTER), router_p)
        # --set overrides the default, and the label says so
        if origin != "file":
            assert fixed_point(reg.get(ROUTER), spec, {"routed_scaling_factor": "3"}).get("routed_scaling_factor") \
                in (None, 3.0)
            assert "routed scaling 3 (--set)" in case_label(src, reg.get(ROUTER), {**router_p,
                                                                                   "routed_scaling_factor": 3.0})


def test_the_fingerprint_states_the_scaling_and_where_it_comes_from(tmp_path):
    from spark_bench.weights import describe

    index = kimi_checkpoint(tmp_path, layers=1, config_patch={"routed_scaling_factor": None})
    assert describe(make_spec(str(index), 0, None))["routed_scaling"] == {
        "value": 1.0, "from": "kimi-linear default, not in the file"}
    stated = kimi_checkpoint(tmp_path / "stated", layers=1)
    got = describe(make_spec(str(stated), 0, None))["routed_scaling"]
    assert math.isclose(got["value"], MOE["rsf"]) and got["from"].endswith("config.json routed_scaling_factor")
