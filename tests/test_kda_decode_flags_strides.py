"""kernels/kda/recurrent_decode.py: each of fla's in-kernel flags acts on its own (beta's sigmoid without the gate,
the gate without beta's sigmoid), and q and k strided differently from each other are each read with their own
strides. Expected outputs come from a token loop written here from kda.md's recurrence."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from spark_bench.kernels.kda.recurrent_decode import kda_recurrent_decode  # noqa: E402

N, T, H, K, V, SLOTS = 2, 2, 2, 16, 16, 3


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(N, T, H, K, generator=g), dim=-1) for _ in range(2))
    return {"q": q, "k": k, "v": torch.randn(N, T, H, V, generator=g),
            "g_raw": torch.randn(N, T, H, K, generator=g), "beta_raw": torch.randn(N, T, H, generator=g),
            "A_log": torch.rand(H, generator=g), "dt_bias": torch.randn(H * K, generator=g),
            "pool": torch.randn(SLOTS, H, K, V, generator=g), "idx": torch.tensor([2, 0], dtype=torch.int32)}


def _loop(q, k, v, decay, beta, pool, idx):
    """S = S * exp(g)[:, None]; u = beta (v - k S); S += k u^T; o = (K^-0.5 q) S, per sequence and head."""
    o = torch.zeros(N, T, H, V, dtype=torch.float64)
    pool = pool.double().clone()
    for n in range(N):
        for h in range(H):
            S = pool[idx[n], h]
            for t in range(T):
                S = S * decay[n, t, h].double().exp()[:, None]
                u = beta[n, t, h].double() * (v[n, t, h].double() - k[n, t, h].double() @ S)
                S = S + torch.outer(k[n, t, h].double(), u)
                o[n, t, h] = (K ** -0.5 * q[n, t, h].double()) @ S
            pool[idx[n], h] = S
    return o, pool


@pytest.mark.parametrize("gate, beta_sigmoid", [(False, True), (True, False)])
def test_each_flag_acts_alone(gate, beta_sigmoid):
    x = _inputs(1)
    decay_in = -F.softplus(x["g_raw"])  # an already computed log-space decay when the gate is not in the kernel
    beta_in = x["beta_raw"] if beta_sigmoid else x["beta_raw"].sigmoid()
    g_in = x["g_raw"] if gate else decay_in
    decay = (-x["A_log"].exp()[:, None] * F.softplus(x["g_raw"] + x["dt_bias"].view(H, K))) if gate else decay_in
    o_ref, pool_ref = _loop(x["q"], x["k"], x["v"], decay, x["beta_raw"].sigmoid(), x["pool"], x["idx"])
    pool = x["pool"].clone()
    o, _ = kda_recurrent_decode(x["q"], x["k"], x["v"], g_in, beta_in, pool, x["idx"], use_gate_in_kernel=gate,
                                use_beta_sigmoid_in_kernel=beta_sigmoid, A_log=x["A_log"], dt_bias=x["dt_bias"])
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.double(), pool_ref, rtol=1e-4, atol=1e-4)


def test_q_and_k_with_different_strides():
    """q a view of a wider [N, T, H*K + 7] buffer, k and v contiguous: the same result as all contiguous."""
    x = _inputs(2)
    wide = torch.randn(N, T, H * K + 7)
    wide[..., 7:] = x["q"].reshape(N, T, H * K)
    q_view = wide[..., 7:].view(N, T, H, K)
    assert q_view.stride()[:2] != x["k"].stride()[:2]
    beta = x["beta_raw"].sigmoid()
    g = -F.softplus(x["g_raw"])
    pool_a, pool_b = x["pool"].clone(), x["pool"].clone()
    o_a, _ = kda_recurrent_decode(x["q"], x["k"], x["v"], g, beta, pool_a, x["idx"])
    o_b, _ = kda_recurrent_decode(q_view, x["k"], x["v"], g, beta, pool_b, x["idx"])
    assert torch.equal(o_a, o_b) and torch.equal(pool_a, pool_b)
    o_ref, _ = _loop(x["q"], x["k"], x["v"], g, beta, x["pool"], x["idx"])
    torch.testing.assert_close(o_b.double(), o_ref, rtol=1e-4, atol=1e-4)
