"""moe.experts, the Triton paths at forced tile choices: the decode down projection split over slices of I, the
grouped GEMMs at every BM and several GROUP_M (partial last group), against the fp32 reference. Odd T, E not a
power of two, top-k 1 and 8, several seeds."""

import pytest
from spark_bench.kernels.moe.experts import BLOCK_M_CONFIGS, fused_experts, live_tiles
from spark_bench.kernels.moe.experts_decode import decode, down_split, up_split

from spark_bench import get_op
from spark_bench.check import check_outputs, poisoned_allocations

OP = get_op("moe.experts")


def inputs(tokens, experts, topk, seed, hidden=72, inter=40, routing="uniform"):
    return OP.make_inputs({"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "inter": inter,
                           "routing": routing}, seed=seed)


def assert_matches(inp, **kw):
    with poisoned_allocations():
        out = fused_experts(inp["x"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], **kw)
    check = check_outputs(OP, out, OP.reference(**inp), inp, "bf16")
    assert check["ok"], check["message"]


@pytest.mark.parametrize("seed, tokens, experts, topk, split_i, split_d", [
    (0, 1, 9, 8, 16, None), (1, 3, 7, 1, 24, 24), (2, 1, 1, 1, 8, 16), (3, 5, 9, 8, None, 40), (4, 3, 9, 8, 40, None),
    (5, 1, 1, 1, None, 32)])
def test_decode_split_over_inter_and_hidden(seed, tokens, experts, topk, split_i, split_d):
    inp = inputs(tokens, experts, topk, seed, routing="zipf" if seed % 2 else "uniform")
    with poisoned_allocations():
        out = decode(inp["x"], inp["topk_ids"].int(), inp["topk_weights"].float(), inp["w13"], inp["w2"],
                     split_i=split_i, split_d=split_d)
    check = check_outputs(OP, out, OP.reference(**inp), inp, "bf16")
    assert check["ok"], check["message"]


@pytest.mark.parametrize("seed, tokens, experts, topk, block_m, group_m", [
    (0, 37, 9, 8, 16, 3), (1, 37, 9, 1, 16, 2), (2, 19, 11, 8, 32, 1), (3, 45, 3, 1, 64, 2), (4, 23, 9, 8, 64, 8)])
def test_grouped_tile_orders(seed, tokens, experts, topk, block_m, group_m):
    routing = ("uniform", "zipf", "worst")[seed % 3]
    assert_matches(inputs(tokens, experts, topk, seed, routing=routing), path="grouped", block_m=block_m,
                   group_m=group_m)


def test_block_m_follows_the_load_and_the_grid_is_trimmed():
    assert [BLOCK_M_CONFIGS.pick(load=n)["BM"] for n in (0, 8, 16, 47, 48, 159, 160, 512)] == \
        [16, 16, 32, 32, 64, 64, 128, 128]
    assert live_tiles(8, 256, 16, 248) == 8  # one slot per tile at most
    assert live_tiles(128, 256, 16, 248) == 128
    assert live_tiles(131072, 256, 128, 1278) == 1278  # prefill: the worst case bound itself


@pytest.mark.parametrize("seed, tokens, experts, topk, routing, split_i, split_d", [
    (0, 8, 9, 8, "worst", None, None),  # 64 slots on 8 experts: 8 leaders serve 8 slots each
    (1, 64, 1, 1, "uniform", None, 24),  # the shared expert: slot 0 leads all 64, D split in 3
    (2, 7, 5, 1, "zipf", 16, None),  # odd T, E = 5, top-1, skewed: groups of uneven size
    (3, 21, 13, 3, "zipf", 24, 40),  # 63 slots, both splits
    (4, 33, 1, 1, "uniform", None, None),
    (5, 100, 1, 1, "uniform", None, None),  # forced past 64 slots: windows of 64, the second led by slot 64
    (6, 30, 7, 3, "worst", 24, None)])  # 90 slots on 3 experts: each window has its own 3 leaders
def test_decode_serves_repeated_experts_from_one_program(seed, tokens, experts, topk, routing, split_i, split_d):
    """Slots that share an expert are computed by its first slot's programs (the others exit): every slot's output
    must still come out (poisoned scratch would show a slot nobody wrote)."""
    inp = inputs(tokens, experts, topk, seed, routing=routing)
    with poisoned_allocations():
        out = decode(inp["x"], inp["topk_ids"].int(), inp["topk_weights"].float(), inp["w13"], inp["w2"],
                     split_i=split_i, split_d=split_d)
    check = check_outputs(OP, out, OP.reference(**inp), inp, "bf16")
    assert check["ok"], check["message"]


def test_auto_takes_the_decode_path_up_to_64_slots():
    from spark_bench.kernels.moe import experts

    calls = []
    real = experts.decode
    try:
        experts.decode = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
        for tokens, topk, n_exp in ((64, 1, 1), (8, 8, 256), (1, 3, 5)):
            inp = inputs(tokens, n_exp, topk, 0, hidden=40, inter=24)
            fused_experts(inp["x"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"])
    finally:
        experts.decode = real
    assert calls == [(64, 1), (8, 8), (1, 3)]


def test_decode_split_reaches_the_cta_target():
    # Kimi-Linear T = 1: 8 slots x 144 D tiles already >= 1024; the shared expert (1 slot) splits I in 8
    assert down_split(8, 2304, 1024, 16, 256, 1024) == (1, 1024)
    S, i_split = down_split(1, 2304, 1024, 16, 128, 1024)
    assert S * 144 >= 1024 and i_split % 128 == 0 and S * i_split >= 1024
    assert up_split(8, 2304, 1024, 16, 1024) == (2, 1152)  # routed: 8 x 2 x 64 = 1024 programs
    assert up_split(1, 2304, 1024, 16, 1024) == (18, 128)  # shared expert: 18 slices of D, 1152 programs
    assert up_split(64, 2304, 1024, 16, 1024) == (1, 2304)  # 64 slots: no split


@pytest.mark.parametrize("seed, tokens, experts, topk, routing, split_i, split_d", [
    (0, 1, 9, 8, "uniform", 16, None), (1, 3, 5, 2, "worst", None, None), (2, 8, 9, 8, "zipf", 24, None),
    (3, 7, 1, 1, "uniform", 8, None),
    (4, 1, 1, 1, "uniform", 16, 32), (5, 3, 7, 1, "zipf", None, 64)])  # gate/up split over D (PARTS): fused too
@pytest.mark.parametrize("fuse", [1, 0])
def test_decode_sums_its_slots_in_the_down_kernel(monkeypatch, seed, tokens, experts, topk, routing, split_i, split_d,
                                                  fuse):
    """FUSE (the decode-size choice of moe.slots._sum_slots): the last _decode_down program of each D tile (D = 300:
    3 tiles of 128 under the interpreter) sums the tile's slot partials, so _sum_slots never launches; FUSE = 0
    (the candidate) launches it. Both against the reference; the tickets are back to zero for the next call."""
    from spark_bench.kernels.common import tickets
    from spark_bench.kernels.moe import slots
    from spark_bench.kernels.moe.slots import SUM_CONFIGS

    from spark_bench.tune.space import applied

    launched = []
    real = slots._sum_slots
    monkeypatch.setattr(slots, "_sum_slots", type("Spy", (), {"__getitem__": lambda self, g: launched.append(g)
                                                              or real[g]})())
    inp = inputs(tokens, experts, topk, seed, hidden=300, inter=48, routing=routing)
    forced = {"moe.slots._sum_slots": {"BT": 1, "BD": 256, "FUSE": fuse, "num_warps": 4}}
    for _ in range(2):
        with poisoned_allocations(), applied(forced):
            out = decode(inp["x"], inp["topk_ids"].int(), inp["topk_weights"].float(), inp["w13"], inp["w2"],
                         split_i=split_i, split_d=split_d)
        check = check_outputs(OP, out, OP.reference(**inp), inp, "bf16")
        assert check["ok"], check["message"]
    assert bool(launched) == (not fuse)
    assert int(tickets("moe.experts_decode._decode_down", inp["x"].device, 1).abs().sum()) == 0
    assert SUM_CONFIGS.declared(T=8, D=2304)["FUSE"] == 1 and SUM_CONFIGS.declared(T=9, D=2304)["FUSE"] == 0


def test_the_slot_sum_takes_column_tiles_fastest_unless_token_blocks_exceed_grid_dimension_1(monkeypatch,
                                                                                               record_grids):
    """_sum_slots' grid is (D/BD, T/BT), whole rows of y_slots in consecutive programs; past CUDA's 65535 cap on grid
    dimension 1 it takes token blocks fastest; both sum each token's rows in order, exactly."""
    import torch
    from spark_bench.kernels import common
    from spark_bench.kernels.moe import slots

    grids = record_grids(slots, "_sum_slots")
    monkeypatch.setattr(common, "WIDEN_WHEN_INTERPRETING", False)  # the declared BT = 16, BD = 128, not wider
    part = torch.randn(37 * 3, 200, generator=torch.Generator().manual_seed(0))  # 3 token blocks, 2 column tiles
    want = part.view(37, 3, 200).sum(1)
    config = {"BT": 16, "BD": 128, "FUSE": 0, "num_warps": 4}
    for cap in (65535, 2):
        monkeypatch.setattr("spark_bench.kernels.common.MAX_GRID_YZ", cap)
        torch.testing.assert_close(slots.sum_slots(part, 37, torch.float32, config), want, rtol=1e-6, atol=1e-6)
    assert grids == [(2, 3), (3, 2)]
