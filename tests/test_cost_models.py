"""Cost models against hand arithmetic (kda.md and moe.md cost tables): FLOPs and minimum bytes at small points,
weights counted once (not per token), element sizes per dtype, the MoE layer's shared expert in its FLOPs.
Every expected number is worked out in the test from the op's inputs and outputs, never from the op itself."""

import pytest

from spark_bench import get_op


def cost(name, dtype="bf16", **params):
    op = get_op(name)
    return op.cost({**op.default_params(), **params}, dtype)


def test_kda_gate_cost_by_hand():
    """kda.gate at T=4, H=2, K=8 (n = T*H*K = 64): FLOPs = 5n (kda.md: ~5 per element);
    bytes = g_raw in (n * 2 bf16 / 4 fp32) + g out (n * 4, always fp32) + dt_bias (4*H*K) + A_log (4*H)."""
    c = cost("kda.gate", tokens=4, heads=2, head_dim=8)
    assert c.flops == 320  # 5 * 64
    assert c.bytes == 128 + 256 + 64 + 8  # 456
    assert c.tokens == 4
    c32 = cost("kda.gate", "fp32", tokens=4, heads=2, head_dim=8)
    assert c32.flops == 320
    assert c32.bytes == 256 + 256 + 64 + 8  # 584: only the input widens


def test_kda_gated_rmsnorm_bytes_follow_dtype():
    """kda.gated_rmsnorm at T=4, H=2, V=8 (n = 64): bytes = elt * (o + z in, y out: 3n, + weight V), elt = 2 for
    bf16 and 4 for fp32 (the fp32 case reads and writes twice the bytes); FLOPs = 8n either way."""
    bf16 = cost("kda.gated_rmsnorm", tokens=4, heads=2, head_dim=8)
    fp32 = cost("kda.gated_rmsnorm", "fp32", tokens=4, heads=2, head_dim=8)
    assert bf16.bytes == 2 * (3 * 64 + 8) == 400
    assert fp32.bytes == 4 * (3 * 64 + 8) == 800
    assert bf16.flops == fp32.flops == 512


def router_point(tokens):
    return dict(tokens=tokens, hidden=16, experts=8, topk=2, groups=1, topk_groups=1)


def test_moe_router_counts_gate_weights_once():
    """moe.router (fused GEMM + selection, logits never leave the chip) at D=16, E=8, K=2:
    bytes = gate_w 2*E*D (bf16, read once per call) + x 2*T*D + bias 4*E + w f32 and ids i32 out 8*T*K;
    FLOPs = GEMM 2*T*E*D + selection 8*T*E. Going from T=3 to T=7 adds only the per-token part 4*(2D + 8K)."""
    c3, c7 = cost("moe.router", **router_point(3)), cost("moe.router", **router_point(7))
    assert c3.bytes == 256 + 96 + 32 + 48  # 432
    assert c3.flops == 768 + 192  # 960
    assert c7.bytes - c3.bytes == 4 * (2 * 16 + 8 * 2) == 192
    assert c3.tokens == 3


@pytest.mark.parametrize("fmt, weight_bytes", [
    ("bf16", 256 * 256 * (2 * 2 + 2)),  # w1|w3 and w2 at 2 bytes a weight
    ("q2k_q3k", 256 * (2 * 84 + 110)),  # I*D*(2*84/256 + 110/256) with D = 256: the super-block sizes
])
def test_moe_shared_expert_counts_weights_once(fmt, weight_bytes):
    """moe.shared_expert at D=I=256 (moe.md: 6*T*I*D FLOPs, 3*I*D*b + 4*T*D bytes): its weights are read once a call,
    so T=3 and T=7 differ by 4 tokens' x in and z out only (4 * 4 * D bytes)."""
    c3 = cost("moe.shared_expert", tokens=3, hidden=256, inter=256, format=fmt)
    c7 = cost("moe.shared_expert", tokens=7, hidden=256, inter=256, format=fmt)
    assert c3.flops == 6 * 3 * 256 * 256 == 1_179_648
    assert c3.bytes == pytest.approx(weight_bytes + 4 * 3 * 256)
    assert c7.bytes - c3.bytes == pytest.approx(4 * 4 * 256)


def test_moe_layer_flops_include_shared_expert():
    """moe.layer at T=2, D=16, E=4, K=2, I=8 (bf16, shared expert in the routed format), moe.md's sum of the parts:
    router 2*T*E*D + 8*T*E = 256 + 64, routed experts 6*T*K*I*D = 3072, shared expert 6*T*I*D = 1536, add T*D = 32.
    Bytes: gate_w 2*E*D = 128, bias 4*E = 16, n_e(2) = 4*(1 - (1 - 2/4)**2) = 3 routed experts hit and the shared one,
    each 3*I*D*2 = 768, x in and out 4*T*D = 128."""
    c = cost("moe.layer", tokens=2, hidden=16, experts=4, topk=2, inter=8, groups=1, topk_groups=1,
             format="bf16", shared_format="routed")
    assert c.flops == 256 + 64 + 3072 + 1536 + 32  # 4960
    assert c.bytes == pytest.approx(128 + 16 + (3 + 1) * 768 + 128)  # 3344
    assert c.tokens == 2
