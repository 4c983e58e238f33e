"""The router settings a weight file states (config.json beside a safetensors checkpoint, or the GGUF metadata),
type-checked and checked against the layer's router: each problem is one WeightError line naming the key.

What the ops implement (plugins/moe/router.py) is DeepSeek-V3's router: sigmoid scores, renormalised top-k weights.
A file that states another scoring function or no renormalisation is read, but its routing cannot be replayed
(`mismatch` says why; routing=model refuses it).

The routed scaling factor of a file that does not state one is the value its family's reference code takes when the
key is absent (`routed_scaling`), so that routing=model and the ops with a routed_scaling_factor axis use one value:
  deepseek-v3  2.5: transformers' DeepseekV3Config defaults routed_scaling_factor to 2.5 (DeepSeek-V3's own
               config.json states 2.5 too; its inference/model.py ModelArgs.route_scale defaults to 1.0, but that
               code reads its own configs, not an HF config.json)
  kimi-linear  1.0: Kimi-Linear's KimiLinearConfig (configuration_kimi.py) defaults routed_scaling_factor to 1.0
               (Kimi-Linear-48B-A3B's config.json states 2.446)
  gguf         unknown: llama.cpp's deepseek2 loader requires {arch}.expert_weights_scale and refuses a file without
               it, so there is no reference value; 1.0 (the renormalised weights unscaled) is used and said so
A case says which value it used and where it came from (spark_bench/weights/label.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spark_bench.weights.errors import WeightError

GGUF_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# family -> the routed scaling factor its reference code uses when the config does not state one (None: unknown)
SCALING_DEFAULTS: dict[str, float | None] = {"deepseek-v3": 2.5, "kimi-linear": 1.0, "gguf": None}
UNKNOWN_SCALING = 1.0  # used, and said so, when the family's default is unknown
DRAWN_SCALING = 2.5  # the MoE ops' own routed scaling factor (DeepSeek-V3's, GLM-4.5's): synthetic routing weights,
# and those drawn for a routing file without weights when there is no layer


@dataclasses.dataclass
class Stated:
    values: dict[str, Any]  # topk, groups, topk_groups, routed_scaling_factor: those the file states
    labels: dict[str, str]  # axis -> where it was read ("<dir>/config.json num_expert_group")
    mismatch: str | None  # why the file's router is not the ops' router, or None


def _metadata(reader) -> tuple[dict[str, Any], str]:
    meta = reader.metadata()
    if reader.format == "gguf":
        arch = meta.get("general.architecture", "")
        meta = {k[len(arch) + 1:]: v for k, v in meta.items() if arch and k.startswith(arch + ".")}
        return meta, f"{reader.path} metadata {arch}."
    if isinstance(meta.get("text_config"), dict):
        meta = {**meta["text_config"], **meta}
    return meta, f"{reader.root / 'config.json'} "


def _value(axis: str, value: Any, label: str) -> int | float:
    """A stated value as the axis takes it: a positive integer, or (the scaling factor) a positive finite number."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if axis == "routed_scaling_factor":
        if number and math.isfinite(value) and value > 0:
            return float(value)
        raise WeightError(f"{label} is {value!r}: expected a positive number (the routed scaling factor)")
    if number and math.isfinite(value) and value == int(value) and value >= 1:  # int(nan or inf) raises
        return int(value)
    raise WeightError(f"{label} is {value!r}: expected a positive integer ({axis})")


def _mismatch(meta: dict[str, Any], family, prefix: str) -> str | None:
    for key in family.router_keys.get("scoring", ()):
        if meta.get(key) is not None and meta[key] not in ("sigmoid", GGUF_SIGMOID):
            return f"{prefix}{key} is {meta[key]!r}, but the MoE ops' router scores with a sigmoid"
    for key in family.router_keys.get("renormalize", ()):
        if meta.get(key) is not None and meta[key] not in (True, 1):
            return f"{prefix}{key} is {meta[key]!r}, but the MoE ops' router renormalises its top-k weights"
    return None


def stated(reader, family) -> Stated:
    """The router settings the file states, type-checked."""
    meta, prefix = _metadata(reader)
    values, labels = {}, {}
    for axis, keys in family.config_keys.items():
        key = next((k for k in keys if meta.get(k) is not None), None)
        if key is not None:
            labels[axis] = prefix + key
            values[axis] = _value(axis, meta[key], labels[axis])
    return Stated(values, labels, _mismatch(meta, family, prefix))


def check_router(config: Stated, experts: int, where: str) -> None:
    """The stated groups and top-k fit the layer's `experts` routed experts."""
    v, label = config.values, config.labels
    groups, kept = v.get("groups", 1), v.get("topk_groups", 1)
    if experts % groups:
        raise WeightError(f"{where}: {label['groups']} is {groups}, which does not divide the layer's {experts} "
                          "routed experts")
    if kept > groups:
        raise WeightError(f"{where}: {label['topk_groups']} is {kept}, more than the {groups} expert groups")
    reachable = kept * (experts // groups)
    if v.get("topk", 0) > reachable:
        raise WeightError(f"{where}: {label['topk']} is {v['topk']}, more than the {reachable} routed experts the "
                          f"router can pick ({experts} experts, {kept} of {groups} groups kept)")


def routed_scaling(config: Stated, family) -> tuple[float, str]:
    """(the routed scaling factor the ops use for this file, where it comes from): the stated value ("<file> <key>"),
    else the family's default (module docstring), else UNKNOWN_SCALING with the word that the default is unknown."""
    if "routed_scaling_factor" in config.values:
        return config.values["routed_scaling_factor"], config.labels["routed_scaling_factor"]
    default = SCALING_DEFAULTS.get(family.name)
    if default is not None:
        return default, f"{family.name} default, not in the file"
    return UNKNOWN_SCALING, f"not in the file, {family.name} default unknown"
