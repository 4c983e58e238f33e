"""KDA chunk stage 2 (sequential over chunks): one program per (sequence, head, BV columns of V) carries the fp32
state S [K, BV] through the sequence's chunks and writes the output:

    U' = U - W S;   O = Qd S + Tril(A_qk) U';   S = exp(G_last)[:, None] * S + Kd^T U'

Every factor is bounded (Qd, Kd and exp(G_last) carry decays <= 1). Dot operands fp32, see chunk_intra.py.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.kda.chunk_prep import to_output_dtype


@triton.jit
def _chunk_state(w, u, qd, kd, aqk, gcum, cu_seqlens, h0, o, ht,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
                 INTERPRET: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    offs_s = ((i_n * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    mask_s = m_k[:, None] & m_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + offs_s, mask=mask_s, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    causal = o_t[:, None] >= o_t[None, :]
    for c0 in range(bos, eos, BT):
        rows = c0 + o_t
        m_t = rows < eos
        mask_tk = m_t[:, None] & m_k[None, :]
        mask_tv = m_t[:, None] & m_v[None, :]
        offs_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        offs_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_w = tl.load(w + offs_tk, mask=mask_tk, other=0.0)
        b_qd = tl.load(qd + offs_tk, mask=mask_tk, other=0.0)
        b_kd = tl.trans(tl.load(kd + offs_tk, mask=mask_tk, other=0.0))
        b_u = tl.load(u + offs_tv, mask=mask_tv, other=0.0)
        b_a = tl.load(aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_t[:, None] & causal, other=0.0)
        last = tl.minimum(c0 + BT, eos) - 1
        decay = tl.exp(tl.load(gcum + (last * H + i_h) * K + o_k, mask=m_k, other=0.0))
        b_u = b_u - tl.dot(b_w, S, input_precision=PREC)
        b_o = tl.dot(b_qd, S, input_precision=PREC) + tl.dot(b_a, b_u, input_precision=PREC)
        tl.store(o + offs_tv, to_output_dtype(b_o, o, INTERPRET), mask=mask_tv)
        S = S * decay[:, None] + tl.dot(b_kd, b_u, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + offs_s, S, mask=mask_s)


def chunk_state(w, u, qd, kd, aqk, gcum, cu_seqlens, *, initial_state, output_final_state, out_dtype, prec,
                interpret):
    """Stage-1 outputs [T, H, *] -> o [T, H, V] (out_dtype) and the final state [N, H, K, V] fp32 (or None)."""
    T, H, K = w.shape
    V = u.shape[-1]
    N = cu_seqlens.numel() - 1
    BT = aqk.shape[-1]
    o = torch.empty(T, H, V, dtype=out_dtype, device=w.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=w.device) if output_final_state else None
    BV = max(16, triton.next_power_of_2(V))
    if not interpret:
        BV = min(BV, 32)
    h0 = initial_state.contiguous() if initial_state is not None else o
    _chunk_state[(N, H, triton.cdiv(V, BV))](
        w, u, qd, kd, aqk, gcum, cu_seqlens, h0, o, ht if ht is not None else o,
        H=H, K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)), BV=BV,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, PREC=prec, INTERPRET=interpret,
        num_warps=4)
    return o, ht
