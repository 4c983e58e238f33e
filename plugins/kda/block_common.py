"""Helpers shared by the KDA short-conv and block ops: sequence-length patterns (varlen), and for the blocks the
engine's weights, the cost model, the fp32 reference and the composition of a block from per-op backends (stages).

Sequence lengths: `varlen="fixed"` packs `batch` sequences of `seq_len` tokens; a named pattern (kda.md "Shapes
worth sweeping") sets the lengths itself and then runs once, at the first value of the batch and seq_len sweeps
(`pattern_constraint`), so the sweep holds no duplicates.
"""

import torch
import torch.nn.functional as F
from spark_bench.plugins.kda import weights
from spark_bench.plugins.kda.core_common import VARLEN
from spark_bench.plugins.models import KIMI_LINEAR

from spark_bench import Axis, Backend, Cost, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import randn


def seq_lengths(p) -> list[int]:
    """The sequence lengths of a parameter point."""
    name = p.get("varlen", "fixed")
    if name == "fixed":
        return [int(p["seq_len"])] * int(p["batch"])
    return list(VARLEN[name])


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    """[N+1] int32 offsets of the packed sequences."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def pattern_constraint(batch: Axis, seq_len: Axis):
    """A named pattern runs only at the first batch and seq_len value of the full or the quick sweep."""
    firsts = {"batch": {batch.sweep(False)[0], batch.sweep(True)[0]},
              "seq_len": {seq_len.sweep(False)[0], seq_len.sweep(True)[0]}}

    def rule(p):
        if p.get("varlen", "fixed") == "fixed":
            return None
        if p["batch"] in firsts["batch"] and p["seq_len"] in firsts["seq_len"]:
            return None
        return f"varlen={p['varlen']} sets its own lengths (runs only at the first batch and seq_len)"

    return rule


def sequence_info(inputs, params) -> dict:
    """extra_info: the realised sequence lengths."""
    lengths = seq_lengths(params)
    return {"sequences": len(lengths), "tokens": sum(lengths), "max_len": max(lengths)}


# --- block weights ---------------------------------------------------------------------------------------------
WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "conv", "f_a", "f_b", "dt_bias", "a_log", "b_proj", "g_a", "g_b",
                "o_norm", "o_proj")


def block_dims(p) -> dict:
    """H, K, V, D, the forget-gate rank r (Kimi: 128, capped at D for tiny shapes) and conv_dim = H*(2K+V)."""
    H, D = p["heads"], p["hidden"]
    K, V = p.get("head_dim_k", p["head_dim"]), p.get("head_dim_v", p["head_dim"])
    return {"H": H, "K": K, "V": V, "D": D, "r": min(KIMI_LINEAR["gate_rank"], D), "conv_dim": H * (2 * K + V)}


def block_weights(p, gen, dtype, device) -> dict:
    """The engine's weights of one block (torch Linear layout [out, in]), initialised so every activation has
    about unit variance: Linear ~ N(0, 1/in); dt_bias and a_log fp32 like the model (kda.md pitfall 7)."""
    from spark_bench.plugins.kda.short_conv import conv_weight  # short_conv imports this module

    d = block_dims(p)
    H, K, V, D, r = d["H"], d["K"], d["V"], d["D"], d["r"]

    def linear(out_f, in_f):
        return randn((out_f, in_f), gen, dtype=dtype, device=device, std=in_f ** -0.5)

    return {
        "q_proj": linear(H * K, D), "k_proj": linear(H * K, D), "v_proj": linear(H * V, D),
        "conv": conv_weight(d["conv_dim"], gen, dtype, device),
        "f_a": linear(r, D), "f_b": linear(H * K, r),
        "dt_bias": weights.dt_bias(H * K, gen, device), "a_log": weights.a_log(H, gen, device),
        "b_proj": linear(H, D), "g_a": linear(V, D), "g_b": linear(H * V, V),
        "o_norm": randn((V,), gen, dtype=dtype, device=device, std=0.1, mean=1.0),
        "o_proj": linear(D, H * V),
    }


def block_cost(p, dtype, tokens: int, states: int, core_flops: float) -> Cost:
    """kda.md: 2*T*(D*(3Hd + H + 2r) + 2r*Hd + Hd*D) + core FLOPs (written with K and V); bytes = weights + x in and
    out + the conv states and fp32 recurrent states of `states` sequences, read and written."""
    d = block_dims(p)
    H, K, V, D, r = d["H"], d["K"], d["V"], d["D"], d["r"]
    elt = 4 if dtype == "fp32" else 2
    proj = D * (H * (2 * K + V) + H + r + V) + r * H * K + V * H * V + H * V * D
    weight_bytes = elt * (proj + d["conv_dim"] * 4 + V) + 4 * (H * K + H)
    state_bytes = 2 * states * (elt * d["conv_dim"] * 3 + 4 * H * K * V)
    return Cost(flops=2 * tokens * proj + core_flops, bytes=weight_bytes + 2 * elt * tokens * D + state_bytes,
                tokens=tokens)


# --- composing a block from stages -----------------------------------------------------------------------------
def run_stages(stages, ctx: dict) -> dict:
    """Run [(name, fn(ctx) -> dict of new values)] in order on a copy of ctx; returns the final context."""
    ctx = dict(ctx)
    for _, fn in stages:
        ctx.update(fn(ctx))
    return ctx


def stage_calls(stages, ctx: dict) -> list:
    """Backend.stages: each stage as a zero-argument call on the intermediates the stages before it produced."""
    calls, ctx = [], dict(ctx)
    for name, fn in stages:
        snapshot = dict(ctx)
        calls.append((name, lambda fn=fn, snapshot=snapshot: fn(snapshot)))
        ctx.update(fn(ctx))
    return calls


def projections(c) -> dict:
    """x @ W.T for every input projection (bf16 GEMMs, fp32 accumulate): qkv, beta logits, gate and z logits."""
    x = c["x"]
    qkv = torch.cat([F.linear(x, c["q_proj"]), F.linear(x, c["k_proj"]), F.linear(x, c["v_proj"])], -1)
    return {"qkv": qkv, "b_logit": F.linear(x, c["b_proj"]), "g_raw": F.linear(F.linear(x, c["f_a"]), c["f_b"]),
            "z": F.linear(F.linear(x, c["g_a"]), c["g_b"])}


def split_heads(c) -> dict:
    """The conv output as the core's q, k [1, T, H, K] and v [1, T, H, V] (views)."""
    H = c["a_log"].numel()
    K = c["q_proj"].shape[0] // H
    T = c["qkv_conv"].shape[0]
    q, k, v = c["qkv_conv"].split([H * K, H * K, c["v_proj"].shape[0]], -1)
    return {"q": q.view(1, T, H, K), "k": k.view(1, T, H, K), "v": v.view(1, T, H, -1)}


def out_projection(c) -> dict:
    T = c["x"].shape[0]
    return {"out": F.linear(c["o_normed"].reshape(T, -1).to(c["x"].dtype), c["o_proj"])}


def fused_gate(c) -> dict:
    """The core's fused-gate arguments: the raw logits g_raw as [T, H, K] (a view), a_log and dt_bias, and
    use_gate_in_kernel. The core computes -exp(A_log[h]) * softplus(g_raw + dt_bias[h*K + d]) where it loads g, so
    the fp32 decay is never written and re-read (fla's chunk_kda and fused_recurrent_kda take the same flag)."""
    H = c["a_log"].numel()
    return {"g": c["g_raw"].view(c["g_raw"].shape[0], H, -1), "A_log": c["a_log"], "dt_bias": c["dt_bias"],
            "use_gate_in_kernel": True}


def norm_stage(norm):
    def run(c):
        T, H = c["x"].shape[0], c["a_log"].numel()
        return {"o_normed": norm(c["o"].reshape(T, H, -1), c["z"].view(T, H, -1), c["o_norm"])}
    return run


def stage_list(conv_stage, core_stage):
    """make_stages(conv, core, norm) -> the block's stages; conv_stage and core_stage wrap the prefill or decode
    calling conventions. The forget gate runs inside the core (fused_gate)."""
    def make(conv, core, norm):
        return [("projections", projections), ("conv", conv_stage(conv)), ("core", core_stage(core)),
                ("norm", norm_stage(norm)), ("out_proj", out_projection)]
    return make


def reference_block(x, conv_state, recurrent_state, cu_seqlens, w) -> tuple:
    """The fp32 block from x to out (kda.md "Forward of one block"): fp32 GEMMs, the fp64 conv reference, the fp32
    token-loop core (core_common). Returns (out, new conv state, new recurrent state), fp32."""
    from spark_bench.plugins.kda import core_common
    from spark_bench.plugins.kda.short_conv import reference as conv_reference

    f = {k: w[k].float() for k in WEIGHT_NAMES}
    H = f["a_log"].numel()
    K, V = f["q_proj"].shape[0] // H, f["o_norm"].numel()
    xf = x.float()
    T = xf.shape[0]
    qkv = xf @ torch.cat([f["q_proj"], f["k_proj"], f["v_proj"]]).T
    y, new_conv = conv_reference(qkv, f["conv"], cu_seqlens, conv_state.float())
    q, k, v = (t.reshape(1, T, H, -1) for t in y.split([H * K, H * K, H * V], -1))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    g_raw = ((xf @ f["f_a"].T) @ f["f_b"].T).view(1, T, H, K)
    g = -f["a_log"].exp().view(H, 1) * F.softplus(g_raw + f["dt_bias"].view(H, K))
    beta = torch.sigmoid(xf @ f["b_proj"].T).view(1, T, H)
    o, new_state = core_common.reference_tokens(q, k, v, g, beta, scale=K ** -0.5, state=recurrent_state.float(),
                                                cu_seqlens=cu_seqlens)
    o = o[0]
    z = ((xf @ f["g_a"].T) @ f["g_b"].T).view(T, H, V)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * f["o_norm"] * torch.sigmoid(z)
    return o.reshape(T, H * V) @ f["o_proj"].T, new_conv, new_state


def _fla_probe(device):
    return probes.package("fla", "fla-core")(device) or (
        "fla-core's conv, gate and gated norm are autotuned and need a GPU" if probes.needs_cuda(device) else None)


_PATH_AVAILABILITY = {  # backend name -> (probe, labels) of the composed path
    "triton": (probes.triton_kernel, probes.triton_labels),
    "torch": (None, ()),
    "fla": (_fla_probe, ("state-mapped",)),
}


def add_composed_backends(op, make_stages, paths: dict, outputs: tuple, parts_doc: str) -> None:
    """Register one backend per path: paths[name] = the (conv, core, norm) callables, composed by
    make_stages(*parts) into [(stage, fn(ctx) -> dict)]; the backend returns the context values named in `outputs`
    and gives the runner its per-stage breakdown. After "torch", adds torch_compile of the whole torch block."""
    for name, parts in paths.items():
        add_staged_backend(op, name, make_stages(*parts), outputs, path=name.partition("_")[0],  # triton_unfused
                           doc=f"The {name} backends of {parts_doc}; torch GEMMs for projections.")
        if name == "torch":
            add_torch_compile(op)


def add_staged_backend(op, name: str, steps, outputs: tuple, path: str, doc: str) -> None:
    """Register backend `name` running the stages [(stage, fn(ctx) -> dict)] in order; it returns the context
    values named in `outputs`, gives the runner its per-stage breakdown, and takes the availability (probe, labels)
    of `path` (triton, torch or fla)."""
    def pick(ctx):
        return tuple(ctx[k] for k in outputs) if len(outputs) > 1 else ctx[outputs[0]]

    probe, labels = _PATH_AVAILABILITY[path]
    op.add_backend(Backend(name, lambda **inputs: pick(run_stages(steps, inputs)), probe=probe, labels=labels, doc=doc,
                           stages=lambda inputs: stage_calls(steps, inputs)))
