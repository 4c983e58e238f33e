"""`kda.block_prefill`: one whole KDA block from x to out for packed (varlen) prompts, with both states.

Calling convention: backend(x=[T, D], cu_seqlens=[N+1] int32, conv_state=[N, conv_dim, W-1] (None: new sequences),
recurrent_state=[N, H, K, V] fp32 (None: zeros), and the engine's weights by name (block_common.WEIGHT_NAMES, torch
Linear layout [out, in]; dt_bias [H*K] and a_log [H] fp32)) -> (out [T, D], new conv state, new recurrent state).
Stages (kda.md "Forward of one block"): projections (torch GEMMs) -> short conv + SiLU -> chunked delta-rule core
(forget gate, q/k L2 norm and beta sigmoid inside it: use_gate_in_kernel with the raw gate logits) -> gated
RMSNorm -> o_proj. Each composed backend takes every stage from the per-op backend of the same name and reports a
per-stage breakdown.
Reference: fp32 GEMMs, the conv reference, the fp32 token-loop core (block_common.reference_block).
Cost: the projections' 2*T*weights FLOPs plus the chunk core's; bytes = weights + x and out + both states.
"""

from spark_bench.plugins.kda import block_common as bc
from spark_bench.plugins.kda import chunk_prefill, core_common, gated_rmsnorm, short_conv
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.kda.core_common import GPU_VARLEN
from spark_bench.plugins.models import KIMI_LINEAR, LONG_PREFILL, kda_presets

from spark_bench import Axis, Op, Tolerance
from spark_bench.inputs import generator, randn


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    lengths = bc.seq_lengths(p)
    d = bc.block_dims(p)
    N = len(lengths)
    return {
        "x": randn((sum(lengths), d["D"]), gen, dtype=dtype, device=device),  # RMS-normed hidden states
        "cu_seqlens": bc.cu_seqlens(lengths, device),
        "conv_state": randn((N, d["conv_dim"], short_conv.WIDTH - 1), gen, dtype=dtype, device=device),
        "recurrent_state": randn((N, d["H"], d["K"], d["V"]), gen, device=device, std=0.5),
        **bc.block_weights(p, gen, dtype, device),
    }


def reference(x, cu_seqlens, conv_state=None, recurrent_state=None, **weights):
    N = cu_seqlens.numel() - 1
    if conv_state is None:
        conv_state = x.new_zeros(N, weights["conv"].shape[0], short_conv.WIDTH - 1)
    if recurrent_state is None:
        H = weights["a_log"].numel()
        recurrent_state = x.new_zeros(N, H, weights["q_proj"].shape[0] // H, weights["o_norm"].numel()).float()
    return bc.reference_block(x, conv_state, recurrent_state, cu_seqlens, weights)


def cost(p, dtype):
    lengths = bc.seq_lengths(p)
    d = bc.block_dims(p)
    core_flops, _ = core_common.core_cost(sum(lengths), d["H"], d["K"], d["V"], states=0, dtype=dtype, fused=True,
                                          chunk=core_common.CHUNK)
    return bc.block_cost(p, dtype, tokens=sum(lengths), states=len(lengths), core_flops=core_flops)


_batch = Axis("batch", [1, 4], quick=[1])
_seq_len = Axis("seq_len", [64, 1024, 4096, 8192, 16384], quick=[65])

def from_file(p, w, gen, *, device, dtype):
    """--weights: the layer's block weights; random tokens, conv states of earlier tokens, random recurrent states."""
    lengths = bc.seq_lengths(p)
    H, K, V = kda_weights.heads_of(w)
    N = len(lengths)
    return {
        "x": kda_weights.draw_x(w, sum(lengths), gen, dtype, device),
        "cu_seqlens": bc.cu_seqlens(lengths, device),
        "conv_state": kda_weights.conv_history(w, N, gen, dtype, device),
        "recurrent_state": randn((N, H, K, V), gen, device=device, std=0.5),
        **w,
    }


op = Op(
    name="kda.block_prefill",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim="head_dim", hidden="hidden"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        _batch,
        _seq_len,
        Axis("varlen", ["fixed", *GPU_VARLEN], quick=["tiny5"]),
        Axis("heads", [32, 16, 8, 4], quick=[2]),
        Axis("head_dim", [128], quick=[32]),
        Axis("hidden", [KIMI_LINEAR["hidden"]], quick=[80]),
    ],
    constraints=[bc.pattern_constraint(_batch, _seq_len)],
    presets=kda_presets(("head_dim",), LONG_PREFILL, hidden=[KIMI_LINEAR["hidden"]]),
    dtypes=["bf16"],
    tolerance={"bf16": Tolerance(1e-2), "fp16": Tolerance(1e-2), "fp32": Tolerance(1e-3)},
    extra_info=bc.sequence_info,
)


def conv_stage(conv):
    def run(c):
        y, state = conv(x=c["qkv"], weight=c["conv"], cu_seqlens=c["cu_seqlens"], conv_state=c["conv_state"])
        return {"qkv_conv": y, "new_conv_state": state}
    return run


def core_stage(core):
    """The chunked core on the conv output (q, k, v: strided views); the gate, the L2 norm of q, k and the sigmoid
    of beta run inside it."""
    def run(c):
        heads = bc.split_heads(c)
        gate = bc.fused_gate(c)
        o, state = core(**heads, **{**gate, "g": gate["g"][None]}, beta=c["b_logit"][None],
                        scale=heads["q"].shape[-1] ** -0.5, initial_state=c["recurrent_state"],
                        output_final_state=True, cu_seqlens=c["cu_seqlens"], use_qk_l2norm_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True)
        return {"o": o[0], "new_recurrent_state": state}
    return run


stages = bc.stage_list(conv_stage, core_stage)


bc.add_composed_backends(op, stages, {
    "triton": (short_conv.triton_short_conv, chunk_prefill.triton_chunk_prefill, gated_rmsnorm.triton_gated_rmsnorm),
    "torch": (short_conv.torch_short_conv, chunk_prefill.torch_chunk_prefill, gated_rmsnorm.torch_gated_rmsnorm),
    "fla": (short_conv.fla_short_conv, chunk_prefill.fla_chunk_prefill, gated_rmsnorm.fla_gated_rmsnorm),
}, outputs=("out", "new_conv_state", "new_recurrent_state"),
    parts_doc="kda.short_conv, kda.chunk_prefill (its fused gate) and kda.gated_rmsnorm")
