"""`kda.gated_rmsnorm`: KDA's output norm, an RMSNorm over V per (token, head) times a SIGMOID gate.

    y[t, h] = o[t, h] * rsqrt(mean(o[t, h]**2) + 1e-5) * weight * sigmoid(z[t, h])

Calling convention: backend(o=[T, H, V], z=[T, H, V] gate logits, weight=[V] shared by all heads) -> y [T, H, V]
in o's dtype. Reference: fp64, rounded once to the output dtype (see kda.short_conv).
Cost: ~8 FLOPs per element; bytes = o and z in, y out, weight.
"""

import torch
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.models import LONG_CONTEXT_T, kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

EPS = 1e-5


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    T, H, V = p["tokens"], p["heads"], p["head_dim"]
    return {
        "o": randn((T, H, V), gen, dtype=dtype, device=device, std=0.3),  # core output
        "z": randn((T, H, V), gen, dtype=dtype, device=device),  # (x @ g_a.T) @ g_b.T logits
        "weight": randn((V,), gen, dtype=dtype, device=device, std=0.1, mean=1.0),  # trained near its init, ones
    }


def reference(o, z, weight):
    """fp64 from the formula, rounded once to o's dtype."""
    x = o.double()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.double() * torch.sigmoid(z.double())
    return y.to(o.dtype).float()


def cost(p, dtype):
    T, H, V = p["tokens"], p["heads"], p["head_dim"]
    elt = 4 if dtype == "fp32" else 2
    n = T * H * V
    return Cost(flops=8 * n, bytes=elt * (3 * n + V), tokens=T)


def from_file(p, w, gen, *, device, dtype):
    """--weights: z = (x @ g_a.T) @ g_b.T of random tokens, the layer's o_norm; o stays a random core output."""
    T = p["tokens"]
    H, _, V = kda_weights.heads_of(w)
    c = kda_weights.tokens(w, T, gen, dtype, device)
    return {"o": randn((T, H, V), gen, dtype=dtype, device=device, std=0.3), "z": c["z"].view(T, H, V),
            "weight": w["o_norm"]}


op = Op(
    name="kda.gated_rmsnorm",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim="head_dim_v"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", [1, 64, 512, 4096, 16384, 65536], quick=[1, 67]),
        Axis("heads", [32, 16, 8, 4], quick=[3]),
        Axis("head_dim", [128], quick=[60]),
    ],
    presets=kda_presets(("head_dim",), {"tokens": LONG_CONTEXT_T}),
    dtypes=["bf16", "fp32"],
    tolerance={"bf16": Tolerance(1e-3), "fp16": Tolerance(1e-3), "fp32": Tolerance(1e-4)},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_gated_rmsnorm(o, z, weight):
    """Ours: kernels/kda/gated_rmsnorm.py."""
    from spark_bench.kernels.kda.gated_rmsnorm import gated_rmsnorm

    return gated_rmsnorm(o, z, weight, EPS)


@op.backend("torch")
def torch_gated_rmsnorm(o, z, weight):
    """Eager torch in fp32, cast once at the end."""
    x = o.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.float() * torch.sigmoid(z.float())
    return y.to(o.dtype)


add_torch_compile(op)


def _fla_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's fused gated norm is autotuned and needs a GPU" if probes.needs_cuda(device) else None)


@op.backend("fla", probe=_fla_probe)
def fla_gated_rmsnorm(o, z, weight):
    """fla-core's rms_norm_gated (what FusedRMSNormGated calls) with activation='sigmoid'."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, z, weight, None, activation="sigmoid", eps=EPS)
