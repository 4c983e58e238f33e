"""A layer's tensors checked at their edges from the headers (found by a hand mutation audit of
spark_bench/weights): each damaged tiny checkpoint is one WeightError naming the tensor and what was expected, before
anything is loaded. Each case names the mutant it kills."""

import pytest
import torch
from weight_files import kda_tensors, kimi_checkpoint

from spark_bench.weights import WeightError, make_spec, source

PRE = "model.layers.0."
ATT, MOE = PRE + "self_attn.", PRE + "block_sparse_moe."


def _set(name, make):
    """An edit of the test checkpoint: tensor `name` replaced by make(old tensor)."""
    def edit(t):
        t[name] = make(t[name]).contiguous()
    return edit


def _rows(name, n):  # n more rows
    return _set(name, lambda t: torch.cat([t, t[:n]]))


def _cols(name, n):  # n more columns
    return _set(name, lambda t: torch.cat([t, t[:, :n]], dim=1))


LAYER_ERRORS = {  # mutant: (edit, the message's needle)
    "k_proj's K not checked against q_proj's": (
        _rows(ATT + "k_proj.weight", 2), "k_proj.weight has shape [34, 64], expected [32, 64] (k_proj is [H*K, D]"),
    "f_b not checked": (_cols(ATT + "f_b_proj.weight", 1), "f_b_proj.weight has shape [32, 17], expected [32, 16]"),
    "g_b not checked": (_cols(ATT + "g_b_proj.weight", 1), "g_b_proj.weight has shape [32, 17], expected [32, 16]"),
    "o_norm not checked": (_set(ATT + "o_norm.weight", lambda t: torch.cat([t, t])),
                           "o_norm.weight has shape [32], expected [16]: o_norm is one RMSNorm weight"),
    "o_proj not checked": (_cols(ATT + "o_proj.weight", 2), "o_proj.weight has shape [64, 34], expected [64, 32]"),
    "gate_bias not checked": (_set(MOE + "gate.e_score_correction_bias", lambda t: t[:-1]),
                              "gate.e_score_correction_bias has shape [7], expected [8] (gate_bias"),
    "pre-MoE norm not checked": (_set(PRE + "post_attention_layernorm.weight", lambda t: t[:-1]),
                                 "post_attention_layernorm.weight has shape [63], expected [64]"),
    "shared down not checked": (_cols(MOE + "shared_experts.down_proj.weight", 1),
                                "shared_experts.down_proj.weight has shape [64, 65], expected [64, 64]"),
    "later experts' dtype not checked": (_set(MOE + "experts.3.w1.weight", lambda t: t.to(torch.int32)),
                                         "experts.3.w1.weight is i32; w1 must be a float tensor"),
    "q/k/v rows not a multiple of the heads": (
        _rows(ATT + "v_proj.weight", 1), "v_proj.weight has shape [33, 64], expected [H*head_dim, D] with H = 2"),
}


@pytest.mark.parametrize("mutant", LAYER_ERRORS)
def test_a_damaged_layer_is_one_weight_error_naming_the_tensor(tmp_path, mutant):
    edit, needle = LAYER_ERRORS[mutant]
    index = kimi_checkpoint(tmp_path, layers=1, edit=edit)
    with pytest.raises(WeightError) as err:
        source(make_spec(index, 0, None))
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1


def test_an_a_log_of_h_values_in_the_wrong_shape_is_refused(tmp_path):
    """Mutant: A_log accepted by its element count alone ([2, 2] for 4 heads is not per head)."""
    from safetensors.torch import save_file

    tensors = kda_tensors(0, torch.Generator().manual_seed(1), H=4)
    tensors[ATT + "A_log"] = tensors[ATT + "A_log"].reshape(2, 2).contiguous()
    save_file(tensors, str(tmp_path / "kda.safetensors"))
    with pytest.raises(WeightError, match=r"A_log has shape \[2, 2\], expected \[4\]: A_log is per head"):
        source(make_spec(tmp_path / "kda.safetensors", 0, None))


def _float_gguf(path, down_shape=None, up_shape=None, E=4, D=32, I=16):
    """A one-layer DeepSeek-style GGUF with float (f32) stacked experts; down/up may be stored in another shape."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_uint32("deepseek2.expert_used_count", 2)
    for name, shape in (("ffn_gate_inp.weight", (E, D)), ("exp_probs_b.bias", (E,)),
                        ("ffn_gate_exps.weight", (E, I, D)), ("ffn_up_exps.weight", up_shape or (E, I, D)),
                        ("ffn_down_exps.weight", down_shape or (E, D, I))):
        w.add_tensor("blk.0." + name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("mutant, shapes, needle", [
    ("stacked down experts not checked", {"down_shape": (4, 16, 32)},
     "blk.0.ffn_down_exps.weight has shape [4, 16, 32], expected [4, 32, 16] (down experts [E, D, I])"),
    ("stacked up experts not checked", {"up_shape": (4, 32, 16)},
     "blk.0.ffn_up_exps.weight has shape [4, 32, 16], expected [4, 16, 32] (up experts like the gate experts)"),
])
def test_stacked_gguf_experts_in_the_wrong_shape_are_refused(tmp_path, mutant, shapes, needle):
    good = source(make_spec(_float_gguf(tmp_path / "good.gguf"), 0, None))
    assert good.moe.shapes()["experts"] == 4 and good.moe.shapes()["inter"] == 16 and good.moe.dims["format"] == "bf16"
    with pytest.raises(WeightError) as err:
        source(make_spec(_float_gguf(tmp_path / "bad.gguf", **shapes), 0, None))
    assert needle in str(err.value)


@pytest.mark.parametrize("mutant, patch, needle", [
    ("a top-k of 0 accepted", {"num_experts_per_token": 0},
     "config.json num_experts_per_token is 0: expected a positive integer (topk)"),
    ("an infinite scaling factor accepted", {"routed_scaling_factor": float("inf")},
     "config.json routed_scaling_factor is inf: expected a positive number"),
    ("one kept group more than the groups accepted", {"num_expert_group": 2, "topk_group": 3},
     "topk_group is 3, more than the 2 expert groups"),
])
def test_router_settings_at_their_limits_are_refused(tmp_path, mutant, patch, needle):
    index = kimi_checkpoint(tmp_path, layers=1, config_patch=patch)
    with pytest.raises(WeightError) as err:
        source(make_spec(index, 0, None))
    assert needle in str(err.value)


def test_a_file_of_neither_format_says_so(tmp_path):
    """Mutant: any file of 9 bytes or more taken for a safetensors file (the error then blamed a truncated
    safetensors file for what is no weight file at all)."""
    from spark_bench.weights.formats import open_weights

    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 8 + b"not json at all")
    with pytest.raises(WeightError, match=r"weights.bin: neither a safetensors nor a GGUF file \(starts with"):
        open_weights(junk)


def test_a_zero_routing_weight_is_refused(tmp_path):
    """Mutant: `w <= 0` -> `w < 0` (a zero weight replayed: an expert picked and then not used)."""
    from spark_bench.weights.routing import load_routing

    path = tmp_path / "ids.jsonl"
    path.write_text('{"ids": [0, 1], "weights": [0.5, 0.0]}\n')
    with pytest.raises(WeightError, match="routing weights must be positive and finite"):
        load_routing(str(path))


def test_a_routing_files_top_k_must_be_the_models(tmp_path):
    """Mutant: a 3-per-token routing file replayed on a layer whose file states top-k 2."""
    from weight_files import routing_npy

    from spark_bench.registry import registry
    from spark_bench.sweep import SweepSpec, build_cases

    index = kimi_checkpoint(tmp_path / "kimi", layers=1)
    ids = routing_npy(tmp_path / "ids.npy", [[0, 1, 2], [3, 4, 5]])
    spec = SweepSpec(ops=["moe.experts"], quick=True, weights=make_spec(index, 0, ids))
    with pytest.raises(WeightError, match="3 experts per token, but the model's top-k is 2"):
        build_cases(registry(), spec)


def test_a_directory_of_two_weight_files_is_refused_not_guessed(tmp_path):
    """Mutant: a directory of two safetensors files (no index) read as its first file, silently."""
    from safetensors.torch import save_file

    for name in ("a", "b"):
        save_file({"model.layers.0.mlp.gate.weight": torch.zeros(2, 2)}, str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(WeightError, match=r"expected one \*.safetensors .* found a.safetensors, b.safetensors; name "
                                          "the file"):
        source(make_spec(tmp_path, 0, None))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_top_k_in_config_json_is_one_line_exit_2(tmp_path, value):
    """BUG (fixed in weights/config.py _value): a config.json top-k of NaN or Infinity (what Python's json writes
    for them) crashed `spark-bench run --weights` with a traceback (int(nan): ValueError, int(inf): OverflowError)
    instead of the one-line error naming the key."""
    from conftest import run_cli

    index = kimi_checkpoint(tmp_path, layers=1, config_patch={"num_experts_per_token": value})
    code, _, err = run_cli("run", "--weights", index, "--op", "moe.router", "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"config.json num_experts_per_token is {value}: expected a positive integer (topk)" in err


def test_a_routing_window_wraps_around_the_file(tmp_path):
    """Mutant: a window past the file's end repeating its last token instead of wrapping to its first."""
    from weight_files import routing_npy

    from spark_bench.weights.routing import load_routing

    trace = load_routing(str(routing_npy(tmp_path / "ids.npy", [[0, 1], [2, 3], [4, 5]])))
    ids, weights = trace.window(5, offset=2)
    assert ids[:, 0].tolist() == [4, 0, 2, 4, 0] and weights is None


def test_activation_rows_start_at_the_drawn_offset_and_wrap(tmp_path):
    """Mutant: the drawn offset ignored (every timed set fed the file's first rows)."""
    import numpy as np

    n, hidden = 7, 64
    acts = np.repeat(np.arange(n, dtype=np.float32)[:, None], hidden, axis=1)
    np.save(tmp_path / "acts.npy", acts)
    index = kimi_checkpoint(tmp_path / "kimi", layers=1)
    src = source(make_spec(index, 0, None, tmp_path / "acts.npy"))
    seed = next(s for s in range(100) if torch.randint(0, n, (1,), generator=torch.Generator().manual_seed(s)) > 2)
    offset = int(torch.randint(0, n, (1,), generator=torch.Generator().manual_seed(seed)))
    x = src.activation_rows(9, torch.Generator().manual_seed(seed), "fp32", "cpu")
    assert x.shape == (9, hidden) and x[:, 0].tolist() == [float((offset + i) % n) for i in range(9)]
