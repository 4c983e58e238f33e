"""An expert id outside [0, E) (vLLM's -1 for an expert on another rank under expert parallelism, or a corrupt id)
adds nothing in every path of our routed-expert kernels, bf16 and GGUF, and is never used to address weights: each
path runs under memcheck as on sm_90a (its GPU block sizes and splits) with unwritten allocations poisoned, against
the reference of the same routing with those slots' weights zeroed and their ids made valid (linearity: a zero
weight adds nothing), a token whose every slot is outside included."""

import dataclasses

import pytest
import torch
from spark_bench.kernels.moe.experts import fused_experts
from spark_bench.kernels.moe.experts_gguf import experts_gguf

from spark_bench import get_op
from spark_bench.check import check_outputs, poisoned_allocations
from spark_bench.kernelgate.memcheck import memcheck
from spark_bench.kernelgate.targets import TARGETS

BF16 = get_op("moe.experts")
GGUF = get_op("moe.experts_gguf")


def outside_ids(inputs: dict, experts: int, seed: int) -> tuple[dict, dict]:
    """(inputs with about a third of the slots, and all of token 1's, routed to -1, E or E + 7 with an infinite
    routing weight; the same inputs with those slots' weights 0 and ids 0): the second is what the first must
    compute (an unrouted slot's weight must not meet its zero partial: 0 x inf is NaN)."""
    ids, weights = inputs["topk_ids"].clone(), inputs["topk_weights"].clone()
    gen = torch.Generator().manual_seed(seed)
    outside = torch.rand(ids.shape, generator=gen) < 0.35
    outside[1] = True
    bad = torch.tensor([-1, experts, experts + 7], dtype=ids.dtype)
    ids[outside] = bad[torch.randint(0, 3, ids.shape, generator=gen)][outside]
    zeroed_ids, zeroed_weights = ids.clone(), weights.clone()
    zeroed_ids[outside], zeroed_weights[outside] = 0, 0.0
    weights[outside] = float("inf")
    return ({**inputs, "topk_ids": ids, "topk_weights": weights},
            {**inputs, "topk_ids": zeroed_ids, "topk_weights": zeroed_weights})


def assert_adds_nothing(op, kernel, inputs: dict, expected_inputs: dict, path: str) -> None:
    args = [inputs[name] for name in ("x", "topk_ids", "topk_weights")] + [v for k, v in inputs.items()
                                                                            if k.startswith("w")]
    with poisoned_allocations(), memcheck(dataclasses.replace(TARGETS["sm_90a"], sm_count=2)):
        out = kernel(*args, path=path)
    want = op.reference(**expected_inputs)
    torch.testing.assert_close(op.reference(**inputs), want, rtol=1e-5, atol=2e-6)  # the reference skips them too
    result = check_outputs(op, out, want, expected_inputs, "bf16")
    assert result["ok"], f"{path}: {result['message']}"
    assert out[1].eq(0).all(), "a token with no routed slot must come out zero"


@pytest.mark.parametrize("path, tokens, seed", [("decode", 5, 0), ("decode", 2, 1), ("grouped", 37, 2),
                                                ("grouped", 70, 3)])
def test_bf16_experts_skip_ids_outside_the_experts(path, tokens, seed):
    params = {"tokens": tokens, "hidden": 72, "experts": 7, "topk": 3, "inter": 40, "routing": "uniform"}
    inputs, expected = outside_ids(BF16.make_inputs(params, seed=seed), 7, seed)
    assert_adds_nothing(BF16, fused_experts, inputs, expected, path)


@pytest.mark.parametrize("path, tokens, seed", [("decode", 3, 0), ("grouped", 19, 1), ("dequant", 19, 2)])
def test_gguf_experts_skip_ids_outside_the_experts(path, tokens, seed):
    params = {"tokens": tokens, "hidden": 256, "inter": 256, "experts": 6, "topk": 2, "routing": "uniform"}
    inputs, expected = outside_ids(GGUF.make_inputs(params, seed=seed), 6, seed)
    assert_adds_nothing(GGUF, experts_gguf, inputs, expected, path)


@pytest.mark.parametrize("tokens, seed", [(5, 4), (3, 5)])
def test_bf16_decode_of_one_expert_skips_ids_outside_it(tokens, seed):
    """E = 1 (the shared expert's launch): each window's first slot leads the whole window whatever its id, so an id
    outside [0, 1), the leader's included, must neither split the window (its slots' partials unwritten) nor add."""
    params = {"tokens": tokens, "hidden": 72, "experts": 1, "topk": 1, "inter": 40, "routing": "uniform"}
    inputs, expected = outside_ids(BF16.make_inputs(params, seed=seed), 1, seed)
    inputs["topk_ids"][0], inputs["topk_weights"][0] = -1, float("inf")  # the window's leader: not an expert
    expected["topk_ids"][0], expected["topk_weights"][0] = 0, 0.0
    assert_adds_nothing(BF16, fused_experts, inputs, expected, "decode")


@pytest.mark.parametrize("op, kernel, params", [
    (BF16, fused_experts, {"tokens": 2, "hidden": 72, "experts": 7, "topk": 3, "inter": 40, "routing": "uniform"}),
    (GGUF, experts_gguf, {"tokens": 2, "hidden": 256, "inter": 256, "experts": 6, "topk": 2, "routing": "uniform"})])
def test_unrouted_slots_stream_no_weights_at_decode(op, kernel, params):
    """Under expert parallelism most of a rank's slots are -1: their groups store zeros without reading an expert's
    weights (bytes counted by the interpreter's traffic counter, with the GPU's block sizes); the same launch with
    every slot routed reads every hit expert."""
    from spark_bench.kernelgate.traffic import counting

    inputs = op.make_inputs(params, seed=6)
    weights = [v for k, v in inputs.items() if k.startswith("w")]
    expert_bytes = sum(w[0].numel() * w.element_size() for w in weights)
    args = [inputs["x"], inputs["topk_ids"], inputs["topk_weights"], *weights]
    with counting() as routed:
        kernel(*args, path="decode")
    assert sum(t.read_unique for t in routed.values()) > expert_bytes
    args[1] = torch.tensor([[-1, params["experts"]] + [-1] * (params["topk"] - 2)] * params["tokens"],
                           dtype=torch.int32)
    with counting() as unrouted:
        out = kernel(*args, path="decode")
    assert out.eq(0).all()
    assert sum(t.read_unique for t in unrouted.values()) < expert_bytes / 8, {k: t.read_unique
                                                                               for k, t in unrouted.items()}
