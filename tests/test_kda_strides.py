"""KDA kernels on strided token rows (the block's q, k, v views of the conv output, read without copies) equal the
same call on contiguous copies and the fp32 references; the chunk table cached per cu_seqlens tensor."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from spark_bench.kernels.kda import chunk_prefill as kernel  # noqa: E402
from spark_bench.kernels.kda.chunk_prep import chunk_table  # noqa: E402
from spark_bench.kernels.kda.gate import kda_gate  # noqa: E402
from spark_bench.plugins.kda import chunk_prefill, recurrent_decode  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402
from spark_bench.plugins.kda import gate as gate_op  # noqa: E402


def as_views(inputs, lead, pad=5):
    """q, k, v rewritten as views of one wider [*lead, H*(2K+V) + pad] buffer, like split_heads of the conv output."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    wide = torch.randn(*lead, H * (2 * K + V) + pad).to(q.dtype)
    views = wide[..., pad:].split([H * K, H * K, H * V], -1)
    for t, src in zip(views, (q, k, v), strict=True):
        t.copy_(src.reshape(*lead, -1))
    out = dict(inputs)
    out["q"], out["k"], out["v"] = (t.view(*lead, H, -1) for t in views)
    assert not out["q"].is_contiguous() and out["q"].stride(-1) == 1
    return out


def clone(inputs):
    """A copy for one call, the strided views passed as they are: `clone()` of a view with gaps between its rows is
    contiguous, so cloning them handed the kernels contiguous copies and the strided cases tested nothing strided."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) and v.is_contiguous() else v) for k, v in inputs.items()}


@pytest.mark.parametrize("seed, N, T, K, V, fused", [(0, 3, 1, 24, 40, True), (1, 2, 3, 32, 16, False),
                                                      (2, 1, 2, 16, 48, True)])
def test_recurrent_decode_strided(seed, N, T, K, V, fused):
    params = {"batch": N, "seq_len": T, "heads": 2, "head_dim_k": K, "head_dim_v": V, "fused": fused}
    inputs = recurrent_decode.op.make_inputs(params, dtype="bf16", seed=seed)
    strided = as_views(inputs, (N, T))
    assert clone(strided)["q"] is strided["q"]
    run = recurrent_decode.triton_recurrent_decode
    a, b, ref = clone(inputs), clone(strided), clone(inputs)
    o_c, pool_c = run(**a)
    o_s, pool_s = run(**b)
    o_r, pool_r = recurrent_decode.reference_recurrent_decode(**ref)
    assert torch.equal(o_s, o_c) and torch.equal(pool_s, pool_c)
    assert cc.err_ratio(o_s, o_r) <= 5e-3 and cc.err_ratio(pool_s, pool_r) <= 5e-3


@pytest.mark.parametrize("seed, varlen, K, V", [(0, "tiny4", 32, 16), (3, "tiny3", 16, 40)])
def test_chunk_prefill_strided(seed, varlen, K, V):
    params = {"batch": 1, "seq_len": 1, "varlen": varlen, "heads": 2, "head_dim_k": K, "head_dim_v": V,
              "fused": True}
    inputs = chunk_prefill.op.make_inputs(params, dtype="bf16", seed=seed)
    strided = as_views(inputs, tuple(inputs["q"].shape[:2]))
    assert clone(strided)["q"] is strided["q"]
    o_c, s_c = chunk_prefill.triton_chunk_prefill(**clone(inputs))
    o_s, s_s = chunk_prefill.triton_chunk_prefill(**clone(strided))
    o_r, s_r = chunk_prefill.reference_chunk_prefill(**clone(inputs))
    assert torch.equal(o_s, o_c) and torch.equal(s_s, s_c)
    assert cc.err_ratio(o_s, o_r) <= 5e-3 and cc.err_ratio(s_s, s_r) <= 5e-3


@pytest.mark.parametrize("seed, T, K", [(0, 1, 60), (1, 37, 128)])
def test_gate_strided_rows(seed, T, K):
    inputs = gate_op.op.make_inputs({"tokens": T, "heads": 3, "head_dim": K}, dtype="bf16", seed=seed)
    wide = torch.randn(T, 3 * K + 7).to(torch.bfloat16)
    wide[:, 7:] = inputs["g"].reshape(T, -1)
    g = wide[:, 7:].view(T, 3, K)
    out = kda_gate(g, inputs["A_log"], inputs["dt_bias"])
    assert torch.equal(out, kda_gate(inputs["g"], inputs["A_log"], inputs["dt_bias"]))
    torch.testing.assert_close(out.double(), gate_op.reference(**inputs), rtol=1e-5, atol=1e-6)


def test_chunk_table_cached_per_tensor():
    cu = torch.tensor([0, 1, 64, 130, 135], dtype=torch.int32)
    first = kernel.cached_chunk_table(cu, 135, 64)
    assert kernel.cached_chunk_table(cu, 135, 64) is first  # same tensor: no recompute
    for got, want in zip(first, chunk_table(cu, 135, 64), strict=True):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    cu[2] = 70  # modified in place: recomputed
    again = kernel.cached_chunk_table(cu, 135, 64)
    assert again is not first and torch.equal(again[0], chunk_table(cu, 135, 64)[0])
    other = cu.clone()  # equal values, another tensor: its own entry, the same table
    assert torch.equal(kernel.cached_chunk_table(other, 135, 64)[0], again[0])
