"""moe.router: id sets, weights and sum(w) against the fp64 reference and a per-token loop; the -inf group mask
with negative biased scores; host selection against device selection; compare= rejects real mismatches."""

import math

import pytest
import torch

from spark_bench import get_op
from spark_bench.check import check_outputs

OP = get_op("moe.router")
CPU_BACKENDS = ["triton", "torch", "host"]


def params(tokens, hidden=72, experts=16, topk=4, groups=1, topk_groups=1, scale=2.5):
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "groups": groups,
            "topk_groups": topk_groups, "routed_scaling_factor": scale}


def loop_router(x, gate_w, gate_bias, topk, groups, topk_groups, scale):
    """Per-token Python selection from the formula (independent of the op's reference)."""
    logits = x.double() @ gate_w.double().T
    out_ids, out_w = [], []
    E = gate_w.shape[0]
    size = E // groups
    for t in range(x.shape[0]):
        score = [1 / (1 + math.exp(-v)) for v in logits[t].tolist()]
        choice = [s + b for s, b in zip(score, gate_bias.double().tolist(), strict=True)]
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -gscore[g])[:topk_groups]
        allowed = [e for e in range(E) if e // size in kept] if groups > 1 else list(range(E))
        ids = sorted(allowed, key=lambda e: -choice[e])[:topk]
        w = [score[e] for e in ids]
        out_ids.append(ids)
        out_w.append([v / sum(w) * scale for v in w])
    return torch.tensor(out_w, dtype=torch.float64), torch.tensor(out_ids)


def call(name, inputs):
    b = OP.backends[name]
    return (b.setup(b.fn, inputs) if b.setup else b.fn)(**inputs)


def assert_same_routing(out, ref, atol_w=1e-5):
    (w, ids), (rw, rids) = out, ref
    order, rorder = ids.long().argsort(-1), rids.long().argsort(-1)
    assert torch.equal(ids.long().gather(1, order), rids.long().gather(1, rorder))
    torch.testing.assert_close(w.double().gather(1, order), rw.double().gather(1, rorder), rtol=1e-5, atol=atol_w)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seed, tokens, experts, topk, groups, topk_groups", [
    (0, 1, 16, 4, 1, 1), (1, 7, 24, 3, 1, 1), (2, 37, 16, 4, 4, 2), (3, 5, 32, 6, 8, 3), (4, 19, 20, 2, 4, 1)])
def test_backend_matches_reference(backend, seed, tokens, experts, topk, groups, topk_groups):
    p = params(tokens, experts=experts, topk=topk, groups=groups, topk_groups=topk_groups)
    assert OP.invalid_reason(p) is None
    inputs = OP.make_inputs(p, seed=seed)
    w, ids = call(backend, inputs)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, topk)
    check = check_outputs(OP, (w, ids), OP.reference(**inputs), inputs, "bf16")
    assert check["ok"], check["message"]
    assert check["mismatched_tokens"] == 0
    torch.testing.assert_close(w.sum(-1).double(), torch.full((tokens,), 2.5, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "ids of a token must be distinct"
    assert_same_routing((w, ids), loop_router(inputs["x"], inputs["gate_w"], inputs["gate_bias"], topk, groups,
                                              topk_groups, 2.5))


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["reference"])
def test_negative_biased_scores_are_masked_with_minus_inf(backend):
    """All biased scores negative: a 0.0 group mask (HF) would make the dropped groups win; -inf never does."""
    p = params(9, experts=32, topk=4, groups=8, topk_groups=2)
    inputs = OP.make_inputs(p, seed=11)
    inputs["gate_bias"] = inputs["gate_bias"] - 2.0  # sigmoid < 1, so every choice is < 0
    inputs["gate_bias_host"] = inputs["gate_bias"].cpu()
    w, ids = call(backend, inputs)
    ref_w, ref_ids = loop_router(inputs["x"], inputs["gate_w"], inputs["gate_bias"], 4, 8, 2, 2.5)
    assert_same_routing((w, ids), (ref_w, ref_ids))
    assert (ids // 4).unique(dim=None).numel() <= 9 * 2
    for t in range(9):
        assert len(set((ids[t] // 4).tolist())) <= 2, "ids from more groups than kept"
    # the zero-mask variant really differs on this input, so the test discriminates between the two
    logits = inputs["x"].float() @ inputs["gate_w"].float().T
    choice = logits.sigmoid() + inputs["gate_bias"]
    grouped = choice.view(9, 8, 4)
    kept = grouped.topk(2, -1).values.sum(-1).topk(2, -1).indices
    keep = torch.zeros(9, 8, dtype=torch.bool).scatter_(1, kept, True)
    zero_masked = grouped.masked_fill(~keep[..., None], 0.0).view(9, 32).topk(4, -1).indices
    assert not torch.equal(zero_masked.sort(-1).values, ids.long().sort(-1).values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_and_device_selection_agree(seed):
    inputs = OP.make_inputs(params(33, experts=24, topk=3, groups=4, topk_groups=2), seed=seed)
    assert inputs["gate_bias_host"].device.type == "cpu"
    assert_same_routing(call("host", inputs), call("triton", inputs), atol_w=1e-6)


def test_compare_accepts_near_ties_and_rejects_real_mismatches():
    inputs = OP.make_inputs(params(1, experts=16, topk=2), seed=4)
    logits = inputs["x"].double() @ inputs["gate_w"].double().T
    choice = logits.sigmoid() + inputs["gate_bias"].double()
    first, second = choice[0].topk(2).indices.tolist()
    other = next(e for e in range(16) if e not in (first, second))
    # expert `other` ties with the 2nd choice to 1e-8 (bias moves the choice only): either pick is acceptable
    inputs["gate_bias"][other] += float(choice[0, second] - choice[0, other]) - 1e-8
    ref = OP.reference(**inputs)
    assert set(ref[1][0].tolist()) == {first, second}
    w, ids = call("torch", inputs)
    swapped = torch.where(ids == second, other, ids)
    metrics, ok, msg = OP.compare((w, swapped), ref, inputs, "bf16")
    assert ok and metrics["near_tie_tokens"] == 1, msg
    far = int(choice[0].argmin())
    metrics, ok, _ = OP.compare((w, torch.where(ids == second, far, ids)), ref, inputs, "bf16")
    assert not ok and metrics["mismatched_tokens"] == 1
    assert not OP.compare((w * torch.tensor([[1.001, 1.0]]), ids), ref, inputs, "bf16")[1]
    assert not OP.compare((w, torch.full_like(ids, first)), ref, inputs, "bf16")[1]  # repeated ids


def test_quick_points_respect_group_constraints():
    points = OP.points(quick=True)
    assert points and all(OP.invalid_reason(p) is None for p in points)
    assert OP.invalid_reason(params(1, experts=16, groups=4, topk_groups=5)) is not None
    assert OP.invalid_reason(params(1, experts=16, groups=4, topk_groups=4)) is None  # every group kept: plain top-k
    assert OP.invalid_reason(params(1, experts=16, topk=9, groups=4, topk_groups=2)) is not None
    assert OP.points(preset="deepseek-v3")[0]["groups"] == 8


@pytest.mark.parametrize("topk, groups, topk_groups, why", [
    (3, 4, 1, "topk 3 exceeds the 2 experts"),  # took a masked group's expert 0
    (2, 8, 2, "groups of >= 2"),  # one expert per group: every group tied at -inf, ids all 0
    (2, 3, 1, "do not split"), (2, 4, 5, "topk_groups 5 must be in")])
def test_the_kernel_refuses_the_groupings_the_op_forbids(topk, groups, topk_groups, why):
    """route() called directly (not through the op's sweep) returned duplicate or masked ids for these."""
    from spark_bench.kernels.moe.router import route

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=g).bfloat16(), torch.randn(8, 16, generator=g).bfloat16()
    with pytest.raises(ValueError, match=why):
        route(x, w, torch.zeros(8), topk=topk, groups=groups, topk_groups=topk_groups)
    assert OP.invalid_reason(params(1, experts=8, topk=topk, groups=groups, topk_groups=topk_groups)) is not None


@pytest.mark.parametrize("path, ticket, rows, sms", [("rows", 1, 16, 1), ("split", 1, 16, 1), ("split", 1, 16, 64),
                                                     ("split", 0, 16, 64), ("split", 1, 1, 64)])
@pytest.mark.parametrize("seed, tokens, hidden, experts, topk, groups, topk_groups", [
    (0, 1, 600, 130, 8, 1, 1), (1, 37, 72, 24, 1, 1, 1), (2, 70, 600, 96, 8, 8, 3), (3, 19, 40, 20, 4, 4, 2)])
def test_router_paths_match_the_loop(monkeypatch, path, ticket, rows, sms, seed, tokens, hidden, experts, topk,
                                     groups, topk_groups):
    """Each path of kernels/moe/router.py: whole-row programs with the selection in the epilogue, split-D logits
    whose last program per row block selects (ticket; with 64 SMs, D = 600 splits into 3 slices and E = 130 into 3
    expert tiles, so 9 programs share a ticket) 16 rows at once or row by row (rows = 1: a 16-row block of T = 37
    or 70 loops its rows), and the two-launch fallback; odd T, E not a power of two."""
    from spark_bench.kernels.moe import router as kernel

    from spark_bench import triton_env
    from spark_bench.tune.space import applied

    monkeypatch.setattr(triton_env, "sm_count", lambda device: sms)
    p = params(tokens, hidden=hidden, experts=experts, topk=topk, groups=groups, topk_groups=topk_groups)
    inputs = OP.make_inputs(p, seed=seed)
    forced = {"moe.router._router_logits": {**kernel.LOGITS_CONFIGS.default, "TICKET": ticket, "ROWS": rows,
                                            "SB": 1 if rows > 1 else 8}}
    for _ in range(2):  # the second call finds the tickets reset by the first
        with applied(forced):
            w, ids = kernel.route(inputs["x"], inputs["gate_w"], inputs["gate_bias"], topk, groups, topk_groups,
                                  2.5, path=path)
        check = check_outputs(OP, (w, ids), OP.reference(**inputs), inputs, "bf16")
        assert check["ok"] and check["mismatched_tokens"] == 0, check["message"]
        assert_same_routing((w, ids), loop_router(inputs["x"], inputs["gate_w"], inputs["gate_bias"], topk, groups,
                                                  topk_groups, 2.5))
    assert int(kernel.tickets(kernel.ROUTER_TICKETS, inputs["x"].device, 1).abs().sum()) == 0


def test_decode_slices_reach_min_ctas():
    """The T <= 4 bucket splits Kimi-Linear's D = 2304 into 72 slices of 32: 16 expert tiles x 72 = 1152 programs
    (the 2-per-SM floor alone would give 288); slices never go below BD nor past D."""
    from spark_bench.kernels.moe.router import LOGITS_CONFIGS, slices

    meta = LOGITS_CONFIGS.declared(T=1, E=256, D=2304)
    tiles = math.ceil(256 / meta["BE"])
    S, d_split = slices(tiles, 2304, meta["BD"], max(meta["MIN_CTAS"], 2 * 132))
    assert (S, d_split, tiles * S) == (72, 32, 1152)
    assert slices(1, 100, 64, 10**6) == (2, 64) and slices(64, 2304, 64, 1) == (1, 2304)
    assert LOGITS_CONFIGS.declared(T=8, E=256, D=2304)["ROWS"] == 16


@pytest.mark.parametrize("path", ["rows", "split"])
def test_router_appends_the_shared_expert_slot(path):
    """shared_id: the same launch writes slot K = (shared_id, weight 1) after the K routed slots."""
    from spark_bench.kernels.moe.router import route

    p = params(13, experts=20, topk=3, groups=4, topk_groups=2)
    inputs = OP.make_inputs(p, seed=5)
    args = (inputs["x"], inputs["gate_w"], inputs["gate_bias"], 3, 4, 2, 2.5)
    w, ids = route(*args, path=path)
    w_s, ids_s = route(*args, path=path, shared_id=20)
    assert ids_s.shape == (13, 4) and w_s.shape == (13, 4)
    assert torch.equal(ids_s[:, :3], ids) and torch.equal(w_s[:, :3], w)
    assert (ids_s[:, 3] == 20).all() and (w_s[:, 3] == 1.0).all()


def test_tickets_are_not_first_allocated_inside_a_graph_capture(monkeypatch):
    """A capture only records the buffer's zero fill: eager calls after it would elect on garbage tickets."""
    import spark_bench.kernels.common as common

    monkeypatch.setattr(common, "_TICKETS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="first allocated inside a CUDA graph capture"):
        common.tickets("moe.router", "cuda:0", 8)
    assert common.tickets("moe.router", "cpu", 8).eq(0).all()  # no capture on a CPU


@pytest.mark.parametrize("path", ["rows", "split"])
@pytest.mark.parametrize("seed, experts, topk, groups, topk_groups", [(1, 20, 4, 4, 2), (2, 24, 3, 1, 1),
                                                                      (3, 130, 8, 1, 1)])
def test_a_nan_row_still_selects_k_distinct_experts_below_e(path, seed, experts, topk, groups, topk_groups):
    """A NaN in a token's hidden state (or the bias) makes its logits NaN: its K ids must still be distinct experts
    < E (the experts index their weights with them; argmax's NaN handling differs between the GPU and the
    interpreter, which picked expert 0 K times); its weights are NaN, and the other rows are untouched."""
    from spark_bench.kernels.moe.router import route

    p = params(9, experts=experts, topk=topk, groups=groups, topk_groups=topk_groups)
    inputs = OP.make_inputs(p, seed=seed)
    x = inputs["x"].clone()
    x[2], x[5, 3] = float("nan"), float("nan")
    w, ids = route(x, inputs["gate_w"], inputs["gate_bias"], topk, groups, topk_groups, 2.5, path=path)
    for row in (2, 5):
        assert sorted(ids[row].tolist()) == sorted(set(ids[row].tolist())), ids[row]
        assert 0 <= int(ids[row].min()) and int(ids[row].max()) < experts and w[row].isnan().all()
    live = [t for t in range(9) if t not in (2, 5)]
    assert_same_routing((w[live], ids[live]), loop_router(x[live], inputs["gate_w"], inputs["gate_bias"], topk,
                                                          groups, topk_groups, 2.5))
    bias = inputs["gate_bias"].clone()
    bias[experts // 2] = float("nan")  # a NaN in the weights: every row still picks K distinct experts < E
    _, ids = route(inputs["x"], inputs["gate_w"], bias, topk, groups, topk_groups, 2.5, path=path)
    assert all(len(set(row)) == topk and 0 <= min(row) and max(row) < experts for row in ids.tolist()), ids
