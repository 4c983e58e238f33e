"""Helpers shared by the MoE ops: routing distributions, realised expert load, weight factories, n_e(T).

Routing distributions (the `routing` axis), each giving topk_ids [T, K] int32 (K distinct experts per token) and
topk_weights [T, K] f32 (positive, summing to the routed scaling factor):
  uniform  every token draws K experts uniformly (fresh per draw, so a rotated benchmark re-reads HBM)
  zipf     expert popularity ~ 1/rank^1.2 over a fixed ranking, K drawn without replacement (Gumbel top-k)
  worst    all tokens on the same K experts
  fixed    a uniform draw that does not depend on the seed: every rotated draw is identical (L2-warm case)

Weights: w13 [E, 2I, D] (gate rows then up rows) scaled so x @ w.T has unit variance for the given input std,
w2 [E, D, I] with std W2_GAIN/sqrt(I): routed outputs of std ~0.25 (max ~1.5), where bf16 spacing is <= 2^-7 and
the moe.md bound max |diff| <= 2e-2 means a few ulps (at std ~1 the rounding of y alone reaches it).
"""

from __future__ import annotations

import functools
import math

import torch

from spark_bench import Axis, Cost
from spark_bench.dtypes import torch_dtype
from spark_bench.inputs import generator, is_meta, randn, uniform
from spark_bench.weights.config import DRAWN_SCALING

ROUTINGS = ("uniform", "zipf", "worst", "fixed")
REPLAY_ROUTINGS = ("model", "file")  # with --weights (the layer's router) / --routing FILE (docs/weights.md)
FORMATS = ("bf16", "q2k_q3k")  # expert weight formats: bf16, or GGUF Q2_K w1|w3 with Q3_K w2
ZIPF_EXPONENT = 1.2
FIXED_SEED = 1234567
RANKING_SEED = 7654321
X_STD = 0.1  # activation std of the expert ops (vLLM's test scale, moe.md tolerances)
W2_GAIN = 0.25
DEFAULT_SCALING = DRAWN_SCALING  # routed scaling factor of drawn routing weights (DeepSeek-V3's and GLM-4.5's)


def draw_topk_ids(routing: str, T: int, E: int, K: int, gen: torch.Generator, device) -> torch.Tensor:
    """topk_ids [T, K] int32 under one routing distribution (see the module docstring)."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    if routing == "fixed":
        gen = generator(device, FIXED_SEED + 31 * T + 7 * E + K)
    if routing == "worst":
        chosen = torch.randperm(E, generator=gen, device=device)[:K]
        return chosen.to(torch.int32).expand(T, K).contiguous()
    keys = torch.rand((T, E), generator=gen, device=device)
    if routing == "zipf":
        ranking = torch.randperm(E, generator=generator("cpu", RANKING_SEED + E)).to(device)
        log_p = -ZIPF_EXPONENT * torch.log1p(ranking.float())
        keys = log_p - torch.log(-torch.log(keys.clamp_min(1e-20)))  # log p + Gumbel noise
    return keys.topk(K, dim=1).indices.to(torch.int32)


def draw_routing(routing: str, T: int, E: int, K: int, gen: torch.Generator, device,
                 scaling: float = DEFAULT_SCALING) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K] int32, topk_weights [T, K] f32): ids from `routing`, weights like a sigmoid router's
    (normalised scores in [0.05, 1) times `scaling`)."""
    ids = draw_topk_ids(routing, T, E, K, gen, device)
    if routing == "fixed":
        gen = generator(device, FIXED_SEED + 13 * T + E + 5 * K)
    scores = uniform((T, K), gen, 0.05, 1.0, device=device)
    return ids, scores / scores.sum(dim=1, keepdim=True) * scaling


def routing_load(topk_ids: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Realised per-expert load: max and mean tokens per expert (mean over all E), their ratio, experts hit."""
    counts = torch.bincount(topk_ids.flatten().long().cpu(), minlength=num_experts)
    mean = topk_ids.numel() / num_experts
    return {"load_max": int(counts.max()), "load_mean": mean, "load_imbalance": float(counts.max()) / mean,
            "experts_hit": int((counts > 0).sum())}


def experts_hit_uniform(T: int, E: int, K: int) -> float:
    """n_e(T) = E (1 - (1 - K/E)^T): expected experts hit by T tokens under uniform routing."""
    return E * (1.0 - (1.0 - K / E) ** T)


def experts_hit(routing: str, T: int, E: int, K: int) -> float:
    """n_e(T) under `routing`: exact for uniform and worst, realised on one CPU draw for zipf and fixed, and for the
    replayed routings (model, file) on the active weight source."""
    if routing in REPLAY_ROUTINGS:
        return replay_experts_hit(routing, T, E, K)
    return _experts_hit(routing, T, E, K)


def experts_cost(p: dict, bytes_w13: float, bytes_w2: float) -> Cost:
    """moe.md's fused routed experts: 6·T·K·I·D FLOPs; the weights of the n_e(T) experts hit, x in, y out (fp32-sized
    as moe.md counts them) and the ids + weights read (8 B per slot), whatever the weights' format."""
    T, D, E, K, I = p["tokens"], p["hidden"], p["experts"], p["topk"], p["inter"]
    n_e = experts_hit(p.get("routing", "uniform"), T, E, K)
    return Cost(flops=6 * T * K * I * D, bytes=n_e * I * D * (2 * bytes_w13 + bytes_w2) + 4 * T * D + 8 * T * K,
                tokens=T)


@functools.lru_cache(maxsize=256)
def _experts_hit(routing: str, T: int, E: int, K: int) -> float:
    if routing == "uniform":
        return experts_hit_uniform(T, E, K)
    if routing == "worst":
        return float(K)
    ids = draw_topk_ids(routing, T, E, K, generator("cpu", 0), "cpu")
    return float(torch.unique(ids).numel())


def _randn_chunked(shape, gen, std, dtype, device, chunk: int = 8) -> torch.Tensor:
    """randn of `shape` in `dtype`, drawn a few experts at a time to bound the fp32 temporary."""
    out = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
    if is_meta(device):
        return out
    for e0 in range(0, shape[0], chunk):
        part = out[e0:e0 + chunk]
        part.copy_(randn(part.shape, gen, device=device, std=std))
    return out


def w13_std(D: int, x_std: float = X_STD) -> float:
    return 1.0 / (x_std * math.sqrt(D))


def w2_std(I: int) -> float:
    return W2_GAIN / math.sqrt(I)


def expert_weights(E: int, D: int, I: int, gen: torch.Generator, *, device, dtype="bf16",
                   x_std: float = X_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, D], w2 [E, D, I]): gate and up pre-activations of unit variance for inputs of std `x_std`."""
    w13 = _randn_chunked((E, 2 * I, D), gen, w13_std(D, x_std), dtype, device)
    w2 = _randn_chunked((E, D, I), gen, w2_std(I), dtype, device)
    return w13, w2


def format_weights(fmt: str, E: int, D: int, I: int, gen: torch.Generator, *, device,
                   x_std: float = X_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights in `fmt`: bf16 (w13 [E, 2I, D], w2 [E, D, I]) or q2k_q3k (w13 Q2_K [E, 2I, D/256*84] and
    w2 Q3_K [E, D, I/256*110] uint8 blocks, same weight std)."""
    if fmt == "bf16":
        return expert_weights(E, D, I, gen, device=device, x_std=x_std)
    if fmt != "q2k_q3k":
        raise ValueError(f"unknown expert format {fmt!r}; choose from {', '.join(FORMATS)}")
    from spark_bench.plugins.quant import kquants

    return (kquants.random_blocks("q2_k", (E, 2 * I), D, gen, std=w13_std(D, x_std), device=device),
            kquants.random_blocks("q3_k", (E, D), I, gen, std=w2_std(I), device=device))


def stack_shared(routed: torch.Tensor, shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed [E, ...], shared [1, ...]) as adjacent views of one [E + 1, ...] tensor, the shared expert stacked as
    expert E (sglang's fused shared expert), so a backend can run both in one routed launch without a copy."""
    both = torch.cat([routed, shared])
    return both[:routed.shape[0]], both[routed.shape[0]:]


def stacked(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor | None:
    """The [E + 1, ...] tensor that `routed` and `shared` are adjacent views of (stack_shared), else None."""
    base = routed._base
    if base is None or shared._base is not base or base.shape[0] != routed.shape[0] + 1 or \
            not base.is_contiguous() or base.shape[1:] != routed.shape[1:] or base.shape[1:] != shared.shape[1:]:
        return None
    if routed.storage_offset() != base.storage_offset() or \
            shared.storage_offset() != base.storage_offset() + routed.numel():
        return None
    return base


def format_bytes(fmt: str) -> tuple[float, float]:
    """Bytes per weight (b13, b2) of w1/w3 and w2 in `fmt` (moe.md)."""
    return (2.0, 2.0) if fmt == "bf16" else (84 / 256, 110 / 256)


def topk_constraint(p) -> str | None:
    """A token is routed to topk distinct experts: no more than there are."""
    if p["topk"] > p["experts"]:
        return f"topk {p['topk']} > experts {p['experts']}: a token's experts are distinct"
    return None


def format_constraint(p) -> str | None:
    if p.get("format") == "q2k_q3k" and (p["hidden"] % 256 or p["inter"] % 256):
        return "GGUF K-quants need hidden and inter multiples of 256"
    return None


def experts_impl(kind: str, fmt: str):
    """The routed-experts function fn(x, topk_ids, topk_weights, w13, w2) of `kind` (triton, torch, reference) for
    weights in `fmt`: moe.experts for bf16, moe.experts_gguf for q2k_q3k."""
    if fmt == "bf16":
        from spark_bench.plugins.moe import experts as mod

        table = {"triton": mod.triton_experts, "torch": mod.torch_experts_impl, "reference": mod.reference}
    else:
        from spark_bench.plugins.moe import experts_gguf as mod

        table = {"triton": mod.triton_experts_gguf, "torch": mod.torch_experts_gguf,
                 "reference": mod.reference_experts_gguf}
    return table[kind]


def router_weights(E: int, D: int, gen: torch.Generator, *, device, x_std: float = 1.0,
                   bias_std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_w [E, D] bf16 giving unit-variance logits, gate_bias [E] f32 with a realistic std of 0.02)."""
    gate_w = randn((E, D), gen, dtype="bf16", device=device, std=1.0 / (x_std * math.sqrt(D)))
    return gate_w, randn((E,), gen, device=device, std=bias_std)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def redraw_routing(p, *, device, dtype, seed) -> dict[str, torch.Tensor]:
    """Just the routing of another timed input set (Op.redraw): the weights stay where they are."""
    ids, weights = draw_routing(p["routing"], p["tokens"], p["experts"], p["topk"], generator(device, seed), device)
    return {"topk_ids": ids, "topk_weights": weights}


def add_triton_paths(op, run_experts, doc: str) -> None:
    """`triton` (path auto: GEMV decode for small batches, else align + grouped GEMMs) plus `triton_decode` and
    `triton_grouped`, which force one path and run only when asked by name; run_experts(**inputs, path=...)."""
    from spark_bench import Backend, probes

    for name, path in (("triton", "auto"), ("triton_decode", "decode"), ("triton_grouped", "grouped")):
        op.add_backend(Backend(name, functools.partial(run_experts, path=path), probe=probes.triton_kernel,
                               labels=probes.triton_labels, default=path == "auto", doc=f"{doc}, path={path}"))


# --- sweeps shared by the MoE ops (moe.md: decode 1..256 including 5-8, prefill 512..16384) ---------------------------
TOKENS = [1, 2, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
ROUTER_AXES = ("hidden", "experts", "topk", "groups", "topk_groups", "routed_scaling_factor")
EXPERT_AXES = ("hidden", "experts", "topk", "inter")


def model_presets(axes, inter_multiple_of: int = 1) -> dict[str, dict[str, list]]:
    """{model name: {axis: [value]}} over `axes` for Kimi-Linear, DeepSeek-V3 and GLM-4.5; `inter` is sliced for each
    tensor-parallel degree, keeping the slices that are multiples of `inter_multiple_of` (256 for GGUF blocks)."""
    from spark_bench.plugins.models import DEEPSEEK_V3, GLM_45, KIMI_LINEAR, tp_slices

    def preset(m):
        out = {a: [m[a]] for a in axes if a != "inter"}
        if "inter" in axes:
            out["inter"] = [i for i in tp_slices(m["inter"]) if i % inter_multiple_of == 0]
        return out

    return {m["name"]: preset(m) for m in (KIMI_LINEAR, DEEPSEEK_V3, GLM_45)}


def routing_extra_info(inputs, p) -> dict:
    """Op.extra_info of ops fed routed ids: the realised per-expert load."""
    return routing_load(inputs["topk_ids"], p["experts"])


# --- from a model's weight file, and routing replay (spark_bench.weights, docs/weights.md) ----------------------
class RoutingAxis(Axis):
    """The routing axis: its sweep values are ROUTINGS; `--set routing=` also takes the replayed `model` (the weight
    file's router on the activations) and `file` (the ids of `--routing FILE`)."""

    def parse(self, text: str):
        return text if text in REPLAY_ROUTINGS else super().parse(text)


def routing_axis(quick) -> Axis:
    return RoutingAxis("routing", list(ROUTINGS), quick=quick,
                       doc="uniform, zipf, worst, fixed; model (--weights' router) and file (--routing FILE)")


def layer_activations(src, T: int, gen: torch.Generator, dtype, device) -> torch.Tensor:
    """x [T, D] as the layer's MoE sees it: rows of the captured activations (--activations, used as given), else
    Gaussian rows at unit RMS (the pre-MoE RMSNorm) times the norm weight when the file has it
    (post_attention_layernorm / ffn_norm)."""
    if src.activations is not None:
        return src.activation_rows(T, gen, dtype, device)
    router = src.moe_part("router", device)
    x = randn((T, router["gate_w"].shape[1]), gen, device=device)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    if router["norm"] is not None:
        x = x * router["norm"]
    return x.to(torch_dtype(dtype))


def router_config(src) -> dict:
    """groups and topk_groups the file states (1 where it does not) and the routed scaling factor of the source
    (LayerSource.scaling): the file's, else its family's default (spark_bench/weights/config.py; moe.router and
    moe.layer get the same value), else, without a layer (a routing file alone), DEFAULT_SCALING."""
    cfg = src.moe.config if src.moe is not None else {}
    return {"groups": cfg.get("groups", 1), "topk_groups": cfg.get("topk_groups", 1),
            "routed_scaling_factor": src.scaling[0]}


def model_routing(src, x: torch.Tensor, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32, topk_weights f32) of `x` through the layer's router (fp32 logits, its bias, its groups)."""
    from spark_bench.plugins.moe.router import select_experts

    router = src.moe_part("router", device)
    cfg = router_config(src)
    weights, ids = select_experts(x.float() @ router["gate_w"].float().T, router["gate_bias"], K, cfg["groups"],
                                  cfg["topk_groups"], cfg["routed_scaling_factor"])
    return ids, weights


def replay_routing(p, src, gen: torch.Generator, device, *, dtype="bf16", x=None, seed=None):
    """(topk_ids, topk_weights) for p["routing"]: model (x, or fresh layer activations, through the router), file
    (a window of the routing trace; rows from `seed`'s offset for rotated sets), else a draw of draw_routing."""
    T, E, K = p["tokens"], p["experts"], p["topk"]
    if p["routing"] == "model":
        x = x if x is not None else layer_activations(src, T, gen, dtype, device)
        return model_routing(src, x, K, device)
    if p["routing"] == "file":
        from spark_bench.weights.routing import torch_window

        trace = src.routing
        ids, weights = torch_window(trace, T, trace.offset_for(seed), device)
        if weights is None:
            scale = router_config(src)["routed_scaling_factor"]
            scores = uniform((T, K), gen, 0.05, 1.0, device=device)
            weights = scores / scores.sum(dim=1, keepdim=True) * scale
        return ids.to(torch.int32), weights.float()
    return draw_routing(p["routing"], T, E, K, gen, device, scaling=router_config(src)["routed_scaling_factor"])


def replay_experts_hit(routing: str, T: int, E: int, K: int) -> float:
    """Experts hit by T tokens under the active source's routing (a seed-0 draw for model)."""
    from spark_bench.weights import active

    src = active()
    if src is None:
        return experts_hit_uniform(T, E, K)
    ids, _ = replay_routing({"tokens": T, "experts": E, "topk": K, "routing": routing}, src, generator("cpu", 0),
                            "cpu")
    return float(torch.unique(ids).numel())


def moe_fixed(*axes, fmt: str | None = None, inter: str = "inter", need_shared: bool = False,
              shared_only: bool = False):
    """Op.from_weights.fixed of an MoE op: the file's values of `axes` (those it states), `inter` read from `inter`
    (shared_inter for the shared expert); fmt: the expert format the op takes; need_shared: the op runs the shared
    expert (refused when the layer has none, or one in a type the ops cannot take); shared_only: it runs nothing else
    (its `format` is the shared expert's)."""
    def fixed(shapes):
        if fmt is not None and shapes["format"] != fmt:
            other = "moe.experts_gguf" if shapes["format"] == "q2k_q3k" else "moe.experts"
            return f"takes {fmt} experts, the layer's are {shapes['format']} (use {other})"
        if need_shared and shapes["shared_inter"] is None:
            return "the layer has no shared expert"
        if need_shared and shapes.get("shared_problem"):
            return f"runs the shared expert, but {shapes['shared_problem']}"
        if shared_only:
            shapes = {**shapes, "format": shapes["shared_format"]}
        if need_shared and inter == "inter" and shapes["shared_inter"] != shapes["inter"]:
            return (f"has one inter axis, but the layer's routed experts are {shapes['inter']} wide and its shared "
                    f"expert {shapes['shared_inter']}")
        out = {}
        for axis in axes:
            value = shapes.get(inter if axis == "inter" else axis)
            if value is not None:
                out[axis] = value
        return out
    return fixed


def moe_binding(make_inputs, fixed, redraw=None, uses=()):
    """A FromWeights of an MoE op: make_inputs(p, src, gen, *, device, dtype, seed, factory) runs for any active
    source (a routing file alone too); `uses`: FromWeights.uses (what the case's weights label names)."""
    from spark_bench.weights import FromWeights

    def from_file(p, src, *, device, dtype, seed, factory):
        return make_inputs(p, src, generator(device, seed), device=device, dtype=dtype, seed=seed, factory=factory)

    def redraw_fn(p, src, *, device, dtype, seed, factory):
        return redraw(p, src, generator(device, seed), device=device, dtype=dtype, seed=seed, factory=factory)

    return FromWeights("moe", fixed, from_file, redraw_fn if redraw else None, uses=tuple(uses))


def experts_from_file(p, src, gen, *, device, dtype, seed, factory, names=("w13", "w2")):
    """moe.experts / moe.experts_gguf: the layer's routed experts (when the source has a layer), activations as the
    layer sees them, routing from p["routing"] (model: those activations through the router)."""
    if not src.has_layer and p["routing"] not in REPLAY_ROUTINGS:
        return factory(p, device=device, dtype=dtype, seed=seed)
    if not src.has_layer:
        inputs = factory({**p, "routing": "uniform"}, device=device, dtype=dtype, seed=seed)
        ids, weights = replay_routing(p, src, gen, device, dtype=dtype)
        return {**inputs, "topk_ids": ids, "topk_weights": weights}
    experts = src.moe_part("experts", device)
    x = layer_activations(src, p["tokens"], gen, dtype, device)
    ids, weights = replay_routing(p, src, gen, device, dtype=dtype, x=x)
    return {"x": x, "topk_ids": ids, "topk_weights": weights, names[0]: experts["w13"], names[1]: experts["w2"]}


def redraw_from_file(p, src, gen, *, device, dtype, seed, factory):
    """Op.redraw under a source: another routing of the same kind (model: of fresh activations; file: another
    window of the trace)."""
    if p["routing"] not in REPLAY_ROUTINGS and not src.has_layer:
        return redraw_routing(p, device=device, dtype=dtype, seed=seed)
    ids, weights = replay_routing(p, src, gen, device, dtype=dtype, seed=seed)  # a draw: at the layer's scaling
    return {"topk_ids": ids, "topk_weights": weights}
