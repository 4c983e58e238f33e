"""The KDA chunk prefill with q, k, v, g and beta each a view of its own, differently padded buffer: pairwise
different token (and sequence) strides, so a kernel that reads one tensor with another's stride fails.
test_kda_strides.py's views all share one buffer (one stride for q, k and v), test_kda_decode_flags_strides.py
covers the decode kernel only: neither catches a prefill that reads q with k's stride. Odd K != V, against the
fp32 reference and the same call on contiguous inputs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from spark_bench.plugins.kda import chunk_prefill  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402

PADS = {"q": 3, "k": 11, "v": 6, "g": 9, "beta": 4}  # per tensor: pairwise different row strides


def padded_views(inputs):
    """Each of q, k, v, g, beta rewritten as a view [..., pad:] of its own [*lead, H*D + pad] buffer."""
    out = dict(inputs)
    for name, pad in PADS.items():
        x = inputs[name]
        lead, tail = x.shape[:2], x.shape[2:]
        wide = torch.full((*lead, x[0, 0].numel() + pad), float("nan"), dtype=x.dtype)
        wide[..., pad:] = x.reshape(*lead, -1)
        out[name] = wide[..., pad:].view(*lead, *tail)
    assert all(not out[n].is_contiguous() for n in PADS) and clone(out)["q"] is out["q"]
    strides = {out[n].stride(1) for n in PADS}
    assert len(strides) == len(PADS), "token strides must differ pairwise"
    assert len({out[n].stride(0) for n in PADS}) == len(PADS)
    return out


def clone(inputs):
    """A copy for one call: the state is written in place; the views are passed as they are (`clone()` of a view
    with gaps between its rows is contiguous: the kernel would never see the strides)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) and k not in PADS else v) for k, v in inputs.items()}


@pytest.mark.parametrize("seed, B, T, varlen, K, V, fused", [
    (0, 2, 37, "fixed", 24, 40, True),
    (1, 1, 1, "tiny4", 40, 24, False),
])
def test_chunk_prefill_pairwise_strides(seed, B, T, varlen, K, V, fused):
    params = {"batch": B, "seq_len": T, "varlen": varlen, "heads": 2, "head_dim_k": K, "head_dim_v": V,
              "fused": fused}
    inputs = chunk_prefill.op.make_inputs(params, dtype="fp32", seed=seed)
    strided = padded_views(inputs)
    o_c, s_c = chunk_prefill.triton_chunk_prefill(**clone(inputs))
    o_s, s_s = chunk_prefill.triton_chunk_prefill(**clone(strided))
    o_r, s_r = chunk_prefill.reference_chunk_prefill(**clone(inputs))
    assert cc.err_ratio(o_s, o_r) <= 1e-4 and cc.err_ratio(s_s, s_r) <= 1e-4
    assert torch.equal(o_s, o_c) and torch.equal(s_s, s_c)
