"""moe.shared_expert and moe.layer: bf16 and GGUF (q2k_q3k) against fp32 references and an independent dense
formula, at T in {1, 5, 7, 64, 300}; per-stage breakdown consistent with the whole; near-tie tokens excluded, real
errors caught."""

import pytest
import torch
from spark_bench.plugins.moe import router

from spark_bench import get_op
from spark_bench.check import check_outputs

SHARED = get_op("moe.shared_expert")
LAYER = get_op("moe.layer")


def call(op, name, inputs):
    b = op.backends[name]
    return (b.setup(b.fn, inputs) if b.setup else b.fn)(**inputs)


def dense_formula(x, w1, w3, w2):
    x = x.double()
    return (torch.nn.functional.silu(x @ w1.double().T) * (x @ w3.double().T)) @ w2.double().T


SHARED_CASES = [(b, s, t, h, i, "bf16") for b in ("triton", "torch")
                for s, t, h, i in [(0, 1, 72, 40), (1, 7, 72, 40), (2, 300, 40, 24)]]
SHARED_CASES += [("triton", 3, 5, 256, 256, "q2k_q3k"), ("torch", 4, 64, 256, 256, "q2k_q3k")]


@pytest.mark.parametrize("backend, seed, tokens, hidden, inter, fmt", SHARED_CASES)
def test_shared_expert(backend, seed, tokens, hidden, inter, fmt):
    p = {"tokens": tokens, "hidden": hidden, "inter": inter, "format": fmt}
    assert SHARED.invalid_reason(p) is None
    inputs = SHARED.make_inputs(p, seed=seed)
    out = call(SHARED, backend, inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    check = check_outputs(SHARED, out, SHARED.reference(**inputs), inputs, "bf16")
    assert check["ok"], check["message"]


def test_shared_reference_is_the_dense_formula():
    inputs = SHARED.make_inputs({"tokens": 5, "hidden": 256, "inter": 256, "format": "q2k_q3k"}, seed=9)
    from spark_bench.plugins.quant import kquants

    w13 = torch.from_numpy(kquants.dequantize_gguf(inputs["w13"][0], "q2_k"))  # gguf's own dequantizer
    w2 = torch.from_numpy(kquants.dequantize_gguf(inputs["w2"][0], "q3_k"))
    want = dense_formula(inputs["x"], w13[:256], w13[256:], w2)
    torch.testing.assert_close(SHARED.reference(**inputs).double(), want, rtol=1e-4, atol=1e-5)
    assert SHARED.invalid_reason({"tokens": 1, "hidden": 72, "inter": 256, "format": "q2k_q3k"}) is not None


def layer_params(tokens, fmt="bf16", hidden=64, experts=8, topk=2, inter=48, groups=4, topk_groups=2,
                 shared_format="routed"):
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "inter": inter, "groups": groups,
            "topk_groups": topk_groups, "routed_scaling_factor": 2.5, "format": fmt, "shared_format": shared_format}


LAYER_CASES = [  # (backend, seed, tokens, format, groups, topk_groups): GGUF shapes are 4x larger, so fewer
    *[("triton", s, t, "bf16", g, tg) for s, t, g, tg in [(0, 1, 4, 2), (1, 5, 1, 1), (2, 7, 4, 1), (3, 64, 4, 2),
                                                           (4, 300, 1, 1)]],
    *[("torch", s, t, "bf16", g, tg) for s, t, g, tg in [(5, 1, 1, 1), (6, 7, 4, 2), (7, 300, 4, 2)]],
    ("triton_host", 8, 5, "bf16", 4, 2), ("triton_host", 9, 64, "bf16", 1, 1),
    ("triton", 10, 1, "q2k_q3k", 4, 2), ("torch", 11, 7, "q2k_q3k", 1, 1)]


@pytest.mark.parametrize("backend, seed, tokens, fmt, groups, topk_groups", LAYER_CASES)
def test_layer_matches_reference(backend, seed, tokens, fmt, groups, topk_groups):
    kw = {"hidden": 256, "inter": 256} if fmt == "q2k_q3k" else {}
    p = layer_params(tokens, fmt, groups=groups, topk_groups=topk_groups, **kw)
    assert LAYER.invalid_reason(p) is None
    inputs = LAYER.make_inputs(p, seed=seed)
    out = call(LAYER, backend, inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, p["hidden"])
    check = check_outputs(LAYER, out, LAYER.reference(**inputs), inputs, "bf16")
    assert check["ok"], check["message"]
    assert check["near_tie_tokens"] == 0  # random fp32 bias: ties within 1e-5 are rare at these sizes


def test_layer_reference_is_router_plus_experts_plus_shared():
    inputs = LAYER.make_inputs(layer_params(6, experts=6, topk=2, groups=3, topk_groups=2), seed=4)
    w, ids = router.reference(**{k: inputs[k] for k in ("x", "gate_w", "gate_bias", "gate_bias_host", "topk",
                                                         "groups", "topk_groups", "routed_scaling_factor")})
    I = 48
    x, w13, w2 = inputs["x"], inputs["w13"], inputs["w2"]
    want = dense_formula(x, inputs["shared_w13"][0, :I], inputs["shared_w13"][0, I:], inputs["shared_w2"][0])
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            want[t] += float(w[t, k]) * dense_formula(x[t:t + 1], w13[e, :I], w13[e, I:], w2[e])[0]
    torch.testing.assert_close(LAYER.reference(**inputs).double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed, tokens, topk, experts", [(0, 1, 8, 9), (1, 7, 8, 13), (2, 37, 1, 5), (3, 300, 2, 8)])
def test_shared_expert_runs_as_routed_expert_e(seed, tokens, topk, experts):
    """make_inputs stacks the shared expert after the routed ones, so triton routes it as slot K (expert E, weight
    1) through the same launches; unstacked copies take the separate path. Both match the reference. T*(K+1):
    9 and 63 slots (decode path), 74 and 900 (grouped)."""
    from spark_bench.plugins.moe import layer

    inputs = LAYER.make_inputs(layer_params(tokens, topk=topk, experts=experts, groups=1, topk_groups=1), seed=seed)
    assert layer.fused_shared("triton", inputs) is not None
    assert [name for name, _ in LAYER.backends["triton"].stages(inputs)] == ["router", "experts"]
    ref = LAYER.reference(**inputs)
    apart = {**inputs, "shared_w13": inputs["shared_w13"].clone()}
    assert layer.fused_shared("triton", apart) is None
    for case in (inputs, apart):
        check = check_outputs(LAYER, call(LAYER, "triton", case), ref, case, "bf16")
        assert check["ok"], check["message"]


@pytest.mark.parametrize("backend, seed, tokens", [("triton", 12, 3), ("torch", 13, 6)])
def test_layer_with_a_bf16_shared_expert_beside_gguf_routed_experts(backend, seed, tokens):
    """shared_format=bf16 (as GGUF files keep it, or a Q6_K one dequantized at load): the shared expert runs apart in
    bf16, the routed experts in Q2_K/Q3_K; the result is the reference's, and the cost counts 2 B a shared weight."""
    p = layer_params(tokens, "q2k_q3k", hidden=256, inter=256, experts=4, groups=1, topk_groups=1,
                     shared_format="bf16")
    assert LAYER.invalid_reason(p) is None
    inputs = LAYER.make_inputs(p, seed=seed)
    assert inputs["w13"].dtype == torch.uint8 and inputs["shared_w13"].dtype == torch.bfloat16
    assert [name for name, _ in LAYER.backends[backend].stages(inputs)] == ["router", "experts", "shared_expert",
                                                                            "add"]
    x, w13, w2 = inputs["x"], inputs["shared_w13"][0], inputs["shared_w2"][0]
    shared_alone = dense_formula(x, w13[:256], w13[256:], w2)
    routed_alone = {**inputs, "shared_w13": torch.zeros_like(inputs["shared_w13"])}
    torch.testing.assert_close(LAYER.reference(**inputs).double() - LAYER.reference(**routed_alone).double(),
                               shared_alone, rtol=1e-3, atol=1e-3)
    check = check_outputs(LAYER, call(LAYER, backend, inputs), LAYER.reference(**inputs), inputs, "bf16")
    assert check["ok"], check["message"]
    gguf_shared = LAYER.cost({**p, "shared_format": "routed"}, "bf16").bytes
    assert LAYER.cost(p, "bf16").bytes - gguf_shared == pytest.approx(3 * 256 * 256 * (2 - (2 * 84 + 110) / 768))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_stages_compose_the_layer(backend):
    inputs = LAYER.make_inputs(layer_params(9), seed=1)
    if backend == "triton":  # the separate stages: weights that are not stacked views
        inputs = {**inputs, "shared_w13": inputs["shared_w13"].clone(), "shared_w2": inputs["shared_w2"].clone()}
    stages = LAYER.backends[backend].stages(inputs)
    assert [name for name, _ in stages] == ["router", "experts", "shared_expert", "add"]
    results = {name: fn() for name, fn in stages}
    weights, ids = results["router"]
    assert ids.shape == (9, 2) and weights.shape == (9, 2)
    torch.testing.assert_close(results["add"], results["experts"] + results["shared_expert"])
    torch.testing.assert_close(results["add"].float(), call(LAYER, backend, inputs).float())


def test_compare_skips_near_ties_and_catches_errors():
    inputs = LAYER.make_inputs(layer_params(12, groups=1, topk_groups=1), seed=2)
    ref = LAYER.reference(**inputs)
    out = call(LAYER, "torch", inputs)
    assert LAYER.compare(out, ref, inputs, "bf16")[1]
    bad = out.clone()
    bad[3] += 0.05
    metrics, ok, _ = LAYER.compare(bad, ref, inputs, "bf16")
    assert not ok and metrics["max_abs"] > 0.04
    # make token 3 a near-tie: its (K+1)-th expert's bias lifted to 1e-7 below the K-th biased score
    choice = (inputs["x"].double() @ inputs["gate_w"].double().T).sigmoid() + inputs["gate_bias"].double()
    top = choice[3].topk(3)
    inputs["gate_bias"][top.indices[2]] += float(top.values[1] - top.values[2]) - 1e-7
    ref = LAYER.reference(**inputs)
    out = call(LAYER, "torch", inputs)
    assert LAYER.compare(out, ref, inputs, "bf16")[1]
    bad = out.clone()
    bad[3] += 0.05  # token 3 may route either way now: left out of the error
    metrics, ok, msg = LAYER.compare(bad, ref, inputs, "bf16")
    assert ok and metrics["near_tie_tokens"] >= 1, msg
    bad[4] += 0.05
    assert not LAYER.compare(bad, ref, inputs, "bf16")[1]
