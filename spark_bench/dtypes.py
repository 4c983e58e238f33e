"""Short dtype names used on the command line and in results (bf16, fp16, fp32, fp64) and their torch dtypes."""

from __future__ import annotations

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "torch.float64": "fp64",
}
DTYPES = ("bf16", "fp16", "fp32", "fp64")


def canonical_dtype(name: object) -> str:
    """'bfloat16', torch.bfloat16 or 'bf16' -> 'bf16'. Raises ValueError naming the valid choices."""
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return _ALIASES[key]


def torch_dtype(name: object):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[
        canonical_dtype(name)
    ]
