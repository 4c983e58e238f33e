"""moe.experts: both Triton paths and torch (grouped_mm and its loop fallback) against the fp32 reference and a
per-(token, slot) loop, at T in {1, 5, 7, 64, 300}; an expert with no tokens; all tokens on one expert; the cost
model and extra_info."""

import pytest
import torch
from spark_bench.plugins.moe.common import experts_hit, experts_hit_uniform

from spark_bench import get_op
from spark_bench.check import check_outputs

OP = get_op("moe.experts")


def params(tokens, hidden=72, experts=8, topk=3, inter=40, routing="uniform"):
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "inter": inter, "routing": routing}


def loop_reference(x, topk_ids, topk_weights, w13, w2):
    """fp64, one (token, slot) at a time, straight from the formula."""
    I = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            xt = x[t].double()
            h = torch.nn.functional.silu(w13[e, :I].double() @ xt) * (w13[e, I:].double() @ xt)
            y[t] += float(topk_weights[t, k]) * (w2[e].double() @ h)
    return y


def assert_ok(name, inputs, ref=None):
    b = OP.backends[name]
    out = (b.setup(b.fn, inputs) if b.setup else b.fn)(**inputs)
    assert out.dtype == inputs["x"].dtype and out.shape == inputs["x"].shape
    check = check_outputs(OP, out, OP.reference(**inputs) if ref is None else ref, inputs, "bf16")
    assert check["ok"], f"{name}: {check['message']}"
    return check


@pytest.mark.parametrize("backend", ["triton", "triton_decode", "triton_grouped", "torch"])
@pytest.mark.parametrize("seed, tokens, routing", [(0, 1, "uniform"), (1, 5, "zipf"), (2, 7, "worst"),
                                                   (3, 64, "uniform"), (4, 300, "zipf")])
def test_backend_matches_reference(backend, seed, tokens, routing):
    if backend == "triton_decode" and tokens > 8:
        pytest.skip("the GEMV path is for decode batches")
    if backend == "triton_grouped" and tokens >= 64:
        pytest.skip("auto (`triton`) takes the grouped path here already")
    assert_ok(backend, OP.make_inputs(params(tokens, routing=routing), seed=seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_per_slot_loop(seed):
    inputs = OP.make_inputs(params(6, hidden=40, experts=5, topk=2, inter=24), seed=seed)
    torch.testing.assert_close(OP.reference(**inputs).double(), loop_reference(**inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton_decode", "triton_grouped", "torch"])
def test_expert_without_tokens_and_all_tokens_on_one_expert(backend):
    inputs = OP.make_inputs(params(9, experts=6, topk=2), seed=7)
    ids = torch.tensor([[1, 4], [4, 1], [5, 1]] * 3, dtype=torch.int32)  # experts 0, 2, 3 get nothing
    check = assert_ok(backend, {**inputs, "topk_ids": ids}, loop_reference(**{**inputs, "topk_ids": ids}))
    assert check["err_ratio"] > 0  # bf16 output: exactly zero error would mean the reference was bypassed
    one = {**inputs, "topk_ids": torch.full((9, 1), 3, dtype=torch.int32),
           "topk_weights": inputs["topk_weights"][:, :1]}
    assert_ok(backend, one, loop_reference(**one))


def test_torch_falls_back_to_a_loop_without_aligned_rows():
    inputs = OP.make_inputs(params(11, hidden=36, inter=20), seed=2)  # 72-byte rows: grouped_mm unusable
    from spark_bench.plugins.moe.experts import grouped_mm_ok

    assert grouped_mm_ok(inputs["x"], inputs["w13"], inputs["w2"]) is not None
    assert_ok("torch", inputs)


def test_errors_are_caught():
    inputs = OP.make_inputs(params(20), seed=5)
    ref = OP.reference(**inputs)
    swapped = {**inputs, "w13": torch.cat([inputs["w13"][:, 40:], inputs["w13"][:, :40]], dim=1)}  # up <-> gate
    out = OP.backends["triton"].fn(**swapped)
    assert not check_outputs(OP, out, ref, inputs, "bf16")["ok"]
    out = OP.backends["triton"].fn(**{**inputs, "topk_weights": inputs["topk_weights"].flip(-1)})
    assert not check_outputs(OP, out, ref, inputs, "bf16")["ok"]


def test_cost_model_and_load():
    p = params(64, hidden=2304, experts=256, topk=8, inter=1024)
    assert experts_hit("uniform", 64, 256, 8) == pytest.approx(experts_hit_uniform(64, 256, 8))
    assert experts_hit("worst", 64, 256, 8) == 8
    assert 8 < experts_hit("zipf", 64, 256, 8) < experts_hit_uniform(64, 256, 8)
    c = OP.cost(p, "bf16")
    assert c.flops == 6 * 64 * 8 * 1024 * 2304
    assert c.bytes == pytest.approx(experts_hit_uniform(64, 256, 8) * 1024 * 2304 * 6 + 4 * 64 * 2304 + 8 * 64 * 8)
    assert OP.cost({**p, "routing": "worst"}, "bf16").bytes < c.bytes
    inputs = OP.make_inputs(params(50, routing="worst"), seed=0)
    info = OP.extra_info(inputs, params(50, routing="worst"))
    assert info["experts_hit"] == 3 and info["load_max"] == 50 and info["load_mean"] == pytest.approx(150 / 8)
    assert set(OP.rotate) == {"topk_ids", "topk_weights"}
