"""Per-model-family tensor names of one layer, mapped to the roles the ops take (block_common.WEIGHT_NAMES, and the
MoE layer's gate_w / gate_bias / experts / shared expert / pre-MoE norm).

Each role lists its candidate names relative to the layer prefix, first match wins; `{e}` is the expert index of
per-expert tensors. The maps are small and explicit on purpose: a name not listed here is not guessed at.

Families:
  kimi-linear  Hugging Face Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B): model.layers.N.self_attn.* (KDA, the short
               conv as separate q_conv1d/k_conv1d/v_conv1d [C, 1, W]) and block_sparse_moe.* (also accepted: mlp.*)
  deepseek-v3  Hugging Face DeepSeek-V3 / Kimi-K2: model.layers.N.mlp.* (gate, e_score_correction_bias,
               experts.{e}.gate_proj/up_proj/down_proj, shared_experts.*)
  gguf         llama.cpp's GGUF names for DeepSeek-style MoE: blk.N.ffn_gate_inp (router), exp_probs_b (correction
               bias), ffn_{gate,up,down}_exps (stacked experts), ffn_{gate,up,down}_shexp, ffn_norm
"""

from __future__ import annotations

import dataclasses

KDA_ROLES = ("q_proj", "k_proj", "v_proj", "conv", "f_a", "f_b", "dt_bias", "a_log", "b_proj", "g_a", "g_b", "o_norm",
             "o_proj")
CONV_PARTS = ("q_conv", "k_conv", "v_conv")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    prefix: str  # the layer prefix, with {n}
    kda: dict[str, tuple[str, ...]]  # role -> candidates (the conv as its q/k/v parts)
    moe: dict[str, tuple[str, ...]]  # gate_w, gate_bias, w1, w3, w2 (per expert or stacked), shared_w1/w3/w2, norm
    stacked_experts: bool  # routed experts in one [E, ...] tensor (GGUF) or one tensor per expert (HF)
    config_keys: dict[str, tuple[str, ...]]  # topk, groups, topk_groups, routed_scaling_factor -> config keys
    router_keys: dict[str, tuple[str, ...]]  # scoring (function), renormalize -> config keys (weights/config.py)

    def layer_prefix(self, layer: int) -> str:
        return self.prefix.format(n=layer)


def _alt(*names: str) -> tuple[str, ...]:
    return tuple(names)


_KIMI_KDA = {
    "q_proj": _alt("self_attn.q_proj.weight"), "k_proj": _alt("self_attn.k_proj.weight"),
    "v_proj": _alt("self_attn.v_proj.weight"),
    "q_conv": _alt("self_attn.q_conv1d.weight"), "k_conv": _alt("self_attn.k_conv1d.weight"),
    "v_conv": _alt("self_attn.v_conv1d.weight"),
    "f_a": _alt("self_attn.f_a_proj.weight"), "f_b": _alt("self_attn.f_b_proj.weight"),
    "dt_bias": _alt("self_attn.dt_bias"), "a_log": _alt("self_attn.A_log"),
    "b_proj": _alt("self_attn.b_proj.weight"), "g_a": _alt("self_attn.g_a_proj.weight"),
    "g_b": _alt("self_attn.g_b_proj.weight"), "o_norm": _alt("self_attn.o_norm.weight"),
    "o_proj": _alt("self_attn.o_proj.weight"),
}


def _hf_moe(moe: str, w1: str, w3: str, w2: str, shared: str, bias: str) -> dict[str, tuple[str, ...]]:
    return {
        "gate_w": (f"{moe}.gate.weight",), "gate_bias": (f"{moe}.gate.{bias}",),
        "w1": (f"{moe}.experts.{{e}}.{w1}.weight",), "w3": (f"{moe}.experts.{{e}}.{w3}.weight",),
        "w2": (f"{moe}.experts.{{e}}.{w2}.weight",),
        "shared_w1": (f"{moe}.{shared}.gate_proj.weight",), "shared_w3": (f"{moe}.{shared}.up_proj.weight",),
        "shared_w2": (f"{moe}.{shared}.down_proj.weight",),
        "norm": ("post_attention_layernorm.weight",),
    }


def _merge(*maps: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for m in maps:
        for role, names in m.items():
            out[role] = tuple(dict.fromkeys(out.get(role, ()) + names))
    return out


FAMILIES = {
    "kimi-linear": Family(
        "kimi-linear", "model.layers.{n}.", _KIMI_KDA,
        _merge(_hf_moe("block_sparse_moe", "w1", "w3", "w2", "shared_experts", "e_score_correction_bias"),
               _hf_moe("mlp", "w1", "w3", "w2", "shared_experts", "e_score_correction_bias")),
        stacked_experts=False,
        config_keys={"topk": ("num_experts_per_token", "num_experts_per_tok"), "groups": ("num_expert_group",),
                     "topk_groups": ("topk_group",), "routed_scaling_factor": ("routed_scaling_factor",)},
        router_keys={"scoring": ("moe_router_activation_func",), "renormalize": ("moe_renormalize",)}),
    "deepseek-v3": Family(
        "deepseek-v3", "model.layers.{n}.", {},
        _hf_moe("mlp", "gate_proj", "up_proj", "down_proj", "shared_experts", "e_score_correction_bias"),
        stacked_experts=False,
        config_keys={"topk": ("num_experts_per_tok",), "groups": ("n_group",), "topk_groups": ("topk_group",),
                     "routed_scaling_factor": ("routed_scaling_factor",)},
        router_keys={"scoring": ("scoring_func",), "renormalize": ("norm_topk_prob",)}),
    "gguf": Family(
        "gguf", "blk.{n}.", {},
        {"gate_w": ("ffn_gate_inp.weight",), "gate_bias": ("exp_probs_b.bias", "exp_probs_b"),
         "w1": ("ffn_gate_exps.weight",), "w3": ("ffn_up_exps.weight",), "w2": ("ffn_down_exps.weight",),
         "shared_w1": ("ffn_gate_shexp.weight",), "shared_w3": ("ffn_up_shexp.weight",),
         "shared_w2": ("ffn_down_shexp.weight",), "norm": ("ffn_norm.weight",)},
        stacked_experts=True,
        # {arch}.<key> in the GGUF metadata
        config_keys={"topk": ("expert_used_count",), "groups": ("expert_group_count",),
                     "topk_groups": ("expert_group_used_count",), "routed_scaling_factor": ("expert_weights_scale",)},
        router_keys={"scoring": ("expert_gating_func",), "renormalize": ("expert_weights_norm",)}),
}


def detect_family(reader, layer: int) -> Family:
    """The family whose names the file's layer uses (GGUF files are always `gguf`)."""
    if reader.format == "gguf":
        return FAMILIES["gguf"]
    names = set(reader.names())
    prefix = f"model.layers.{layer}."
    if any(n.startswith(prefix + "self_attn.") and n.endswith(("A_log", "dt_bias", "q_conv1d.weight"))
           for n in names) or any(n.startswith(prefix + "block_sparse_moe.") for n in names):
        return FAMILIES["kimi-linear"]
    if any(n.startswith(prefix + "mlp.") for n in names):
        return FAMILIES["deepseek-v3"]
    return None  # the caller says what it looked for


def layers_in(reader) -> list[int]:
    """The layer indices the file holds tensors of (model.layers.N.* / blk.N.*)."""
    out = set()
    for name in reader.names():
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in ("layers", "blk") and parts[i + 1].isdigit():
                out.add(int(parts[i + 1]))
                break
    return sorted(out)
