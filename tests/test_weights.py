"""Weights from model files (issue 16): every KDA and MoE op runs on tiny Kimi-Linear-like and DeepSeek-like
safetensors checkpoints and a DeepSeek-style GGUF and matches its reference; only the requested layer is read; the
inputs are the file's tensors; routing replay from a file and through the layer's router."""

import json
import shutil

import numpy as np
import pytest
import torch
from weight_files import KDA, MOE, deepseek_checkpoint, gguf_file, kimi_checkpoint, routing_npy

from spark_bench.registry import registry
from spark_bench.sweep import SweepSpec, build_cases
from spark_bench.timing import TimingConfig
from spark_bench.weights import WeightError, make_spec, source, using
from spark_bench.worker import CaseRunner

ONE_CALL = TimingConfig(warmup_s=0.0, min_samples=1, max_samples=1, min_time_s=0.0, max_time_s=0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {"kimi": kimi_checkpoint(root / "kimi"), "gguf": gguf_file(root / "deepseek.gguf"),
            "deepseek": deepseek_checkpoint(root / "deepseek")}


def run_cases(weights, ops, backends, **sets):
    spec = SweepSpec(ops=ops, backends=backends, device="cpu", quick=True, weights=weights,
                     overrides={k: str(v).split(",") for k, v in sets.items()})
    cases = build_cases(registry(), spec)
    runner = CaseRunner(registry())
    return [(case, runner.run(case, ONE_CALL)) for case in cases]


def assert_all_ok(results):
    assert results
    bad = [(c.op, c.backend, c.params, r["status"], r["error"]) for c, r in results if r["status"] != "ok"]
    assert not bad, bad


KDA_OPS = ["kda.gate", "kda.short_conv", "kda.short_conv_decode", "kda.gated_rmsnorm", "kda.chunk_prefill",
           "kda.recurrent_decode", "kda.block_prefill", "kda.block_decode"]
MOE_OPS = ["moe.router", "moe.align", "moe.experts", "moe.shared_expert", "moe.layer"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_kda_op_on_a_kimi_checkpoint_matches_its_reference(files, backend):
    results = run_cases(make_spec(files["kimi"], 1, None), KDA_OPS, [backend])
    assert_all_ok(results)
    assert {c.op for c, _ in results} == set(KDA_OPS)
    for case, _ in results:  # the shapes come from the file: H = 2, K = V = 16, D = 64
        p = case.params
        assert p["heads"] == KDA["H"]
        assert {p[a] for a in ("head_dim", "head_dim_k", "head_dim_v") if a in p} == {KDA["K"]}
        assert p.get("hidden", KDA["D"]) == KDA["D"]


@pytest.mark.parametrize("name, layer, ops, backends, sets", [
    ("kimi", 0, MOE_OPS, ["torch", "triton"], {"tokens": "1,5"}),
    ("deepseek", None, ["moe.router", "moe.layer", "moe.experts"], ["torch", "triton"], {"tokens": "5"}),
    ("gguf", 1, ["moe.router", "moe.experts_gguf", "moe.shared_expert", "moe.layer"], ["torch", "triton"],
     {"tokens": "5"}),
])
def test_every_moe_op_on_safetensors_and_gguf_matches_its_reference(files, name, layer, ops, backends, sets):
    results = run_cases(make_spec(files[name], layer, None), ops, backends, **sets)
    assert_all_ok(results)
    assert {c.op for c, _ in results} == set(ops)
    fmt = "q2k_q3k" if name == "gguf" else "bf16"
    assert all(c.params.get("format", fmt) == fmt for c, _ in results)
    if name == "deepseek":  # config.json: top-3 of 8 experts in 2 groups (1 kept)
        router = next(c for c, _ in results if c.op == "moe.router")
        assert (router.params["topk"], router.params["groups"], router.params["topk_groups"]) == (3, 2, 1)


def test_inputs_are_the_files_tensors(files):
    from safetensors.torch import load_file

    shard = load_file(str(files["kimi"].parent / "model-00002-of-00002.safetensors"))
    pre = "model.layers.1.self_attn."
    reg = registry()
    with using(make_spec(files["kimi"], 1, None)):
        gate = reg.get("kda.gate").make_inputs({"tokens": 3, "heads": 2, "head_dim": 16}, dtype="fp32")
        block = reg.get("kda.block_prefill").make_inputs({"heads": 2, "head_dim": 16, "hidden": 64})
    assert torch.equal(gate["A_log"], shard[pre + "A_log"].flatten())  # HF's [1, 1, H, 1] flattened to [H]
    assert torch.equal(gate["dt_bias"], shard[pre + "dt_bias"])
    assert torch.equal(block["q_proj"], shard[pre + "q_proj.weight"])
    conv = torch.cat([shard[pre + f"{p}_conv1d.weight"][:, 0] for p in "qkv"])  # the q|k|v concatenation
    assert torch.equal(block["conv"], conv)
    assert torch.equal(block["o_norm"], shard[pre + "o_norm.weight"])
    # without an active source the factory's random weights come back
    assert not torch.equal(reg.get("kda.gate").make_inputs({"tokens": 3, "heads": 2, "head_dim": 16})["A_log"],
                           gate["A_log"])


def test_gguf_blocks_are_loaded_as_stored(files):
    from gguf import GGUFReader

    raw = {t.name: np.array(t.data) for t in GGUFReader(str(files["gguf"])).tensors}
    with using(make_spec(files["gguf"], 1, None)):
        inputs = registry().get("moe.experts_gguf").make_inputs({"tokens": 2, "hidden": 256, "experts": 4,
                                                                 "topk": 2, "inter": 256})
    w13 = np.concatenate([raw["blk.1.ffn_gate_exps.weight"], raw["blk.1.ffn_up_exps.weight"]], axis=1)
    assert inputs["w13_q"].dtype == torch.uint8 and np.array_equal(inputs["w13_q"].numpy(), w13)
    assert np.array_equal(inputs["w2_q"].numpy(), raw["blk.1.ffn_down_exps.weight"])  # Q3_K bytes, never requantized


class SafeOpenSpy:
    """Wraps safetensors.safe_open: which files are opened, which tensors read."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, path, *args, **kwargs):
        self.opened.append(path)
        handle, spy = self.real(path, *args, **kwargs), self

        class Handle:
            def __getattr__(self, name):
                return getattr(handle, name)

            def get_tensor(self, name):
                spy.read.append(name)
                return handle.get_tensor(name)

        return Handle()


def test_only_the_requested_layer_of_a_sharded_checkpoint_is_read(files, tmp_path, monkeypatch):
    import safetensors

    ckpt = tmp_path / "kimi"
    shutil.copytree(files["kimi"].parent, ckpt)
    spy = SafeOpenSpy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    src = source(make_spec(ckpt / "model.safetensors.index.json", 1, None))
    fingerprint = src.describe()
    for part in ("router", "experts", "shared"):
        src.moe_part(part, "cpu")
    src.kda_weights(torch.bfloat16, "cpu")
    layer_shard = str(ckpt / "model-00002-of-00002.safetensors")
    assert set(spy.opened) == {layer_shard} and src.reader.files_opened == {layer_shard}
    assert spy.read and all(n.startswith("model.layers.1.") for n in spy.read)
    # the hash reads the layer once, the loads once more: twice the layer's bytes, and nothing of layer 0
    assert src.reader.bytes_read == 2 * fingerprint["layer_bytes"]
    assert fingerprint["layer_bytes"] < 0.6 * fingerprint["size_bytes"]
    # layer 0's shard can be garbage: layer 1 loads and hashes the same
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    again = source(make_spec(ckpt, 1, None))  # the directory: finds the index
    assert again.describe()["sha256"] == fingerprint["sha256"]


def test_only_the_requested_layer_of_a_gguf_is_read(files, tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "copy.gguf"
    shutil.copy(files["gguf"], path)
    src = source(make_spec(path, 0, None))
    digest = src.describe()
    for part in ("router", "experts", "shared"):
        src.moe_part(part, "cpu")
    assert all(n.startswith("blk.0.") for n in src.reader.tensors_read)
    layer0 = sum(t.n_bytes for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.0."))
    assert src.reader.bytes_read == 2 * layer0 and layer0 < 0.55 * path.stat().st_size
    # overwrite every byte of layer 1's tensors: layer 0's content hash does not change
    data = bytearray(path.read_bytes())
    for t in GGUFReader(str(files["gguf"])).tensors:
        if t.name.startswith("blk.1."):
            data[t.data_offset:t.data_offset + t.n_bytes] = b"\x55" * t.n_bytes
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    assert source(make_spec(other, 0, None)).describe()["sha256"] == digest["sha256"]
    assert source(make_spec(other, 1, None)).describe()["sha256"] != source(make_spec(path, 1, None)).describe()[
        "sha256"]


def test_routing_file_is_replayed(files, tmp_path):
    from spark_bench.plugins.moe.common import routing_load

    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(MOE["E"])[:MOE["topk"]] for _ in range(40)])
    trace = routing_npy(tmp_path / "ids.npy", ids)
    results = run_cases(make_spec(files["kimi"], 0, trace), ["moe.experts", "moe.align"], ["torch"], tokens="5,33")
    assert_all_ok(results)
    for case, record in results:
        assert case.params["routing"] == "file"  # --routing FILE makes `file` the routing value
        T = case.params["tokens"]
        assert record["extra"] == routing_load(torch.from_numpy(ids[:T]), MOE["E"])
    # weights in a .jsonl are replayed as given; without --weights the file fixes topk
    lines = [json.dumps({"ids": row.tolist(), "weights": [1.5, 1.0]}) for row in ids]
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    with using(make_spec(None, None, tmp_path / "ids.jsonl")):
        inputs = registry().get("moe.experts").make_inputs({"tokens": 7, "experts": 8, "topk": 2, "routing": "file"})
    assert torch.equal(inputs["topk_ids"], torch.from_numpy(ids[:7]).int())
    assert torch.equal(inputs["topk_weights"], torch.tensor([[1.5, 1.0]] * 7))
    results = run_cases(make_spec(None, None, tmp_path / "ids.jsonl"), ["moe.experts"], ["torch"], tokens="5",
                        experts="8")
    assert_all_ok(results)
    assert all(c.params["topk"] == 2 and c.params["routing"] == "file" for c, _ in results)


@pytest.mark.parametrize("bad, message", [
    ([[0, 9]], "token 0 has expert id 9, out of range for 8 experts"),
    ([[1, 2], [3, 3]], "token 1 names an expert twice"),
    ([[1, -1]], "token 0 has expert id -1, out of range"),
])
def test_bad_routing_files_are_rejected(files, tmp_path, bad, message):
    trace = routing_npy(tmp_path / "bad.npy", bad)
    with pytest.raises(WeightError, match=message):
        run_cases(make_spec(files["kimi"], 0, trace), ["moe.experts"], ["torch"], tokens="5")


def test_routing_model_gives_the_load_the_router_implies(files):
    from safetensors.torch import load_file
    from spark_bench.plugins.moe.common import routing_load

    shard = load_file(str(files["kimi"].parent / "model-00001-of-00002.safetensors"))
    gate_w = shard["model.layers.0.block_sparse_moe.gate.weight"].double()
    bias = shard["model.layers.0.block_sparse_moe.gate.e_score_correction_bias"].double()
    results = run_cases(make_spec(files["kimi"], 0, None), ["moe.experts"], ["torch"], tokens="33",
                        routing="model")
    assert_all_ok(results)
    (case, record), = results
    with using(case.weights):
        inputs = registry().get("moe.experts").make_inputs(case.params, seed=case.input_seed())
    choice = torch.sigmoid(inputs["x"].double() @ gate_w.T) + bias  # the router's biased selection, in fp64
    expected = choice.topk(MOE["topk"], dim=-1).indices
    assert torch.equal(inputs["topk_ids"].long().sort(-1).values, expected.sort(-1).values)
    assert record["extra"] == routing_load(expected, MOE["E"])
    scores = torch.sigmoid(inputs["x"].double() @ gate_w.T).gather(1, expected)
    w = scores / scores.sum(-1, keepdim=True) * MOE["rsf"]
    got = inputs["topk_weights"].double().gather(1, inputs["topk_ids"].long().argsort(-1))
    assert torch.allclose(got, w.gather(1, expected.argsort(-1)), rtol=1e-5)


def test_an_mla_layer_has_no_kda_block(tmp_path):
    from safetensors.torch import save_file
    from weight_files import KIMI_NAMES, moe_tensors

    gen = torch.Generator().manual_seed(3)
    tensors = {"model.layers.3.self_attn.q_proj.weight": torch.randn(64, 64).bfloat16(),  # MLA: q_proj, no KDA part
               "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.randn(32, 64).bfloat16(),
               **moe_tensors("model.layers.3.", gen, KIMI_NAMES, 64)}
    save_file(tensors, str(tmp_path / "mla.safetensors"))
    src = source(make_spec(tmp_path / "mla.safetensors", 3, None))
    assert src.kda is None and src.moe is not None and src.family.name == "kimi-linear"
    spec = SweepSpec(ops=["kda.*", "moe.router"], backends=["torch"], quick=True, weights=src.spec,
                     overrides={"topk": ["2"]})  # no config.json: the top-k is given
    notes = []
    assert {c.op for c in build_cases(registry(), spec, notes)} == {"moe.router"}  # the KDA ops left out of the glob
    [note] = notes  # and the user is told which and why
    assert "kda.gate (" in note and "has no KDA block" in note and "moe.router" not in note
    with pytest.raises(WeightError, match="kda.gate: .* layer 3 has no KDA block"):
        build_cases(registry(), SweepSpec(ops=["kda.gate"], quick=True, weights=src.spec))


def test_captured_activations_are_fed_as_x(files, tmp_path):
    rng = np.random.default_rng(1)
    acts = rng.standard_normal((50, KDA["D"])).astype(np.float32)
    np.save(tmp_path / "x.npy", acts)
    spec = make_spec(files["kimi"], 0, None, tmp_path / "x.npy")
    reg = registry()
    with using(spec):
        block = reg.get("kda.block_decode").make_inputs({"batch": 3, "heads": 2, "head_dim": 16, "hidden": 64},
                                                        seed=5)
        moe = reg.get("moe.router").make_inputs({"tokens": 7, "hidden": 64, "experts": 8, "topk": 2, "groups": 1,
                                                 "topk_groups": 1, "routed_scaling_factor": 2.5}, seed=5)
    for x in (block["x"], moe["x"]):  # consecutive rows of the file (wrapping), in the activation dtype
        match = [r for r in range(50) if torch.equal(x[0], torch.from_numpy(acts[r]).bfloat16())]
        assert len(match) == 1
        rows = (np.arange(x.shape[0]) + match[0]) % 50
        assert torch.equal(x, torch.from_numpy(acts[rows]).bfloat16())
    assert_all_ok(run_cases(spec, ["kda.block_prefill", "moe.layer"], ["torch"], tokens="5"))
    assert source(spec).describe()["activations"]["shape"] == [50, KDA["D"]]
    np.save(tmp_path / "wide.npy", np.zeros((4, 96), dtype=np.float32))
    with pytest.raises(WeightError, match="rows of 96, but .* has hidden = 64"):
        run_cases(make_spec(files["kimi"], 0, None, tmp_path / "wide.npy"), ["moe.router"], ["torch"])
    with pytest.raises(WeightError, match="--activations needs --weights"):
        make_spec(None, None, None, tmp_path / "x.npy")


def test_the_layer_hash_covers_the_router_settings_the_file_states(tmp_path):
    """Same tensors, another routed scaling factor in config.json: the ops route differently, so the fingerprint
    (and with it `compare` and `run --resume`) must tell the two apart."""
    from spark_bench.weights import describe

    a = describe(make_spec(kimi_checkpoint(tmp_path / "a"), 0, None))
    b = describe(make_spec(kimi_checkpoint(tmp_path / "b", config_patch={"routed_scaling_factor": 1.5}), 0, None))
    assert a["layer_bytes"] == b["layer_bytes"] and a["router"] != b["router"]
    assert b["router"]["routed_scaling_factor"] == 1.5 and a["sha256"] != b["sha256"]
