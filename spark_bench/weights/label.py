"""A case's weights label: one compact line saying what a case ran on when a weight source is active (the `weights`
field of its result record, shown on its console line), e.g.

    Kimi-Linear-48B-A3B-Instruct L3, routed scaling 2.446 (file)
    model-Q2_K_XL.gguf L5, shared expert Q6_K dequantized to bf16, routed scaling 1.0 (not in the file, gguf default
    unknown)
    routing trace.npy, routed scaling 2.5 (ops' default)

None when the case ran on synthetic weights and routing (an op the source does not feed). run.json's fingerprint
keeps the full description (paths, sizes, hashes); this is its per-case summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GENERIC_PREFIX = "model"  # model.safetensors, model-00001-of-00004.safetensors, model.safetensors.index.json


def short_name(path: str) -> str:
    """The file's name; for a checkpoint's generically named file (model*.safetensors, its index) the folder's."""
    p = Path(path)
    if p.is_dir():
        return p.name
    generic = p.name.startswith(GENERIC_PREFIX) and ".safetensors" in p.name
    return p.parent.name if generic and p.parent.name else p.name


def case_label(src, op, params: dict[str, Any]) -> str | None:
    """The label of a case of `op` at `params` run with the active source `src` (a LayerSource), or None."""
    binding = op.from_weights
    if binding is None:
        return None
    uses = binding.uses if binding.family == "moe" else ()
    routing = params.get("routing")
    parts = []
    if src.has_layer:
        parts.append(f"{short_name(src.spec['path'])} L{src.layer}")
        stored = (src.shapes("moe") or {}).get("shared_stored")
        if "shared" in uses and stored:
            parts.append(f"shared expert {stored.upper()} dequantized to bf16")
        if src.activations is not None:
            parts.append(f"x from {Path(src.spec['activations']).name}")
    if routing == "file" and src.routing is not None:
        parts.append(f"routing {src.routing.path.name}")
    scaling = _scaling(src, params, routing) if "scaling" in uses else None
    if scaling and parts:
        parts.append(scaling)
    return ", ".join(parts) or None


def _scaling(src, params: dict[str, Any], routing: str | None) -> str | None:
    """'routed scaling V (origin)' when the case's routing weights carry the factor of the source, else None."""
    if "routed_scaling_factor" in params:  # moe.router, moe.layer: the axis value (file, default or --set)
        if not src.has_layer:
            return None  # synthetic router: nothing of the source in it
        value = params["routed_scaling_factor"]
        return f"routed scaling {value:g} ({_origin(src) if value == src.scaling[0] else '--set'})"
    if routing == "file" and src.routing is not None and src.routing.weights is not None:
        return None  # the trace's own weights are replayed
    if not src.has_layer and routing != "file":
        return None
    return f"routed scaling {src.scaling[0]:g} ({_origin(src)})"


def _origin(src) -> str:
    """'file' for a stated factor, else where LayerSource.scaling came from (weights/config.py routed_scaling)."""
    return "file" if src.has_layer and "routed_scaling_factor" in src.router_stated else src.scaling[1]


def labels_of(cases, registry) -> dict[str, str]:
    """{case_id: label} of the cases that have a weight source and a label (skipped cases too: they say what they
    would have run on)."""
    from spark_bench.weights.layer import source

    out = {}
    for case in cases:
        if not case.weights:
            continue
        label = case_label(source(case.weights), registry.get(case.op), case.params)
        if label:
            out[case.case_id] = label
    return out
