"""moe.align: vLLM's moe_align_block_size semantics (per-expert slot sets, sentinel, padding, tile experts),
checked from first principles and through compare=, including several Triton chunks and empty experts."""

import pytest
import torch
from spark_bench.plugins.moe.common import draw_topk_ids

from spark_bench import get_op
from spark_bench.inputs import generator

OP = get_op("moe.align")
CPU_BACKENDS = ["triton", "torch"]


def call(name, inputs):
    b = OP.backends[name]
    return (b.setup(b.fn, inputs) if b.setup else b.fn)(**inputs)


def assert_aligned(topk_ids, E, bm, out):
    """The contract, written out: every slot once, in a segment of its expert; segments padded with T*K to a
    multiple of bm in ascending expert order; tile experts; the padded count; sentinels past it."""
    sorted_ids, expert_ids, num_post = (t.long() for t in out)
    flat = topk_ids.flatten().long()
    N = flat.numel()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + bm - 1) // bm * bm
    post = int(padded.sum())
    assert int(num_post.flatten()[0]) == post
    assert sorted_ids.numel() == N + E * (bm - 1)
    assert expert_ids.numel() >= post // bm
    assert (sorted_ids[post:] == N).all()
    tile_expert = expert_ids[:post // bm]
    assert torch.equal(tile_expert, torch.repeat_interleave(torch.arange(E), padded // bm))
    body = sorted_ids[:post]
    real = body[body != N]
    assert torch.equal(real.sort().values, torch.arange(N)), "every slot exactly once"
    row_expert = tile_expert.repeat_interleave(bm)
    assert torch.equal(flat[real], row_expert[body != N]), "slots sit in their expert's segment"
    assert int((body == N).sum()) == post - N


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["reference"])
@pytest.mark.parametrize("seed, tokens, experts, topk, bm, routing", [
    (0, 1, 13, 3, 16, "uniform"), (1, 5, 8, 2, 16, "worst"), (2, 33, 13, 3, 32, "zipf"),
    (3, 300, 37, 4, 16, "uniform"), (4, 7, 64, 8, 64, "fixed"), (5, 3000, 13, 4, 16, "zipf")])
def test_alignment_semantics(backend, seed, tokens, experts, topk, bm, routing):
    inputs = OP.make_inputs({"tokens": tokens, "experts": experts, "topk": topk, "block_m": bm, "routing": routing},
                            seed=seed)
    out = call(backend, inputs)
    assert all(t.dtype == torch.int32 for t in out)
    assert_aligned(inputs["topk_ids"], experts, bm, out)
    metrics, ok, msg = OP.compare(out, OP.reference(**inputs), inputs, "bf16")
    assert ok, msg


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_experts_take_no_tiles_and_invalid_tail(backend):
    ids = torch.tensor([[5, 2], [5, 9], [2, 5]], dtype=torch.int32)  # experts 0, 1, 3, 4, 6.. unused
    out = call(backend, {"topk_ids": ids, "num_experts": 12, "block_m": 16})
    assert_aligned(ids, 12, 16, out)
    sorted_ids, expert_ids, num_post = out
    assert int(num_post[0]) == 48 and expert_ids[:3].tolist() == [2, 5, 9]
    assert (expert_ids[3:] == -1).all()
    assert sorted_ids[:16].tolist()[:2] == [1, 4] and sorted_ids[16:19].tolist() == [0, 2, 5]  # slot order kept


def test_compare_checks_semantics_not_order():
    inputs = OP.make_inputs({"tokens": 40, "experts": 6, "topk": 2, "block_m": 16, "routing": "uniform"}, seed=3)
    ref = OP.reference(**inputs)
    sorted_ids, expert_ids, num_post = (t.clone() for t in ref)
    seg = sorted_ids[:16].clone()
    sorted_ids[:16] = seg.flip(0)  # a permutation within expert 0's first tile: still valid
    assert OP.compare((sorted_ids, expert_ids, num_post), ref, inputs, "bf16")[1]
    moved = ref[0].clone()
    last_of_0 = int((ref[0][:16] != 80).sum()) - 1
    first_of_next = 16 * int((ref[1] == ref[1][0]).sum())
    moved[last_of_0], moved[first_of_next] = ref[0][first_of_next], ref[0][last_of_0]  # swap across experts
    assert not OP.compare((moved, ref[1], ref[2]), ref, inputs, "bf16")[1]
    assert not OP.compare((ref[0], ref[1], ref[2] + 16), ref, inputs, "bf16")[1]
    tail = ref[0].clone()
    tail[-1] = 0
    assert not OP.compare((tail, ref[1], ref[2]), ref, inputs, "bf16")[1]


def test_routing_distributions():
    gen = generator("cpu", 0)
    T, E, K = 512, 32, 4
    for routing in ("uniform", "zipf", "worst", "fixed"):
        ids = draw_topk_ids(routing, T, E, K, gen, "cpu")
        assert ids.shape == (T, K) and ids.dtype == torch.int32
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), f"{routing}: ids of a token must be distinct"
    counts = {r: torch.bincount(draw_topk_ids(r, T, E, K, gen, "cpu").flatten().long(), minlength=E)
              for r in ("uniform", "zipf", "worst")}
    assert counts["zipf"].max() > 2 * counts["uniform"].max()
    assert int((counts["worst"] > 0).sum()) == K and counts["worst"].max() == T
    fixed = [draw_topk_ids("fixed", T, E, K, generator("cpu", s), "cpu") for s in (0, 1)]
    assert torch.equal(*fixed)
    uniform = [draw_topk_ids("uniform", T, E, K, generator("cpu", s), "cpu") for s in (0, 1)]
    assert not torch.equal(*uniform)


@pytest.mark.parametrize("seed, tokens, experts, topk, bm, routing", [
    (0, 700, 160, 8, 16, "zipf"), (1, 9, 256, 8, 64, "uniform"), (2, 333, 37, 1, 32, "worst"),
    (3, 700, 8, 2, 16, "zipf")])
def test_gpu_chunking(monkeypatch, seed, tokens, experts, topk, bm, routing):
    """The GPU's chunk sizes (BN = 16384 // next_pow2(E)): many chunks (88 at 700 x 8 slots, E = 160), the prefix
    over chunks in parallel per 16 experts, each scatter program writing its share of tile experts and sentinels;
    or a single chunk (9 x 8 slots: one launch); with 2-32 experts, chunks of 4096 // next_pow2(E) slots (3 of 512
    at 700 x 2 slots, E = 8)."""
    from spark_bench.kernels import common
    from spark_bench.kernels.moe import align

    monkeypatch.setattr(common, "WIDEN_WHEN_INTERPRETING", False)  # the GPU's chunk sizes
    inputs = OP.make_inputs({"tokens": tokens, "experts": experts, "topk": topk, "block_m": bm, "routing": routing},
                            seed=seed)
    out = align.moe_align(inputs["topk_ids"], experts, bm)
    assert_aligned(inputs["topk_ids"], experts, bm, out)
    assert OP.compare(out, OP.reference(**inputs), inputs, "bf16")[1]

