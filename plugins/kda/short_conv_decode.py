"""`kda.short_conv_decode`: one decode step of KDA's short conv + SiLU, with a conv state pool and slot indices.

    xp = cat([pool[slot_n].T, x[n][None]], 0);  y[n] = silu(sum_j weight[:, j] * xp[j]);  pool[slot_n] = xp[1:].T

Calling convention: backend(x=[N, D] qkv of one token per sequence, weight=[D, W], conv_state_pool=[S, D, W-1]
the W-1 PRE-conv inputs per slot (updated IN PLACE), slots=[N] int32 distinct) -> y [N, D]. The updated pool is
checked too (`outputs`); slots not indexed must stay bit-identical. Pool of 3*N slots, random distinct indices.
Reference: fp64, rounded once to the output dtype (see kda.short_conv).
Cost: 2*W FLOPs per element; bytes = x in + y out + the touched slots read and written + weight.
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.kda.short_conv import WIDTH, conv_dim, conv_weight
from spark_bench.plugins.models import kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.check import untouched_slots
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

POOL_FACTOR = 3


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    N, D = p["batch"], conv_dim(p)
    slots = torch.randperm(POOL_FACTOR * N, generator=gen, device=device)[:N]
    return {
        "x": randn((N, D), gen, dtype=dtype, device=device),
        "weight": conv_weight(D, gen, dtype, device),
        "conv_state_pool": randn((POOL_FACTOR * N, D, WIDTH - 1), gen, dtype=dtype, device=device),
        "slots": slots.to(torch.int32),
    }


def reference(x, weight, conv_state_pool, slots):
    """fp64, one sequence at a time; updates the pool in place like the backends."""
    w = weight.double()
    ys = []
    for n, slot in enumerate(slots.tolist()):
        xp = torch.cat([conv_state_pool[slot].double().T, x[n].double()[None]])
        ys.append(F.silu((w.T * xp).sum(0)))
        conv_state_pool[slot] = xp[1:].T.to(conv_state_pool.dtype)
    return torch.stack(ys).to(x.dtype).float()


def outputs(returned, inputs):
    return returned, inputs["conv_state_pool"]


def cost(p, dtype):
    N, D = p["batch"], conv_dim(p)
    elt = 4 if dtype == "fp32" else 2
    return Cost(flops=2 * WIDTH * N * D, bytes=elt * (2 * N * D + 2 * N * D * (WIDTH - 1) + D * WIDTH), tokens=N)


def from_file(p, w, gen, *, device, dtype):
    """--weights: the q|k|v projections of random tokens, the layer's conv weight, a pool of earlier tokens."""
    N = p["batch"]
    slots = torch.randperm(POOL_FACTOR * N, generator=gen, device=device)[:N]
    return {"x": kda_weights.tokens(w, N, gen, dtype, device)["qkv"], "weight": w["conv"],
            "conv_state_pool": kda_weights.conv_history(w, POOL_FACTOR * N, gen, dtype, device),
            "slots": slots.to(torch.int32)}


op = Op(
    name="kda.short_conv_decode",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim="head_dim"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("batch", [1, 2, 4, 7, 16, 64, 128, 256, 512], quick=[1, 7]),
        Axis("heads", [32, 16, 8, 4], quick=[3]),
        Axis("head_dim", [128], quick=[60]),
    ],
    presets=kda_presets(("head_dim",)),
    dtypes=["bf16", "fp32"],
    tolerance={"bf16": Tolerance(1e-3), "fp16": Tolerance(1e-3), "fp32": Tolerance(1e-4)},
    outputs=outputs,
    untouched=untouched_slots("slots", "conv_state_pool"),  # kda.md: other slots stay bit-identical
    rotate=("x", "slots"),
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_short_conv_decode(x, weight, conv_state_pool, slots):
    """Ours: kernels/kda/short_conv.py, reads and shifts each slot in place."""
    from spark_bench.kernels.kda.short_conv import short_conv_decode

    return short_conv_decode(x, weight, conv_state_pool, slots)


@op.backend("torch")
def torch_short_conv_decode(x, weight, conv_state_pool, slots):
    """Eager torch: gather the slots, one fp32 multiply-add over the window, scatter the shifted window back."""
    idx = slots.long()
    window = torch.cat([conv_state_pool[idx], x[..., None].to(conv_state_pool.dtype)], -1)  # [N, D, W]
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    conv_state_pool[idx] = window[..., 1:]
    return y


add_torch_compile(op)


def _fla_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's causal_conv1d_update is autotuned and needs a GPU" if probes.needs_cuda(device) else None)


@op.backend("fla", probe=_fla_probe, labels=("gather-scatter",))
def fla_short_conv_decode(x, weight, conv_state_pool, slots):
    """fla-core's causal_conv1d_update. It takes one cache per sequence with W columns (the last = current
    token) and no slot indices: the slots are gathered into that layout and scattered back around the call."""
    from fla.modules.causal_conv1d import causal_conv1d_update

    idx = slots.long()
    cache = F.pad(conv_state_pool[idx], (1, 0))
    y, cache = causal_conv1d_update(x, cache, weight=weight, activation="silu")
    conv_state_pool[idx] = cache[..., 1:]
    return y
