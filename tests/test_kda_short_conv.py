"""kda.short_conv: the varlen prefill conv against its fp64 reference, the reference against F.conv1d, and the
state semantics (W-1 pre-conv inputs, short segments reading the state, new sequences from zeros)."""

import pytest
import torch
import torch.nn.functional as F

import spark_bench

OP = spark_bench.get_op("kda.short_conv")
BACKENDS = ["triton", "torch"]


def err_ratio(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def check(out, ref, dtype):
    tol = OP.tolerance_for(dtype).err_ratio
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape
        assert torch.isfinite(o.float()).all()
        assert err_ratio(o, r) <= tol, err_ratio(o, r)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("seq_len,batch,seed", [(1, 2, 0), (2, 2, 6), (3, 1, 1), (63, 1, 2), (64, 1, 3), (65, 2, 4),
                                                (130, 1, 5), (500, 1, 7), (1000, 2, 8)])  # kda.md's edge lengths
def test_fixed_lengths(backend, dtype, seq_len, batch, seed):
    params = {"batch": batch, "seq_len": seq_len, "varlen": "fixed", "heads": 3, "head_dim": 20}
    inputs = OP.make_inputs(params, dtype=dtype, seed=seed)
    check(OP.backends[backend].fn(**inputs), OP.reference(**inputs), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["tiny5", "tiny3"])
@pytest.mark.parametrize("with_state", [True, False])
def test_varlen_short_segments(backend, pattern, with_state):
    params = {"batch": 1, "seq_len": 1, "varlen": pattern, "heads": 3, "head_dim": 12,
              "head_dim_k": 12, "head_dim_v": 20}
    inputs = OP.make_inputs(params, dtype="bf16", seed=7)
    assert inputs["x"].shape[1] == 3 * (2 * 12 + 20)
    if not with_state:
        inputs["conv_state"] = None
    out = OP.backends[backend].fn(**inputs)
    check(out, OP.reference(**inputs), "bf16")
    if not with_state:  # a new sequence starts from a zero state
        zeros = torch.zeros(len(inputs["cu_seqlens"]) - 1, inputs["x"].shape[1], 3, dtype=torch.bfloat16)
        check(out, OP.reference(**{**inputs, "conv_state": zeros}), "bf16")


def test_reference_is_causal_conv1d():
    """Zero state: the reference equals F.conv1d with W-1 zeros of left padding (last tap = current token)."""
    inputs = OP.make_inputs({"batch": 1, "seq_len": 37, "varlen": "fixed", "heads": 2, "head_dim": 8},
                            dtype="fp32", seed=3)
    x, w = inputs["x"].double(), inputs["weight"].double()
    W = w.shape[1]
    expected = F.silu(F.conv1d(x.T[None], w[:, None, :], padding=W - 1, groups=x.shape[1])[0, :, :x.shape[0]].T)
    y, state = OP.reference(**{**inputs, "conv_state": None})
    assert err_ratio(y, expected) < 1e-6
    assert torch.equal(state[0], inputs["x"][-(W - 1):].T)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("split", [1, 2, 5])
def test_state_handoff(backend, split):
    """Running each sequence in two pieces with the state handed over equals running it whole; pieces of 1 or 2
    tokens are shorter than W-1 and must read part of their state."""
    fn = OP.backends[backend].fn
    lengths = [9, 6, 12]
    inputs = OP.make_inputs({"batch": 1, "seq_len": 1, "varlen": "fixed", "heads": 3, "head_dim": 12},
                            dtype="fp32", seed=11)
    D = inputs["x"].shape[1]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lengths), D, generator=gen)
    state = torch.randn(len(lengths), D, 3, generator=gen)
    cu = torch.tensor([0, 9, 15, 27], dtype=torch.int32)
    y_full, s_full = fn(x=x, weight=inputs["weight"], conv_state=state, cu_seqlens=cu)
    head = torch.cat([x[a:a + split] for a in (0, 9, 15)])
    tail = torch.cat([x[a + split:b] for a, b in ((0, 9), (9, 15), (15, 27))])
    cu_head = torch.arange(4, dtype=torch.int32) * split
    cu_tail = torch.tensor([0, 9 - split, 15 - 2 * split, 27 - 3 * split], dtype=torch.int32)
    y_head, s_mid = fn(x=head, weight=inputs["weight"], conv_state=state, cu_seqlens=cu_head)
    y_tail, s_end = fn(x=tail, weight=inputs["weight"], conv_state=s_mid, cu_seqlens=cu_tail)
    y_pieces = torch.cat([torch.cat([y_head[i * split:(i + 1) * split], y_tail[cu_tail[i]:cu_tail[i + 1]]])
                          for i in range(3)])
    assert err_ratio(y_pieces, y_full) < 1e-6
    assert torch.equal(s_end, s_full)


def test_wrong_state_column_order_fails():
    """A state read in reverse column order (oldest input last) must fail the tolerance: the check can fail."""
    inputs = OP.make_inputs({"batch": 1, "seq_len": 1, "varlen": "tiny5", "heads": 3, "head_dim": 8},
                            dtype="bf16", seed=2)
    ref = OP.reference(**inputs)
    flipped = OP.backends["torch"].fn(**{**inputs, "conv_state": inputs["conv_state"].flip(-1)})
    assert err_ratio(flipped[0], ref[0]) > 10 * OP.tolerance_for("bf16").err_ratio


def test_cost_and_availability():
    params = {"batch": 1, "seq_len": 8192, "varlen": "fixed", "heads": 32, "head_dim": 128}
    cost = OP.cost(params, "bf16")
    assert cost.flops == 2 * 4 * 8192 * 12288
    assert cost.bytes == 2 * (2 * 8192 * 12288 + 12288 * 4 + 2 * 12288 * 3)
    assert OP.cost({**params, "varlen": "short5"}, "bf16").tokens == 2000
    assert OP.backends["fla"].unavailable("cpu")
    assert len(OP.points(quick=True)) == len({tuple(sorted(p.items())) for p in OP.points(quick=True)})
    assert all(p["batch"] == 1 for p in OP.points() if p["varlen"] != "fixed")


def test_fla_gets_one_int64_offsets_tensor_per_cu_seqlens(monkeypatch):
    """fla caches its chunk indices by the offsets tensor's identity: a fresh .long() per call rebuilt them (a host
    sync with CUDA offsets) on every timed call of the fla peers. The same int32 tensor now maps to one int64 one,
    until it is modified in place."""
    from spark_bench.plugins.kda import short_conv
    from spark_bench.plugins.kda.core_common import int64_offsets

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    first = int64_offsets(cu)
    assert first.dtype == torch.int64 and first.tolist() == [0, 3, 8] and int64_offsets(cu) is first
    cu[2] = 9
    assert int64_offsets(cu) is not first and int64_offsets(cu).tolist() == [0, 3, 9]
    assert int64_offsets(None) is None and int64_offsets(first) is first
    fla = pytest.importorskip("fla.modules.causal_conv1d")
    seen = []
    monkeypatch.setattr(fla, "causal_conv1d", lambda x, w, **kw: (seen.append(kw["cu_seqlens"]), (x, x))[1])
    x, w = torch.randn(9, 6), torch.randn(6, 4)
    for _ in range(2):
        short_conv.fla_short_conv(x, w, cu)
    assert seen[0] is seen[1]
