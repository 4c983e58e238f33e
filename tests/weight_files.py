"""Tiny model files the weight tests write themselves: a Kimi-Linear-like sharded safetensors checkpoint (KDA block +
MoE per layer, one shard per layer, index and config.json), a DeepSeek-V3-like one (MoE only, mlp.* names) and a
DeepSeek-style GGUF (llama.cpp's blk.N.* names, Q2_K/Q3_K experts from the project's own quantizer).

Weights are scaled like the op factories' (unit-variance pre-activations), so every op passes its tolerance.
`corrupt=` variants write the broken files of the error tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

KDA = {"H": 2, "K": 16, "D": 64, "r": 16}  # heads, head_dim (K = V), hidden, gate rank
MOE = {"E": 8, "I": 64, "topk": 2, "rsf": 2.5}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, gen, std=1.0, mean=0.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std + mean).to(dtype)


def kda_tensors(layer: int, gen, H=KDA["H"], K=KDA["K"], D=KDA["D"], r=KDA["r"], corrupt: str | None = None) -> dict:
    """model.layers.N.self_attn.* of a Kimi-Linear KDA block (HF layout: q/k/v_conv1d [C, 1, 4], A_log [1, 1, H, 1])."""
    V = K

    def lin(o, i):
        return _randn((o, i), gen, std=i ** -0.5)

    dt = torch.exp(torch.rand(H * K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    t = {
        "q_proj.weight": lin(H * K, D), "k_proj.weight": lin(H * K, D), "v_proj.weight": lin(H * V, D),
        "q_conv1d.weight": (torch.rand(H * K, 1, 4, generator=gen) - 0.5).to(torch.bfloat16),
        "k_conv1d.weight": (torch.rand(H * K, 1, 4, generator=gen) - 0.5).to(torch.bfloat16),
        "v_conv1d.weight": (torch.rand(H * V, 1, 4, generator=gen) - 0.5).to(torch.bfloat16),
        "f_a_proj.weight": lin(r, D), "f_b_proj.weight": lin(H * K, r),
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).float(),
        "A_log": (torch.rand(H, generator=gen) * 15 + 1).log().float().view(1, 1, H, 1),
        "b_proj.weight": lin(H, D), "g_a_proj.weight": lin(V, D), "g_b_proj.weight": lin(H * V, V),
        "o_norm.weight": _randn((V,), gen, std=0.1, mean=1.0), "o_proj.weight": lin(D, H * V),
    }
    if corrupt == "swap":
        t["dt_bias"], t["A_log"] = t["A_log"].reshape(H).contiguous(), t["dt_bias"].contiguous()
    elif corrupt == "dtype":
        t["A_log"] = t["A_log"].to(torch.bfloat16)
    elif corrupt == "missing":
        del t["o_norm.weight"]
    return {f"model.layers.{layer}.self_attn.{k}": v for k, v in t.items()}


def moe_tensors(prefix: str, gen, names: dict, D: int, E=MOE["E"], I=MOE["I"], x_std=1.0) -> dict:
    """Router, correction bias, E routed experts (one tensor each) and a shared expert under HF names."""
    t = {f"{prefix}{names['gate']}": _randn((E, D), gen, std=1 / (x_std * math.sqrt(D))),
         f"{prefix}{names['bias']}": _randn((E,), gen, std=0.02, dtype=torch.float32)}
    for e in range(E):
        for role, shape, std in (("w1", (I, D), 1 / (x_std * math.sqrt(D))), ("w3", (I, D), 1 / (x_std * math.sqrt(D))),
                                 ("w2", (D, I), 0.25 / math.sqrt(I))):
            t[prefix + names[role].format(e=e)] = _randn(shape, gen, std=std)
    for role, shape, std in (("sw1", (I, D), 1 / math.sqrt(D)), ("sw3", (I, D), 1 / math.sqrt(D)),
                             ("sw2", (D, I), 0.25 / math.sqrt(I))):
        t[prefix + names[role]] = _randn(shape, gen, std=std)
    t[prefix + "post_attention_layernorm.weight"] = _randn((D,), gen, std=0.05, mean=1.0)
    return t


KIMI_NAMES = {"gate": "block_sparse_moe.gate.weight", "bias": "block_sparse_moe.gate.e_score_correction_bias",
              "w1": "block_sparse_moe.experts.{e}.w1.weight", "w3": "block_sparse_moe.experts.{e}.w3.weight",
              "w2": "block_sparse_moe.experts.{e}.w2.weight",
              "sw1": "block_sparse_moe.shared_experts.gate_proj.weight",
              "sw3": "block_sparse_moe.shared_experts.up_proj.weight",
              "sw2": "block_sparse_moe.shared_experts.down_proj.weight"}
DEEPSEEK_NAMES = {"gate": "mlp.gate.weight", "bias": "mlp.gate.e_score_correction_bias",
                  "w1": "mlp.experts.{e}.gate_proj.weight", "w3": "mlp.experts.{e}.up_proj.weight",
                  "w2": "mlp.experts.{e}.down_proj.weight", "sw1": "mlp.shared_experts.gate_proj.weight",
                  "sw3": "mlp.shared_experts.up_proj.weight", "sw2": "mlp.shared_experts.down_proj.weight"}


def kimi_checkpoint(root: Path, layers: int = 2, corrupt: str | None = None, corrupt_layer: int = 1,
                    config: bool = True, config_patch: dict | None = None, edit=None) -> Path:
    """root/ with model-0000{n+1}-of-0000{layers}.safetensors (layer n in shard n), model.safetensors.index.json and
    config.json (updated with `config_patch`). `edit(tensors)` may change each layer's tensors before they are
    written. Returns the index path."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for n in range(layers):
        gen = _gen(100 + n)
        tensors = {**kda_tensors(n, gen, corrupt=corrupt if n == corrupt_layer else None),
                   **moe_tensors(f"model.layers.{n}.", gen, KIMI_NAMES, KDA["D"])}
        if edit is not None:
            edit(tensors)
        shard = f"model-{n + 1:05d}-of-{layers:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config:
        (root / "config.json").write_text(json.dumps({
            "model_type": "kimi_linear", "hidden_size": KDA["D"], "num_experts": MOE["E"],
            "num_experts_per_token": MOE["topk"], "num_expert_group": 1, "topk_group": 1,
            "routed_scaling_factor": MOE["rsf"], "moe_intermediate_size": MOE["I"], **(config_patch or {})}))
    return index


def deepseek_checkpoint(root: Path, layer: int = 3, D: int = 96, E: int = 8, groups: int = 2) -> Path:
    """A one-file DeepSeek-V3-like checkpoint of one MoE layer (mlp.* names), with config.json (group-limited)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    tensors = moe_tensors(f"model.layers.{layer}.", _gen(7), DEEPSEEK_NAMES, D, E=E)
    path = root / "model.safetensors"
    save_file(tensors, str(path))
    (root / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "n_routed_experts": E, "num_experts_per_tok": 3, "n_group": groups,
        "topk_group": 1, "routed_scaling_factor": 2.5}))
    return path


def gguf_file(path: Path, layers: int = 2, D: int = 256, I: int = 256, E: int = 4, topk: int = 2,
              meta: dict | None = None, types: dict | None = None) -> Path:
    """A DeepSeek-style GGUF (arch deepseek2) with `layers` MoE layers: f32 router, exp_probs_b, Q2_K gate/up and Q3_K
    down experts (stacked) and shared expert, all quantized by plugins/quant/kquants.quantize. `meta` adds or
    replaces deepseek2.* keys (value types as given, None: left out); `types` stores named expert tensors (e.g.
    ffn_down_exps) in another GGML type, as random bytes of its size (valid blocks for q6_k: q6_k_blocks)."""
    import gguf
    from spark_bench.plugins.quant import kquants

    w = gguf.GGUFWriter(str(path), "deepseek2")
    keys = {"expert_count": E, "expert_used_count": topk, "expert_group_count": 1, "expert_group_used_count": 1,
            "expert_weights_scale": 2.5, **(meta or {})}
    for key, value in keys.items():
        if value is None:  # meta={key: None}: the file does not state it
            continue
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)]
        add(f"deepseek2.{key}", value)
    Q2, Q3 = gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K
    for n in range(layers):
        gen = _gen(200 + n)
        p = f"blk.{n}."
        w.add_tensor(p + "ffn_gate_inp.weight", (torch.randn(E, D, generator=gen) / math.sqrt(D)).numpy())
        w.add_tensor(p + "exp_probs_b.bias", (torch.randn(E, generator=gen) * 0.02).numpy())
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.05 * torch.randn(D, generator=gen)).numpy())
        for name, rows, cols, fmt, qtype, std, lead in (
                ("ffn_gate_exps", I, D, "q2_k", Q2, 1 / math.sqrt(D), (E,)),
                ("ffn_up_exps", I, D, "q2_k", Q2, 1 / math.sqrt(D), (E,)),
                ("ffn_down_exps", D, I, "q3_k", Q3, 0.25 / math.sqrt(I), (E,)),
                ("ffn_gate_shexp", I, D, "q2_k", Q2, 1 / math.sqrt(D), ()),
                ("ffn_up_shexp", I, D, "q2_k", Q2, 1 / math.sqrt(D), ()),
                ("ffn_down_shexp", D, I, "q3_k", Q3, 0.25 / math.sqrt(I), ())):
            blocks = kquants.quantize(torch.randn(*lead, rows, cols, generator=gen) * std, fmt)
            if name in (types or {}):
                qtype = gguf.GGMLQuantizationType[types[name].upper()]
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                blocks = torch.randint(0, 256, (*lead, rows, cols // block * size), generator=gen, dtype=torch.uint8)
                if qtype == gguf.GGMLQuantizationType.Q6_K:  # valid blocks: sane scales, not random fp16 bytes
                    blocks = q6_k_blocks(blocks, std)
            w.add_tensor(p + name + ".weight", blocks.numpy(), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q6_k_blocks(raw: torch.Tensor, std: float) -> torch.Tensor:
    """Random Q6_K blocks (ggml block_q6_K, 210 bytes: ql[128] | qh[64] | int8 scales[16] | fp16 d; w = d * scale_j *
    (q - 32), q a 6-bit code) from random bytes `raw` [..., n * 210]: the codes stay random, the 16 scales are set to
    +-(32..63) and d so that the weights have about `std` (gguf cannot quantize Q6_K; it dequantizes it)."""
    blocks = raw.reshape(-1, 210).clone()
    gen = torch.Generator().manual_seed(int(raw[..., :8].sum()))
    magnitude = torch.randint(32, 64, (blocks.shape[0], 16), generator=gen)
    sign = torch.randint(0, 2, (blocks.shape[0], 16), generator=gen) * 2 - 1
    blocks[:, 192:208] = (magnitude * sign).to(torch.int8).view(torch.uint8)
    d = torch.full((blocks.shape[0],), std / (48 * 18.5), dtype=torch.float16)  # |scale| ~48, |q - 32| ~18.5
    blocks[:, 208:210] = d.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(raw.shape)


def routing_npy(path: Path, ids) -> Path:
    np.save(path, np.asarray(ids, dtype=np.int64))
    return path
