"""The gated RMS norm's eps reaches the kernels: kda.gated_rmsnorm and the block decode's launch 2 (gated norm + conv
shift) were only ever called at the default 1e-5, which next to unit-variance rows changes nothing, so a kernel
that ignored its `eps` argument passed every test. Here eps = 0.5 against rows of mean square ~0.04, where
ignoring it (or using the default) misses by ~3x; odd V, V != K."""

import pytest
import torch

EPS = 0.5


def gated_norm(o, z, weight, eps):
    o = o.double()
    return o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps) * weight.double() * torch.sigmoid(z.double())


def draw(shape, seed, std):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * std


@pytest.mark.parametrize("eps", [EPS, 1e-5])
def test_gated_rmsnorm_takes_its_eps(eps):
    from spark_bench.kernels.kda.gated_rmsnorm import gated_rmsnorm

    o, z, w = draw((5, 3, 37), 0, 0.2), draw((5, 3, 37), 1, 1.0), 1 + draw((37,), 2, 0.1)
    y = gated_rmsnorm(o, z, w, eps=eps)
    torch.testing.assert_close(y.double(), gated_norm(o, z, w, eps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [EPS, 1e-5])
def test_block_decode_norm_takes_its_eps(eps):
    """gated_norm_conv_shift at N = 3, H = 3, K = 16, V = 24 (slot -1: a padding row, zero out)."""
    from spark_bench.kernels.kda.block_decode import gated_norm_conv_shift

    N, H, K, V, W = 3, 3, 16, 24, 4
    o, z, w = draw((N, H, V), 3, 0.2), draw((N, H, V), 4, 1.0), 1 + draw((V,), 5, 0.1)
    qkv = draw((N, H * (2 * K + V)), 6, 1.0)
    pool = draw((4, H * (2 * K + V), W - 1), 7, 1.0)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    want_pool = pool.clone()
    for n, s in ((0, 2), (2, 0)):
        want_pool[s] = torch.cat([pool[s, :, 1:], qkv[n, :, None]], -1)
    y = gated_norm_conv_shift(o, z, w, qkv, pool, slots, eps=eps)
    want = gated_norm(o, z, w, eps)
    want[1] = 0
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool, want_pool)
