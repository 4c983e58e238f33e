"""moe.align's compare= at its edges: the expert of the LAST real tile and the FIRST sentinel slot past
num_tokens_post_pad are checked too (an off-by-one in either range would let a wrong value through)."""

import torch

from spark_bench import get_op

OP = get_op("moe.align")
S = 10  # the sentinel: T*K = 5*2

# T=5, K=2, E=4, block_m=4: flat slots t*K + k of each expert, padded to 4 with the sentinel 10
TOPK_IDS = [[0, 2], [2, 0], [0, 1], [2, 3], [0, 2]]  # flat: 0 2 2 0 0 1 2 3 0 2
SORTED = [0, 3, 4, 8, 5, S, S, S, 1, 2, 6, 9, 7, S, S, S] + [S] * 6  # 16 padded + up to N + E*(bm-1) = 22
TILES = [0, 1, 2, 3, -1, -1]  # cdiv(22, 4) = 6 tiles, 4 of them real
POST = 16


def inputs():
    return {"topk_ids": torch.tensor(TOPK_IDS, dtype=torch.int32), "num_experts": 4, "block_m": 4}


def test_reference_matches_hand_layout():
    """The layout worked out by hand above is the reference's, and compare= accepts it unchanged."""
    inp = inputs()
    ref = OP.reference(**inp)
    assert ref[0].tolist() == SORTED and ref[1].tolist() == TILES and ref[2].tolist() == [POST]
    metrics, ok, msg = OP.compare(tuple(t.clone() for t in ref), ref, inp, "bf16")
    assert ok, msg
    assert metrics["tiles"] == 4 and metrics["padding"] == POST - S


def test_compare_rejects_wrong_expert_of_last_tile():
    """Tile 3 (the last of post // block_m = 4) names expert 2 instead of 3: its slots would go through the wrong
    expert's weights. sorted_ids are untouched, so only the tile-expert check can see it."""
    inp = inputs()
    ref = OP.reference(**inp)
    tiles = ref[1].clone()
    tiles[POST // 4 - 1] = 2
    _, ok, msg = OP.compare((ref[0].clone(), tiles, ref[2].clone()), ref, inp, "bf16")
    assert not ok
    assert "expert of some tiles" in msg


def test_compare_rejects_slot_at_first_padding_position():
    """sorted_ids[post] (the first entry past num_tokens_post_pad) holds slot 0 instead of the sentinel: a kernel
    reading one row too far would gather a real token there."""
    inp = inputs()
    ref = OP.reference(**inp)
    s = ref[0].clone()
    s[POST] = 0
    _, ok, msg = OP.compare((s, ref[1].clone(), ref[2].clone()), ref, inp, "bf16")
    assert not ok
    assert "1 non-sentinel entries past the padded count" in msg
