"""Model shapes shared by the op plugins (kda.md, moe.md), with tensor-parallel slicing helpers."""

from collections.abc import Mapping, Sequence
from typing import Any

KIMI_LINEAR = {
    "name": "kimi-linear", "hidden": 2304, "heads": 32, "head_dim": 128, "conv_width": 4, "gate_rank": 128,
    "experts": 256, "topk": 8, "inter": 1024, "groups": 1, "topk_groups": 1, "routed_scaling_factor": 2.446,
}
DEEPSEEK_V3 = {
    "name": "deepseek-v3", "hidden": 7168, "experts": 256, "topk": 8, "inter": 2048, "groups": 8, "topk_groups": 4,
    "routed_scaling_factor": 2.5,
}
GLM_45 = {
    "name": "glm-4.5", "hidden": 5120, "experts": 160, "topk": 8, "inter": 1536, "groups": 1, "topk_groups": 1,
    "routed_scaling_factor": 2.5,
}
TP_DEGREES = (1, 2, 4, 8)


def tp_slices(total: int, degrees=TP_DEGREES) -> list[int]:
    """The per-GPU share of `total` (heads or expert width) at each tensor-parallel degree that divides it."""
    return [total // tp for tp in degrees if total % tp == 0]


LONG_CONTEXT_T = [32768, 65536, 131072]  # kda.md: prefill T runs to 131072 at B = 1; the default sweeps stop earlier
LONG_PREFILL = {"seq_len": LONG_CONTEXT_T, "batch": [1], "varlen": ["fixed"]}  # a prefill op's long-context axes
STRESS_HEADS = [64, 96]  # kda.md's stress points beyond Kimi-Linear's 32 heads per GPU


def kda_presets(dims: Sequence[str], long_context: Mapping[str, Sequence[Any]] | None = None,
                **fixed: Sequence[Any]) -> dict[str, dict[str, list[Any]]]:
    """A KDA op's named shape sets: `kimi-linear` (its heads per GPU at each TP degree, head dim 128 on each axis in
    `dims`, and the `fixed` axes, e.g. hidden), `stress-heads` (H = 64, 96 at those dims) and, for a prefill op,
    `long-context` (the axes in `long_context`, e.g. T = 32k-128k at B = 1, at TP1 and TP8)."""
    kimi = {"heads": tp_slices(KIMI_LINEAR["heads"]), **{d: [KIMI_LINEAR["head_dim"]] for d in dims},
            **{k: list(v) for k, v in fixed.items()}}
    out = {"kimi-linear": kimi, "stress-heads": {**kimi, "heads": list(STRESS_HEADS)}}
    if long_context:
        tp1_tp8 = [KIMI_LINEAR["heads"], KIMI_LINEAR["heads"] // 8]
        out["long-context"] = {**kimi, "heads": tp1_tp8, **{k: list(v) for k, v in long_context.items()}}
    return out
