"""`kda.block_decode`: one decode step of a whole KDA block (one token per sequence) on state pools.

Calling convention: backend(x=[N, D], conv_state_pool=[S, conv_dim, W-1], state_pool=[S, H, K, V] fp32, slots=[N]
int32 distinct, and the engine's weights by name (block_common.WEIGHT_NAMES)) -> out [N, D]; both pools are updated
IN PLACE at `slots` and checked too (`outputs`). Pools of 3*N slots with random distinct indices.
Stages as kda.block_prefill (the gate fused into the core), with the decode conv and the recurrent decode core.
Reference: block_common.reference_block on the gathered states (one token per sequence), scattered back.
Cost: the projections' 2*N*weights FLOPs plus ~7*H*K*V per token; bytes = weights + x and out + both states.
"""

import torch
from spark_bench.plugins.kda import block_common as bc
from spark_bench.plugins.kda import gated_rmsnorm, short_conv, short_conv_decode
from spark_bench.plugins.kda import recurrent_decode as rd
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.models import KIMI_LINEAR, kda_presets

from spark_bench import Axis, Op, Tolerance
from spark_bench.check import untouched_slots
from spark_bench.inputs import generator, randn

POOL_FACTOR = 3


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    d = bc.block_dims(p)
    N, S = p["batch"], POOL_FACTOR * p["batch"]
    return {
        "x": randn((N, d["D"]), gen, dtype=dtype, device=device),
        "conv_state_pool": randn((S, d["conv_dim"], short_conv.WIDTH - 1), gen, dtype=dtype, device=device),
        "state_pool": randn((S, d["H"], d["K"], d["V"]), gen, device=device, std=0.5),
        "slots": torch.randperm(S, generator=gen, device=device)[:N].to(torch.int32),
        **bc.block_weights(p, gen, dtype, device),
    }


def reference(x, conv_state_pool, state_pool, slots, **weights):
    idx = slots.long()
    cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    out, conv_state, state = bc.reference_block(x, conv_state_pool[idx], state_pool[idx], cu, weights)
    conv_state_pool[idx] = conv_state.to(conv_state_pool.dtype)
    state_pool[idx] = state
    return out


def outputs(returned, inputs):
    return returned, inputs["conv_state_pool"], inputs["state_pool"]


def cost(p, dtype):
    d = bc.block_dims(p)
    N = p["batch"]
    return bc.block_cost(p, dtype, tokens=N, states=N, core_flops=7 * N * d["H"] * d["K"] * d["V"])


def from_file(p, w, gen, *, device, dtype):
    """--weights: the layer's block weights; random tokens, pools of earlier conv inputs and random states."""
    H, K, V = kda_weights.heads_of(w)
    N, S = p["batch"], POOL_FACTOR * p["batch"]
    return {
        "x": kda_weights.draw_x(w, N, gen, dtype, device),
        "conv_state_pool": kda_weights.conv_history(w, S, gen, dtype, device),
        "state_pool": randn((S, H, K, V), gen, device=device, std=0.5),
        "slots": torch.randperm(S, generator=gen, device=device)[:N].to(torch.int32),
        **w,
    }


op = Op(
    name="kda.block_decode",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim="head_dim", hidden="hidden"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("batch", [1, 2, 4, 7, 16, 64, 128, 256, 512], quick=[5]),
        Axis("heads", [32, 16, 8, 4], quick=[2]),
        Axis("head_dim", [128], quick=[32]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[80]),
    ],
    presets=kda_presets(("head_dim",), hidden=[KIMI_LINEAR["hidden"]]),
    dtypes=["bf16"],
    tolerance={"bf16": Tolerance(1e-2), "fp16": Tolerance(1e-2), "fp32": Tolerance(1e-3)},
    outputs=outputs,
    untouched=untouched_slots("slots", "conv_state_pool", "state_pool"),  # kda.md: other slots stay bit-identical
    rotate=("x", "slots"),
)


def conv_stage(conv):
    def run(c):
        return {"qkv_conv": conv(x=c["qkv"], weight=c["conv"], conv_state_pool=c["conv_state_pool"],
                                 slots=c["slots"])}
    return run


def core_stage(core):
    """The recurrent core on the pool, one token per sequence ([N, 1, H, *] strided views); gate, L2 norm and beta
    sigmoid inside."""
    def run(c):
        heads = {name: t.transpose(0, 1) for name, t in bc.split_heads(c).items()}
        gate = bc.fused_gate(c)
        o, _ = core(**heads, **{**gate, "g": gate["g"][:, None]}, beta=c["b_logit"][:, None],
                    scale=heads["q"].shape[-1] ** -0.5, initial_state=c["state_pool"], ssm_state_indices=c["slots"],
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        return {"o": o[:, 0]}
    return run


stages = bc.stage_list(conv_stage, core_stage)


def fused_conv_core(c):
    """kernels/kda/block_decode.py launch 1: conv, SiLU, L2 norms, gate, beta and the recurrence of every head."""
    from spark_bench.kernels.kda.block_decode import conv_recurrent_decode

    return {"o": conv_recurrent_decode(c["qkv"], c["conv"], c["conv_state_pool"], c["g_raw"], c["b_logit"],
                                       c["a_log"], c["dt_bias"], c["state_pool"], c["slots"],
                                       heads=c["a_log"].numel())}


def fused_norm_shift(c):
    """Launch 2: the gated norm, and the conv state shifted by the new token (after launch 1 has read it)."""
    from spark_bench.kernels.kda.block_decode import gated_norm_conv_shift

    N, H, V = c["o"].shape
    return {"o_normed": gated_norm_conv_shift(c["o"], c["z"].view(N, H, V), c["o_norm"], c["qkv"],
                                              c["conv_state_pool"], c["slots"])}


bc.add_staged_backend(op, "triton", [("projections", bc.projections), ("conv+core", fused_conv_core),
                                     ("norm+conv_shift", fused_norm_shift), ("out_proj", bc.out_projection)],
                      outputs=("out",), path="triton",
                      doc="Two Triton launches between the torch GEMMs (kernels/kda/block_decode.py: the conv fused "
                          "into the recurrent core, the conv state shift into the gated norm); triton_unfused is the "
                          "three-launch composition of the per-op kernels.")
bc.add_composed_backends(op, stages, {
    "triton_unfused": (short_conv_decode.triton_short_conv_decode, rd.triton_recurrent_decode,
                       gated_rmsnorm.triton_gated_rmsnorm),
    "torch": (short_conv_decode.torch_short_conv_decode, rd.torch_recurrent_decode, gated_rmsnorm.torch_gated_rmsnorm),
    "fla": (short_conv_decode.fla_short_conv_decode, rd.fla_recurrent_decode, gated_rmsnorm.fla_gated_rmsnorm),
}, outputs=("out",),
    parts_doc="kda.short_conv_decode, kda.recurrent_decode (its fused gate) and kda.gated_rmsnorm")
