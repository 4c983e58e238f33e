"""One decode step of a KDA block between its projections, in two launches (the unfused path takes three: the conv
update, the recurrent core, the gated norm). A negative slot is a padding row (recurrent_decode.py): neither pool is
read or written there and its o and y are zero.

  1. `_conv_recurrent_decode`, grid (V/BV, H, N): for sequence n and head h, the causal conv of the head's q, k
     (all K channels) and v (BV channels) from the conv state pool and the new token, SiLU, the q/k L2 norm, the gate
     -exp(A_log) softplus(g + dt_bias), the beta sigmoid, and the delta-rule step on the state tile [K, BV] (fp32, in
     registers, read and written once). The conv output never goes to memory.
  2. `_gated_norm_conv_shift`, grid (N, H): the gated RMS norm of o[n, h, :] (V whole), and the conv state of the
     head's 2K + V channels shifted by one token.

Why two and not one: the V/BV programs of a head all read the q/k conv windows, so none of them may shift those
windows in place (another program of the same head may not have read them yet: a race on the GPU that the
interpreter, running programs one after another, can never show). The shift waits for the next launch, which runs
after every program of the first. The norm needs all V columns of o, which the first launch spreads over V/BV
programs; with BV = V (one program per head, N*H CTAs: 32 at N = 1, H = 32) the step would be one launch but carry
an eighth of the programs that keep the state's bytes in flight. The projections stay torch GEMMs: at decode sizes
they read the weights (~77 MB a step at Kimi-Linear TP1 against ~4 MB of recurrent state at N = 1), which is cuBLAS'
job.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, live_rows, next_pow2, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import kda_decay, l2_normalize_rows, to_output_dtype
from spark_bench.kernels.kda.recurrent_decode import decode_grid, delta_step, state_tile

# As recurrent_decode.py: BV = 32 at 4 warps ([128, 32] fp32 state tile, 32 registers a thread); N <= 2: BV = 16 for
# twice the programs. The conv windows add [K, W] x 2 + [BV, W] loads per program.
CORE_CONFIGS = declare(ConfigSpace(
    "kda.block_decode._conv_recurrent_decode", key=("N", "K", "V", "dtype"),
    default={"BV": 32, "V_FASTEST": 1, "num_warps": 4},
    buckets=[({"N": 2}, {"BV": 16, "V_FASTEST": 1, "num_warps": 4})],
    candidates=[{"BV": 64, "V_FASTEST": 1, "num_warps": 8}, {"BV": 16, "V_FASTEST": 1, "num_warps": 2},
                {"BV": 32, "V_FASTEST": 0, "num_warps": 4}]))  # the grid order until 2026-12-05
NORM_CONFIGS = declare(ConfigSpace(
    "kda.block_decode._gated_norm_conv_shift", key=("V", "K", "dtype"),
    default={"num_warps": 2},
    candidates=[{"num_warps": 1}, {"num_warps": 4}]))


@triton.jit
def _conv_channels(x, pool, weight, slot, i_n, ch, m_ch, D, W: tl.constexpr, BW: tl.constexpr):
    """SiLU(causal conv) of channels `ch` of sequence i_n: the W-1 earlier inputs from the pool row of `slot` (none
    for a padding row, slot < 0), the new one from x [N, D]; fp32."""
    o_c = tl.arange(0, BW)
    m_w = live_rows(m_ch[:, None] & (o_c < W - 1)[None, :], slot)
    cols = tl.load(pool + (slot * D + ch[:, None]) * (W - 1) + o_c[None, :], mask=m_w, other=0.0).to(tl.float32)
    w_cols = tl.load(weight + ch[:, None] * W + o_c[None, :], mask=m_w, other=0.0).to(tl.float32)
    w_cur = tl.load(weight + ch * W + W - 1, mask=m_ch, other=0.0).to(tl.float32)
    xv = tl.load(x + i_n * D + ch, mask=m_ch, other=0.0).to(tl.float32)
    acc = tl.sum(cols * w_cols, 1) + xv * w_cur
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_recurrent_decode(qkv, conv_pool, conv_w, g, beta, A_log, dt_bias, o, state_pool, slots, scale, D,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, BW: tl.constexpr, INTERPRET: tl.constexpr, V_FASTEST: tl.constexpr):
    i_n, i_h, slot, o_k, o_v, m_k, m_v, offs_s, mask_s = state_tile(slots, H, K, V, BK, BV, V_FASTEST)
    b_q = _conv_channels(qkv, conv_pool, conv_w, slot, i_n, i_h * K + o_k, m_k, D, W, BW)
    b_k = _conv_channels(qkv, conv_pool, conv_w, slot, i_n, (H + i_h) * K + o_k, m_k, D, W, BW)
    b_v = _conv_channels(qkv, conv_pool, conv_w, slot, i_n, 2 * H * K + i_h * V + o_v, m_v, D, W, BW)
    b_q = l2_normalize_rows(tl.where(m_k, b_q, 0.0), True)
    b_k = l2_normalize_rows(tl.where(m_k, b_k, 0.0), True)
    b_g = kda_decay(tl.load(g + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32), A_log, dt_bias,
                    i_h, o_k, m_k, K)
    b_beta = tl.sigmoid(tl.load(beta + i_n * H + i_h).to(tl.float32))
    S, b_o = delta_step(tl.load(state_pool + offs_s, mask=mask_s, other=0.0), b_q, b_k, b_v, b_g, b_beta, scale)
    tl.store(o + (i_n * H + i_h) * V + o_v, to_output_dtype(tl.where(slot >= 0, b_o, 0.0), o, INTERPRET), mask=m_v)
    tl.store(state_pool + offs_s, S, mask=mask_s)


@triton.jit
def _shift_window(x, pool, slot, i_n, ch, m_ch, D, W: tl.constexpr, BW: tl.constexpr):
    """pool[slot, ch, :] <- (pool[slot, ch, 1:], x[i_n, ch]): loaded once, shifted in registers, stored once;
    nothing for a padding row (slot < 0)."""
    o_c = tl.arange(0, BW)
    m_w = live_rows(m_ch[:, None] & (o_c < W - 1)[None, :], slot)
    p = pool + (slot * D + ch[:, None]) * (W - 1) + o_c[None, :]
    cols = tl.load(p, mask=m_w, other=0.0).to(tl.float32)
    take = (o_c[:, None] + 1) == o_c[None, :]  # [c, j]: column j moves to c
    shifted = tl.sum(tl.where(take[None, :, :], cols[:, None, :], 0.0), axis=2)
    xv = tl.load(x + i_n * D + ch, mask=m_ch, other=0.0).to(tl.float32)
    tl.store(p, tl.where((o_c == W - 2)[None, :], xv[:, None], shifted).to(pool.dtype.element_ty), mask=m_w)


@triton.jit
def _gated_norm_conv_shift(o, z, norm_w, y, qkv, conv_pool, slots, eps, D, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                           BW: tl.constexpr, INTERPRET: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_v = tl.arange(0, BVF)
    m_v = o_v < V
    row = (i_n * H + i_h) * V
    b_o = tl.load(o + row + o_v, mask=m_v, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, 0) / V + eps)
    b_z = tl.load(z + row + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_w = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    slot = tl.load(slots + i_n).to(tl.int64)
    b_y = tl.where(slot >= 0, b_o * rstd * b_w * tl.sigmoid(b_z), 0.0)  # a padding row's z may be anything
    tl.store(y + row + o_v, to_output_dtype(b_y, y, INTERPRET), mask=m_v)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    _shift_window(qkv, conv_pool, slot, i_n, i_h * K + o_k, m_k, D, W, BW)
    _shift_window(qkv, conv_pool, slot, i_n, (H + i_h) * K + o_k, m_k, D, W, BW)
    _shift_window(qkv, conv_pool, slot, i_n, 2 * H * K + i_h * V + o_v, m_v, D, W, BW)


def conv_recurrent_decode(qkv, conv_weight, conv_state_pool, g, beta, A_log, dt_bias, state_pool, slots, heads: int,
                          scale: float | None = None):
    """Launch 1. qkv [N, H(2K+V)] (the projections, not yet convolved), conv_weight [H(2K+V), W], conv_state_pool
    [S, H(2K+V), W-1] (read, not written), g [N, H*K] raw gate logits, beta [N, H] logits, A_log [H], dt_bias [H*K],
    state_pool [S, H, K, V] fp32 (updated in place at slots [N]) -> o [N, H, V] in qkv's dtype."""
    N, D = qkv.shape
    H = heads
    K, V = g.shape[-1] // H, state_pool.shape[-1]
    W = conv_weight.shape[1]
    assert conv_state_pool.is_contiguous() and state_pool.is_contiguous() and state_pool.dtype == torch.float32
    o = torch.empty(N, H, V, dtype=qkv.dtype, device=qkv.device)
    meta, options = split(CORE_CONFIGS.pick(N=N, K=K, V=V, dtype=str(qkv.dtype)))
    full_v = next_pow2(max(V, 16))
    meta["BV"] = full_v if widen() else min(meta["BV"], full_v)
    _conv_recurrent_decode[decode_grid(N, H, triton.cdiv(V, meta["BV"]), meta)](
        qkv.contiguous(), conv_state_pool, conv_weight.contiguous(), g.contiguous(), beta.contiguous(),
        A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous(), o, state_pool, slots.contiguous(),
        K ** -0.5 if scale is None else float(scale), D, H=H, K=K, V=V, W=W, BK=next_pow2(max(K, 16)),
        BW=next_pow2(W - 1), INTERPRET=INTERPRET, **meta, **options)
    return o


def gated_norm_conv_shift(o, z, norm_weight, qkv, conv_state_pool, slots, eps: float = 1e-5):
    """Launch 2 (after launch 1). o, z [N, H, V], norm_weight [V] -> y [N, H, V] in o's dtype; shifts the conv
    state pool at slots by the new token qkv [N, H(2K+V)] in place."""
    N, H, V = o.shape
    D = qkv.shape[1]
    K = (D // H - V) // 2
    W = conv_state_pool.shape[-1] + 1
    y = torch.empty_like(o)
    meta, options = split(NORM_CONFIGS.pick(V=V, K=K, dtype=str(o.dtype)))
    _gated_norm_conv_shift[(N, H)](o, z.contiguous(), norm_weight.contiguous(), y, qkv.contiguous(), conv_state_pool,
                                   slots.contiguous(), eps, D, H=H, K=K, V=V, W=W, BK=next_pow2(max(K, 16)),
                                   BVF=next_pow2(max(V, 16)), BW=next_pow2(W - 1), INTERPRET=INTERPRET, **meta,
                                   **options)
    return y
