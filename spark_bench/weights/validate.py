"""One layer's KDA block and MoE layer, checked against the engine's layouts from the file's headers alone (names,
dtypes, shapes; no tensor data read), then loaded on request.

KDA (kda.md): q/k proj [H*K, D], v_proj [H*V, D], the short conv q|k|v concatenation [2HK + HV, W] (W = 4), f_a [r, D],
f_b [H*K, r], dt_bias [H*K] f32 PER CHANNEL, A_log [H] f32 PER HEAD (HF's [1, 1, H, 1] is flattened; a swapped pair is
rejected, never broadcast), b_proj [H, D], g_a [Vg, D], g_b [H*V, Vg], o_norm [V], o_proj [D, H*V]. H comes from
b_proj, K and V from the projections.
MoE (moe.md): gate_w [E, D] (float), gate_bias [E] f32, routed experts w1, w3 [I, D] and w2 [D, I] per expert (HF)
or stacked [E, I, D] / [E, D, I] (GGUF), shared expert w1, w3 [Is, D], w2 [D, Is]; experts either all float (run as
bf16) or Q2_K w1/w3 with Q3_K w2 (K-quant rows: D and I multiples of 256); the shared expert in either format of its
own, or (GGUF) any type the gguf package dequantizes, then dequantized to bf16 at load (`_shared_format`: a type it
cannot take refuses only the ops that run it); an optional pre-MoE norm [D].
Every problem is a WeightError naming the tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from spark_bench.weights.formats import FLOAT_DTYPES, Reader, TensorInfo, WeightError
from spark_bench.weights.names import CONV_PARTS, KDA_ROLES, Family

CONV_WIDTH = 4
QK_K = 256
F32_ROLES = ("dt_bias", "a_log", "gate_bias")
KDA_MARKERS = ("a_log", "dt_bias", "q_conv", "k_conv", "v_conv", "f_a", "f_b", "g_a", "g_b")  # not in an MLA layer


def _shape(info: TensorInfo) -> list[int]:
    return list(info.shape)


class _Names:
    """Finds a role's tensor in the layer (first candidate present)."""

    def __init__(self, reader: Reader, family: Family, layer: int, where: str) -> None:
        self.reader, self.prefix, self.where = reader, family.layer_prefix(layer), where

    def find(self, candidates, **fmt) -> TensorInfo | None:
        for c in candidates:
            info = self.reader.info(self.prefix + c.format(**fmt))
            if info is not None:
                return info
        return None

    def need(self, role: str, candidates, what: str, **fmt) -> TensorInfo:
        info = self.find(candidates, **fmt)
        if info is None:
            names = " or ".join(self.prefix + c.format(**fmt) for c in candidates)
            raise WeightError(f"{self.where}: missing tensor {names} ({what})")
        return info


def _float(info: TensorInfo, where: str, role: str) -> None:
    if role in F32_ROLES:
        if info.dtype != "f32":
            raise WeightError(f"{where}: {info.name} is {info.dtype}, but {role} must be float32 (the engine keeps "
                              f"it in f32; a {info.dtype} copy changes the gate)")
    elif info.dtype not in FLOAT_DTYPES:
        raise WeightError(f"{where}: {info.name} is {info.dtype}; {role} must be a float tensor (bf16, f16 or f32)")


def _expect(info: TensorInfo, shape: list[int], where: str, what: str) -> None:
    if _shape(info) != list(shape):
        raise WeightError(f"{where}: {info.name} has shape {_shape(info)}, expected {list(shape)} ({what})")


@dataclasses.dataclass
class KdaPlan:
    names: dict[str, Any]  # role -> tensor name (conv: the (q, k, v) names)
    dims: dict[str, int]  # H, K, V, D, r, W, conv_dim

    def shapes(self) -> dict[str, int]:
        d = self.dims
        return {"heads": d["H"], "head_dim_k": d["K"], "head_dim_v": d["V"], "hidden": d["D"], "rank": d["r"]}


def plan_kda(reader: Reader, family: Family, layer: int, where: str) -> KdaPlan | None:
    """The layer's KDA block, validated; None when the layer has none (e.g. an MLA layer of Kimi-Linear)."""
    if not family.kda:
        return None
    n = _Names(reader, family, layer, where)
    if not any(n.find(family.kda[role]) for role in KDA_MARKERS if role in family.kda):
        return None  # no tensor only a KDA block has: an MLA (full attention) layer, or none
    infos = {role: n.need(role, cands, "KDA block") for role, cands in family.kda.items()}
    for role, info in infos.items():
        _float(info, where, role.replace("_conv", "_proj") if role in CONV_PARTS else role)
    if len(infos["b_proj"].shape) != 2:
        raise WeightError(f"{where}: {infos['b_proj'].name} has shape {_shape(infos['b_proj'])}, expected [H, D]")
    H, D = infos["b_proj"].shape
    q, v = infos["q_proj"], infos["v_proj"]
    for role in ("q_proj", "k_proj", "v_proj"):
        info = infos[role]
        if len(info.shape) != 2 or info.shape[1] != D or info.shape[0] % H:
            raise WeightError(f"{where}: {info.name} has shape {_shape(info)}, expected [H*head_dim, D] with "
                              f"H = {H} heads (from b_proj) and D = {D}")
    K, V = q.shape[0] // H, v.shape[0] // H
    _expect(infos["k_proj"], [H * K, D], where, "k_proj is [H*K, D] like q_proj")
    _check_gate_params(infos["a_log"], infos["dt_bias"], H, K, where)
    widths = {}
    for part, rows in zip(CONV_PARTS, (H * K, H * K, H * V), strict=True):
        info = infos[part]
        shape = _shape(info)
        if len(shape) == 3 and shape[1] == 1:
            shape = [shape[0], shape[2]]
        if len(shape) != 2 or shape[0] != rows:
            raise WeightError(f"{where}: {info.name} has shape {_shape(info)}, expected [{rows}, 1, W] (the short "
                              f"conv of {part[0]}: the conv weight is the q|k|v concatenation [2HK + HV, W])")
        widths[info.name] = shape[1]
    if set(widths.values()) != {CONV_WIDTH}:
        listing = ", ".join(f"{name} {w}" for name, w in widths.items())
        raise WeightError(f"{where}: short conv widths {listing}; the KDA ops take width {CONV_WIDTH} for all three")
    W = CONV_WIDTH
    f_a, f_b = infos["f_a"], infos["f_b"]
    if len(f_a.shape) != 2 or f_a.shape[1] != D:
        raise WeightError(f"{where}: {f_a.name} has shape {_shape(f_a)}, expected [r, D = {D}] (forget gate down)")
    r = f_a.shape[0]
    _expect(f_b, [H * K, r], where, "forget gate up [H*K, r]")
    g_a = infos["g_a"]
    if len(g_a.shape) != 2 or g_a.shape[1] != D:
        raise WeightError(f"{where}: {g_a.name} has shape {_shape(g_a)}, expected [rank, D = {D}] (output gate down)")
    _expect(infos["g_b"], [H * V, g_a.shape[0]], where, "output gate up [H*V, rank]")
    if _shape(infos["o_norm"]) != [V]:
        raise WeightError(f"{where}: {infos['o_norm'].name} has shape {_shape(infos['o_norm'])}, expected [{V}]: "
                          "o_norm is one RMSNorm weight of [head_dim] shared by all heads")
    _expect(infos["o_proj"], [D, H * V], where, "o_proj [D, H*V]")
    names = {role: infos[role].name for role in KDA_ROLES if role != "conv"}
    names["conv"] = tuple(infos[p].name for p in CONV_PARTS)
    return KdaPlan(names, {"H": H, "K": K, "V": V, "D": D, "r": r, "W": W, "conv_dim": H * (2 * K + V)})


def _check_gate_params(a_log: TensorInfo, dt_bias: TensorInfo, H: int, K: int, where: str) -> None:
    """A_log per head [H] (or HF's [1, 1, H, 1]), dt_bias per channel [H*K]: a swap is named, never broadcast."""
    a_numel = 1
    for s in a_log.shape:
        a_numel *= s
    a_ok = a_numel == H and all(s in (1, H) for s in a_log.shape)
    d_ok = _shape(dt_bias) == [H * K]
    if not d_ok and dt_bias.shape and dt_bias.shape[-1] == H and a_numel == H * K:
        raise WeightError(f"{where}: {dt_bias.name} has shape {_shape(dt_bias)} and {a_log.name} {_shape(a_log)}: "
                          f"dt_bias is per channel [H*K] = [{H * K}] and A_log per head [H] = [{H}] (swapped?)")
    if not d_ok:
        raise WeightError(f"{where}: {dt_bias.name} has shape {_shape(dt_bias)}, expected [{H * K}]: dt_bias is "
                          f"per channel [H*K] (H = {H}, K = {K})")
    if not a_ok:
        raise WeightError(f"{where}: {a_log.name} has shape {_shape(a_log)}, expected [{H}]: A_log is per head [H]")


@dataclasses.dataclass
class MoePlan:
    names: dict[str, Any]  # gate_w, gate_bias, norm (or None), w1/w3/w2 (list per expert or one stacked name), shared
    dims: dict[str, Any]  # D, E, I, Is (None without a shared expert), format
    config: dict[str, Any]  # topk, groups, topk_groups, routed_scaling_factor (those the file states)

    def shapes(self) -> dict[str, Any]:
        d = self.dims
        return {"hidden": d["D"], "experts": d["E"], "inter": d["I"], "shared_inter": d["Is"], "format": d["format"],
                "shared_format": d["shared_format"], "shared_stored": d["shared_stored"],
                "shared_problem": d["shared_problem"], **self.config}


def _format_of(infos: list[TensorInfo], where: str, what: str) -> str:
    """bf16 (every tensor float) or q2k_q3k (w1/w3 Q2_K, w2 Q3_K); else a WeightError."""
    kinds = [i.dtype for i in infos]
    if all(k in FLOAT_DTYPES for k in kinds):
        return "bf16"
    if kinds[0] == kinds[1] == "q2_k" and kinds[2] == "q3_k":
        return "q2k_q3k"
    listing = ", ".join(f"{i.name} {i.dtype}" for i in infos)
    raise WeightError(f"{where}: {what} are {listing}; the MoE ops take float (bf16/f16/f32) experts or GGUF Q2_K "
                      "w1/w3 with Q3_K w2")


def _shared_format(infos: list[TensorInfo], file_format: str) -> dict[str, str | None]:
    """How the ops take the shared expert: shared_format bf16 or q2k_q3k (as the routed experts' formats), with
    shared_stored naming the stored GGML types when they are dequantized to bf16 at load (a Q6_K shared expert of a
    mixed "XL" GGUF: what an engine that runs bf16 or Q2_K/Q3_K shared experts does with it), or shared_problem: why
    the ops that run the shared expert cannot take it (the other MoE ops do not use it and are not refused)."""
    kinds = [i.dtype for i in infos]
    if all(k in FLOAT_DTYPES for k in kinds) or kinds in (["q2_k", "q2_k", "q3_k"],):
        return {"shared_format": "bf16" if kinds[0] in FLOAT_DTYPES else "q2k_q3k", "shared_stored": None,
                "shared_problem": None}
    listing = ", ".join(f"{i.name} {i.dtype}" for i in infos)
    if file_format == "gguf" and all(k in FLOAT_DTYPES or gguf_dequantizes(k) for k in kinds):
        return {"shared_format": "bf16", "shared_stored": "/".join(dict.fromkeys(kinds)), "shared_problem": None}
    return {"shared_format": None, "shared_stored": None,
            "shared_problem": f"its shared expert is {listing}: not float or Q2_K w1/w3 with Q3_K w2 (what the ops "
                              "take), nor a type the gguf package dequantizes"}


def gguf_dequantizes(dtype: str) -> bool:
    """Whether the `gguf` package dequantizes GGML type `dtype` (tried on one zero block)."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper(), None)
    if qtype is None:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def plan_moe(reader: Reader, family: Family, layer: int, where: str, config: dict[str, Any]) -> MoePlan | None:
    """The layer's MoE, validated; None when the layer has no router (a dense layer)."""
    n = _Names(reader, family, layer, where)
    gate = n.find(family.moe["gate_w"])
    if gate is None:
        return None
    _float(gate, where, "gate_w")
    if len(gate.shape) != 2:
        raise WeightError(f"{where}: {gate.name} has shape {_shape(gate)}, expected [experts, hidden]")
    E, D = gate.shape
    bias = n.need("gate_bias", family.moe["gate_bias"], "the router's selection bias [experts] f32")
    _float(bias, where, "gate_bias")
    _expect(bias, [E], where, "gate_bias: one f32 per routed expert")
    names: dict[str, Any] = {"gate_w": gate.name, "gate_bias": bias.name}
    if family.stacked_experts:
        w1, w3, w2 = (n.need(r, family.moe[r], "routed experts") for r in ("w1", "w3", "w2"))
        fmt = _format_of([w1, w3, w2], where, "the routed experts")
        if len(w1.shape) != 3 or w1.shape[0] != E or w1.shape[2] != D:
            raise WeightError(f"{where}: {w1.name} has shape {_shape(w1)}, expected [{E}, inter, {D}]")
        I = w1.shape[1]
        _expect(w3, [E, I, D], where, "up experts like the gate experts")
        _expect(w2, [E, D, I], where, "down experts [E, D, I]")
        names.update(w1=w1.name, w3=w3.name, w2=w2.name)
    else:
        first = [n.need(r, family.moe[r], f"routed expert 0 of {E}", e=0) for r in ("w1", "w3", "w2")]
        fmt = _format_of(first, where, "the routed experts")
        if len(first[0].shape) != 2 or first[0].shape[1] != D:
            raise WeightError(f"{where}: {first[0].name} has shape {_shape(first[0])}, expected [inter, {D}]")
        I = first[0].shape[0]
        lists: dict[str, list[str]] = {"w1": [], "w3": [], "w2": []}
        for e in range(E):
            for role, shape in (("w1", [I, D]), ("w3", [I, D]), ("w2", [D, I])):
                info = n.need(role, family.moe[role], f"routed expert {e} of {E} (the router has {E})", e=e)
                _float(info, where, role)
                _expect(info, shape, where, f"routed expert {e}")
                lists[role].append(info.name)
        names.update(lists)
    shared = [n.find(family.moe[r]) for r in ("shared_w1", "shared_w3", "shared_w2")]
    Is, shared_dims = None, {"shared_format": None, "shared_stored": None, "shared_problem": None}
    if any(shared):
        s1, s3, s2 = (n.need(r, family.moe[r], "shared expert") for r in ("shared_w1", "shared_w3", "shared_w2"))
        shared_dims = _shared_format([s1, s3, s2], reader.format)
        if len(s1.shape) != 2:
            raise WeightError(f"{where}: {s1.name} has shape {_shape(s1)}, expected [Is, D = {D}] (shared expert gate)")
        Is = s1.shape[0]
        _expect(s1, [Is, D], where, "shared expert gate [Is, D]")
        _expect(s3, [Is, D], where, "shared expert up [Is, D]")
        _expect(s2, [D, Is], where, "shared expert down [D, Is]")
        names.update(shared_w1=s1.name, shared_w3=s3.name, shared_w2=s2.name)
    if fmt == "q2k_q3k" and (D % QK_K or I % QK_K):
        raise WeightError(f"{where}: K-quant experts need hidden and inter multiples of {QK_K} (D={D}, I={I})")
    if shared_dims["shared_format"] == "q2k_q3k" and (D % QK_K or Is % QK_K):
        raise WeightError(f"{where}: a K-quant shared expert needs hidden and inter multiples of {QK_K} (D={D}, "
                          f"Is={Is})")
    norm = n.find(family.moe["norm"])
    if norm is not None:
        _float(norm, where, "norm")
        _expect(norm, [D], where, "the pre-MoE RMSNorm weight")
    names["norm"] = norm.name if norm is not None else None
    return MoePlan(names, {"D": D, "E": E, "I": I, "Is": Is, "format": fmt, **shared_dims}, config)


# --- loading ------------------------------------------------------------------------------------------------------
def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous()


def load_kda(reader: Reader, plan: KdaPlan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The block's weights by role (block_common.WEIGHT_NAMES), CPU: matrices in `dtype`, dt_bias and a_log f32."""
    out = {}
    for role, name in plan.names.items():
        if role == "conv":
            parts = [reader.load(p) for p in name]
            out["conv"] = _as(torch.cat([p.reshape(p.shape[0], -1) for p in parts]), dtype)
        elif role in ("dt_bias", "a_log"):
            out[role] = reader.load(name).float().reshape(-1).contiguous()
        else:
            out[role] = _as(reader.load(name), dtype)
    return out


def load_moe_part(reader: Reader, plan: MoePlan, part: str) -> dict[str, torch.Tensor]:
    """One part of the MoE layer on the CPU, as the ops take it: `router` (gate_w bf16, gate_bias f32, norm f32 or
    None), `experts` (w13 [E, 2I, D], w2 [E, D, I]: bf16, or uint8 K-quant rows) or `shared` (w13 [1, 2Is, D],
    w2 [1, D, Is])."""
    names, quant = plan.names, plan.dims["format"] == "q2k_q3k"

    def weight(name):
        t = reader.load(name)
        return t if quant else t.to(torch.bfloat16)

    if part == "router":
        norm = reader.load(names["norm"]).float() if names["norm"] else None
        return {"gate_w": _as(reader.load(names["gate_w"]), torch.bfloat16),
                "gate_bias": reader.load(names["gate_bias"]).float().contiguous(), "norm": norm}
    if part == "experts":
        if isinstance(names["w1"], str):
            w13 = torch.cat([weight(names["w1"]), weight(names["w3"])], dim=1)
            return {"w13": w13.contiguous(), "w2": weight(names["w2"]).contiguous()}
        E = plan.dims["E"]
        w13 = torch.stack([torch.cat([weight(names["w1"][e]), weight(names["w3"][e])]) for e in range(E)])
        w2 = torch.stack([weight(names["w2"][e]) for e in range(E)])
        return {"w13": w13.contiguous(), "w2": w2.contiguous()}
    if part == "shared":
        if "shared_w1" not in names:
            raise WeightError("the layer has no shared expert")
        if plan.dims["shared_problem"]:
            raise WeightError(f"the layer's shared expert cannot be loaded: {plan.dims['shared_problem']}")

        def shared(name):
            if plan.dims["shared_stored"]:  # dequantized to bf16 at load (gguf package)
                return _dequantize_gguf(reader, name)
            t = reader.load(name)
            return t if plan.dims["shared_format"] == "q2k_q3k" else t.to(torch.bfloat16)

        w13 = torch.cat([shared(names["shared_w1"]), shared(names["shared_w3"])])[None]
        return {"w13": w13.contiguous(), "w2": shared(names["shared_w2"])[None].contiguous()}
    raise KeyError(part)


def _dequantize_gguf(reader: Reader, name: str) -> torch.Tensor:
    """One GGUF tensor as bf16: float types converted, quantized ones through gguf.quants.dequantize."""
    info = reader.info(name)
    t = reader.load(name)
    if info.dtype in FLOAT_DTYPES:
        return t.to(torch.bfloat16)
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, info.dtype.upper())
    values = gguf.quants.dequantize(t.numpy(), qtype)
    return torch.from_numpy(values).reshape(info.shape).to(torch.bfloat16)


def layer_tensor_names(plan_kda_: KdaPlan | None, plan_moe_: MoePlan | None) -> list[str]:
    """Every tensor name the layer's plans use (for the content hash)."""
    names: list[str] = []
    for plan in (plan_kda_, plan_moe_):
        if plan is None:
            continue
        for value in plan.names.values():
            if value is None:
                continue
            names.extend([value] if isinstance(value, str) else list(value))
    return sorted(set(names))
