"""`moe.experts_gguf`: fused routed experts (SwiGLU) with GGUF weights: w1|w3 in Q2_K, w2 in Q3_K.

    y[t] = sum_k w[t, k] * (silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T,   e = topk_ids[t, k]

Calling convention: backend(x=[T, D] bf16, topk_ids=[T, K] int32, topk_weights=[T, K] f32,
w13_q=[E, 2I, D/256*84] uint8 (Q2_K rows, gate rows then up rows), w2_q=[E, D, I/256*110] uint8 (Q3_K rows))
-> y [T, D] bf16. D and I must be multiples of 256. Block layouts: plugins/quant/kquants.py (moe.md).
The reference and every backend use the same weights (the blocks dequantize exactly), so the tolerance measures
the GEMM path only: ours keeps bf16 activations and weight tiles with fp32 accumulation.
Backends: triton (kernels/moe/experts_gguf.py: decode GEMVs on the blocks up to 8 tokens; beyond, the fused
dequant-in-register grouped path, or from a declared mean load per expert the hit experts dequantized once into bf16
scratch and the bf16 grouped GEMMs), triton_decode / triton_grouped / triton_dequant (one path forced, on request),
torch (dequantize the hit experts with the torch dequant, F.grouped_mm; at prefill that is a bf16 copy of every
expert), torch_compile.
Module-level functions (`triton_experts_gguf`, `torch_experts_gguf`, `reference_experts_gguf`) take the same
arguments, so moe.shared_expert / moe.layer run a GGUF shared expert as E=1, K=1 (ids 0, weights 1).
An id outside [0, E) adds nothing in the reference and our Triton kernels, as in moe.experts.
Cost: FLOPs 6*T*K*I*D; bytes n_e(T)*I*D*(2*84 + 110)/256 + 4*T*D + 8*T*K, n_e from the routing (moe.md; the
ids + weights as moe.experts counts them).
"""

import functools

import torch
import torch.nn.functional as F
from spark_bench.plugins.models import KIMI_LINEAR
from spark_bench.plugins.moe.common import (
    EXPERT_AXES,
    TOKENS,
    X_STD,
    add_triton_paths,
    draw_routing,
    experts_cost,
    experts_from_file,
    format_weights,
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
from spark_bench.plugins.quant import kquants

from spark_bench import Axis, Backend, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

W13_FORMAT, W2_FORMAT = "q2_k", "q3_k"
DEQUANT_CHUNK = 16  # torch backend: experts dequantized at a time


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, D, E, K, I = p["tokens"], p["hidden"], p["experts"], p["topk"], p["inter"]
    # random valid blocks with the bf16 experts' weight std (unit-variance gate/up pre-activations)
    w13_q, w2_q = format_weights("q2k_q3k", E, D, I, gen, device=device, x_std=X_STD)
    ids, weights = draw_routing(p["routing"], T, E, K, gen, device)
    return {"x": randn((T, D), gen, dtype=dtype, device=device, std=X_STD), "topk_ids": ids,
            "topk_weights": weights, "w13_q": w13_q, "w2_q": w2_q}


def reference_experts_gguf(x, topk_ids, topk_weights, w13_q, w2_q):
    """fp32, one hit expert at a time, on weights from the formula dequantizer (plugins/quant/kquants.py)."""
    T, D = x.shape
    I = w13_q.shape[1] // 2
    y = torch.zeros((T, D), dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w13_q.shape[0]:  # not an expert: adds nothing (moe.experts' contract)
            continue
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        w13 = kquants.dequantize_reference(w13_q[e], W13_FORMAT)
        w2 = kquants.dequantize_reference(w2_q[e], W2_FORMAT)
        xt = x[t].float()
        h = torch.nn.functional.silu(xt @ w13[:I].T) * (xt @ w13[I:].T)
        y.index_add_(0, t, topk_weights[t, k, None].float() * (h @ w2.T))
    return y


def cost(p, dtype):
    return experts_cost(p, kquants.bytes_per_weight(W13_FORMAT), kquants.bytes_per_weight(W2_FORMAT))


def _valid(p):
    if p["hidden"] % kquants.QK_K or p["inter"] % kquants.QK_K:
        return f"GGUF K-quants need hidden and inter multiples of {kquants.QK_K}"
    return topk_constraint(p)


op = Op(
    name="moe.experts_gguf",
    doc=__doc__,
    from_weights=moe_binding(functools.partial(experts_from_file, names=("w13_q", "w2_q")),
                             moe_fixed(*EXPERT_AXES, fmt="q2k_q3k"), redraw_from_file, uses=("scaling",)),
    make_inputs_fn=make_inputs,
    reference=reference_experts_gguf,
    cost=cost,
    axes=[
        Axis("tokens", TOKENS, quick=[1, 5, 33]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[256]),
        Axis("experts", [KIMI_LINEAR["experts"]], quick=[8]),
        Axis("topk", [KIMI_LINEAR["topk"]], quick=[2]),
        Axis("inter", [KIMI_LINEAR["inter"]], quick=[256]),
        routing_axis(quick=["uniform"]),
    ],
    presets=model_presets(EXPERT_AXES, inter_multiple_of=kquants.QK_K),
    constraints=[_valid],
    dtypes=["bf16"],
    # measured on CPU: ours <= 6.5e-3 (grouped path: bf16 h and per-slot outputs, truncated by the interpreter),
    # torch <= 5.5e-3. 1e-2 is NMSE 1e-4 (the bf16 experts' bound), inside moe.md's 5e-4 for GGUF paths.
    tolerance={"bf16": Tolerance(1e-2)},
    extra_info=routing_extra_info,
    rotate=("topk_ids", "topk_weights"),
    redraw=redraw_routing,
)


def triton_experts_gguf(x, topk_ids, topk_weights, w13_q, w2_q, path="auto"):
    """Ours: kernels/moe/experts_gguf.py (dequant inside the kernel)."""
    from spark_bench.kernels.moe.experts_gguf import experts_gguf

    return experts_gguf(x, topk_ids, topk_weights, w13_q, w2_q, path=path)


add_triton_paths(op, triton_experts_gguf, "Ours: kernels/moe/experts_gguf.py")
op.add_backend(Backend("triton_dequant", functools.partial(triton_experts_gguf, path="dequant"),
                       probe=probes.triton_kernel, labels=probes.triton_labels, default=False,
                       doc="Ours: kernels/moe/experts_gguf.py, path=dequant (bf16 scratch + bf16 grouped GEMMs)"))


def _dequantize_chunked(blocks, hit, fmt, dtype):
    """The bf16 weights of experts `hit`, dequantized DEQUANT_CHUNK experts at a time (bounds the fp32
    temporaries: a whole DeepSeek-V3 layer at prefill is 22.5 GB in bf16)."""
    _, rows, nbytes = blocks.shape
    out = torch.empty((hit.numel(), rows, nbytes // kquants.kquant(fmt).block_bytes * kquants.QK_K), dtype=dtype,
                      device=blocks.device)
    for c0 in range(0, hit.numel(), DEQUANT_CHUNK):
        out[c0:c0 + DEQUANT_CHUNK] = kquants.dequantize_torch(blocks[hit[c0:c0 + DEQUANT_CHUNK]], fmt, dtype)
    return out


@op.backend("torch")
def torch_experts_gguf(x, topk_ids, topk_weights, w13_q, w2_q):
    """Eager torch, static shapes (no host sync): pairs sorted by expert, the hit experts (list padded to
    min(E, T*K) with a repeat) dequantized by the torch bit-op dequantizer, two F.grouped_mm, weighted index_add."""
    T, D = x.shape
    K, E = topk_ids.shape[1], w13_q.shape[0]
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)
    sorted_e = flat[order]
    new = torch.ones_like(sorted_e, dtype=torch.bool)
    new[1:] = sorted_e[1:] != sorted_e[:-1]
    slot = new.long().cumsum(0) - 1  # the hit-expert slot of each sorted pair
    n_slots = min(E, T * K)
    hit = sorted_e[-1:].repeat(n_slots).scatter_(0, slot, sorted_e)
    offs = torch.zeros(n_slots, dtype=torch.long, device=x.device).scatter_add_(0, slot, torch.ones_like(slot))
    offs = offs.cumsum(0).to(torch.int32)
    w13 = _dequantize_chunked(w13_q, hit, W13_FORMAT, x.dtype)
    w2 = _dequantize_chunked(w2_q, hit, W2_FORMAT, x.dtype)
    gate, up = F.grouped_mm(x[order // K], w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    out = F.grouped_mm(silu_mul(gate, up), w2.transpose(-2, -1), offs=offs)
    out = out.float() * topk_weights.flatten()[order, None].float()
    y = torch.zeros((T, D), dtype=torch.float32, device=x.device).index_add_(0, order // K, out)
    return y.to(x.dtype)


add_torch_compile(op)
