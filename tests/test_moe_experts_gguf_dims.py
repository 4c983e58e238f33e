"""moe.experts_gguf's prefill paths with hidden != inter: every grouped (fused) and dequant-once test ran at
D = I = 256, so a kernel that swapped the two (the Q2_K gate/up loop over I/256 super-blocks instead of D/256, h's
rows read at stride D, the dequant scratch's GEMMs told inter = D) passed them all. D = 512, I = 256 and the other
way round, against the fp64 loop on gguf's own dequantization (the oracle) and the op's check."""

import pytest
import torch
from test_moe_experts_gguf import naive, run  # the fp64 loop on gguf's dequantization, the poisoned call

from spark_bench import get_op
from spark_bench.check import check_outputs

OP = get_op("moe.experts_gguf")


@pytest.mark.parametrize("path", ["grouped", "dequant"])
@pytest.mark.parametrize("hidden, inter, seed", [(512, 256, 0), (256, 512, 1)])
def test_prefill_paths_with_hidden_not_inter(path, hidden, inter, seed):
    inputs = OP.make_inputs({"tokens": 9, "hidden": hidden, "inter": inter, "experts": 5, "topk": 2,
                             "routing": "uniform"}, seed=seed)
    out = run(inputs, path=path)
    assert out.shape == (9, hidden) and out.dtype == torch.bfloat16
    want = naive(**inputs)
    assert float(((out.double() - want) ** 2).mean() / (want ** 2).mean()) <= 5e-4
    result = check_outputs(OP, out, OP.reference(**inputs), inputs, "bf16")
    assert result["ok"], result["message"]
