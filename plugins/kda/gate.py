"""`kda.gate`: the KDA forget gate (Kimi-Linear's unbounded softplus gate, not fla's "safe gate").

    g[t, h, d] = -exp(A_log[h]) * softplus(g_raw[t, h, d] + dt_bias[h*K + d])      (fp32 out, g <= 0)

Calling convention (fla's names): backend(g=[T, H, K] bf16/fp16/fp32, A_log=[H] f32, dt_bias=[H*K] f32)
-> g [T, H, K] fp32. A_log is per head, dt_bias per channel (kda.md pitfall 1).
Cost: ~5 FLOPs per element; bytes = g in + fp32 g out + A_log + dt_bias.
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.kda import weights
from spark_bench.plugins.models import LONG_CONTEXT_T, kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, H, K = p["tokens"], p["heads"], p["head_dim"]
    return {
        # g_raw = (x @ f_a.T) @ f_b.T: roughly unit-variance logits
        "g": randn((T, H, K), gen, dtype=dtype, device=device),
        "A_log": weights.a_log(H, gen, device),
        "dt_bias": weights.dt_bias(H * K, gen, device),
    }


def reference(g, A_log, dt_bias):
    """fp64, straight from the formula."""
    H, K = g.shape[-2:]
    x = g.double() + dt_bias.double().view(H, K)
    return -A_log.double().exp().view(H, 1) * F.softplus(x)


def cost(p, dtype):
    T, H, K = p["tokens"], p["heads"], p["head_dim"]
    in_bytes = {"fp32": 4, "fp64": 8}.get(dtype, 2)
    n = T * H * K
    return Cost(flops=5 * n, bytes=n * in_bytes + 4 * n + 4 * H * K + 4 * H, tokens=T)


def from_file(p, w, gen, *, device, dtype):
    """--weights: g_raw = (x @ f_a.T) @ f_b.T of random tokens, the layer's A_log and dt_bias."""
    T = p["tokens"]
    H, K, _ = weights.heads_of(w)
    c = weights.tokens(w, T, gen, dtype, device)
    return {"g": c["g_raw"].view(T, H, K), "A_log": w["a_log"], "dt_bias": w["dt_bias"]}


op = Op(
    name="kda.gate",
    doc=__doc__,
    from_weights=weights.binding(from_file, heads="heads", head_dim="head_dim_k"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", [1, 64, 512, 4096, 16384, 65536], quick=[1, 67, 300]),
        Axis("heads", [32, 16, 8, 4], quick=[4]),
        Axis("head_dim", [128], quick=[128, 60]),
    ],
    presets=kda_presets(("head_dim",), {"tokens": LONG_CONTEXT_T}),
    dtypes=["bf16", "fp32"],
    tolerance={"bf16": Tolerance(1e-3), "fp16": Tolerance(1e-3), "fp32": Tolerance(1e-4)},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_gate(g, A_log, dt_bias):
    """Ours: kernels/kda/gate.py."""
    from spark_bench.kernels.kda.gate import kda_gate

    return kda_gate(g, A_log, dt_bias)


@op.backend("torch")
def torch_gate(g, A_log, dt_bias):
    """Eager torch, broadcast in fp32."""
    H, K = g.shape[-2:]
    return -A_log.float().exp().view(H, 1) * F.softplus(g.float() + dt_bias.view(H, K))


add_torch_compile(op)


def _fla_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's fused_kda_gate is autotuned and needs a GPU" if probes.needs_cuda(device) else None)


@op.backend("fla", probe=_fla_probe)
def fla_gate(g, A_log, dt_bias):
    """fla-core's fused_kda_gate (lower_bound=None: the same unbounded softplus gate)."""
    from fla.ops.kda.gate import fused_kda_gate

    return fused_kda_gate(g, A_log, dt_bias, output_dtype=torch.float32)
