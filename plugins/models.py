"""Model shapes shared by the op plugins (kda.md, moe.md), with tensor-parallel slicing helpers."""

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
