"""`moe.shared_expert`: the dense SwiGLU shared expert, z = w2 @ (silu(w1 @ x) * (w3 @ x)), bf16 or GGUF.

Calling convention: backend(x=[T, D] bf16, w13=[1, 2I, D] (w1 rows then w3 rows), w2=[1, D, I], topk_ids=[T, 1]
int32 zeros, topk_weights=[T, 1] f32 ones, format) -> z [T, D] bf16. format bf16: bf16 weights; q2k_q3k: uint8
GGUF blocks, w13 Q2_K [1, 2I, D/256*84] and w2 Q3_K [1, D, I/256*110] (plugins/quant/kquants.py).
The weights are stored stacked as one expert, and the constant ids/weights are resident buffers, so ours runs the
routed experts' kernels unchanged (E = 1, K = 1, weight 1); torch is the dense form a user writes (F.linear, GGUF
dequantized per call). Cost: 6 T I D FLOPs; bytes 3 I D b + 4 T D (b = bytes per weight of the format).
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.models import KIMI_LINEAR
from spark_bench.plugins.moe import common

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

TOLERANCE = Tolerance(err_ratio=1e-2, max_abs=2e-2)


def single_expert_routing(T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, 1] zeros, topk_weights [T, 1] ones): every token on expert 0 with weight 1."""
    return (torch.zeros((T, 1), dtype=torch.int32, device=device),
            torch.ones((T, 1), dtype=torch.float32, device=device))


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, D, I, fmt = p["tokens"], p["hidden"], p["inter"], p["format"]
    w13, w2 = common.format_weights(fmt, 1, D, I, gen, device=device)
    ids, weights = single_expert_routing(T, device)
    return {"x": randn((T, D), gen, dtype=dtype, device=device, std=common.X_STD), "w13": w13, "w2": w2,
            "topk_ids": ids, "topk_weights": weights, "format": fmt}


def reference(x, w13, w2, topk_ids, topk_weights, format):
    """fp32 dense formula (GGUF weights through the formula dequantizer)."""
    if format != "bf16":
        from spark_bench.plugins.quant import kquants

        w13, w2 = kquants.dequantize_reference(w13[0], "q2_k"), kquants.dequantize_reference(w2[0], "q3_k")
    w13, w2 = w13.reshape(-1, x.shape[1]).float(), w2.reshape(x.shape[1], -1).float()
    gate, up = (x.float() @ w13.T).chunk(2, dim=-1)
    return common.silu_mul(gate, up) @ w2.T


def dense_swiglu(x, w13, w2):
    """Dense SwiGLU on [2I, D] / [D, I] weights in x's dtype (two F.linear)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(common.silu_mul(gate, up), w2)


def torch_shared(x, w13, w2, format):
    if format != "bf16":
        from spark_bench.plugins.quant import kquants

        w13 = kquants.dequantize_torch(w13, "q2_k", x.dtype)
        w2 = kquants.dequantize_torch(w2, "q3_k", x.dtype)
    return dense_swiglu(x, w13[0], w2[0])


def cost(p, dtype):
    T, D, I = p["tokens"], p["hidden"], p["inter"]
    b13, b2 = common.format_bytes(p["format"])
    return Cost(flops=6 * T * I * D, bytes=I * D * (2 * b13 + b2) + 4 * T * D, tokens=T)


def from_file(p, src, gen, *, device, dtype, seed, factory):
    """--weights: the layer's shared expert (bf16, its Q2_K/Q3_K blocks, or another GGUF type dequantized to bf16 at
    load: the case's weights label says so) on activations as the layer sees them."""
    if not src.has_layer:
        return factory(p, device=device, dtype=dtype, seed=seed)
    shared = src.moe_part("shared", device)
    ids, weights = single_expert_routing(p["tokens"], device)
    return {"x": common.layer_activations(src, p["tokens"], gen, dtype, device), "w13": shared["w13"],
            "w2": shared["w2"], "topk_ids": ids, "topk_weights": weights, "format": p["format"]}


op = Op(
    name="moe.shared_expert",
    doc=__doc__,
    from_weights=common.moe_binding(from_file, common.moe_fixed("hidden", "inter", "format", inter="shared_inter",
                                                           need_shared=True, shared_only=True), uses=("shared",)),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", common.TOKENS,
             quick=[1, 5, 33]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[256]),
        Axis("inter", [KIMI_LINEAR["inter"]], quick=[72, 256]),
        Axis("format", list(common.FORMATS), quick=list(common.FORMATS)),
    ],
    presets=common.model_presets(("hidden", "inter")),
    constraints=[common.format_constraint],
    tolerance={"bf16": TOLERANCE},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_shared(x, w13, w2, topk_ids, topk_weights, format):
    """Ours: the routed experts' kernels with E = 1, K = 1 (kernels/moe/experts.py or experts_gguf.py)."""
    return common.experts_impl("triton", format)(x, topk_ids, topk_weights, w13, w2)


@op.backend("torch")
def torch_dense(x, w13, w2, topk_ids, topk_weights, format):
    """Eager torch: two F.linear in bf16 (GGUF weights dequantized to bf16 first, every call)."""
    return torch_shared(x, w13, w2, format)


add_torch_compile(op)
