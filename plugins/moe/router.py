"""`moe.router`: DeepSeek-V3-style sigmoid router with a selection bias and group-limited top-k (moe.md).

    logits = x.float() @ gate_w.float().T;  scores = sigmoid(logits);  choice = scores + gate_bias
    groups > 1: keep the topk_groups groups with the best top-2 sums of `choice`, the rest -> -inf
                (topk_groups == groups keeps every group: plain top-k over the experts, a valid config)
    ids = topk(choice, K);  w = scores[ids] / sum * routed_scaling_factor

Calling convention: backend(x=[T, D] bf16, gate_w=[E, D] bf16, gate_bias=[E] f32 (device), gate_bias_host=[E] f32
(CPU copy), topk, groups, topk_groups, routed_scaling_factor) -> (topk_weights [T, K] f32, topk_ids [T, K] int32).
Id order within a token is unspecified: compare= matches ids as sets, accepting a swap only at a near-tie
(biased-score gap < 1e-6), then weights with rtol 1e-5 and sum(w) = routed_scaling_factor.
`host` is the engine's CPU path: logits on the device, copied to the host, selection there with the host bias,
ids and weights copied back (a sync each way).
"""

import torch
from spark_bench.plugins.moe.common import ROUTER_AXES, TOKENS, model_presets, moe_binding, moe_fixed, router_weights

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, host_copy, randn

NEAR_TIE = 1e-6
WEIGHT_RTOL = 1e-5


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    gate_w, gate_bias = router_weights(p["experts"], p["hidden"], gen, device=device)
    return {
        "x": randn((p["tokens"], p["hidden"]), gen, dtype=dtype, device=device),
        "gate_w": gate_w, "gate_bias": gate_bias, "gate_bias_host": host_copy(gate_bias),
        "topk": p["topk"], "groups": p["groups"], "topk_groups": p["topk_groups"],
        "routed_scaling_factor": p["routed_scaling_factor"],
    }


def select_experts(logits, gate_bias, topk, groups, topk_groups, routed_scaling_factor):
    """The vectorised selection (torch and host backends): logits [T, E] f32 -> (weights f32, ids int32)."""
    scores = logits.sigmoid()
    choice = scores + gate_bias
    if groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, groups, E // groups)
        kept = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
        keep = torch.zeros(T, groups, dtype=torch.bool, device=choice.device).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    ids = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * routed_scaling_factor
    return weights, ids.to(torch.int32)


def biased_choice(x, gate_w, gate_bias, groups, topk_groups):
    """fp64 (scores, choice with dropped groups at -inf, group scores [T, G], kept-group mask [T, G]), by sorting."""
    scores = torch.sigmoid(x.double() @ gate_w.double().T)
    choice = scores + gate_bias.double().to(scores.device)
    T, E = choice.shape
    per_group = choice.view(T, groups, E // groups)
    gscore = per_group.sort(dim=-1, descending=True).values[..., :2].sum(-1) if groups > 1 else per_group[..., 0]
    kept = torch.zeros(T, groups, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, gscore.argsort(dim=-1, descending=True)[:, :topk_groups], True)
    masked = torch.where(kept.repeat_interleave(E // groups, dim=1), choice, torch.full_like(choice, -torch.inf))
    return scores, masked, gscore, kept, choice


def reference(x, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor):
    """fp64 from the formula: sorted (not topk) selection; returns (weights f64, ids int64)."""
    scores, masked, *_ = biased_choice(x, gate_w, gate_bias, groups, topk_groups)
    ids = masked.argsort(dim=-1, descending=True, stable=True)[:, :topk]
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * routed_scaling_factor, ids


def near_tie_mask(x, gate_w, gate_bias, topk, groups, topk_groups, tol=NEAR_TIE):
    """bool [T]: tokens whose selection is within `tol` of a tie (K-th vs (K+1)-th biased score, or the last kept vs
    the first dropped group), where any correct fp32 router may pick another set than the fp64 reference."""
    _, masked, gscore, _, _ = biased_choice(x, gate_w, gate_bias, groups, topk_groups)
    top = masked.topk(min(topk + 1, masked.shape[1]), dim=-1).values
    near = (top[:, topk - 1] - top[:, topk] < tol) if top.shape[1] > topk else torch.zeros_like(top[:, 0], dtype=bool)
    if 1 < groups and topk_groups < groups:  # all groups kept: no group boundary to be near
        g = gscore.sort(dim=-1, descending=True).values
        near |= g[:, topk_groups - 1] - g[:, topk_groups] < tol
    return near.cpu()


def near_tie_swaps(ids, ref_ids, x, gate_w, gate_bias, groups, topk_groups, tol=NEAR_TIE):
    """Per token: 0 = same id set, 1 = a different set explained by near-ties (every expert chosen instead of a
    reference one is within `tol` of the reference's K-th biased score, and its group within `tol` of the last
    kept group's score), 2 = a real mismatch."""
    _, masked, gscore, kept, choice = biased_choice(x, gate_w, gate_bias, groups, topk_groups)
    ids, ref_ids = ids.long().cpu(), ref_ids.long().cpu()
    masked, gscore, kept, choice = masked.cpu(), gscore.cpu(), kept.cpu(), choice.cpu()
    status = torch.zeros(ids.shape[0], dtype=torch.int64)
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    E = choice.shape[1]
    for t in (~same).nonzero().flatten().tolist():
        kth = masked[t, ref_ids[t]].min()
        last_group = gscore[t][kept[t]].min()
        extra = set(ids[t].tolist()) - set(ref_ids[t].tolist())
        ok = len(set(ids[t].tolist())) == ids.shape[1] and all(
            0 <= e < E and choice[t, e] >= kth - tol and gscore[t, e // (E // groups)] >= last_group - tol
            for e in extra)
        status[t] = 1 if ok else 2
    return status


def compare(out, ref, inputs, dtype):
    (w, ids), (ref_w, ref_ids) = out, ref
    K, scale = inputs["topk"], inputs["routed_scaling_factor"]
    if tuple(ids.shape) != tuple(ref_ids.shape) or tuple(w.shape) != tuple(ref_w.shape):
        return {}, False, f"shapes {tuple(w.shape)}/{tuple(ids.shape)} != reference {tuple(ref_w.shape)}"
    w = w.double().cpu()
    if not torch.isfinite(w).all():
        return {"nonfinite": int((~torch.isfinite(w)).sum())}, False, "non-finite routing weights"
    status = near_tie_swaps(ids, ref_ids, inputs["x"], inputs["gate_w"], inputs["gate_bias"], inputs["groups"],
                            inputs["topk_groups"])
    same = status == 0
    order, ref_order = ids.long().cpu().argsort(-1), ref_ids.cpu().argsort(-1)
    w_sorted, ref_sorted = w.gather(1, order)[same], ref_w.cpu().gather(1, ref_order)[same]
    rel = ((w_sorted - ref_sorted).abs() / ref_sorted.abs()).max().item() if same.any() else 0.0
    diff = w_sorted - ref_sorted
    err_ratio = (diff.pow(2).mean().sqrt() / ref_sorted.pow(2).mean().sqrt()).item() if same.any() else 0.0
    sum_err = (w.sum(-1) - scale).abs().max().item()
    metrics = {"err_ratio": err_ratio, "max_abs": diff.abs().max().item() if same.any() else 0.0,
               "weight_max_rel": rel, "sum_err": sum_err, "tokens": int(ids.shape[0]),
               "near_tie_tokens": int((status == 1).sum()), "mismatched_tokens": int((status == 2).sum())}
    problems = []
    if metrics["mismatched_tokens"]:
        problems.append(f"{metrics['mismatched_tokens']} tokens select different experts (not near-ties)")
    if rel > WEIGHT_RTOL:
        problems.append(f"weights differ by {rel:.3g} relative > {WEIGHT_RTOL}")
    if sum_err > WEIGHT_RTOL * scale * K:
        problems.append(f"sum(w) off routed_scaling_factor by {sum_err:.3g}")
    return metrics, not problems, "; ".join(problems)


def cost(p, dtype):
    T, D, E, K = p["tokens"], p["hidden"], p["experts"], p["topk"]
    return Cost(flops=2 * T * E * D + 8 * T * E, bytes=2 * E * D + 2 * T * D + 4 * E + 8 * T * K, tokens=T)


def valid_groups(p):
    from spark_bench.kernels.moe.router import group_problem

    return group_problem(p["experts"], p["groups"], p["topk_groups"], p["topk"])


def from_file(p, src, gen, *, device, dtype, seed, factory):
    """--weights: the layer's router (gate_w, its correction bias) on activations as the layer sees them."""
    if not src.has_layer:
        return factory(p, device=device, dtype=dtype, seed=seed)
    from spark_bench.plugins.moe.common import layer_activations

    r = src.moe_part("router", device)
    return {"x": layer_activations(src, p["tokens"], gen, dtype, device), "gate_w": r["gate_w"],
            "gate_bias": r["gate_bias"], "gate_bias_host": host_copy(r["gate_bias"]), "topk": p["topk"],
            "groups": p["groups"], "topk_groups": p["topk_groups"], "routed_scaling_factor": p["routed_scaling_factor"]}


op = Op(
    name="moe.router",
    doc=__doc__,
    from_weights=moe_binding(from_file, moe_fixed(*ROUTER_AXES), uses=("scaling",)),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", TOKENS, quick=[1, 5, 33]),
        Axis("hidden", [2304, 7168], quick=[136]),
        Axis("experts", [256], quick=[16]),
        Axis("topk", [8], quick=[3]),
        Axis("groups", [1, 8], quick=[1, 4]),
        Axis("topk_groups", [1, 4], quick=[1, 2], doc="router groups kept per token"),
        Axis("routed_scaling_factor", [2.5], quick=[2.5], doc="scale of the renormalised routing weights"),
    ],
    presets=model_presets(ROUTER_AXES),
    constraints=[valid_groups],
    tolerance={"bf16": Tolerance(WEIGHT_RTOL)},
    compare=compare,
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_router(x, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor):
    """Ours: kernels/moe/router.py, one launch: whole-row programs with the selection in the epilogue at prefill,
    split-D fp32 logits whose last program per row block selects (atomic ticket) at decode."""
    from spark_bench.kernels.moe.router import route

    return route(x, gate_w, gate_bias, topk, groups, topk_groups, routed_scaling_factor)


@op.backend("torch")
def torch_router(x, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor):
    """Eager torch: fp32 GEMM, then topk-based selection on the device."""
    logits = x.float() @ gate_w.float().T
    return select_experts(logits, gate_bias, topk, groups, topk_groups, routed_scaling_factor)


add_torch_compile(op)


def _host_labels(device):
    return ["host=device: no transfer"] if device.startswith("cpu") else ["host-selection", "syncs"]


@op.backend("host", labels=_host_labels)
def host_router(x, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor):
    """The engine's CPU path: device logits -> host (sync) -> selection with the host bias -> ids/weights back."""
    logits = host_copy(x.float() @ gate_w.float().T)
    weights, ids = select_experts(logits, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor)
    return weights.to(x.device, non_blocking=False), ids.to(x.device, non_blocking=False)


def _vllm_probe(device):
    return probes.package("vllm", "vllm")(device) or (
        "vLLM's grouped_topk runs on CUDA only" if probes.needs_cuda(device) else None)


@op.backend("vllm", probe=_vllm_probe)
def vllm_router(x, gate_w, gate_bias, gate_bias_host, topk, groups, topk_groups, routed_scaling_factor):
    """vLLM's grouped_topk on our fp32 logits (sigmoid scoring, e_score_correction_bias)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import grouped_topk

    logits = x.float() @ gate_w.float().T
    weights, ids = grouped_topk(x, logits, topk, True, num_expert_group=groups, topk_group=topk_groups,
                                scoring_func="sigmoid", routed_scaling_factor=routed_scaling_factor,
                                e_score_correction_bias=gate_bias)
    return weights.float(), ids.to(torch.int32)
