"""`moe.layer`: one DeepSeek-V3-style MoE layer end to end: router -> routed experts -> shared expert -> add.

    w, ids = router(x);  out = experts(x, ids, w) + shared_expert(x)          (moe.md forward)

Calling convention: backend(x=[T, D] bf16, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups,
routed_scaling_factor (as moe.router), w13, w2 (routed, as moe.experts / moe.experts_gguf for `format`),
shared_w13=[1, 2I, D], shared_w2=[1, D, I] (in the shared expert's format: `format` at axis shared_format=routed,
or bf16: a file's shared expert stored in a type the ops do not take, dequantized at load, or `--set
shared_format=bf16`), shared_ids=[T, 1] zeros, shared_weights=[T, 1] ones, format, shared_format (the format
name)) -> out [T, D] bf16. Every backend declares `stages` for the per-stage breakdown: router, experts,
shared_expert, add; or, for triton with the shared expert stacked after the routed ones (make_inputs stacks them:
common.stack_shared), router (K routed slots + the shared one, in one launch) and experts (routed and shared in
one set of expert launches; the slots summed in fp32, so no add). Backends: triton (all ours), triton_host (the
engine's CPU-selection router, then ours; shared expert apart), torch, torch_compile. A token whose routing is a
near-tie (biased-score gap < 1e-5) may legitimately pick another expert than the fp64 reference: compare= leaves
those tokens out of the error (and counts them).
The --quick sweep is bf16 only (the interpreted GGUF layer takes minutes); on CPU try GGUF with
`--set format=q2k_q3k --set hidden=256 --set inter=256` (K-quant rows are multiples of 256).
"""

import torch
from spark_bench.plugins.models import KIMI_LINEAR
from spark_bench.plugins.moe import common, router, shared_expert

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.check import tensor_metrics
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, host_copy, randn

TOLERANCE = Tolerance(err_ratio=1e-2, max_abs=2e-2)
TIE_TOL = 1e-5  # wider than the router's 1e-6: fp32 logits over D = 7168 can move a score by ~1e-6
ROUTER_KEYS = ("x", "gate_w", "gate_bias", "gate_bias_host", "topk", "groups", "topk_groups", "routed_scaling_factor")


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, D, E, I, fmt = p["tokens"], p["hidden"], p["experts"], p["inter"], p["format"]
    gate_w, gate_bias = common.router_weights(E, D, gen, device=device, x_std=common.X_STD)
    w13, w2 = common.format_weights(fmt, E, D, I, gen, device=device)
    shared_w13, shared_w2 = common.format_weights(shared_format(p), 1, D, I, gen, device=device)
    if shared_format(p) == fmt:  # one [E + 1] tensor: triton runs the shared expert in the routed launches
        (w13, shared_w13), (w2, shared_w2) = common.stack_shared(w13, shared_w13), common.stack_shared(w2, shared_w2)
    shared_ids, shared_weights = shared_expert.single_expert_routing(T, device)
    return {
        "x": randn((T, D), gen, dtype=dtype, device=device, std=common.X_STD),
        "gate_w": gate_w, "gate_bias": gate_bias, "gate_bias_host": host_copy(gate_bias),
        "topk": p["topk"], "groups": p["groups"], "topk_groups": p["topk_groups"],
        "routed_scaling_factor": p["routed_scaling_factor"],
        "w13": w13, "w2": w2, "shared_w13": shared_w13, "shared_w2": shared_w2,
        "shared_ids": shared_ids, "shared_weights": shared_weights, "format": fmt, "shared_format": shared_format(p),
    }


def _shared(kind, inputs):
    x, fmt = inputs["x"], inputs["shared_format"]
    if kind == "torch":
        return shared_expert.torch_shared(x, inputs["shared_w13"], inputs["shared_w2"], fmt)
    return common.experts_impl(kind, fmt)(x, inputs["shared_ids"], inputs["shared_weights"], inputs["shared_w13"],
                                   inputs["shared_w2"])


ROUTERS = {"triton": router.triton_router, "host": router.host_router, "torch": router.torch_router,
           "reference": router.reference}
PIPELINES = {  # backend -> (router, routed experts, shared expert)
    "triton": ("triton", "triton", "triton"),
    "triton_host": ("host", "triton", "triton"),
    "torch": ("torch", "torch", "torch"),
    "reference": ("reference", "reference", "reference"),
}


def fused_shared(pipeline, inputs):
    """(w13, w2) with the shared expert as expert E when the triton pipeline can run it in the routed launches."""
    if pipeline != "triton":
        return None
    w13, w2 = common.stacked(inputs["w13"], inputs["shared_w13"]), common.stacked(inputs["w2"], inputs["shared_w2"])
    return None if w13 is None or w2 is None else (w13, w2)


def _parts(pipeline, inputs):
    """The three stage callables of a pipeline: route(), experts(weights, ids), shared(); shared is None when the
    routed stage runs the shared expert too (route() then returns its slot as well)."""
    fused = fused_shared(pipeline, inputs)
    if fused is not None:
        from spark_bench.kernels.moe.router import route as kernel_route

        args = {k: inputs[k] for k in ROUTER_KEYS if k != "gate_bias_host"}
        experts_fn = common.experts_impl("triton", inputs["format"])
        return (lambda: kernel_route(**args, shared_id=inputs["w13"].shape[0]),
                lambda weights, ids: experts_fn(inputs["x"], ids, weights, *fused), None)
    r, e, s = PIPELINES[pipeline]
    route_fn, experts_fn = ROUTERS[r], common.experts_impl(e, inputs["format"])
    x, w13, w2 = inputs["x"], inputs["w13"], inputs["w2"]
    return (lambda: route_fn(**{k: inputs[k] for k in ROUTER_KEYS}),
            lambda weights, ids: experts_fn(x, ids, weights.float(), w13, w2),
            lambda: _shared(s, inputs))


def forward(pipeline, inputs):
    route, experts, shared = _parts(pipeline, inputs)
    weights, ids = route()
    return experts(weights, ids) if shared is None else experts(weights, ids) + shared()


def stages_of(pipeline):
    def stages(inputs):
        route, experts, shared = _parts(pipeline, inputs)
        weights, ids = route()
        if shared is None:
            return [("router", route), ("experts", lambda: experts(weights, ids))]
        y, z = experts(weights, ids), shared()
        return [("router", route), ("experts", lambda: experts(weights, ids)), ("shared_expert", shared),
                ("add", lambda: y + z)]

    return stages


def reference(**inputs):
    """fp64 router, fp32 routed and shared experts (GGUF weights through the formula dequantizer), fp32 sum."""
    return forward("reference", inputs)


def compare(out, ref, inputs, dtype):
    near = router.near_tie_mask(inputs["x"], inputs["gate_w"], inputs["gate_bias"], inputs["topk"],
                                inputs["groups"], inputs["topk_groups"], tol=TIE_TOL)
    if tuple(out.shape) != tuple(ref.shape):
        return {}, False, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    metrics = tensor_metrics(out.cpu()[~near], ref.cpu()[~near])
    metrics["near_tie_tokens"] = int(near.sum())
    if "error" in metrics:
        return metrics, False, metrics["error"]
    problems = []
    if metrics["err_ratio"] > TOLERANCE.err_ratio:
        problems.append(f"error ratio {metrics['err_ratio']:.3g} > {TOLERANCE.err_ratio:.3g}")
    if metrics["max_abs"] > TOLERANCE.max_abs:
        problems.append(f"max |diff| {metrics['max_abs']:.3g} > {TOLERANCE.max_abs:.3g}")
    if not torch.isfinite(out[near]).all():
        problems.append("non-finite outputs at near-tie tokens")
    return metrics, not problems, "; ".join(problems)


def cost(p, dtype):
    T, D, E, K, I = p["tokens"], p["hidden"], p["experts"], p["topk"], p["inter"]
    b13, b2 = common.format_bytes(p["format"])
    s13, s2 = common.format_bytes(shared_format(p))
    weights = 2 * E * D + 4 * E + I * D * (common.experts_hit_uniform(T, E, K) * (2 * b13 + b2) + 2 * s13 + s2)
    flops = 2 * T * E * D + 8 * T * E + 6 * T * (K + 1) * I * D + T * D
    return Cost(flops=flops, bytes=weights + 4 * T * D, tokens=T)


def extra_info(inputs, p):
    _, ids = router.torch_router(**{k: inputs[k] for k in ROUTER_KEYS})
    return common.routing_load(ids, p["experts"])


def shared_format(p):
    """The shared expert's weight format at point `p`: the routed experts' (`format`) at shared_format=routed."""
    return p["format"] if p["shared_format"] == "routed" else p["shared_format"]


def fixed(shapes):
    """The file's axes (common.moe_fixed), with shared_format=bf16 when its shared expert is bf16 (or dequantized
    to bf16 at load) and its routed experts are not."""
    out = common.moe_fixed(*common.ROUTER_AXES, "inter", "format", need_shared=True)(shapes)
    if isinstance(out, dict):
        out["shared_format"] = "routed" if shapes["shared_format"] == shapes["format"] else shapes["shared_format"]
    return out


def from_file(p, src, gen, *, device, dtype, seed, factory):
    """--weights: the whole layer from the file (router, routed and shared experts) on activations as it sees them;
    a shared expert in a type the ops do not take comes dequantized to bf16 (the case's weights label says so)."""
    if not src.has_layer:
        return factory(p, device=device, dtype=dtype, seed=seed)
    r, experts, shared = (src.moe_part(part, device) for part in ("router", "experts", "shared"))
    shared_ids, shared_weights = shared_expert.single_expert_routing(p["tokens"], device)
    return {
        "x": common.layer_activations(src, p["tokens"], gen, dtype, device),
        "gate_w": r["gate_w"], "gate_bias": r["gate_bias"], "gate_bias_host": host_copy(r["gate_bias"]),
        "topk": p["topk"], "groups": p["groups"], "topk_groups": p["topk_groups"],
        "routed_scaling_factor": p["routed_scaling_factor"],
        "w13": experts["w13"], "w2": experts["w2"], "shared_w13": shared["w13"], "shared_w2": shared["w2"],
        "shared_ids": shared_ids, "shared_weights": shared_weights, "format": p["format"],
        "shared_format": shared_format(p),
    }


op = Op(
    name="moe.layer",
    doc=__doc__,
    from_weights=common.moe_binding(from_file, fixed, uses=("shared", "scaling")),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", common.TOKENS, quick=[1, 5, 33]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[136]),
        Axis("experts", [KIMI_LINEAR["experts"]], quick=[16]),
        Axis("topk", [KIMI_LINEAR["topk"]], quick=[3]),
        Axis("inter", [KIMI_LINEAR["inter"]], quick=[72]),
        Axis("groups", [1], quick=[4]),
        Axis("topk_groups", [1], quick=[2], doc="router groups kept per token"),
        Axis("routed_scaling_factor", [KIMI_LINEAR["routed_scaling_factor"]], quick=[2.5],
             doc="scale of the renormalised routing weights"),
        Axis("format", list(common.FORMATS), quick=["bf16"]),
        Axis("shared_format", ["routed"], also=["bf16"],
             doc="the shared expert's format: routed (as `format`) or bf16 (GGUF files often keep it wider)"),
    ],
    presets=common.model_presets((*common.ROUTER_AXES, "inter")),
    constraints=[router.valid_groups, common.format_constraint],
    tolerance={"bf16": TOLERANCE},
    compare=compare,
    extra_info=extra_info,
)


def _register(name, doc, **kwargs):
    def run(**inputs):
        return forward(name, inputs)

    run.__doc__ = doc
    op.backend(name, stages=stages_of(name), **kwargs)(run)


_register("triton", "Ours: the router with the shared expert's slot, then the routed kernels with the shared expert "
          "as expert E (separate launches and a torch add when the weights are not stacked).",
          probe=probes.triton_kernel, labels=probes.triton_labels)
_register("triton_host", "The engine's CPU path: device logits, host selection (syncs), then our expert kernels.",
          probe=probes.triton_kernel,
          labels=lambda d: probes.triton_labels(d) + router._host_labels(d))
_register("torch", "Eager torch: torch router, sort + grouped_mm experts, dense shared expert.")
add_torch_compile(op)
