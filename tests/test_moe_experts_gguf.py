"""moe.experts_gguf: our experts (decode GEMVs on the blocks, fused grouped, dequantize-once prefill), the torch
backend and the fp32 reference, checked against each other and against a naive fp64 token-by-slot loop on gguf's own
dequantized weights (the oracle)."""

import pytest
import torch
from spark_bench.kernels.moe.experts_gguf import dequant_groups, experts_gguf, prefill_path
from spark_bench.kernels.moe.experts_gguf_decode import down_split
from spark_bench.plugins.moe import experts_gguf as mod
from spark_bench.plugins.moe.common import experts_hit_uniform
from spark_bench.plugins.quant import kquants

from spark_bench import get_op
from spark_bench.check import check_outputs, poisoned_allocations
from spark_bench.tune.space import applied

OP = get_op("moe.experts_gguf")
SMALL = {"hidden": 256, "inter": 256, "experts": 8, "topk": 2, "routing": "uniform"}


def make(tokens, seed=0, **over):
    return OP.make_inputs({**SMALL, "tokens": tokens, **over}, seed=seed)


def check(out, inputs, ref=None):
    ref = OP.reference(**inputs) if ref is None else ref
    result = check_outputs(OP, out, ref, inputs, "bf16")
    assert result["ok"], result["message"]
    assert out.dtype == torch.bfloat16 and out.shape == inputs["x"].shape
    return result["err_ratio"]


def run(inputs, **kw):
    with poisoned_allocations():  # unwritten outputs show up as NaN
        return experts_gguf(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], inputs["w13_q"],
                            inputs["w2_q"], **kw)


def naive(x, topk_ids, topk_weights, w13_q, w2_q):
    """fp64, token by token and slot by slot, weights from gguf's numpy dequantizer."""
    I = w13_q.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            w13 = torch.from_numpy(kquants.dequantize_gguf(w13_q[e], "q2_k")).double()
            w2 = torch.from_numpy(kquants.dequantize_gguf(w2_q[e], "q3_k")).double()
            g, u = w13[:I] @ x[t].double(), w13[I:] @ x[t].double()
            y[t] += float(topk_weights[t, k]) * (w2 @ (torch.nn.functional.silu(g) * u))
    return y


@pytest.mark.parametrize("path, tokens, experts, topk, seed", [
    ("decode", 1, 8, 2, 0), ("decode", 5, 8, 2, 1), ("decode", 7, 8, 2, 2),
    ("grouped", 1, 8, 2, 3),  # 6 idle experts
    ("grouped", 64, 4, 1, 5),  # 16 pairs per expert: 16-row tiles
    ("grouped", 300, 2, 1, 6),  # 150 pairs per expert: 64-row tiles
])
def test_triton_paths_match_reference(path, tokens, experts, topk, seed):
    inputs = make(tokens, seed, experts=experts, topk=topk)
    assert check(run(inputs, path=path), inputs) < 8e-3


def test_decode_rows_sharing_a_pair():
    """The GPU's decode configuration (a program's rows within one pair / token, loaded as scalars)."""
    inputs = make(3, seed=8)
    check(run(inputs, path="decode", rows_per_program=256), inputs)


def test_reference_matches_naive_loop_on_gguf_weights():
    inputs = make(5, seed=9)
    torch.testing.assert_close(OP.reference(**inputs).double(), naive(**inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [5, 64])
def test_torch_backend_matches_reference(tokens):
    inputs = make(tokens, seed=10)
    check(OP.backends["torch"].fn(**inputs), inputs)


@pytest.mark.parametrize("path", ["decode"])
def test_fixed_ids_with_idle_experts(path):
    """Hand-written ids over experts 0..4 of 8 (5, 6, 7 get no token), expert 4 on every token."""
    inputs = make(7, seed=11)
    ids = torch.tensor([[4, t % 4] for t in range(7)], dtype=torch.int32)
    inputs["topk_ids"] = ids
    assert OP.extra_info(inputs, {**SMALL, "tokens": 7})["experts_hit"] == 5
    check(run(inputs, path=path), inputs)


@pytest.mark.parametrize("path, tokens", [("decode", 6), ("grouped", 40)])  # grouped: 32-row tiles (E = 8)
def test_all_tokens_on_one_expert(path, tokens):
    inputs = make(tokens, seed=12, topk=1)
    inputs["topk_ids"] = torch.full((tokens, 1), 3, dtype=torch.int32)
    check(run(inputs, path=path), inputs)


def test_worst_routing_load_and_result():
    inputs = make(33, seed=13, routing="worst")
    info = OP.extra_info(inputs, {**SMALL, "tokens": 33, "routing": "worst"})
    assert info["load_max"] == 33 and info["experts_hit"] == 2
    check(run(inputs), inputs)


def test_single_expert_as_shared_expert():
    """E = 1, K = 1, weight 1: the dense SwiGLU MLP (how moe.shared_expert calls us)."""
    inputs = make(5, seed=14, experts=1, topk=1)
    inputs["topk_ids"] = torch.zeros((5, 1), dtype=torch.int32)
    inputs["topk_weights"] = torch.ones((5, 1))
    ref = naive(**inputs)
    for path in ("decode", "grouped"):
        check(run(inputs, path=path), inputs, ref=ref)


def test_check_catches_swapped_gate_and_up():
    inputs = make(1, seed=15)
    I = SMALL["inter"]
    swapped = dict(inputs, w13_q=torch.cat([inputs["w13_q"][:, I:], inputs["w13_q"][:, :I]], dim=1))
    result = check_outputs(OP, run(swapped), OP.reference(**inputs), inputs, "bf16")
    assert not result["ok"]


def test_rejects_non_kquant_shapes():
    inputs = make(2, seed=16)
    with pytest.raises(ValueError):
        experts_gguf(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], inputs["w13_q"][..., :-84],
                     inputs["w2_q"])


def test_cost_model():
    p = {**SMALL, "tokens": 5}
    c = OP.cost(p, "bf16")
    n_e = experts_hit_uniform(5, 8, 2)
    assert c.flops == 6 * 5 * 2 * 256 * 256
    assert c.bytes == pytest.approx(n_e * 256 * 256 * (2 * 84 + 110) / 256 + 4 * 5 * 256 + 8 * 5 * 2)
    worst = OP.cost({**p, "routing": "worst"}, "bf16")
    assert worst.bytes == pytest.approx(2 * 256 * 256 * (2 * 84 + 110) / 256 + 4 * 5 * 256 + 8 * 5 * 2)
    assert mod.op.rotate == ("topk_ids", "topk_weights")


@pytest.mark.parametrize("seed, tokens, experts, topk, hidden, inter, split_i, split_d, rows", [
    (17, 1, 9, 8, 256, 512, 2, None, None),  # programs over many pairs (the interpreter's layout)
    (18, 1, 9, 8, 256, 512, 2, None, 256),  # the GPU layout: a program's rows share one pair
    (19, 3, 5, 1, 256, 768, 3, None, 512),  # BR does not divide D: per-row pairs and slices
    (20, 1, 1, 1, 512, 512, None, 2, 256),  # the shared expert: gate/up split over D, S from the CTA target
    (21, 3, 5, 1, 512, 512, 2, 2, 512)])  # both splits, per-row pairs
def test_decode_split_over_inter_and_hidden(seed, tokens, experts, topk, hidden, inter, split_i, split_d, rows):
    inputs = make(tokens, seed, experts=experts, topk=topk, hidden=hidden, inter=inter,
                  routing="zipf" if seed % 2 else "uniform")
    check(run(inputs, path="decode", split_i=split_i, split_d=split_d, rows_per_program=rows), inputs)


@pytest.mark.parametrize("seed, hidden, inter", [(22, 768, 768), (23, 512, 256)])
def test_decode_unrolled_candidate(seed, hidden, inter):
    """The UNROLL = 2 candidates (two super-blocks per loop trip, so ptxas issues the second's loads before the first's
    FMAs) reach the kernels: odd and single super-block loop counts give the oracle's result. The interpreter runs
    the loop as written; the unrolled SASS is checked by `spark-bench kernels --candidates` (docs/kernels.md)."""
    inputs = make(3, seed, hidden=hidden, inter=inter)
    forced = {"moe.experts_gguf._decode_up": {"BR": 8, "MIN_CTAS": 1024, "UNROLL": 2, "num_warps": 4},
              "moe.experts_gguf._decode_down": {"BR": 16, "MIN_CTAS": 1024, "UNROLL": 2, "num_warps": 4}}
    with applied(forced):
        out = run(inputs, path="decode", rows_per_program=256)
    assert nmse(out, naive(**{k: inputs[k] for k in ("x", "topk_ids", "topk_weights", "w13_q", "w2_q")})) < 5e-4
    check(out, inputs)


def test_decode_down_split_reaches_the_cta_target():
    assert down_split(8, 2304, 4, 16, 1024) == 1  # Kimi-Linear T = 1: 8 x 144 programs
    assert down_split(1, 2304, 4, 16, 1024) == 4  # shared expert: every super-block its own slice (576)
    assert down_split(1, 2304, 6, 16, 300) == 3  # a divisor of the 6 super-blocks


def nmse(out, want):
    return float(((out.double() - want) ** 2).mean() / (want**2).mean())


@pytest.mark.parametrize("path, tokens, experts, topk, routing, seed, rows", [
    ("decode", 1, 9, 8, "uniform", 30, None),  # top-8 of 9 experts, T = 1
    ("decode", 1, 9, 8, "uniform", 31, 64),  # the GPU layout at T = 1: a program's rows within one pair
    ("decode", 7, 5, 1, "zipf", 32, None),  # odd T, E = 5, top-1, skewed
    ("decode", 3, 6, 2, "worst", 33, 64),  # every token on the same two experts
    ("dequant", 1, 8, 2, "uniform", 34, None),  # 6 idle experts: their scratch is never written nor read
    ("dequant", 9, 5, 1, "zipf", 35, None),
    ("dequant", 5, 9, 8, "uniform", 36, None),
    ("dequant", 17, 6, 2, "worst", 37, None),
    ("grouped", 9, 9, 8, "zipf", 38, None)])
def test_paths_on_odd_shapes_against_the_gguf_oracle(path, tokens, experts, topk, routing, seed, rows):
    """Odd T, E not a power of two, top-k 1 and 8, skewed and uniform routing; Q3_K blocks carry negative scales
    (l - 32 < 0) and d of both signs. NMSE against the fp64 loop on gguf's dequantization <= 5e-4 (llama.cpp's bound
    where activations are quantized; ours keeps them in bf16 / fp32), and the op's check."""
    inputs = make(tokens, seed, experts=experts, topk=topk, routing=routing)
    scales = inputs["w2_q"].view(-1, 110)[:, 96:108]
    assert ((scales[:, :8] & 15) < 8).any()  # some l_j - 32 < 0 (low bits; high bits random too)
    out = run(inputs, path=path, rows_per_program=rows) if path == "decode" else run(inputs, path=path)
    want = naive(**inputs)
    assert nmse(out, want) <= 5e-4
    check(out, inputs)


def test_decode_error_is_bf16_rounding_only():
    """No activation quantization on the decode path: its error against the oracle is the bf16 output's."""
    inputs = make(2, seed=40, experts=8, topk=8)
    want = naive(**inputs)
    out = run(inputs, path="decode")
    assert nmse(out, want) <= 4 * nmse(want.to(torch.bfloat16), want) + 1e-7


def test_prefill_threshold_is_a_declared_parameter():
    """path auto: decode up to DECODE_MAX_TOKENS, then fused grouped below the declared mean load per expert and
    dequantize-once from it; forcing the parameter (as tune does) moves the switch."""
    D = I = 256
    assert prefill_path(16384, 8, 256, D, I) == "dequant" and prefill_path(64, 8, 256, D, I) == "grouped"
    with applied({"moe.experts_gguf.prefill": {"DEQUANT_MIN_LOAD": 4}}):
        assert prefill_path(16, 2, 8, D, I) == "dequant" and prefill_path(15, 2, 8, D, I) == "grouped"
        inputs = make(16, seed=41)
        check(run(inputs), inputs)  # auto -> dequant


@pytest.mark.parametrize("fuse", [1, 0])
@pytest.mark.parametrize("tokens, experts, topk, split_i, split_d, rows", [
    (1, 5, 4, 2, None, 128), (3, 6, 2, None, None, 64),
    (1, 1, 1, 2, 2, 128)])  # the shared expert's gate/up split over D (PARTS): fused too
def test_decode_sums_its_slots_in_the_down_kernel(monkeypatch, fuse, tokens, experts, topk, split_i, split_d, rows):
    """FUSE with the GPU layout (BR divides D = 512: 4 or 8 D tiles): the last _decode_down program of each tile sums
    its slots' partials and _sum_slots never launches; FUSE = 0 launches it. Both against the oracle, twice (the
    tickets reset)."""
    from spark_bench.kernels.common import tickets
    from spark_bench.kernels.moe import slots

    launched = []
    real = slots._sum_slots
    monkeypatch.setattr(slots, "_sum_slots", type("Spy", (), {"__getitem__": lambda self, g: launched.append(g)
                                                              or real[g]})())
    inputs = make(tokens, 50 + tokens, experts=experts, topk=topk, hidden=512, inter=512)
    want = naive(**inputs)
    for _ in range(2):
        with applied({"moe.slots._sum_slots": {"BT": 1, "BD": 256, "FUSE": fuse, "num_warps": 4}}):
            out = run(inputs, path="decode", split_i=split_i, split_d=split_d, rows_per_program=rows)
        assert nmse(out, want) <= 5e-4
        check(out, inputs)
    assert bool(launched) == (not fuse)
    assert int(tickets("moe.experts_gguf._decode_down", out.device, 1).abs().sum()) == 0


TINY = {"moe.experts_gguf.scratch": {"DEQUANT_SCRATCH_MB": 0.8}}  # 2 experts of 3*256*256 bf16 (0.375 MiB each)


def test_dequant_scratch_groups_are_declared_and_bounded():
    """Kimi-Linear: every expert in one group (today's launches); DeepSeek-V3 TP1: 6 groups within 4 GiB."""
    assert dequant_groups(256, 1024, 2304) == [(0, 256)]
    ds = dequant_groups(256, 2048, 7168)
    assert len(ds) == 6 and ds[-1][1] == 256 and max(hi - lo for lo, hi in ds) * 3 * 2048 * 7168 * 2 <= 4 << 30
    with applied(TINY):
        assert dequant_groups(5, 256, 256) == [(0, 2), (2, 4), (4, 5)]


class _Spy:
    """A kernel (or function) that counts its launches (calls) and passes them on."""

    def __init__(self, real, log, name):
        self.real, self.log, self.name = real, log, name

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.real[grid]

    def __call__(self, *args, **kw):
        self.log.append(self.name)
        return self.real(*args, **kw)


def spied(monkeypatch):
    from spark_bench.kernels.moe import experts as bf16_experts
    from spark_bench.kernels.moe import experts_gguf as gguf

    log, outs = [], []
    for mod_, name in ((bf16_experts, "_grouped_swiglu"), (bf16_experts, "_grouped_down"), (bf16_experts, "moe_align")):
        monkeypatch.setattr(mod_, name, _Spy(getattr(mod_, name), log, name))
    real = gguf.dequantize

    def dequantize(raw, fmt, dtype, hit=None, out=None):
        outs.append((fmt, raw.shape[0], out.data_ptr(), out.untyped_storage().nbytes()))
        return real(raw, fmt, dtype, hit=hit, out=out)

    monkeypatch.setattr(gguf, "dequantize", dequantize)
    return log, outs


@pytest.mark.parametrize("tokens, topk, routing, ids, seed", [
    (9, 1, "zipf", None, 60),  # odd T, top-1, skewed
    (7, 3, "uniform", None, 61),  # top-3 of 5
    (11, 2, "uniform", [0, 4, 1], 62)])  # experts 2 and 3 (the middle group) get no pair
def test_dequant_in_expert_groups_equals_one_group(monkeypatch, tokens, topk, routing, ids, seed):
    """E = 5 in 3 groups of <= 2 experts: one alignment, one scratch reused, each group's GEMMs over its own tiles;
    bit-for-bit the one-group result (same kernels, one writer per slot, one slot sum), and against the oracle."""
    inputs = make(tokens, seed, experts=5, topk=topk, routing=routing)
    if ids is not None:
        inputs["topk_ids"] = torch.tensor([[ids[(t + k) % 3] for k in range(topk)] for t in range(tokens)],
                                          dtype=torch.int32)
    one = run(inputs, path="dequant")
    log, outs = spied(monkeypatch)
    with applied(TINY):
        grouped = run(inputs, path="dequant")
    assert torch.equal(grouped, one)
    assert log.count("moe_align") == 1 and log.count("_grouped_swiglu") == log.count("_grouped_down") == 3
    assert [(fmt, n) for fmt, n, _, _ in outs] == [("q2_k", 2), ("q3_k", 2)] * 2 + [("q2_k", 1), ("q3_k", 1)]
    assert len({(fmt, ptr) for fmt, _, ptr, _ in outs}) == 2  # one scratch per matrix, reused by every group
    assert sum({ptr: size for _, _, ptr, size in outs}.values()) == 2 * 3 * 256 * 256 * 2  # 2 experts' bf16
    assert nmse(grouped, naive(**inputs)) <= 5e-4
    check(grouped, inputs)


def test_one_group_launches_as_an_unbounded_scratch(monkeypatch):
    """The default budget at a small shape: every expert in one group, 2 dequant and 2 GEMM launches."""
    log, outs = spied(monkeypatch)
    inputs = make(9, seed=63, experts=5, topk=2)
    check(run(inputs, path="dequant"), inputs)
    assert log == ["moe_align", "_grouped_swiglu", "_grouped_down"] and [n for _, n, _, _ in outs] == [5, 5]


def test_bf16_grouped_experts_over_expert_groups():
    """kernels/moe/experts.py's shared helper with the weights in 3 groups (in any order: each slot is written by its
    own group only) equals its one-group call exactly."""
    from spark_bench.kernels.moe.experts import grouped_experts

    g = torch.Generator().manual_seed(64)
    T, D, I, E, K = 13, 64, 32, 5, 3
    x = torch.randn(T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / 8).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    ids[ids == 3] = 1  # expert 3 unhit
    wts = torch.rand(T * K, generator=g)

    def alone(w, lo, hi):  # the group's experts, NaN behind them: a tile of another group's expert would read NaN
        return torch.cat([w[lo:hi], torch.full_like(w, float("nan"))])[:hi - lo]

    with poisoned_allocations():
        one = grouped_experts(x, ids, wts, [(0, w13, w2)], E, I, 16)
        groups = [(lo, alone(w13, lo, hi), alone(w2, lo, hi)) for lo, hi in ((4, 5), (2, 4), (0, 2))]  # any order
        split = grouped_experts(x, ids, wts, groups, E, I, 16)
    assert torch.equal(one, split) and not one.isnan().any()
