"""The sweep side of a weight source: which selected ops a file's layer can feed, the axes it fixes, and the routing
axis values `model` and `file`.

Rules (docs/weights.md):
- With --weights, an op takes the layer only through its `from_weights` binding. Ops picked by a glob (or by default)
  that the layer cannot feed are left out; an op named exactly is an error.
- The axes the file fixes (heads, head dims, hidden, experts, inter, format, and topk/groups/scaling where the file
  states them) cannot be set: `--set heads=4` is an error naming the file's value. `--preset` is refused with --weights.
  Where the file does not state them, groups and topk_groups are 1 and routed_scaling_factor is the value routing=model
  uses (its family's default, weights/config.py); `--set` may change those.
- routing=file needs --routing FILE; routing=model needs --weights with an MoE layer. A routing file fixes topk and
  its ids must be below the experts of every point (the file's E with --weights).
"""

from __future__ import annotations

from typing import Any

from spark_bench.sweep import op_overrides, split_key
from spark_bench.weights import WeightError, source

GLOB_CHARS = set("*?[")
REPLAY_ROUTINGS = ("model", "file")
ROUTER_DEFAULTS = {"groups": 1, "topk_groups": 1}  # when the file does not say (no config.json / GGUF metadata)


def bind(ops: list, spec: Any, typed_overrides, notes: list[str] | None = None
         ) -> tuple[list, dict[str, dict[str, list[Any]]]]:
    """(the ops to sweep, {op name: {axis: [values]} to put over the user's overrides}). Raises WeightError. The
    ops a glob selected but the layer cannot feed are left out, each with its reason appended to `notes`."""
    routing_values = [v for key, vals in spec.overrides.items() if split_key(key)[1] == "routing" for v in vals]
    if spec.weights is None:
        for value in REPLAY_ROUTINGS:
            if value in routing_values:
                raise WeightError("routing=model needs --weights PATH (its router)" if value == "model" else
                                  "routing=file needs --routing FILE (the expert ids to replay)")
        return ops, {}
    src = source(spec.weights)
    if src.has_layer and spec.preset is not None:
        raise WeightError(f"--preset {spec.preset} and --weights both set the shapes; drop --preset")
    explicit = {p for p in spec.ops if not (set(p) & GLOB_CHARS)}
    kept, fixed, dropped, replaying = [], {}, [], False
    for op in ops:
        axes: dict[str, list[Any]] = {}
        if src.has_layer:
            why = _why_not(op, src)
            if why:
                _leave_out(op, why, explicit, dropped)
                continue
            for axis, value in op.from_weights.fixed(src.shapes(op.from_weights.family)).items():
                if axis not in op.axis_names:
                    continue
                if axis in op_overrides(spec.overrides, op.name):
                    raise WeightError(f"--set {axis}: the weight file fixes {op.name}'s {axis} to {value} "
                                      f"({src.where}); drop --set {axis}")
                axes[axis] = [value]
            _router_axes(op, src, spec, axes)
            hidden = src.shapes(op.from_weights.family)["hidden"]
            if src.activations is not None and src.activations.shape[1] != hidden:
                raise WeightError(f"activation file {src.spec['activations']}: rows of {src.activations.shape[1]}, "
                                  f"but {src.where} has hidden = {hidden}")
        replays = "routing" in op.axis_names and _routing(op, src, spec, axes, typed_overrides)
        why = _no_point(op, src, spec, typed_overrides, axes) if src.has_layer else None
        if why:
            _leave_out(op, why, explicit, dropped)
            continue
        kept.append(op)
        replaying = replaying or bool(replays)
        if axes:
            fixed[op.name] = axes
    if not kept:
        raise WeightError(f"no selected op can run on {src.where}: {'; '.join(dropped)}")
    if src.routing is not None and not replaying:  # else the fingerprint would name a trace no case replayed
        names = ", ".join(o.name for o in kept)
        raise WeightError(f"routing file {src.routing.path}: no selected op replays it ({names}); the ops with a "
                          "routing axis do, at routing=file")
    if dropped and notes is not None:
        notes.append(f"left out of the sweep, {src.where} cannot feed them: {'; '.join(dropped)}")
    return kept, fixed


def _leave_out(op, why: str, explicit: set[str], dropped: list[str]) -> None:
    """An op the layer cannot feed: an error when named exactly, else left out of the glob (with its reason)."""
    if op.name in explicit:
        raise WeightError(f"{op.name}: {why}")
    dropped.append(f"{op.name} ({why})")


def _no_point(op, src, spec, typed_overrides, axes) -> str | None:
    """Why a constraint rejects every point of `op` with the axes the file fixes (else the op would silently run
    no case), or None."""
    values = {**typed_overrides(op, spec.overrides), **axes}
    if op.points(values, quick=spec.quick):
        return None
    point = {a.name: a.sweep(spec.quick)[0] for a in op.axes} | {k: v[0] for k, v in values.items()}
    return f"no valid point on {src.where}: {op.invalid_reason(point)}"


def _why_not(op, src) -> str | None:
    binding = op.from_weights
    if binding is None:
        return "does not take its weights from a file"
    shapes = src.shapes(binding.family)
    if shapes is None:
        return f"{src.where} has no {'KDA block' if binding.family == 'kda' else 'MoE layer'}"
    fixed = binding.fixed(shapes)
    return fixed if isinstance(fixed, str) else None


def _router_axes(op, src, spec, axes) -> None:
    """topk must be known (from the file or --set); groups default to 1 and the routed scaling factor to the one
    routing=model uses (LayerSource.scaling) when the file does not state them."""
    if op.from_weights.family != "moe":
        return
    sets = op_overrides(spec.overrides, op.name)
    if "topk" in op.axis_names and "topk" not in axes and "topk" not in sets and \
            not (src.routing and "routing" in op.axis_names):
        raise WeightError(f"{src.where}: the file does not state the router's top-k (no config.json beside a "
                          f"safetensors checkpoint, no expert_used_count in a GGUF): give --set topk=K")
    for axis, value in {**ROUTER_DEFAULTS, "routed_scaling_factor": src.scaling[0]}.items():
        if axis in op.axis_names and axis not in axes and axis not in sets:
            axes[axis] = [value]


def _routing(op, src, spec, axes, typed_overrides) -> bool:
    """Check the op's routing values against the source and fix the axes a routing file fixes; True when the op
    replays the file (routing=file)."""
    sets = op_overrides(spec.overrides, op.name)
    values = list(sets.get("routing", [])) or (["file"] if src.routing else [])
    if "file" in values and src.routing is None:
        raise WeightError("routing=file needs --routing FILE (the expert ids to replay)")
    if "model" in values and (not src.has_layer or src.moe is None):
        raise WeightError("routing=model needs --weights PATH with an MoE layer (its router)")
    if "model" in values and src.router_mismatch:
        raise WeightError(f"routing=model: {src.router_mismatch}, so the file's routing cannot be replayed")
    if src.routing is not None and "routing" not in sets:
        axes["routing"] = ["file"]
    if "file" not in values:
        return False
    trace = src.routing
    if "topk" in axes and axes["topk"] != [trace.topk]:
        raise WeightError(f"routing file {trace.path}: {trace.topk} experts per token, but the model's top-k is "
                          f"{axes['topk'][0]}")
    if "topk" in sets and "topk" not in axes:
        raise WeightError(f"--set topk: the routing file fixes topk to {trace.topk} ({trace.path}); drop --set topk")
    axes["topk"] = [trace.topk]
    if "experts" in axes:
        trace.check_experts(axes["experts"][0], f" (the layer has {axes['experts'][0]} routed experts)")
        return True
    points = op.points({**typed_overrides(op, spec.overrides), **axes}, quick=spec.quick, preset=spec.preset)
    for experts in sorted({p["experts"] for p in points}):
        trace.check_experts(experts, f" ({op.name} at experts={experts}; --set experts=N with N > {trace.max_id})")
    return True


def fixed_point(op, weights: dict[str, Any], sets: dict[str, str]) -> dict[str, Any]:
    """One point's file-fixed axis values for `op` (spark-bench profile): the same rules as a sweep's."""
    from spark_bench.sweep import SweepSpec, _typed_overrides

    spec = SweepSpec(ops=[op.name], overrides={k: [v] for k, v in sets.items()}, quick=True, weights=weights)
    _, fixed = bind([op], spec, _typed_overrides)
    return {axis: values[0] for axis, values in fixed.get(op.name, {}).items()}
