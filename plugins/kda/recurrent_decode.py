"""`kda.recurrent_decode`: the KDA decode core, 1-4 tokens per sequence (seq_len > 1: speculative verify), on an
fp32 state pool updated in place.

Calling convention (fla's fused_recurrent_kda_fwd keyword names), every backend:
    fn(q=[N, T, H, K], k=[N, T, H, K], v=[N, T, H, V], g=[N, T, H, K], beta=[N, T, H], scale=float,
       initial_state=[S, H, K, V] fp32 (the pool, S >= N), ssm_state_indices=[N] int32 (distinct slots),
       use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, A_log=[H] or None,
       dt_bias=[H*K] or None)
    -> (o [N, T, H, V] in v's dtype, the pool)
Sequence n reads slot ssm_state_indices[n], runs its T tokens and writes the state after the last one back to the
same slot; every other slot stays bit-identical. The check compares o and the whole pool (`outputs=`).
g, beta and the flags: as kda.chunk_prefill (core_common.py).

fla mapping: fused_recurrent_kda_fwd(initial_state=pool, inplace_final_state=True, ssm_state_indices=[N, T]).
Its kernel reads the slot at column 0 and writes the state after token t to column t, so the slot is repeated
over the T columns (a 1-D index would make it write tokens t > 0 to the next sequences' slots).
"""

import torch
from spark_bench.plugins.kda import core_common as cc
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.models import kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.check import untouched_slots
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    N, T, H, K, V = p["batch"], p["seq_len"], p["heads"], p["head_dim_k"], p["head_dim_v"]
    inputs = cc.draw_core_inputs((N, T), H, K, V, fused=p["fused"], dtype=dtype, device=device, gen=gen)
    slots = p.get("pool_factor", 3) * N
    pool = randn((slots, H, K, V), gen, device=device, std=0.5)
    indices = torch.randperm(slots, generator=gen, device=device)[:N].to(torch.int32)
    return {**inputs, "scale": K ** -0.5, "initial_state": pool, "ssm_state_indices": indices}


def cost(p, dtype):
    N, T = p["batch"], p["seq_len"]
    flops, nbytes = cc.core_cost(N * T, p["heads"], p["head_dim_k"], p["head_dim_v"], states=2 * N, dtype=dtype,
                                 fused=p["fused"])
    return Cost(flops=flops, bytes=nbytes + 4 * N, tokens=N * T)


def reference_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=None, **fused):
    """fp32 token loop on the gathered slots, written back in place."""
    slots = ssm_state_indices.long()
    o, S = cc.reference_tokens(q, k, v, g, beta, scale=scale, state=initial_state[slots], **fused)
    initial_state[slots] = S
    return o, initial_state


def from_file(p, w, gen, *, device, dtype):
    """--weights: each sequence's tokens through the layer's projections and short conv; a random state pool."""
    N, T = p["batch"], p["seq_len"]
    H, K, V = kda_weights.heads_of(w)
    inputs = kda_weights.core_inputs(w, [T] * N, gen, dtype, device, p["fused"])
    for name in ("q", "k", "v", "g", "beta"):
        inputs[name] = inputs[name].reshape(N, T, *inputs[name].shape[1:]).contiguous()
    slots = p.get("pool_factor", 3) * N
    pool = randn((slots, H, K, V), gen, device=device, std=0.5)
    indices = torch.randperm(slots, generator=gen, device=device)[:N].to(torch.int32)
    return {**inputs, "scale": K ** -0.5, "initial_state": pool, "ssm_state_indices": indices}


op = Op(
    name="kda.recurrent_decode",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim_k="head_dim_k", head_dim_v="head_dim_v"),
    make_inputs_fn=make_inputs,
    reference=reference_recurrent_decode,
    cost=cost,
    axes=[
        Axis("batch", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], quick=[7], doc="sequences N (pool of 3N slots)"),
        Axis("seq_len", [1, 2, 3, 4], quick=[3], doc="tokens per sequence (> 1: speculative verify)"),
        Axis("heads", [32, 16, 8, 4], quick=[3]),
        Axis("head_dim_k", [128], quick=[32]),
        Axis("head_dim_v", [128], quick=[48]),
        Axis("fused", [True, False], quick=[True], doc="q/k L2 norm, gate and beta sigmoid inside the kernel"),
    ],
    presets=kda_presets(("head_dim_k", "head_dim_v")),
    dtypes=["bf16", "fp16", "fp32"],
    quick_dtypes=["bf16"],
    tolerance={"bf16": Tolerance(5e-3), "fp16": Tolerance(5e-3), "fp32": Tolerance(1e-4)},
    outputs=lambda returned, inputs: (returned[0], inputs["initial_state"]),
    untouched=untouched_slots("ssm_state_indices", "initial_state"),  # kda.md: other slots stay bit-identical
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=None, **fused):
    """Ours: kernels/kda/recurrent_decode.py (state tile in registers across the T tokens, one write back)."""
    from spark_bench.kernels.kda.recurrent_decode import kda_recurrent_decode

    return kda_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=scale, **fused)


@op.backend("torch")
def torch_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=None, **fused):
    """Eager torch: gather the slots, batched matrix-vector products over (N*H), scatter back with index_copy_."""
    N, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = cc.prepare(q, k, g, beta, **fused)
    slots = ssm_state_indices.long()
    S = initial_state.index_select(0, slots).view(N * H, K, V)
    o = torch.empty(N, T, H, V, dtype=v.dtype, device=v.device)
    for t in range(T):
        k_t = k[:, t].reshape(N * H, 1, K)
        S = S * g[:, t].exp().reshape(N * H, K, 1)
        u = beta[:, t].reshape(N * H, 1, 1) * (v[:, t].float().reshape(N * H, 1, V) - torch.bmm(k_t, S))
        S = torch.baddbmm(S, k_t.transpose(1, 2), u)
        o[:, t] = torch.bmm(q[:, t].reshape(N * H, 1, K) * scale, S).view(N, H, V)
    initial_state.index_copy_(0, slots, S.view(N, H, K, V))
    return o, initial_state


add_torch_compile(op)


@op.backend("fla", probe=probes.package("fla", "fla-core"), labels=probes.triton_labels)
def fla_recurrent_decode(q, k, v, g, beta, initial_state, ssm_state_indices, scale=None, **fused):
    """fla-core's fused_recurrent_kda_fwd on the pool in place (continuous batching: ssm_state_indices)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    T = q.shape[1]
    slots = ssm_state_indices[:, None].expand(-1, T).contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # its kernel assumes contiguous rows
    return fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                   inplace_final_state=True, ssm_state_indices=slots, **fused)
