"""The KDA chunkwise prefill core in three Triton stages (chunk BT = 64):

  1. chunk_intra.py  G = chunk-local cumsum of the decay (gate fused), A_qk, the UT transform W, U, the decayed
                     Kd and Q' = Qd - Tril(A_qk) W (L2 norm, beta sigmoid fused)    grid PROGRAMS_PER_SM x SMs
  2. chunk_state.py  the sequential pass over chunks: per-chunk states h and the final state  grid (V/BV, H, N)
  3. chunk_output.py O = Q' h + Tril(A_qk) U, chunk-parallel                                 grid (V/BV, H, chunks)

O = Qd h + Tril(A_qk) (U - W h) is regrouped as (Qd - Tril(A_qk) W) h + Tril(A_qk) U, so the serial pass forms the
corrected values U - W h only in registers and writes nothing but h (counted: 256 B less per token·head).

G and L live in a per-program fp32 slot (only G's last row per chunk is stored, [chunks, H, K] fp32); the other
intermediates [T, H, *] and h [chunks, H, K, V] are bf16 for 16-bit inputs (fp32 for fp32 inputs), with bf16 dot
operands and fp32 accumulation in stages 2-3. Varlen sequences never share a chunk; the chunk table is built on the
device (no host sync, so the call is graph-capturable for a fixed token count) and cached per cu_seqlens tensor, as
fla does: a repeated call with the same tensor launches none of its ~20 small torch kernels. q, k and v are passed
with their token strides (the block's views of the conv output are not copied).
"""

import torch
from spark_bench.kernels.common import INTERPRET, per_tensor
from spark_bench.kernels.kda.chunk_intra import chunk_intra
from spark_bench.kernels.kda.chunk_output import chunk_output
from spark_bench.kernels.kda.chunk_prep import chunk_table
from spark_bench.kernels.kda.chunk_state import chunk_state

BT = 64
_TABLES: dict = {}  # cached_chunk_table's per_tensor cache
_OFFSETS: dict = {}  # (B, T, device) -> cu_seqlens of B sequences of T tokens


def cached_chunk_table(cu_seqlens: torch.Tensor, total: int, chunk: int):
    """chunk_table, reused while the same cu_seqlens tensor (same object, not modified in place) comes back."""
    return per_tensor(_TABLES, cu_seqlens, lambda: chunk_table(cu_seqlens, total, chunk), total, chunk)


def _offsets(B: int, T: int, device) -> torch.Tensor:
    key = (B, T, str(device))
    if key not in _OFFSETS:
        if len(_OFFSETS) >= 8:
            _OFFSETS.pop(next(iter(_OFFSETS)))
        _OFFSETS[key] = torch.arange(0, B + 1, device=device, dtype=torch.int32) * T
    return _OFFSETS[key]


def _token_rows(x: torch.Tensor, total: int) -> torch.Tensor:
    """x [B, T, H, D] as [total, H, D] with contiguous heads and channels; a view (any token stride) when it can be."""
    x = x.reshape(total, *x.shape[2:])
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def chunk_kda_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      A_log=None, dt_bias=None):
    """fla's chunk_kda calling convention: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], initial_state
    [N, H, K, V] fp32 -> (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        cu_seqlens = _offsets(B, T, q.device)
    elif B != 1:
        raise ValueError(f"cu_seqlens needs B = 1 (flattened sequences), got B = {B}")
    total = B * T
    q, k, v = (_token_rows(x, total) for x in (q, k, v))
    g = g.reshape(total, H, K).contiguous()
    beta = beta.reshape(total, H).contiguous()
    prec = "ieee" if v.dtype == torch.float32 else "tf32"
    start, end, n_chunks, first = cached_chunk_table(cu_seqlens, total, BT)
    glast, w, u, q_out, kd, aqk = chunk_intra(
        q, k, v, g, beta, start, end, n_chunks, scale=scale, BT=BT, l2norm=use_qk_l2norm_in_kernel,
        beta_sigmoid=use_beta_sigmoid_in_kernel, prec=prec, interpret=INTERPRET, gate=use_gate_in_kernel,
        A_log=None if A_log is None else A_log.reshape(-1).contiguous(),
        dt_bias=None if dt_bias is None else dt_bias.reshape(-1).contiguous())
    h_dtype = torch.float32 if v.dtype == torch.float32 else torch.bfloat16
    h, ht = chunk_state(w, u, kd, glast, cu_seqlens, first, n_chunks, BT=BT, initial_state=initial_state,
                        output_final_state=output_final_state, h_dtype=h_dtype, prec=prec, interpret=INTERPRET)
    o = chunk_output(q_out, h, u, aqk, start, end, n_chunks, out_dtype=v.dtype, prec=prec, interpret=INTERPRET)
    return o.view(B, T, H, V), ht
