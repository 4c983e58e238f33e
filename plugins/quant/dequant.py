"""`quant.dequant`: GGUF Q2_K / Q3_K super-blocks -> bf16 (or fp32) weights.

Calling convention: backend(raw=[rows, cols/256*block_bytes] uint8, fmt='q2_k'|'q3_k', out_dtype=torch dtype)
-> [rows, cols] in out_dtype (the op's dtype axis picks bf16 or fp32 OUTPUT; the input is always raw bytes).
Block layouts and element formulas: plugins/quant/kquants.py (moe.md). Every product is exact in fp32, so fp32
output is bit-exact across backends and bf16 output is that value rounded once to nearest even.
Backends: triton (kernels/quant/dequant.py), torch (vectorised bit ops), torch_compile, gguf (the `gguf` package's
numpy dequantizer: host only, so it is unavailable on CUDA rather than timed with two PCIe copies and a sync).
Cost: ~4 FLOPs per weight; bytes = blocks in + weights out.
"""

import torch
from spark_bench.plugins.models import DEEPSEEK_V3, GLM_45, KIMI_LINEAR, tp_slices
from spark_bench.plugins.quant import kquants

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.dtypes import torch_dtype
from spark_bench.inputs import generator

WEIGHT_STD = 0.02  # typical expert weight std


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    raw = kquants.random_blocks(p["format"], p["rows"], p["cols"], gen, std=WEIGHT_STD, device=device)
    return {"raw": raw, "fmt": p["format"], "out_dtype": torch_dtype(dtype)}


def reference(raw, fmt, out_dtype):
    """fp32 from the element formulas (index gathers), whatever the output dtype."""
    return kquants.dequantize_reference(raw, fmt)


def cost(p, dtype):
    n = p["rows"] * p["cols"]
    out_bytes = 4 if dtype == "fp32" else 2
    return Cost(flops=4 * n, bytes=n * kquants.bytes_per_weight(p["format"]) + n * out_bytes)


def _cols_multiple_of_256(p):
    return None if p["cols"] % kquants.QK_K == 0 else f"cols={p['cols']} is not a multiple of {kquants.QK_K}"


def _expert_shapes(model):
    """A model's expert matrices at each tensor-parallel degree that keeps I a multiple of 256: rows = 2I (w1|w3,
    Q2_K) or D (w2, Q3_K), cols = D or I."""
    widths = [i for i in tp_slices(model["inter"]) if i % kquants.QK_K == 0]
    return {"rows": sorted({2 * i for i in widths} | {model["hidden"]}), "cols": sorted({model["hidden"], *widths})}


op = Op(
    name="quant.dequant",
    doc=__doc__,
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("format", ["q2_k", "q3_k"]),
        Axis("rows", [256, 2048, 7168, 32768], quick=[37]),
        Axis("cols", [1024, 2048, 7168], quick=[768]),
    ],
    presets={m["name"]: _expert_shapes(m) for m in (KIMI_LINEAR, DEEPSEEK_V3, GLM_45)},
    constraints=[_cols_multiple_of_256],
    dtypes=["bf16", "fp32"],
    quick_dtypes=["bf16", "fp32"],
    # fp32: bit-exact (exact products, one rounding); bf16: one rounding of a value of relative error <= 2^-9
    tolerance={"bf16": Tolerance(3e-3), "fp32": Tolerance(0.0, max_abs=0.0)},
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_dequant(raw, fmt, out_dtype):
    """Ours: kernels/quant/dequant.py."""
    from spark_bench.kernels.quant.dequant import dequantize

    return dequantize(raw, fmt, out_dtype)


@op.backend("torch")
def torch_dequant(raw, fmt, out_dtype):
    """Eager torch: reshape the bytes and shift with broadcasting."""
    return kquants.dequantize_torch(raw, fmt, out_dtype)


add_torch_compile(op)


def _gguf_probe(device):
    return probes.package("gguf", "gguf")(device) or (
        None if device.startswith("cpu") else "gguf dequantizes with numpy on the host: CPU only")


@op.backend("gguf", probe=_gguf_probe, labels=("host", "numpy"))
def gguf_dequant(raw, fmt, out_dtype):
    """The `gguf` package (gguf.quants.dequantize, numpy fp32), cast to out_dtype."""
    return torch.from_numpy(kquants.dequantize_gguf(raw, fmt)).to(out_dtype)
