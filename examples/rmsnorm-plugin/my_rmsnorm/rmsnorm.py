"""`mine.rmsnorm`: y = x / sqrt(mean(x^2) + eps) * weight, over the last axis."""

import torch

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator, randn

EPS = 1e-6


def make_inputs(p, *, device, dtype, seed):
    """Seeded, random, realistic: never zeros."""
    gen = generator(device, seed)
    return {"x": randn((p["tokens"], p["hidden"]), gen, dtype=dtype, device=device),
            "weight": randn((p["hidden"],), gen, dtype=dtype, device=device, std=0.1, mean=1.0)}


def reference(x, weight):
    """fp64, straight from the formula: the oracle every backend is checked against."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def cost(p, dtype):
    n, b = p["tokens"] * p["hidden"], 2 if dtype in ("bf16", "fp16") else 4
    return Cost(flops=4 * n, bytes=2 * n * b + p["hidden"] * b, tokens=p["tokens"])


op = Op(
    name="mine.rmsnorm",                                         # dotted: family.op
    make_inputs_fn=make_inputs, reference=reference, cost=cost,
    axes=[Axis("tokens", [1, 64, 4096, 65536], quick=[1, 67]),   # full (GPU) sweep, and the --quick / CPU one
          Axis("hidden", [2304, 7168], quick=[96])],
    presets={"kimi-linear": {"hidden": [2304]}},
    constraints=[lambda p: "hidden must be even" if p["hidden"] % 2 else None],
    dtypes=["bf16", "fp32"],
    # bf16 outputs carry ~3 significant digits: even torch's own rms_norm is ~2e-3 off the fp64 reference
    tolerance={"bf16": Tolerance(err_ratio=1e-2), "fp32": Tolerance(err_ratio=1e-5)},
)


@op.backend("torch")
def torch_rmsnorm(x, weight):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps=EPS)


add_torch_compile(op)                                            # `torch_compile`: compiled in setup, never timed


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_rmsnorm(x, weight):
    from my_rmsnorm.kernels import rmsnorm  # imported lazily: TRITON_INTERPRET is set by then

    return rmsnorm(x, weight, EPS)
