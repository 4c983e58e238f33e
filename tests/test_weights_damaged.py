"""Damaged or inconsistent model files on the command line: each is one line on stderr naming what was expected,
exit 2, before any case runs (the router settings a file states, a malformed index, a routing file whose ids would
wrap around, a router the ops do not implement). And the GGUF experts the ops take dequantize, with the `gguf`
package as the oracle, to the file's weights."""

import json
import struct

import numpy as np
import pytest
import torch
from conftest import run_cli
from weight_files import gguf_file, kimi_checkpoint, routing_npy

from spark_bench.registry import registry
from spark_bench.weights import make_spec, using

PRE = "model.layers.0."


def _config_list(root):
    index = kimi_checkpoint(root, layers=1)
    (root / "config.json").write_text("[1, 2]")
    return index


def _index_list(root):
    index = kimi_checkpoint(root, layers=1)
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00001.safetensors"]}))
    return index


def _jsonl(root, text):
    (root / "ids.jsonl").write_text(text)
    return root / "ids.jsonl"


def _gguf_cut(root, keep=None, count=None):
    """The test GGUF cut to its first `keep` bytes, or with its tensor count (a u64 at byte 8) overwritten."""
    path = gguf_file(root.with_suffix(".gguf"), layers=1)
    data = bytearray(path.read_bytes()[:keep])
    if count is not None:
        data[8:16] = struct.pack("<Q", count)
    path.write_bytes(bytes(data))
    return path


def _gguf_header_only(root):
    """A GGUF whose header names a 16 TiB f32 tensor, and no tensor data."""
    import gguf

    path = root.with_suffix(".gguf")
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tensor_info("blk.0.ffn_gate_inp.weight", (2 ** 20, 2 ** 22), np.dtype(np.float32), 2 ** 44)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def _gguf_duplicate_key(root):
    """The test GGUF with a metadata key stored twice."""
    path = gguf_file(root.with_suffix(".gguf"), layers=1, meta={"expert_used_coun_": 2})
    path.write_bytes(path.read_bytes().replace(b"expert_used_coun_", b"expert_used_count"))
    return path


def _q_conv_width_3(t):
    t[PRE + "self_attn.q_conv1d.weight"] = t[PRE + "self_attn.q_conv1d.weight"][..., :3].contiguous()


def _shared_gate_1d(t):
    t[PRE + "block_sparse_moe.shared_experts.gate_proj.weight"] = torch.ones(64, dtype=torch.bfloat16)


def _nan_a_log(t):
    t[PRE + "self_attn.A_log"].view(-1)[1] = float("nan")


def _inf_router_bias(t):
    t[PRE + "block_sparse_moe.gate.e_score_correction_bias"][3] = float("inf")


def _renamed(t):  # a layer under names no family maps
    for name in list(t):
        t[name.replace(".self_attn.", ".attn.").replace(".block_sparse_moe.", ".moe.")] = t.pop(name)


def kimi(**kwargs):
    return lambda root: kimi_checkpoint(root, layers=1, **kwargs)


def gguf_with(**kwargs):
    return lambda root: gguf_file(root.with_suffix(".gguf"), layers=1, **kwargs)


TRACE = kimi()  # the weights beside a routing file
CASES = {  # name: (the weights, a routing file or None, run's args, the line's needle)
    "config not an object": (_config_list, None, [], "config.json: expected a JSON object (a model config), got list"),
    "config value": (kimi(config_patch={"num_experts_per_token": "two"}), None, [],
                     "config.json num_experts_per_token is 'two': expected a positive integer (topk)"),
    "gguf scale": (gguf_with(meta={"expert_weights_scale": "x"}), None, [],
                   "metadata deepseek2.expert_weights_scale is 'x': expected a positive number"),
    "groups": (kimi(config_patch={"num_expert_group": 3}), None, [],
               "num_expert_group is 3, which does not divide the layer's 8 routed experts"),
    "kept groups": (kimi(config_patch={"num_expert_group": 2, "topk_group": 4}), None, [],
                    "topk_group is 4, more than the 2 expert groups"),
    "gguf topk": (gguf_with(meta={"expert_used_count": 9}), None, [],
                  "deepseek2.expert_used_count is 9, more than the 4 routed experts the router can pick"),
    "index": (_index_list, None, [], "not a safetensors index (weight_map must map tensor names to shard files)"),
    "softmax": (gguf_with(meta={"expert_gating_func": 1}), None, ["--op", "moe.experts_gguf", "--set", "routing=model"],
                "routing=model: ", "deepseek2.expert_gating_func is 1, but the MoE ops' router scores with a sigmoid"),
    "no renorm": (kimi(config_patch={"moe_renormalize": False}), None, ["--op", "moe.experts", "--set",
                                                                       "routing=model"],
                  "moe_renormalize is False, but the MoE ops' router renormalises its top-k weights"),
    "groups of one": (kimi(config_patch={"num_expert_group": 8, "topk_group": 2}), None, ["--op", "moe.router"],
                      "moe.router: no valid point on ", "8 experts do not split into groups of >= 2"),
    "conv width": (kimi(edit=_q_conv_width_3), None, ["--op", "kda.gate"],
                   "short conv widths model.layers.0.self_attn.q_conv1d.weight 3, "),
    "shared 1-d": (kimi(edit=_shared_gate_1d), None, [],
                   "shared_experts.gate_proj.weight has shape [64], expected [Is, D = 64] (shared expert gate)"),
    "no family": (kimi(edit=_renamed), None, [],
                  "looked for model.layers.0.self_attn.A_log (KDA), ", "; the layer holds model.layers.0.attn.A_log"),
    "q4_k": (gguf_with(types={"ffn_down_exps": "q4_k"}), None, [], "blk.0.ffn_down_exps.weight q4_k; the MoE ops take"),
    "gguf count": (lambda root: _gguf_cut(root, count=10 ** 6), None, [],
                   "corrupt or truncated GGUF file (its header runs past the end of the file (at byte "),
    "gguf cut in header": (lambda root: _gguf_cut(root, keep=200), None, [], "its header runs past the end"),
    "gguf no data": (_gguf_header_only, None, [],
                     "truncated: tensor blk.0.ffn_gate_inp.weight ends at byte 17592186044"),
    "gguf duplicate key": (_gguf_duplicate_key, None, [],
                           "corrupt or truncated GGUF file ('Duplicate deepseek2.expert_used_count already in list"),
    "unused trace": (TRACE, lambda root: routing_npy(root / "ids.npy", [[0, 1]]), ["--op", "moe.router"],
                     "ids.npy: no selected op replays it (moe.router)"),
    "id wraps": (TRACE, lambda root: routing_npy(root / "ids.npy", [[0, 2 ** 32 + 3]]), ["--op", "moe.experts"],
                 "token 0 has expert id 4294967299, out of range (ids are <= 2147483647)"),
    "jsonl id": (TRACE, lambda root: _jsonl(root, "[0, 1180591620717411303424]\n"), ["--op", "moe.experts"],
                 "line 1: expert id out of range"),
    "jsonl weights": (TRACE, lambda root: _jsonl(root, '{"ids": [0, 1], "weights": [1, "a"]}\n'),
                      ["--op", "moe.experts"], "line 1: weights must be a list of 2 numbers"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_damaged_files_are_one_line_exit_2(tmp_path, name):
    weights, routing, args, *needles = CASES[name]
    extra = ["--routing", routing(tmp_path)] if routing else []
    code, out, err = run_cli("run", "--weights", weights(tmp_path / "w"), *extra, *(args or ["--op", "moe.*"]),
                             "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, err
    assert lines[0].startswith("spark-bench: error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize(("edit", "op", "needle"), [
    (_nan_a_log, "kda.gate", "model.layers.0.self_attn.A_log holds 1 non-finite value(s) (first nan at index 1)"),
    (_inf_router_bias, "moe.router", "e_score_correction_bias holds 1 non-finite value(s) (first inf at index 3)"),
])
def test_a_non_finite_f32_parameter_refuses_the_run(tmp_path, edit, op, needle):
    """Read on the bytes the layer hash reads when the run starts (a dry run reads no tensor): NaN in A_log used to
    surface as a mismatch of every case."""
    code, out, err = run_cli("run", "--weights", kimi(edit=edit)(tmp_path / "w"), "--op", op, "--backend", "torch",
                             "--out", tmp_path / "run", "--no-report", "--executor", "inprocess")
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in out + err, err
    assert lines[-1].startswith("spark-bench: error: ") and needle in lines[-1], lines[-1]


def test_a_constraint_the_file_breaks_is_a_note_under_a_glob(tmp_path):
    """A glob leaves out the ops a constraint empties (with the reason), instead of running none of their cases."""
    index = kimi_checkpoint(tmp_path, layers=1, config_patch={"num_expert_group": 8, "topk_group": 2})
    code, out, err = run_cli("run", "--weights", index, "--op", "moe.*", "--dry-run")
    assert code == 0 and "moe.router (no valid point on " in " ".join(err.split()), err
    assert "moe.experts torch" in out and "moe.router torch" not in out


@pytest.mark.parametrize("D, I", [(256, 512), (512, 256)])
def test_gguf_experts_dequantize_to_the_files_weights(tmp_path, D, I):
    """The blocks the ops take, dequantized by the project's K-quant code, equal gguf's dequantization of the file's
    tensors (D != I: a transposed or mis-split row would show)."""
    import gguf
    from spark_bench.plugins.quant import kquants

    path = gguf_file(tmp_path / "m.gguf", layers=1, D=D, I=I)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}
    reg = registry()
    with using(make_spec(path, 0, None)):
        routed = reg.get("moe.experts_gguf").make_inputs({"tokens": 2, "hidden": D, "experts": 4, "topk": 2,
                                                           "inter": I, "routing": "uniform"})
        shared = reg.get("moe.shared_expert").make_inputs({"tokens": 2, "hidden": D, "inter": I, "format": "q2k_q3k"})
    for w13, w2, kind, lead in ((routed["w13_q"], routed["w2_q"], "exps", np.s_[:]),
                                (shared["w13"], shared["w2"], "shexp", 0)):
        gate_up = np.concatenate([stored[f"blk.0.ffn_gate_{kind}.weight"], stored[f"blk.0.ffn_up_{kind}.weight"]], -2)
        down = stored[f"blk.0.ffn_down_{kind}.weight"]
        assert np.array_equal(kquants.dequantize_torch(w13, "q2_k").numpy()[lead], gate_up)
        assert np.array_equal(kquants.dequantize_torch(w2, "q3_k").numpy()[lead], down)
