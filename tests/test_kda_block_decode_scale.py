"""kernels/kda/block_decode.py's conv_recurrent_decode takes a `scale` that kda.block_decode never passes (it runs at
the default K^-0.5), so a kernel that ignored the argument passed every test. The scale multiplies q only where
the output is read (o = scale q S; the state update uses k, v, g, beta), so o at scale s is s / K^-0.5 times o at
the default, and both state pools come out the same; K != V, odd H, fp32."""

import pytest
import torch
from spark_bench.kernels.kda.block_decode import conv_recurrent_decode
from spark_bench.plugins.kda import block_common as bc

import spark_bench

DECODE = spark_bench.get_op("kda.block_decode")


@pytest.mark.parametrize("scale", [0.3, 1.7])
def test_conv_recurrent_decode_takes_its_scale(scale):
    params = {"batch": 2, "heads": 3, "head_dim": 16, "head_dim_k": 16, "head_dim_v": 24, "hidden": 24}
    inputs = DECODE.make_inputs(params, dtype="fp32", seed=3)
    c = bc.projections(inputs)
    H, K = 3, 16

    def run(s):
        conv_pool, state_pool = inputs["conv_state_pool"].clone(), inputs["state_pool"].clone()
        o = conv_recurrent_decode(c["qkv"], inputs["conv"], conv_pool, c["g_raw"], c["b_logit"], inputs["a_log"],
                                  inputs["dt_bias"], state_pool, inputs["slots"], heads=H, scale=s)
        return o, conv_pool, state_pool

    o_default, conv_default, state_default = run(None)
    o, conv_pool, state_pool = run(scale)
    assert o.abs().max() > 0.1
    torch.testing.assert_close(o, o_default * (scale / K ** -0.5), rtol=1e-5, atol=1e-6)
    assert torch.equal(state_pool, state_default) and torch.equal(conv_pool, conv_default)
    assert torch.equal(run(K ** -0.5)[0], o_default)
