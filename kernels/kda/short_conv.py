"""KDA causal depthwise short conv + SiLU over concat([q, k, v]), prefill (varlen) and decode (state pool).

Conv state = the W-1 PRE-conv inputs before the first token of a sequence, [N, D, W-1] (vLLM/sglang semantics,
kda.md pitfall 6); column W-1 of the weight multiplies the current token:

    xp = cat([state.T, x_seq], 0);   y[t] = silu(sum_j weight[:, j] * xp[t + j]);   new_state = xp[-(W-1):].T

Prefill: one program per BT tokens x BD channels finds each token's sequence by a binary search of cu_seqlens
(no host sync, so the launch is graph-capturable); N extra programs write the new states. Decode: one program per
(sequence, BD channels) reads its slot of the pool, writes y and shifts the slot in place. fp32 math throughout.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import live_rows, next_pow2, round_bf16, rounds_bf16, row_block, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

# BT x BD = 16 x 128 at 8 warps: 128 registers, no spills on sm_90a (32 x 128 at 4 warps spills: each of the W
# taps keeps a [BT, BD] load in flight); 16 warps per SM either way. fp32 inputs: 8 x 128 at 4 warps (the same
# elements per thread; at 8 warps the one-sequence variant took 138 registers under triton 3.9: 1 CTA/SM).
PREFILL_CONFIGS = declare(ConfigSpace(
    "kda.short_conv._short_conv_prefill", key=("D", "dtype"),
    default={"BT": 16, "BD": 128, "num_warps": 8},
    buckets=[({"dtype": "torch.float32"}, {"BT": 8, "BD": 128, "num_warps": 4})],
    candidates=[{"BT": 8, "BD": 128, "num_warps": 4}, {"BT": 32, "BD": 64, "num_warps": 8},
                {"BT": 16, "BD": 256, "num_warps": 8}]))

# Decode: BD channels x the W-1 state columns per program, grid (D/BD, N). BD = 256 at 4 warps: 56 registers,
# 9 CTAs/SM, 48 programs at N = 1 (D = 12288). N <= 2: BD = 64 at 2 warps, 192 programs, so more SMs issue loads.
DECODE_CONFIGS = declare(ConfigSpace(
    "kda.short_conv._short_conv_decode", key=("N", "D", "dtype"),
    default={"BD": 256, "num_warps": 4},
    buckets=[({"N": 2}, {"BD": 64, "num_warps": 2})],
    candidates=[{"BD": 128, "num_warps": 4}, {"BD": 512, "num_warps": 8}]))


@triton.jit
def _conv_token_block(x, weight, state, cu_seqlens, y, i_t, o_d, m_d, T, D, N, W: tl.constexpr,
                      HAS_STATE: tl.constexpr, SEARCH_STEPS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                      ROUND: tl.constexpr):
    """y for BT tokens x BD channels."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    # sequence of each token: the largest n with cu_seqlens[n] <= t (invariant cu[lo] <= t < cu[hi])
    lo = tl.zeros([BT], dtype=tl.int32)
    hi = tl.zeros([BT], dtype=tl.int32) + N
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens + mid) <= o_t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    pos = o_t - tl.load(cu_seqlens + lo)  # position inside the sequence
    # row base pointers ([BT] vectors) and column offsets: the [BT, BD] pointer tiles live one tap at a time
    x_rows = x + (o_t - (W - 1)).to(tl.int64) * D
    s_rows = state + lo.to(tl.int64) * D * (W - 1)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        from_x = pos + j >= W - 1  # else xp[pos + j] is state column pos + j
        xv = tl.load(x_rows[:, None] + (j * D + o_d)[None, :], mask=(m_t & from_x)[:, None] & m_d[None, :],
                     other=0.0).to(tl.float32)
        if HAS_STATE:
            p_s = s_rows[:, None] + (o_d * (W - 1))[None, :] + (pos + j)[:, None]
            xv += tl.load(p_s, mask=(m_t & (pos + j < W - 1))[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        acc += xv * w_j[None, :]
    out = round_bf16(acc * tl.sigmoid(acc), ROUND)
    p_y = y + o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    tl.store(p_y, out.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _conv_new_state(x, state, cu_seqlens, new_state, i_n, o_d, m_d, D, W: tl.constexpr, HAS_STATE: tl.constexpr,
                    BW: tl.constexpr):
    """The new state of sequence i_n: columns c = xp[L + c], from the tokens or (short sequences) the old state."""
    bos = tl.load(cu_seqlens + i_n)
    seq_len = tl.load(cu_seqlens + i_n + 1) - bos
    o_c = tl.arange(0, BW)
    m_c = o_c < W - 1
    src = seq_len + o_c - (W - 1)
    p_x = x + (bos + src).to(tl.int64)[None, :] * D + o_d[:, None]
    cols = tl.load(p_x, mask=m_d[:, None] & (m_c & (src >= 0))[None, :], other=0.0)
    state_row = (i_n.to(tl.int64) * D + o_d[:, None]) * (W - 1)
    if HAS_STATE:
        p_s = state + state_row + (seq_len + o_c)[None, :]
        cols += tl.load(p_s, mask=m_d[:, None] & (m_c & (src < 0))[None, :], other=0.0)
    tl.store(new_state + state_row + o_c[None, :], cols.to(new_state.dtype.element_ty),
             mask=m_d[:, None] & m_c[None, :])


@triton.jit
def _short_conv_prefill(x, weight, state, cu_seqlens, y, new_state, T, D, N, n_token_blocks,
                        W: tl.constexpr, HAS_STATE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, ROUND: tl.constexpr):
    """Programs (BD channels, i_t): token blocks first, then one program per sequence for its new state. Each
    branch is its own helper: Triton types every name assigned in both branches of an `if` as one scf.if result,
    and the two branches hold tiles of different shapes."""
    i_d = tl.program_id(0)
    i_t = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if i_t < n_token_blocks:
        _conv_token_block(x, weight, state, cu_seqlens, y, i_t, o_d, m_d, T, D, N, W, HAS_STATE, SEARCH_STEPS, BT,
                          BD, ROUND)
    else:
        _conv_new_state(x, state, cu_seqlens, new_state, i_t - n_token_blocks, o_d, m_d, D, W, HAS_STATE, BW)


def short_conv_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                       conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], weight [D, W], cu_seqlens [N+1] int32, conv_state [N, D, W-1] or None (new sequences: zeros)
    -> (y [T, D] in x's dtype, new_state [N, D, W-1] in the state's dtype, x's without one)."""
    x, weight, cu_seqlens = x.contiguous(), weight.contiguous(), cu_seqlens.contiguous()
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    y = torch.empty_like(x)
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    new_state = torch.empty(N, D, W - 1, dtype=state_dtype, device=x.device)
    if conv_state is not None:
        conv_state = conv_state.contiguous()
    meta, options = split(PREFILL_CONFIGS.pick(D=D, dtype=str(x.dtype)))
    if widen():  # one Python program at a time: few large ones
        meta["BD"] = min(next_pow2(D), 1024)
        meta["BT"] = row_block(meta["BD"])
    meta["BD"] = min(meta["BD"], next_pow2(D))
    n_token_blocks = triton.cdiv(T, meta["BT"])
    grid = (triton.cdiv(D, meta["BD"]), n_token_blocks + N)
    _short_conv_prefill[grid](x, weight, conv_state if conv_state is not None else x, cu_seqlens, y, new_state,
                              T, D, N, n_token_blocks, W=W, HAS_STATE=conv_state is not None,
                              SEARCH_STEPS=max(N - 1, 0).bit_length(), BW=next_pow2(W - 1),
                              ROUND=rounds_bf16(y.dtype), **meta, **options)
    return y, new_state


@triton.jit
def _short_conv_decode(x, pool, slots, weight, y, D, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
                       ROUND: tl.constexpr):
    i_d = tl.program_id(0)
    i_n = tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    o_c = tl.arange(0, BW)
    m_d = o_d < D
    m_s = live_rows(m_d[:, None] & (o_c < W - 1)[None, :], slot)  # slot < 0: a padding row, no state
    p_state = pool + (slot * D + o_d[:, None]) * (W - 1) + o_c[None, :]
    cols = tl.load(p_state, mask=m_s, other=0.0)
    w_cols = tl.load(weight + o_d[:, None] * W + o_c[None, :], mask=m_s, other=0.0).to(tl.float32)
    w_cur = tl.load(weight + o_d * W + W - 1, mask=m_d, other=0.0).to(tl.float32)
    xv = tl.load(x + i_n.to(tl.int64) * D + o_d, mask=m_d, other=0.0)
    acc = tl.sum(cols.to(tl.float32) * w_cols, 1) + xv.to(tl.float32) * w_cur
    out = tl.where(slot >= 0, round_bf16(acc * tl.sigmoid(acc), ROUND), 0.0)
    tl.store(y + i_n.to(tl.int64) * D + o_d, out.to(y.dtype.element_ty), mask=m_d)
    # shift the window left by one in registers and append the current token: new[:, c] = cols[:, c + 1]. Never
    # re-load what this kernel stores: lanes holding one 6-byte state row would race on the GPU.
    take = (o_c[:, None] + 1) == o_c[None, :]  # [c, j]: column j moves to c
    shifted = tl.sum(tl.where(take[None, :, :], cols.to(tl.float32)[:, None, :], 0.0), axis=2)
    new = tl.where((o_c == W - 2)[None, :], xv.to(tl.float32)[:, None], shifted)
    # the store's thread mapping differs from the load's (sm_90a TTGIR: [1, 4] per thread over 32 x 1 threads for
    # the load, [1, 1] over 8 x 4 for the store), so another warp may overwrite a column before its loader read it;
    # today the layout conversion between them happens to pass through shared memory behind a barrier: this one
    # does not depend on that
    tl.debug_barrier()
    tl.store(p_state, new.to(pool.dtype.element_ty), mask=m_s)


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """x [N, D], weight [D, W], pool [S, D, W-1] (updated in place, must be contiguous), slots [N] distinct
    -> y [N, D]. A negative slot (vLLM's PAD_SLOT_ID) is a padding row: its y is zero and no state is touched."""
    assert conv_state_pool.is_contiguous(), "the conv state pool is updated in place: it must be contiguous"
    x, weight, slots = x.contiguous(), weight.contiguous(), slots.contiguous()
    N, D = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    meta, options = split(DECODE_CONFIGS.pick(N=N, D=D, dtype=str(x.dtype)))
    meta["BD"] = next_pow2(D) if widen() else min(meta["BD"], next_pow2(D))
    _short_conv_decode[(triton.cdiv(D, meta["BD"]), N)](x, conv_state_pool, slots, weight, y, D, W=W,
                                                       BW=next_pow2(W - 1), ROUND=rounds_bf16(y.dtype), **meta,
                                                       **options)
    return y
