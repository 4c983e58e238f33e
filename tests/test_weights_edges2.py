"""More edges of the weight loaders found by a hand mutation audit of spark_bench/weights (the second half of the one in
test_weights_edges.py): each damaged or unusual file is one WeightError naming what was expected (never a traceback
of another type, never silently accepted), and what a file states is read as stated. Each case names the mutant it
kills."""

import json

import numpy as np
import pytest
from test_weights_edges import ATT, _float_gguf, _set
from weight_files import gguf_file, kimi_checkpoint

from spark_bench.weights import WeightError, make_spec, source
from spark_bench.weights.formats import open_weights
from spark_bench.weights.layer import load_activations
from spark_bench.weights.routing import load_routing


def test_k_quant_experts_need_q2_k_up_experts_too(tmp_path):
    """Mutant: the routed experts taken as Q2_K/Q3_K when only the gate (w1) and down (w2) experts are (a Q4_K up
    expert then fed to the Q2_K kernels as Q2_K blocks)."""
    path = gguf_file(tmp_path / "up_q4k.gguf", layers=1, types={"ffn_up_exps": "q4_k"})
    with pytest.raises(WeightError, match=r"blk.0.ffn_up_exps.weight q4_k, blk.0.ffn_down_exps.weight q3_k; the MoE "
                                          "ops take float"):
        source(make_spec(path, 0, None))


def test_a_b_proj_of_three_dims_is_one_weight_error(tmp_path):
    """Mutant: b_proj's rank not checked (a [H, D, 1] b_proj was a ValueError traceback: too many values to
    unpack)."""
    index = kimi_checkpoint(tmp_path, layers=1, edit=_set(ATT + "b_proj.weight", lambda t: t[..., None]))
    with pytest.raises(WeightError, match=r"b_proj.weight has shape \[2, 64, 1\], expected \[H, D\]"):
        source(make_spec(index, 0, None))


def test_a_gguf_cut_by_one_byte_is_truncated(tmp_path):
    """Mutant: `end > size` -> `end > size + 1` (a file one byte short of its last tensor opened as whole)."""
    path = _float_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    assert open_weights(path).info("blk.0.ffn_down_exps.weight") is not None  # whole: opens
    path.write_bytes(data[:-1])
    with pytest.raises(WeightError, match=rf"truncated: tensor blk.0.ffn_down_exps.weight ends at byte {len(data)} "
                                          rf"but the file has {len(data) - 1}"):
        open_weights(path)


def _index(tmp_path, change, layers=1):
    """The test checkpoint with its index's weight_map changed by change(weight_map)."""
    index = kimi_checkpoint(tmp_path, layers=layers)
    meta = json.loads(index.read_text())
    change(meta["weight_map"])
    index.write_text(json.dumps(meta))
    return index


def test_an_index_naming_a_tensor_its_shard_lacks_is_one_weight_error(tmp_path):
    """Mutant: the shard's header not checked for the tensor the index names (a KeyError traceback)."""
    ghost = "model.layers.0.self_attn.ghost.weight"
    index = _index(tmp_path, lambda m: m.update({ghost: "model-00001-of-00001.safetensors"}))
    with pytest.raises(WeightError, match=rf"model-00001-of-00001.safetensors: has no tensor {ghost}, but .*index.json "
                                          "says it does"):
        open_weights(index).info(ghost)


def test_an_index_whose_shard_is_not_a_file_name_is_refused(tmp_path):
    """Mutant: weight_map's values not checked to be strings (a number was a TypeError traceback)."""
    index = _index(tmp_path, lambda m: m.update({"model.layers.0.self_attn.A_log": 5}))
    with pytest.raises(WeightError, match=r"not a safetensors index \(weight_map must map tensor names to shard "
                                          r"files\)"):
        open_weights(index)


def test_a_boolean_top_k_in_config_json_is_refused(tmp_path):
    """Mutant: a JSON `true` taken for the number 1 (bool is an int in Python)."""
    index = kimi_checkpoint(tmp_path, layers=1, config_patch={"num_experts_per_token": True})
    with pytest.raises(WeightError, match=r"config.json num_experts_per_token is True: expected a positive integer "
                                          r"\(topk\)"):
        source(make_spec(index, 0, None))


def test_a_gguf_that_states_sigmoid_gating_can_replay_its_routing(tmp_path):
    """Mutant: llama.cpp's sigmoid gating value (expert_gating_func = 2) taken for another scoring function (then
    routing=model refused every DeepSeek-V3 GGUF that states it)."""
    path = gguf_file(tmp_path / "m.gguf", layers=1, meta={"expert_gating_func": 2})
    assert source(make_spec(path, 0, None)).router_mismatch is None


def test_router_settings_under_text_config_are_read(tmp_path):
    """Mutant: a multimodal config.json's text_config (where such models state the text model's router) ignored."""
    index = kimi_checkpoint(tmp_path, layers=1, config=False)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "kimi_vl", "text_config": {"num_experts_per_token": 4, "routed_scaling_factor": 1.5}}))
    src = source(make_spec(index, 0, None))
    assert src.router_stated == {"topk": 4, "routed_scaling_factor": 1.5} and src.scaling[0] == 1.5


@pytest.mark.parametrize("mutant, text, needle", [
    ("lines of different lengths not checked (a numpy ValueError traceback)", "[0, 1]\n[2]\n",
     "line 2 has 1 ids, the first line 2"),
    ("weights on some lines only not checked (a numpy traceback)", '{"ids": [0, 1], "weights": [0.5, 0.5]}\n[2, 3]\n',
     "weights on some lines only (give them on every line or none)"),
])
def test_a_ragged_routing_file_is_one_weight_error(tmp_path, mutant, text, needle):
    path = tmp_path / "ids.jsonl"
    path.write_text(text)
    with pytest.raises(WeightError) as err:
        load_routing(str(path))
    assert needle in str(err.value)


def test_float_expert_ids_are_refused(tmp_path):
    """Mutant: a float .npy of expert ids cast to int32 (2.7 replayed as expert 2)."""
    np.save(tmp_path / "ids.npy", np.array([[0.0, 2.7], [1.0, 3.0]]))
    with pytest.raises(WeightError, match="expert ids must be integers, not float64"):
        load_routing(str(tmp_path / "ids.npy"))


def test_integer_activations_are_refused(tmp_path):
    """Mutant: an integer activation file taken as activations (token ids are not hidden states)."""
    np.save(tmp_path / "acts.npy", np.arange(4 * 64, dtype=np.int64).reshape(4, 64))
    with pytest.raises(WeightError, match=r"expected a float array \[tokens, hidden\], got int64 \[4, 64\]"):
        load_activations(str(tmp_path / "acts.npy"))


def test_layers_with_a_gap_are_listed_one_by_one(tmp_path):
    """Mutant: the layers a file holds always written as a range (a file of layers 0 and 2 said "0..2", naming a
    layer 1 it does not hold)."""
    index = _index(tmp_path, lambda m: [m.pop(k) for k in list(m) if k.startswith("model.layers.1.")], layers=3)
    with pytest.raises(WeightError, match=r"no layer 1 \(the file holds layers 0, 2\)"):
        source(make_spec(index, 1, None))


def test_a_k_quant_down_tensor_of_part_blocks_is_a_corrupt_file(tmp_path):
    """Why validate.py's "K-quant experts need ... inter multiples of 256" check is unreachable from a file (its
    mutants are equivalent): GGUFWriter writes a Q3_K down tensor of 128 columns (raw bytes with a declared shape), but
    the gguf reader refuses a row that is not whole blocks before any layer is validated (and likewise a Q2_K row of
    D, or a shared expert's)."""
    import gguf

    E, D, I = 4, 256, 128
    Q2, Q3 = gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((E, D), np.float32))
    w.add_tensor("blk.0.exp_probs_b.bias", np.zeros(E, np.float32))
    for name in ("ffn_gate_exps", "ffn_up_exps"):
        w.add_tensor(f"blk.0.{name}.weight", np.zeros((E, I, D // 256 * 84), np.uint8), raw_dtype=Q2)
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((E, D, I * 110 // 256), np.int8), raw_shape=(E, D, I),
                 raw_dtype=Q3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightError, match=r"m.gguf: corrupt or truncated GGUF file \("):  # gguf: "row size (128) is
        # not a multiple of Q3_K block size (256)"; should a later gguf read it, the check becomes reachable: test it
        source(make_spec(tmp_path / "m.gguf", 0, None))
