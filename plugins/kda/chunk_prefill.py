"""`kda.chunk_prefill`: the KDA chunkwise delta-rule core (chunk 64) for prefill; varlen; fp32 states.

Calling convention (fla's chunk_kda keyword names), every backend:
    fn(q=[B, T, H, K], k=[B, T, H, K], v=[B, T, H, V], g=[B, T, H, K], beta=[B, T, H], scale=float,
       initial_state=[N, H, K, V] fp32 or None, output_final_state=bool, cu_seqlens=[N+1] int32 or None,
       use_qk_l2norm_in_kernel=bool, use_gate_in_kernel=bool, use_beta_sigmoid_in_kernel=bool,
       A_log=[H] fp32 or None, dt_bias=[H*K] fp32 or None)
    -> (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 ("K-first" [K, V] per head, as fla))
With cu_seqlens, B = 1 and N = len(cu_seqlens) - 1 sequences are packed along T; without, N = B.
g is the log-space decay (fp32), or with use_gate_in_kernel the raw gate logits (activation dtype), the decay
then being -exp(A_log[h]) * softplus(g + dt_bias[h*K + d]) (core_common.py). The `fused` axis sets all three flags.

Backends: triton (ours, kernels/kda/chunk_prefill.py), torch (eager chunkwise, vectorised over chunks),
torch_compile, fla (fla.ops.kda.chunk_kda, GPU only), fla_recurrent (fla's token-serial fused_recurrent_kda,
which also runs interpreted on CPU), reference (fp32 token loop).
"""

import torch
from spark_bench.plugins.kda import core_common as cc
from spark_bench.plugins.kda import weights as kda_weights
from spark_bench.plugins.models import LONG_PREFILL, kda_presets

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

_BATCH = Axis("batch", [1, 4], quick=[2])
_SEQ_LEN = Axis("seq_len", [64, 1024, 4096, 8192, 16384], quick=[65])


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    H, K, V = p["heads"], p["head_dim_k"], p["head_dim_v"]
    lens = cc.seq_lengths(p)
    shape = (1, sum(lens)) if lens else (p["batch"], p["seq_len"])
    inputs = cc.draw_core_inputs(shape, H, K, V, fused=p["fused"], dtype=dtype, device=device, gen=gen)
    N = len(lens) if lens else p["batch"]
    h0 = randn((N, H, K, V), gen, device=device, std=0.5) if p.get("initial_state", True) else None
    cu = None
    if lens:
        cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    return {**inputs, "scale": K ** -0.5, "initial_state": h0, "output_final_state": True, "cu_seqlens": cu}


def cost(p, dtype):
    lens = cc.seq_lengths(p) or [p["seq_len"]] * p["batch"]
    T, N = sum(lens), len(lens)
    flops, nbytes = cc.core_cost(T, p["heads"], p["head_dim_k"], p["head_dim_v"], states=2 * N, dtype=dtype,
                                 fused=p["fused"], chunk=cc.CHUNK)
    return Cost(flops=flops, bytes=nbytes, tokens=T)


def _varlen_once(p):
    if p["varlen"] != "fixed" and (p["batch"] not in (_BATCH.values[0], _BATCH.quick[0])
                                   or p["seq_len"] not in (_SEQ_LEN.values[0], _SEQ_LEN.quick[0])):
        return "a varlen pattern sets its own lengths: it runs at the first batch and seq_len only"
    return None


def reference_chunk_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            cu_seqlens=None, **fused):
    """fp32 token loop, sequence by sequence (core_common.reference_tokens)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = initial_state if initial_state is not None else q.new_zeros(N, H, K, v.shape[-1], dtype=torch.float32)
    o, ht = cc.reference_tokens(q, k, v, g, beta, scale=scale, state=h0, cu_seqlens=cu_seqlens, **fused)
    return o, (ht if output_final_state else None)


_D = ("heads", "head_dim_k", "head_dim_v")
def from_file(p, w, gen, *, device, dtype):
    """--weights: q, k, v, gate and beta of random tokens through the layer's projections and short conv."""
    H, K, V = kda_weights.heads_of(w)
    lens = cc.seq_lengths(p)
    lengths = lens or [p["seq_len"]] * p["batch"]
    inputs = kda_weights.core_inputs(w, lengths, gen, dtype, device, p["fused"])
    B = 1 if lens else p["batch"]
    for name in ("q", "k", "v", "g", "beta"):
        inputs[name] = inputs[name].reshape(B, -1, *inputs[name].shape[1:]).contiguous()
    h0 = randn((len(lengths), H, K, V), gen, device=device, std=0.5) if p.get("initial_state", True) else None
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32) if lens else None
    return {**inputs, "scale": K ** -0.5, "initial_state": h0, "output_final_state": True, "cu_seqlens": cu}


op = Op(
    name="kda.chunk_prefill",
    doc=__doc__,
    from_weights=kda_weights.binding(from_file, heads="heads", head_dim_k="head_dim_k", head_dim_v="head_dim_v"),
    make_inputs_fn=make_inputs,
    reference=reference_chunk_prefill,
    cost=cost,
    axes=[
        _BATCH, _SEQ_LEN,
        Axis("varlen", ["fixed", *cc.GPU_VARLEN],
             quick=["tiny4"], doc="fixed = batch x seq_len; else a pattern of core_common.VARLEN"),
        Axis("heads", [32, 16, 8, 4], quick=[3]),
        Axis("head_dim_k", [128], quick=[32]),
        Axis("head_dim_v", [128], quick=[48]),
        Axis("fused", [True, False], quick=[True], doc="q/k L2 norm, gate and beta sigmoid inside the kernel"),
    ],
    presets={
        **kda_presets(("head_dim_k", "head_dim_v"), LONG_PREFILL),
        **{f"fla-B{b}-T{t}-H{h}": {"batch": [b], "seq_len": [t], "heads": [h], "varlen": ["fixed"],
                                   "head_dim_k": [128], "head_dim_v": [128]}
           for b, t, h in ((1, 8192, 96), (4, 2048, 16), (2, 16384, 16))},
    },
    constraints=[_varlen_once],
    dtypes=["bf16", "fp16", "fp32"],
    quick_dtypes=["bf16"],
    tolerance={"bf16": Tolerance(5e-3), "fp16": Tolerance(5e-3), "fp32": Tolerance(1e-4)},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_chunk_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **fused):
    """Ours: kernels/kda/chunk_prefill.py (cumsum, chunk-parallel UT transform, sequential state pass)."""
    from spark_bench.kernels.kda.chunk_prefill import chunk_kda_prefill

    return chunk_kda_prefill(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, **fused)


@op.backend("torch")
def torch_chunk_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, **fused):
    """Eager torch, chunkwise in fp32: every chunk's UT transform at once (triangular solve), then one batched
    state step per chunk index across the sequences that have that chunk (a loop torch.compile leaves eager)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = cc.prepare(q, k, g, beta, **fused)
    idx, steps = _chunk_plan(cu_seqlens, B, T, q.device)
    qc, kc, vc, gc, bc = (_chunks(x.reshape(B * T, H, -1).float(), idx) for x in (q, k, v, g, beta))
    G = gc.cumsum(2)
    a_qk, a_kk = _intra_chunk(qc, kc, G)
    a_qk = torch.tril(a_qk * scale)
    a_kk = torch.tril(a_kk, -1) * bc
    rhs = bc * torch.cat([kc * G.exp(), vc], -1)
    wu = torch.linalg.solve_triangular(a_kk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :K], wu[..., K:]
    qd, kd = qc * G.exp() * scale, kc * (G[:, :, -1:] - G).exp()
    decay = G[:, :, -1].exp().unsqueeze(-1)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S = (initial_state.float().clone() if initial_state is not None
         else q.new_zeros(N, H, K, V, dtype=torch.float32))
    out = _inter_chunk(steps, w, u, qd, kd, a_qk, decay, S)
    o = torch.empty(B * T + 1, H, V, dtype=torch.float32, device=q.device)
    o[idx.reshape(-1)] = out.transpose(1, 2).reshape(-1, H, V)
    return o[:-1].view(B, T, H, V).to(v.dtype), (S if output_final_state else None)


@torch.compiler.disable
def _chunk_plan(cu_seqlens, B, T, device):
    """Token ids [chunks, 64] of every chunk (B*T: a zero pad row), and per chunk index c the chunk ids and the
    sequences that have a chunk c."""
    lens = [T] * B if cu_seqlens is None else torch.diff(cu_seqlens).tolist()
    n_chunks = [-(-n // cc.CHUNK) for n in lens]
    bounds, first, pos = [], [], 0
    for n, nc in zip(lens, n_chunks, strict=True):
        first.append(len(bounds))
        bounds += [(pos + c * cc.CHUNK, pos + n) for c in range(nc)]
        pos += n
    bounds = torch.tensor(bounds or [(0, 0)], device=device)[: len(bounds)]
    ids = bounds[:, :1] + torch.arange(cc.CHUNK, device=device)
    steps = []
    for c in range(max(n_chunks, default=0)):
        seqs = [n for n, nc in enumerate(n_chunks) if nc > c]
        steps.append((torch.tensor([first[n] + c for n in seqs], device=device), torch.tensor(seqs, device=device)))
    return torch.where(ids < bounds[:, 1:], ids, pos), steps


@torch.compiler.disable
def _inter_chunk(steps, w, u, qd, kd, a_qk, decay, S):
    """The sequential pass: per chunk index, U' = U - W S, O = Qd S + A_qk U', S = decay * S + Kd^T U' (S in place)."""
    out = torch.empty_like(u)
    for ids, seqs in steps:
        S_c = S[seqs]
        u_c = u[ids] - w[ids] @ S_c
        out[ids] = qd[ids] @ S_c + a_qk[ids] @ u_c
        S[seqs] = S_c * decay[ids] + kd[ids].transpose(-1, -2) @ u_c
    return out


_BC = 16  # sub-block of the safe intra-chunk decay split


def _chunks(x, idx):
    """[T, H, D] -> [chunks, H, 64, D] (zero rows past each sequence's end); beta [T, H, 1] likewise."""
    x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return x[idx].transpose(1, 2)


def _intra_chunk(qc, kc, G):
    """sum_d q_i k_j exp(G_i - G_j) and the same for k_i, for j <= i, [chunks, H, 64, 64]: blocks below the
    diagonal split the decay at the row block's first token (both factors <= 1), diagonal blocks are pairwise."""
    NC, H, C, K = qc.shape
    nb = C // _BC
    Gb, qb, kb = (x.view(NC, H, nb, _BC, K) for x in (G, qc, kc))
    ref = Gb[:, :, :, :1]
    e_rows = (Gb - ref).exp()
    earlier = torch.arange(C, device=qc.device) < _BC * torch.arange(nb, device=qc.device)[:, None]
    split = (ref - G[:, :, None]).masked_fill(~earlier[:, :, None], float("-inf")).exp()
    k_cols = (kc[:, :, None] * split).transpose(-1, -2)
    a_qk = (qb * e_rows) @ k_cols
    a_kk = (kb * e_rows) @ k_cols
    upper = (torch.arange(_BC, device=qc.device)[:, None] < torch.arange(_BC, device=qc.device))[:, :, None]
    d_qk, d_kk = [], []
    for b in range(nb):  # one [.., 16, 16, K] pairwise tensor at a time (memory)
        k_pair = kb[:, :, b, None] * (Gb[:, :, b, :, None] - Gb[:, :, b, None]).masked_fill(upper, float("-inf")).exp()
        d_qk.append((qb[:, :, b, :, None] * k_pair).sum(-1))
        d_kk.append((kb[:, :, b, :, None] * k_pair).sum(-1))
    d_qk, d_kk = torch.stack(d_qk, 2), torch.stack(d_kk, 2)
    diag = torch.eye(nb, device=qc.device).view(nb, 1, nb, 1)
    a_qk = a_qk.view(NC, H, nb, _BC, nb, _BC) + d_qk.unsqueeze(4) * diag
    a_kk = a_kk.view(NC, H, nb, _BC, nb, _BC) + d_kk.unsqueeze(4) * diag
    return a_qk.view(NC, H, C, C), a_kk.view(NC, H, C, C)


add_torch_compile(op)


def _fla_chunk_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's chunk_kda is autotuned and needs a GPU" if probes.needs_cuda(device) else None)


@op.backend("fla", probe=_fla_chunk_probe)
def fla_chunk_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **fused):
    """fla-core's chunk_kda (Kimi's unbounded softplus gate: safe_gate off, lower_bound None)."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cc.int64_offsets(cu_seqlens), **fused)


@op.backend("fla_recurrent", probe=probes.package("fla", "fla-core"), labels=probes.triton_labels, default=False)
def fla_recurrent_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, **fused):
    """fla-core's fused_recurrent_kda, the token-serial kernel: a peer that also runs (slowly) interpreted on CPU;
    run by name only."""
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cc.int64_offsets(cu_seqlens), **fused)
