"""moe.experts_gguf's prefill paths with hidden != inter: every grouped (fused) and dequant-once test ran at
D = I = 256, so a kernel that swapped the two (the Q2_K gate/up loop over I/256 super-blocks instead of D/256, h's
rows read at stride D, the dequant scratch's GEMMs told inter = D) passed them all. D = 512, I = 256 and the other
way round, against the fp64 loop on gguf's own dequantization (the oracle) and the op's check."""

import pytest
import torch
from spark_bench.kernels.moe.experts_gguf import experts_gguf
from spark_bench.plugins.quant import kquants

from spark_bench import get_op
from spark_bench.check import check_outputs, poisoned_allocations

OP = get_op("moe.experts_gguf")


def naive(x, topk_ids, topk_weights, w13_q, w2_q):
    """fp64, token by token and slot by slot, weights from gguf's numpy dequantizer."""
    I = w13_q.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            w13 = torch.from_numpy(kquants.dequantize_gguf(w13_q[e], "q2_k")).double()
            w2 = torch.from_numpy(kquants.dequantize_gguf(w2_q[e], "q3_k")).double()
            g, u = w13[:I] @ x[t].double(), w13[I:] @ x[t].double()
            y[t] += float(topk_weights[t, k]) * (w2 @ (torch.nn.functional.silu(g) * u))
    return y


@pytest.mark.parametrize("path", ["grouped", "dequant"])
@pytest.mark.parametrize("hidden, inter, seed", [(512, 256, 0), (256, 512, 1)])
def test_prefill_paths_with_hidden_not_inter(path, hidden, inter, seed):
    inputs = OP.make_inputs({"tokens": 9, "hidden": hidden, "inter": inter, "experts": 5, "topk": 2,
                             "routing": "uniform"}, seed=seed)
    with poisoned_allocations():  # unwritten outputs show up as NaN
        out = experts_gguf(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], inputs["w13_q"],
                           inputs["w2_q"], path=path)
    assert out.shape == (9, hidden) and out.dtype == torch.bfloat16
    want = naive(**inputs)
    assert float(((out.double() - want) ** 2).mean() / (want ** 2).mean()) <= 5e-4
    result = check_outputs(OP, out, OP.reference(**inputs), inputs, "bf16")
    assert result["ok"], result["message"]
