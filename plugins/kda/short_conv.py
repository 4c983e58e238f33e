"""`kda.short_conv`: KDA's causal depthwise short conv + SiLU over concat([q, k, v]), prefill with varlen and state.

    xp = cat([conv_state[n].T, x[bos:eos]], 0);  y[t] = silu(sum_j weight[:, j] * xp[t + j]);  new = xp[-(W-1):].T

Calling convention: backend(x=[T, D] qkv, D = conv_dim = 2*H*K + H*V, weight=[D, W] (column W-1 multiplies the
current token), conv_state=[N, D, W-1] the W-1 PRE-conv inputs per sequence (None: new sequences, zeros),
cu_seqlens=[N+1] int32) -> (y [T, D] in x's dtype, new_conv_state [N, D, W-1]). Segments shorter than W-1 keep
part of the old state (kda.md pitfall 6).
Reference: fp64 per sequence, rounded once to the output dtype (the correctly rounded result: bf16 storage
alone costs an error ratio of 1.7e-3 against unrounded values, above the 1e-3 bound).
Cost: 2*W FLOPs per element; bytes = x in + y out + weight + state in and out.
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.kda import block_common
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.kda.core_common import GPU_VARLEN, int64_offsets
from spark_bench.plugins.models import KIMI_LINEAR, LONG_PREFILL, kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn, uniform

WIDTH = KIMI_LINEAR["conv_width"]


def conv_dim(p) -> int:
    """2*H*K + H*V of a parameter point (head_dim_k/head_dim_v override head_dim where given)."""
    k = p.get("head_dim_k", p["head_dim"])
    v = p.get("head_dim_v", p["head_dim"])
    return p["heads"] * (2 * k + v)


def conv_weight(dim: int, gen, dtype, device) -> torch.Tensor:
    """[D, W] like nn.Conv1d's default init of a depthwise conv: U(-1/sqrt(W), 1/sqrt(W))."""
    bound = WIDTH ** -0.5
    return uniform((dim, WIDTH), gen, -bound, bound, dtype=dtype, device=device)


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    lengths = block_common.seq_lengths(p)
    D = conv_dim(p)
    return {
        "x": randn((sum(lengths), D), gen, dtype=dtype, device=device),  # projections: ~unit variance
        "weight": conv_weight(D, gen, dtype, device),
        "conv_state": randn((len(lengths), D, WIDTH - 1), gen, dtype=dtype, device=device),
        "cu_seqlens": block_common.cu_seqlens(lengths, device),
    }


def reference(x, weight, cu_seqlens, conv_state=None):
    """fp64, one sequence at a time, straight from the formula."""
    T, D = x.shape
    W = weight.shape[1]
    w = weight.double()
    ys, states = [], []
    cu = cu_seqlens.tolist()
    for n in range(len(cu) - 1):
        seq = x[cu[n]:cu[n + 1]].double()
        prev = conv_state[n].double().T if conv_state is not None else seq.new_zeros(W - 1, D)
        xp = torch.cat([prev, seq])
        L = seq.shape[0]
        ys.append(F.silu(sum(w[:, j] * xp[j:j + L] for j in range(W))))
        states.append(xp[L:].T)
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    return (torch.cat(ys).to(x.dtype).float(), torch.stack(states).to(state_dtype).float())


def cost(p, dtype):
    lengths = block_common.seq_lengths(p)
    T, N, D = sum(lengths), len(lengths), conv_dim(p)
    elt = 4 if dtype == "fp32" else 2
    return Cost(flops=2 * WIDTH * T * D, bytes=elt * (2 * T * D + D * WIDTH + 2 * N * D * (WIDTH - 1)), tokens=T)


_batch = Axis("batch", [1, 2, 4], quick=[1, 2])
_seq_len = Axis("seq_len", [64, 1000, 4096, 16384, 32768], quick=[65])

def from_file(p, w, gen, *, device, dtype):
    """--weights: the q|k|v projections of random tokens, the layer's conv weight, states of earlier tokens."""
    lengths = block_common.seq_lengths(p)
    c = kda_weights.tokens(w, sum(lengths), gen, dtype, device)
    return {"x": c["qkv"], "weight": w["conv"],
            "conv_state": kda_weights.conv_history(w, len(lengths), gen, dtype, device),
            "cu_seqlens": block_common.cu_seqlens(lengths, device)}


op = Op(
    name="kda.short_conv",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim="head_dim"),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        _batch,
        _seq_len,
        Axis("varlen", ["fixed", *GPU_VARLEN],
             quick=["fixed", "tiny5"]),
        Axis("heads", [32, 16, 8, 4], quick=[3]),
        Axis("head_dim", [128], quick=[60]),
    ],
    constraints=[block_common.pattern_constraint(_batch, _seq_len)],
    presets=kda_presets(("head_dim",), LONG_PREFILL),
    dtypes=["bf16", "fp32"],
    tolerance={"bf16": Tolerance(1e-3), "fp16": Tolerance(1e-3), "fp32": Tolerance(1e-4)},
    extra_info=block_common.sequence_info,
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_short_conv(x, weight, cu_seqlens, conv_state=None):
    """Ours: kernels/kda/short_conv.py (one launch: outputs and new states)."""
    from spark_bench.kernels.kda.short_conv import short_conv_prefill

    return short_conv_prefill(x, weight, cu_seqlens, conv_state)


@op.backend("torch")
def torch_short_conv(x, weight, cu_seqlens, conv_state=None):
    """Eager torch: scatter every sequence behind its state into one buffer [D, T + N*(W-1)], then a single
    fp32 depthwise F.conv1d (groups=D) and SiLU; no per-sequence loop, no host sync."""
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    ar = torch.arange(T, device=x.device)
    seq = torch.searchsorted(cu[1:], ar, right=True)
    token_pos = ar + (seq + 1) * (W - 1)
    cols = torch.arange(W - 1, device=x.device)
    seg_start = cu[:-1] + torch.arange(N, device=x.device) * (W - 1)
    buf = x.new_zeros(D, T + N * (W - 1), dtype=torch.float32)
    buf[:, token_pos] = x.T.float()
    if conv_state is not None:
        buf[:, (seg_start[:, None] + cols).flatten()] = conv_state.float().permute(1, 0, 2).reshape(D, -1)
    out = F.conv1d(buf[None], weight.float()[:, None, :], groups=D)[0]
    y = F.silu(out.T[token_pos - (W - 1)]).to(x.dtype)
    seg_end = seg_start + (cu[1:] - cu[:-1]) + (W - 1)
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    new_state = buf[:, seg_end[:, None] - (W - 1) + cols].permute(1, 0, 2).to(state_dtype)
    return y, new_state


add_torch_compile(op)


def _fla_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's causal_conv1d is autotuned and needs a GPU" if probes.needs_cuda(device) else None)


@op.backend("fla", probe=_fla_probe, labels=("state-mapped",))
def fla_short_conv(x, weight, cu_seqlens, conv_state=None):
    """fla-core's causal_conv1d (Triton). Its states hold W columns including the current token: ours is
    mapped in by a zero column in front (fla never reads column 0) and out by dropping column 0."""
    from fla.modules.causal_conv1d import causal_conv1d

    initial = F.pad(conv_state, (1, 0)) if conv_state is not None else None
    y, final = causal_conv1d(x[None], weight, initial_state=initial, output_final_state=True, activation="silu",
                             cu_seqlens=int64_offsets(cu_seqlens))
    return y[0], final[..., 1:]
