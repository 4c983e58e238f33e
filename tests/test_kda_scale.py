"""The KDA core's `scale` argument is honoured: every other test passes scale = K^-0.5, the kernels' default, so a
kernel that dropped the argument and used its default passed. Here scale = 0.3 (K^-0.5 = 0.204 at K = 24), the
Triton chunk prefill and recurrent decode against the fp32 reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from spark_bench.plugins.kda import chunk_prefill, recurrent_decode  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402

SCALE = 0.3


def copy(inputs):
    return {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}


@pytest.mark.parametrize("fused", [True, False])
def test_chunk_prefill_scale(fused):
    p = {"batch": 1, "seq_len": 37, "varlen": "fixed", "heads": 2, "head_dim_k": 24, "head_dim_v": 40, "fused": fused}
    inputs = {**chunk_prefill.op.make_inputs(p, dtype="fp32", seed=11), "scale": SCALE}
    assert abs(SCALE - 24 ** -0.5) > 0.05
    o, s = chunk_prefill.triton_chunk_prefill(**copy(inputs))
    o_r, s_r = chunk_prefill.reference_chunk_prefill(**copy(inputs))
    assert cc.err_ratio(o, o_r) <= 1e-4 and cc.err_ratio(s, s_r) <= 1e-4
    o_d, _ = chunk_prefill.reference_chunk_prefill(**copy({**inputs, "scale": None}))
    assert cc.err_ratio(o_d, o_r) > 0.1  # the reference itself sees the scale


@pytest.mark.parametrize("fused", [True, False])
def test_recurrent_decode_scale(fused):
    p = {"batch": 3, "seq_len": 2, "heads": 2, "head_dim_k": 24, "head_dim_v": 40, "fused": fused}
    inputs = {**recurrent_decode.op.make_inputs(p, dtype="fp32", seed=12), "scale": SCALE}
    o, pool = recurrent_decode.triton_recurrent_decode(**copy(inputs))
    o_r, pool_r = recurrent_decode.reference_recurrent_decode(**copy(inputs))
    assert cc.err_ratio(o, o_r) <= 1e-4 and cc.err_ratio(pool, pool_r) <= 1e-4
