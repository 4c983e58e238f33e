"""Shared by `kda.chunk_prefill` and `kda.recurrent_decode`: inputs, the fused pre-processing, the fp32 token-loop
reference of the KDA delta rule, the varlen patterns and the cost model.

The recurrence (per sequence and head, state S [K, V] fp32, "K-first" like fla):
    S = S * exp(g[t])[:, None];  u = beta[t] * (v[t] - k[t] @ S);  S = S + outer(k[t], u);  o[t] = (scale * q[t]) @ S

"Fused" inputs (the `fused` axis) are the raw tensors the block produces, with fla's in-kernel flags set:
use_qk_l2norm_in_kernel (q, k <- x * rsqrt(sum(x^2) + 1e-6)), use_gate_in_kernel (g is the raw gate, the decay is
-exp(A_log[h]) * softplus(g + dt_bias[h*K + d])) and use_beta_sigmoid_in_kernel (beta holds logits).
Unfused inputs are already normalised, g is the fp32 log-space decay and beta is in (0, 1).
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.kda import weights

from spark_bench.dtypes import torch_dtype
from spark_bench.inputs import randn

CHUNK = 64
FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel")

# kda.md's varlen patterns ("fixed" = `batch` sequences of `seq_len` tokens); tiny ones for the CPU sweep.
VARLEN = {
    "mixed6": [1300, 547, 2048, 963, 271, 3063],
    "uniform8x1024": [1024] * 8,
    "short5": [15, 85, 200, 900, 800],
    "prefill+decode": [4096] + [1] * 255,
    # quick (CPU) patterns: odd lengths around the chunk size, and several segments shorter than the conv's W-1 = 3
    "tiny4": [1, 63, 70, 5],
    "tiny-mixed": [40] + [1] * 3,
    "tiny5": [1, 9, 2, 17, 3],
    "tiny3": [2, 1, 5],
}
GPU_VARLEN = [name for name in VARLEN if not name.startswith("tiny")]  # kda.md's varlen shape sets


def seq_lengths(p) -> list[int] | None:
    """The lengths of a varlen point, or None for a fixed batch x seq_len point."""
    return None if p.get("varlen", "fixed") == "fixed" else list(VARLEN[p["varlen"]])


def dtype_bytes(dtype) -> int:
    return torch_dtype(dtype).itemsize


def draw_core_inputs(shape, H, K, V, *, fused, dtype, device, gen) -> dict:
    """q, k [*shape, H, K], v [*shape, H, V], g [*shape, H, K], beta [*shape, H] (+ A_log, dt_bias and the fla flags).

    The gate always comes from the model's initialisers (weights.py): raw logits g_raw ~ N(0, 1) with
    a per-head A_log and a per-channel dt_bias; unfused inputs carry the resulting decay instead."""
    act = torch_dtype(dtype)
    q = randn((*shape, H, K), gen, device=device)
    k = randn((*shape, H, K), gen, device=device)
    v = randn((*shape, H, V), gen, device=device)
    g_raw = randn((*shape, H, K), gen, device=device)
    b_logit = randn((*shape, H), gen, device=device)
    A_log, dt_bias = weights.a_log(H, gen, device), weights.dt_bias(H * K, gen, device)
    flags = dict.fromkeys(FLAGS, bool(fused))
    if fused:
        return {"q": q.to(act), "k": k.to(act), "v": v.to(act), "g": g_raw.to(act), "beta": b_logit.to(act),
                "A_log": A_log, "dt_bias": dt_bias, **flags}
    return {"q": l2_normalize(q).to(act), "k": l2_normalize(k).to(act), "v": v.to(act),
            "g": kda_decay(g_raw, A_log, dt_bias), "beta": b_logit.sigmoid().to(act), "A_log": None, "dt_bias": None,
            **flags}


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_decay(g_raw, A_log, dt_bias) -> torch.Tensor:
    """-exp(A_log[h]) * softplus(g_raw[..., h, d] + dt_bias[h*K + d]), fp32: A_log per head, dt_bias per channel."""
    H, K = g_raw.shape[-2:]
    return -A_log.float().reshape(H, 1).exp() * F.softplus(g_raw.float() + dt_bias.float().reshape(H, K))


def prepare(q, k, g, beta, *, A_log=None, dt_bias=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False):
    """The fused pre-processing in torch: fp32 (q, k, g, beta) as the recurrence consumes them."""
    q, k, g, beta = q.float(), k.float(), g.float(), beta.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_gate_in_kernel:
        g = kda_decay(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    return q, k, g, beta


def delta_rule_loop(q, k, v, g, beta, scale, state):
    """The token loop on fp32 tensors: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [B, H, K, V]
    (not modified). Returns o [B, T, H, V] fp32 and the final state."""
    S = state.clone()
    o = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S)
    return o, S


def reference_tokens(q, k, v, g, beta, *, scale=None, state, cu_seqlens=None, **flags):
    """fp32 reference over sequences (cu_seqlens, B = 1) or a batch; `state` [N, H, K, V]. Returns (o fp32, state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, g, beta = prepare(q, k, g, beta, **flags)
    v = v.float()
    if cu_seqlens is None:
        return delta_rule_loop(q, k, v, g, beta, scale, state.float())
    o = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg = slice(bos, eos)
        o[:, seg], S = delta_rule_loop(q[:, seg], k[:, seg], v[:, seg], g[:, seg], beta[:, seg], scale,
                                       state[n:n + 1].float())
        finals.append(S)
    return o, torch.cat(finals)


def fused_flags(inputs: dict) -> dict:
    """The fla keyword arguments of the fused pre-processing (flags plus A_log and dt_bias)."""
    return {name: inputs[name] for name in (*FLAGS, "A_log", "dt_bias")}


def naive_inputs(inputs: dict) -> dict:
    """fp32 (q, k, v, g, beta) for fla's naive references, pre-processed without `prepare`: F.normalize,
    kda.gate's fp64 reference and torch.sigmoid."""
    from spark_bench.plugins.kda.gate import reference as gate_reference

    q, k, v, g, beta = (inputs[n].float() for n in ("q", "k", "v", "g", "beta"))
    if inputs["use_qk_l2norm_in_kernel"]:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if inputs["use_gate_in_kernel"]:
        g = gate_reference(inputs["g"], inputs["A_log"], inputs["dt_bias"]).float()
    if inputs["use_beta_sigmoid_in_kernel"]:
        beta = torch.sigmoid(beta)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def core_cost(tokens, heads, K, V, *, states, dtype, fused, chunk=None) -> tuple[float, float]:
    """(FLOPs, bytes) of the delta-rule core. Chunked (paper Eq. 13 with d^2 -> K*V): H*T*(6KV + 3C(K+V)/2 + C^2);
    token recurrence: 7*H*T*K*V. Bytes: q, k, v, o in the activation dtype, g fp32 (activation dtype when raw),
    beta, and `states` fp32 states of [H, K, V] (read and/or written)."""
    e = dtype_bytes(dtype)
    if chunk:
        flops = heads * tokens * (6 * K * V + 1.5 * chunk * (K + V) + chunk * chunk)
    else:
        flops = 7 * heads * tokens * K * V
    g_bytes = e if fused else 4
    per_token = heads * (2 * K * e + 2 * V * e + K * g_bytes + e)
    params = (4 * heads + 4 * heads * K) if fused else 0
    return flops, tokens * per_token + params + states * heads * K * V * 4


def err_ratio(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


_INT64_OFFSETS: dict = {}  # int64_offsets' per_tensor cache


def int64_offsets(cu_seqlens):
    """cu_seqlens as int64 for fla, the same tensor object while the same (unmodified) int32 tensor comes back: fla
    caches its chunk indices by the tensor's identity, and a fresh `.long()` per call made it rebuild them every
    call (with CUDA counts, `repeat_interleave` reads their sum on the host: a sync per call, no graph capture)."""
    from spark_bench.kernels.common import per_tensor

    if cu_seqlens is None or cu_seqlens.dtype == torch.int64:
        return cu_seqlens
    return per_tensor(_INT64_OFFSETS, cu_seqlens, cu_seqlens.long, limit=16)
