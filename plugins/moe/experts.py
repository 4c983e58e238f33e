"""`moe.experts`: the fused routed experts with bf16 weights (SwiGLU), fed a routing drawn from `routing`.

    y[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t,k]

Calling convention: backend(x=[T, D] bf16, topk_ids=[T, K] int32, topk_weights=[T, K] f32, w13=[E, 2I, D] bf16
(w1 rows then w3 rows), w2=[E, D, I] bf16) -> y [T, D] bf16. Inputs have std 0.1 (vLLM's test scale), weights give
unit-variance pre-activations (plugins/moe/common.py). topk_ids/topk_weights are redrawn between timed calls
(rotate), so decode batches read their experts from HBM rather than L2; `fixed` routing keeps them.
An id outside [0, E) (vLLM's -1 for an expert on another rank under expert parallelism) adds nothing: the reference
and our Triton kernels skip it (without reading out of bounds); the factories never draw one, and the torch and vLLM
backends do not promise it (torch's grouped_mm path raises on a negative id, its loop fallback indexes from the end).
Cost: 6 T K I D FLOPs; bytes n_e(T) I D (2 b13 + b2) + 4 T D + 8 T K with n_e(T) the experts hit.
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.models import KIMI_LINEAR
from spark_bench.plugins.moe.common import (
    EXPERT_AXES,
    TOKENS,
    add_triton_paths,
    draw_routing,
    expert_weights,
    experts_cost,
    experts_from_file,
    model_presets,
    moe_binding,
    moe_fixed,
    redraw_from_file,
    redraw_routing,
    routing_axis,
    routing_extra_info,
    silu_mul,
    topk_constraint,
)

from spark_bench import Axis, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

X_STD = 0.1
TOLERANCE = Tolerance(err_ratio=1e-2, max_abs=2e-2)  # NMSE <= 1e-4, max |diff| <= 2e-2 at input std 0.1


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, D, E, K, I = p["tokens"], p["hidden"], p["experts"], p["topk"], p["inter"]
    w13, w2 = expert_weights(E, D, I, gen, device=device, x_std=X_STD)
    ids, weights = draw_routing(p["routing"], T, E, K, gen, device)
    return {"x": randn((T, D), gen, dtype=dtype, device=device, std=X_STD), "topk_ids": ids,
            "topk_weights": weights, "w13": w13, "w2": w2}


def reference(x, topk_ids, topk_weights, w13, w2):
    """fp32, one expert at a time over the (token, slot) pairs routed to it."""
    I = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w13.shape[0]:  # not an expert: adds nothing (the contract above)
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w1, w3 = w13[e, :I].float(), w13[e, I:].float()
        h = silu_mul(xf[tok] @ w1.T, xf[tok] @ w3.T)
        y.index_add_(0, tok, topk_weights[tok, slot, None].float() * (h @ w2[e].float().T))
    return y


def grouped_mm_ok(x, w13, w2):
    """Why torch's grouped_mm cannot run these operands, or None (bf16, 16-byte aligned rows)."""
    if not hasattr(F, "grouped_mm"):
        return "torch has no grouped_mm (needs >= 2.9)"
    if not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16):
        return "grouped_mm takes bf16 only"
    if (x.shape[1] * 2) % 16 or (w2.shape[2] * 2) % 16:
        return "grouped_mm needs 16-byte aligned rows"
    return None


def torch_experts_impl(x, topk_ids, topk_weights, w13, w2):
    """Sort the (token, slot) pairs by expert, grouped_mm per expert segment (bf16), else a loop over the hit
    experts; the routed weight is applied in fp32 and the slots summed with index_add."""
    T, K = topk_ids.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)
    tok = order // K
    xs = x[tok]
    if xs.shape[0] == 0:  # grouped_mm raises on zero rows
        return torch.zeros_like(x)
    if grouped_mm_ok(x, w13, w2) is None:
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        gu = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        h = silu_mul(gu[:, :I].float(), gu[:, I:].float()).to(x.dtype)
        out = F.grouped_mm(h, w2.transpose(1, 2), offs=offs).float()
    else:
        out = torch.empty((xs.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        sorted_e = flat[order]
        for e in torch.unique(sorted_e).tolist():
            rows = (sorted_e == e).nonzero().flatten()
            gu = xs[rows] @ w13[e].T
            out[rows] = (silu_mul(gu[:, :I].float(), gu[:, I:].float()).to(x.dtype) @ w2[e].T).float()
    out *= topk_weights.flatten()[order, None]
    return torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device).index_add_(0, tok, out).to(x.dtype)


def cost(p, dtype):
    return experts_cost(p, bytes_w13=2.0, bytes_w2=2.0)


op = Op(
    name="moe.experts",
    doc=__doc__,
    from_weights=moe_binding(experts_from_file, moe_fixed(*EXPERT_AXES, fmt="bf16"), redraw_from_file,
                             uses=("scaling",)),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", TOKENS, quick=[1, 5, 33]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[136]),
        Axis("experts", [KIMI_LINEAR["experts"]], quick=[11]),
        Axis("topk", [KIMI_LINEAR["topk"]], quick=[3]),
        Axis("inter", [KIMI_LINEAR["inter"]], quick=[72]),
        routing_axis(quick=["uniform", "worst"]),
    ],
    presets=model_presets(EXPERT_AXES),
    tolerance={"bf16": TOLERANCE},
    extra_info=routing_extra_info,
    rotate=("topk_ids", "topk_weights"),
    redraw=redraw_routing,
    constraints=[topk_constraint],
)


def triton_experts(x, topk_ids, topk_weights, w13, w2, path="auto"):
    """Ours: kernels/moe/experts.py (GEMV decode path for small T*K, else align + two grouped GEMMs + sum)."""
    from spark_bench.kernels.moe.experts import fused_experts

    return fused_experts(x, topk_ids, topk_weights, w13, w2, path=path)


add_triton_paths(op, triton_experts, "Ours: kernels/moe/experts.py")


@op.backend("torch")
def torch_experts(x, topk_ids, topk_weights, w13, w2):
    """Eager torch: sort by expert + torch.nn.functional.grouped_mm (loop over hit experts without it)."""
    return torch_experts_impl(x, topk_ids, topk_weights, w13, w2)


add_torch_compile(op)


def _vllm_probe(device):
    return probes.package("vllm", "vllm")(device) or (
        "vLLM's fused_experts runs on CUDA only" if probes.needs_cuda(device) else None)


@op.backend("vllm", probe=_vllm_probe)
def vllm_experts(x, topk_ids, topk_weights, w13, w2):
    """vLLM's fused_experts (Triton, its default configs; w13 = [gate; up] as vLLM's silu_and_mul expects)."""
    from vllm.model_executor.layers.fused_moe import fused_experts

    return fused_experts(x, w13, w2, topk_weights, topk_ids, inplace=False)
