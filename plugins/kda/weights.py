"""Initialisers for KDA parameters, the way the model initialises them (kda.md pitfall 7: an uninitialised
dt_bias gives NaNs): dt ~ logU(1e-3, 0.1), dt_bias = dt + log(-expm1(-dt)), A ~ U(1, 16), a_log = log A."""

import torch

from spark_bench.inputs import log_uniform, uniform


def a_log(heads: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """[H] fp32, per head."""
    return uniform((heads,), gen, 1.0, 16.0, device=device).log()


def dt_bias(channels: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """[H*K] fp32, per channel: the inverse softplus of dt."""
    dt = log_uniform((channels,), gen, 1e-3, 0.1, device=device)
    return dt + torch.log(-torch.expm1(-dt))


# --- from a model's weight file (spark_bench.weights, docs/weights.md) ------------------------------------------------
# With --weights every KDA op takes the layer's tensors; the activations stay random (seeded) but go through the real
# projections, so the gate sees real A_log/dt_bias with real f_a/f_b logits, the conv real q|k|v inputs, and so on.

def fixed_axes(**axes):
    """Op.from_weights.fixed: {axis: shape key} -> the values of this layer; head_dim needs K == V."""
    def fixed(shapes):
        if "head_dim" in axes and axes["head_dim"] == "head_dim" and shapes["head_dim_k"] != shapes["head_dim_v"]:
            return (f"has one head_dim axis, but the layer has K = {shapes['head_dim_k']} != V = "
                    f"{shapes['head_dim_v']}")
        return {axis: shapes["head_dim_k" if key == "head_dim" else key] for axis, key in axes.items()}
    return fixed


def binding(make_inputs, **axes):
    from spark_bench.weights import FromWeights

    def from_file(p, src, *, device, dtype, seed, factory):
        if not src.has_layer:
            return factory(p, device=device, dtype=dtype, seed=seed)
        from spark_bench.dtypes import torch_dtype
        from spark_bench.inputs import generator

        w = src.kda_weights(torch_dtype(dtype), device)
        return make_inputs(p, w, generator(device, seed), device=device, dtype=dtype)

    return FromWeights("kda", fixed_axes(**axes), from_file)


def draw_x(w, T, gen, dtype, device):
    """x [T, D]: rows of the captured activations (--activations), else N(0, 1) (RMS-normed hidden states)."""
    from spark_bench.inputs import randn
    from spark_bench.weights import active

    src = active()
    if src is not None and src.activations is not None:
        return src.activation_rows(T, gen, dtype, device)
    return randn((T, w["q_proj"].shape[1]), gen, dtype=dtype, device=device)


def tokens(w, T, gen, dtype, device):
    """x [T, D] (draw_x) and its projections through the layer's weights."""
    from spark_bench.plugins.kda.block_common import projections

    x = draw_x(w, T, gen, dtype, device)
    return {"x": x, **projections({"x": x, **w})}


def conv_history(w, N, gen, dtype, device):
    """[N, conv_dim, W-1] conv states: the qkv projections of W-1 earlier random tokens per sequence."""
    W = w["conv"].shape[1]
    qkv = tokens(w, N * (W - 1), gen, dtype, device)["qkv"]
    return qkv.view(N, W - 1, -1).transpose(1, 2).contiguous()


def heads_of(w):
    H = w["a_log"].numel()
    return H, w["q_proj"].shape[0] // H, w["v_proj"].shape[0] // H


def core_inputs(w, lengths, gen, dtype, device, fused):
    """The delta-rule core's inputs for packed sequences of `lengths`: q, k, v from the real short conv (zero state)
    of the real projections, the raw gate and beta logits (fused), or their pre-processed forms (unfused)."""
    from spark_bench.plugins.kda import core_common, short_conv
    from spark_bench.plugins.kda.block_common import cu_seqlens

    H, K, V = heads_of(w)
    c = tokens(w, sum(lengths), gen, dtype, device)
    y, _ = short_conv.torch_short_conv(c["qkv"], w["conv"], cu_seqlens(lengths, device))
    T = y.shape[0]
    q, k, v = (t.reshape(T, H, -1) for t in y.split([H * K, H * K, H * V], -1))
    g, beta = c["g_raw"].view(T, H, K), c["b_logit"]
    flags = dict.fromkeys(core_common.FLAGS, bool(fused))
    if fused:
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": w["a_log"], "dt_bias": w["dt_bias"], **flags}
    return {"q": core_common.l2_normalize(q).to(q.dtype), "k": core_common.l2_normalize(k).to(k.dtype), "v": v,
            "g": core_common.kda_decay(g, w["a_log"], w["dt_bias"]), "beta": beta.float().sigmoid().to(beta.dtype),
            "A_log": None, "dt_bias": None, **flags}
