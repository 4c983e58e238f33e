"""KDA chunk stage 3 (chunk-parallel): the output of every chunk from the state it starts from,

    O = Q' h[c] + Tril(A_qk) U        (Q' = scale q exp(G) - Tril(A_qk) W, U and A_qk from stage 1, h from stage 2)

which is Qd h[c] + Tril(A_qk) (U - W h[c]) regrouped (chunk_prefill.py),

one program per (BV columns of V, head, chunk), so the grid has V/BV x H x chunks programs however few sequences
and heads there are (the serial stage has N x H x V/BV). Heads before chunks (since 2026-12-05; chunks before
heads took one head's 256-byte piece of each 8 KB token row of Q', U and o at H = 32, K = 128). The K reduction
runs in slices of BK loaded from memory. For 16-bit inputs Q', h, U and A_qk are bf16 and the dots take them as
bf16 operands (fp32 accumulation); fp32 inputs keep fp32 operands (tf32x3).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import dot_operand, to_output_dtype
from spark_bench.kernels.kda.chunk_state import tile

CONFIGS = declare(ConfigSpace(
    "kda.chunk_output._chunk_output", key=("K", "V", "dtype"),
    default={"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2},
    candidates=[{"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2}, {"BK": 64, "BV": 128, "num_warps": 8,
                                                                       "num_stages": 2},
                {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3}],
    # A100: fp32 (3xTF32 mma.sync) spills 8.8 KB at the default, 236-376 B at the other candidates
    per_target={"sm_80": [({}, {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3})]}))


@triton.jit
def _chunk_output(q_out, h, u, aqk, chunk_start, chunk_end, o, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                  DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)  # heads before chunks: the programs in flight read whole token rows of Q', U, A_qk, h
    i_c = tl.program_id(2).to(tl.int64)
    start = tl.load(chunk_start + i_c).to(tl.int64)
    end = tl.load(chunk_end + i_c).to(tl.int64)
    if start >= end:
        return
    o_t = tl.arange(0, BT)
    rows = start + o_t
    m_t = rows < end
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # Tril(A_qk): its upper blocks are never written, so they are not read either
    a = tile(aqk, rows, m_t, i_h, o_t, o_t < BT, H, BT, o_t[:, None] >= o_t[None, :])
    b_u = tile(u, rows, m_t, i_h, o_v, m_v, H, V)
    acc = tl.dot(dot_operand(a, DOT_BF16, INTERPRET), dot_operand(b_u, DOT_BF16, INTERPRET), input_precision=PREC)
    matrix = i_c * H + i_h
    for k0 in tl.range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_h = tl.load(h + (matrix * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                      other=0.0)
        b_q = tile(q_out, rows, m_t, i_h, o_k, m_k, H, K)
        acc = tl.dot(dot_operand(b_q, DOT_BF16, INTERPRET), dot_operand(b_h, DOT_BF16, INTERPRET), acc,
                     input_precision=PREC)
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], to_output_dtype(acc, o, INTERPRET),
             mask=m_t[:, None] & m_v[None, :])


def chunk_output(q_out, h, u, aqk, chunk_start, chunk_end, n_chunks, *, out_dtype, prec, interpret):
    """Q' [T, H, K], h [n_chunks, H, K, V], U [T, H, V], A_qk [T, H, BT] (bf16, or fp32 for fp32 inputs) -> o
    [T, H, V] in out_dtype."""
    T, H, K = q_out.shape
    V = u.shape[-1]
    BT = aqk.shape[-1]
    o = torch.empty(T, H, V, dtype=out_dtype, device=q_out.device)
    meta, options = split(CONFIGS.pick(K=K, V=V, dtype=str(out_dtype)))
    full_k, full_v = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    if widen():  # one program at a time in Python: whole rows at once
        meta["BK"], meta["BV"] = full_k, full_v
    meta["BK"], meta["BV"] = min(meta["BK"], full_k), min(meta["BV"], full_v)
    if prec == "ieee" and not interpret:
        prec = "tf32x3"
    _chunk_output[(triton.cdiv(V, meta["BV"]), H, n_chunks)](
        q_out, h, u, aqk, chunk_start, chunk_end, o, H=H, K=K, V=V, BT=BT, PREC=prec,
        DOT_BF16=q_out.dtype == torch.bfloat16, INTERPRET=interpret,
        **meta, **options)
    return o
