"""spark_bench/weights: a Hugging Face checkpoint's per-expert gate and up projections load as w13 = [gate | up] in
that order (moe.md: h = silu(x w1^T) * (x w3^T), w1 = gate_proj / w1, w3 = up_proj / w3), for both the
DeepSeek-V3 names (gate_proj / up_proj) and Kimi-Linear's (w1 / w3); a file's router settings that the router
cannot honour are refused at the boundary (one group too many kept; a top-k above what the kept groups hold).
Expected tensors are read straight from the files with safetensors, not through the loader."""

import pytest
import torch
from safetensors.torch import load_file
from weight_files import deepseek_checkpoint, kimi_checkpoint

from spark_bench.weights import WeightError, make_spec, source
from spark_bench.weights.config import Stated, check_router


@pytest.mark.parametrize("family", ["deepseek", "kimi"])
def test_per_expert_gate_and_up_load_as_gate_then_up(tmp_path, family):
    if family == "deepseek":
        path, layer = deepseek_checkpoint(tmp_path / "ds"), 3
        tensors = load_file(str(path))
        gate, up, down = "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", \
            "mlp.experts.{e}.down_proj.weight"
    else:
        path, layer = kimi_checkpoint(tmp_path / "kimi", layers=1), 0
        tensors = load_file(str(path.parent / "model-00001-of-00001.safetensors"))
        gate, up, down = ("block_sparse_moe.experts.{e}." + w + ".weight" for w in ("w1", "w3", "w2"))
    pre = f"model.layers.{layer}."
    part = source(make_spec(str(path), layer, None)).moe_part("experts", "cpu")
    E = part["w13"].shape[0]
    assert E == 8
    for e in range(E):
        stored = torch.cat([tensors[pre + gate.format(e=e)], tensors[pre + up.format(e=e)]])
        assert torch.equal(part["w13"][e], stored), e
        assert torch.equal(part["w2"][e], tensors[pre + down.format(e=e)]), e


def _stated(**values):
    return Stated(values, {k: f"config.json {k}" for k in values}, None)


def test_keeping_one_group_more_than_there_are_is_refused():
    with pytest.raises(WeightError, match="topk_groups is 3, more than the 2 expert groups"):
        check_router(_stated(topk=2, groups=2, topk_groups=3), 8, "layer 0")
    check_router(_stated(topk=2, groups=2, topk_groups=2), 8, "layer 0")  # every group kept: valid


def test_a_top_k_above_the_experts_of_the_kept_groups_is_refused():
    """8 experts in 4 groups of 2, one group kept: the router can pick 2 experts, so top-3 is impossible."""
    with pytest.raises(WeightError, match="topk is 3, more than the 2 routed experts the router can pick"):
        check_router(_stated(topk=3, groups=4, topk_groups=1), 8, "layer 0")
    check_router(_stated(topk=2, groups=4, topk_groups=1), 8, "layer 0")
