"""KDA chunk stage 2 (sequential over chunks): one program per (BV columns of V, head, sequence), V tiles fastest
so that the programs of one (sequence, head), which all read its W and Kd, run together and share them in L2 (with
sequences fastest, as before 2026-12-05, they were N x H programs apart: at many sequences, each re-read W and Kd
from DRAM), carries the fp32 state S [K, BV] through the sequence's chunks. Per chunk c it stores the state it
starts from, then steps:

    h[c] = S;   U' = U - W S   (registers only);   S = exp(G_last)[:, None] * S + Kd^T U'

The output O = Q' h[c] + Tril(A_qk) U is chunk-parallel (chunk_output.py), as in fla's chunk_delta_h + chunk_o
split, except that fla's output kernel reads U' (v_new) written here, and ours reads U and Q' = Qd - Tril(A_qk) W
(formed by the intra kernel): this pass writes only h. It carries 2 dots per state tile, so it stays in registers
on the fp32 path too.
S is held as two register tiles of BKT = K/2 rows (fla keeps up to four 64-row tiles). For 16-bit inputs W, U, Kd
and h are bf16 and the dots take bf16 operands (S and U' rounded to bf16 as operands only, fp32 accumulation), as
fla's chunk_delta_h: a step moves [64, K] x 2 + [64, BV] x 2 bf16 tiles. fp32 inputs keep fp32 intermediates and
tf32x3 dots (fp32-accurate on tensor cores; IEEE dots run on CUDA cores and spill). The chunk loop is a
dependent chain (one step per chunk, few CTAs at one long sequence), so each step's operand loads are on it unless
issued a step early: PREFETCH (declared, 16-bit default) loads chunk c+1's operands into registers at the top of step
c; fp32 inputs load at use (their tiles would double the registers).
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import MAX_GRID_YZ, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.kda.chunk_prep import dot_operand, to_output_dtype

CONFIGS = declare(ConfigSpace(
    "kda.chunk_state._chunk_state", key=("K", "V", "dtype", "NH"),
    default={"BV": 32, "PREFETCH": 0, "num_warps": 4, "num_stages": 1},
    # 16-bit: each step loads the next chunk's W, Kd, U and decay into registers before its own dots, so the serial
    # chain does not wait a DRAM round trip per chunk (sm_90a: 120 -> 202 registers, 4 -> 2 CTAs/SM). Triton's own
    # pipelining needs 3 stages for that (2 issue the next loads after the dots: no overlap), 116 KB of shared
    # memory: 1 CTA/SM.
    # NH = sequences x heads, the grid's rows: at NH <= 16 (one sequence at TP2 and beyond: 4-16 heads) BV 32 gives
    # NH x V/32 <= 64 CTAs on 132 SMs, each a serial chain; BV 16 doubles them (<= 128: still one per SM) at no
    # more L2 reads per step than BV 32 at NH = 32 (each CTA reads the chunk's whole W and Kd).
    buckets=[({"dtype": "torch.bfloat16", "NH": 16}, {"BV": 16, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}),
             ({"dtype": "torch.float16", "NH": 16}, {"BV": 16, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}),
             ({"dtype": "torch.bfloat16"}, {"BV": 32, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}),
             ({"dtype": "torch.float16"}, {"BV": 32, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}),
             # fp32 (3xTF32) at 32 < K <= 64 (head_dim 64, outside the presets): the default spilled 280-308 B on
             # sm_90a at 255 registers, every other candidate 20-704 B; BV 16 at 8 warps is clean (K <= 32 and
             # K = 128 are clean at the default)
             ({"dtype": "torch.float32", "K": (33, 64)}, {"BV": 16, "PREFETCH": 0, "num_warps": 8, "num_stages": 1})],
    candidates=[{"BV": 16, "PREFETCH": 0, "num_warps": 4, "num_stages": 1},
                {"BV": 64, "PREFETCH": 0, "num_warps": 8, "num_stages": 1},
                {"BV": 32, "PREFETCH": 0, "num_warps": 4, "num_stages": 2},
                {"BV": 32, "PREFETCH": 0, "num_warps": 4, "num_stages": 3},
                {"BV": 16, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}],
    # A100, fp32 (3xTF32 mma.sync): the default spills 264 B, BV 16 at 4 warps 8 B; 16-bit is clean at the default
    # A100, 16-bit (mma.sync): PREFETCH spills 48 B, so it loads at use
    per_target={"sm_80": [({"dtype": "torch.float32"}, {"BV": 16, "PREFETCH": 0, "num_warps": 8, "num_stages": 1}),
                          ({"dtype": "torch.bfloat16"}, {"BV": 32, "PREFETCH": 0, "num_warps": 4, "num_stages": 1}),
                          ({"dtype": "torch.float16"}, {"BV": 32, "PREFETCH": 0, "num_warps": 4, "num_stages": 1})]}))


@triton.jit
def tile(ptr, rows, m_rows, i_h, o_c, m_c, H: tl.constexpr, C: tl.constexpr, m_tile=True):
    """The [rows, o_c] tile of head i_h of a [T, H, C] tensor (zeros where masked; m_tile: a [rows, o_c] mask)."""
    return tl.load(ptr + (rows[:, None] * H + i_h) * C + o_c[None, :],
                   mask=m_rows[:, None] & m_c[None, :] & m_tile, other=0.0)


@triton.jit
def _half(ptr, c0, eos, o_t, i_h, k0, H: tl.constexpr, K: tl.constexpr, BKT: tl.constexpr):
    """Columns k0 .. k0+BKT of chunk c0's rows of a [T, H, K] tensor (W or Kd); all masked off when c0 >= eos."""
    o_k = k0 + tl.arange(0, BKT)
    return tile(ptr, c0 + o_t, c0 + o_t < eos, i_h, o_k, o_k < K, H, K)


@triton.jit
def _g_last(glast, chunk, c0, eos, k0, K: tl.constexpr, BKT: tl.constexpr):
    """G_last of columns k0 .. k0+BKT for chunk c0 (its row `chunk` of glast); zeros when c0 >= eos. The exp is taken
    where the decay is used: taken here, a prefetched value would stall the step on its own load."""
    o_k = k0 + tl.arange(0, BKT)
    live = c0 + tl.zeros([BKT], dtype=tl.int64) < eos  # a tensor: a scalar bool is no mask in the interpreter
    return tl.load(glast + chunk * K + o_k, mask=(o_k < K) & live, other=0.0)


@triton.jit
def _w_times(w_t, S, acc, PREC: tl.constexpr, DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + W_half S_half (S rounded to the operand type)."""
    return tl.dot(dot_operand(w_t, DOT_BF16, INTERPRET), dot_operand(S, DOT_BF16, INTERPRET), acc,
                  input_precision=PREC)


@triton.jit
def _advance(S, kd_t, g_last, b_u, PREC: tl.constexpr, DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """exp(G_last) S + Kd^T U' for one half of the state's K rows."""
    return tl.dot(dot_operand(tl.trans(kd_t), DOT_BF16, INTERPRET), b_u, S * tl.exp(g_last)[:, None],
                  input_precision=PREC)


@triton.jit
def _state_offsets(matrix, k0, o_v, K: tl.constexpr, V: tl.constexpr, BKT: tl.constexpr):
    """Offsets and mask of rows k0 .. k0+BKT, columns o_v of the [K, V] matrix number `matrix`."""
    o_k = k0 + tl.arange(0, BKT)
    return (matrix * K + o_k[:, None]) * V + o_v[None, :], (o_k < K)[:, None] & (o_v < V)[None, :]


@triton.jit
def _load_state(ptr, matrix, k0, o_v, K: tl.constexpr, V: tl.constexpr, BKT: tl.constexpr):
    offs, mask = _state_offsets(matrix, k0, o_v, K, V, BKT)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, S, matrix, k0, o_v, K: tl.constexpr, V: tl.constexpr, BKT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    offs, mask = _state_offsets(matrix, k0, o_v, K, V, BKT)
    tl.store(ptr + offs, to_output_dtype(S, ptr, INTERPRET), mask=mask)


@triton.jit
def _chunk_state(w, u, kd, glast, cu_seqlens, chunk_first, h0, h, ht,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKT: tl.constexpr,
                 BV: tl.constexpr, PREFETCH: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                 PREC: tl.constexpr, DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    i_v = tl.program_id(0)  # V tiles fastest: a (sequence, head)'s programs run together and share W, Kd in L2
    i_h = tl.program_id(1)
    i_n = tl.program_id(2).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_first + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    state = i_n * H + i_h  # this sequence's and head's [K, V] matrix in h0 / ht
    if HAS_H0:
        S1 = _load_state(h0, state, 0, o_v, K, V, BKT)
        S2 = _load_state(h0, state, BKT, o_v, K, V, BKT)
    else:
        S1 = tl.zeros([BKT, BV], dtype=tl.float32)
        S2 = tl.zeros([BKT, BV], dtype=tl.float32)
    if PREFETCH:  # chunk 0's operands; each step then loads the next chunk's before its own dots
        n_w1, n_w2 = _half(w, bos, eos, o_t, i_h, 0, H, K, BKT), _half(w, bos, eos, o_t, i_h, BKT, H, K, BKT)
        n_kd1, n_kd2 = _half(kd, bos, eos, o_t, i_h, 0, H, K, BKT), _half(kd, bos, eos, o_t, i_h, BKT, H, K, BKT)
        n_u = tile(u, bos + o_t, bos + o_t < eos, i_h, o_v, m_v, H, V)
        chunk = first * H + i_h
        n_g1, n_g2 = _g_last(glast, chunk, bos, eos, 0, K, BKT), _g_last(glast, chunk, bos, eos, BKT, K, BKT)
    for c0 in range(bos, eos, BT):
        chunk = (first + (c0 - bos) // BT) * H + i_h  # h[chunk, head]
        _store_state(h, S1, chunk, 0, o_v, K, V, BKT, INTERPRET)
        _store_state(h, S2, chunk, BKT, o_v, K, V, BKT, INTERPRET)
        nxt = c0 + BT
        if PREFETCH:  # this chunk's operands were loaded a step ago; the next chunk's are loaded now
            w1, w2, kd1, kd2, u_t, g1, g2 = n_w1, n_w2, n_kd1, n_kd2, n_u, n_g1, n_g2
            n_w1, n_w2 = _half(w, nxt, eos, o_t, i_h, 0, H, K, BKT), _half(w, nxt, eos, o_t, i_h, BKT, H, K, BKT)
            n_kd1 = _half(kd, nxt, eos, o_t, i_h, 0, H, K, BKT)
            n_kd2 = _half(kd, nxt, eos, o_t, i_h, BKT, H, K, BKT)
            n_u = tile(u, nxt + o_t, nxt + o_t < eos, i_h, o_v, m_v, H, V)
            n_g1 = _g_last(glast, chunk + H, nxt, eos, 0, K, BKT)
            n_g2 = _g_last(glast, chunk + H, nxt, eos, BKT, K, BKT)
        else:  # each operand is loaded just before its dot (fp32 tiles loaded at once would spill)
            w1 = _half(w, c0, eos, o_t, i_h, 0, H, K, BKT)
        ws = _w_times(w1, S1, tl.zeros([BT, BV], dtype=tl.float32), PREC, DOT_BF16, INTERPRET)
        if not PREFETCH:
            w2 = _half(w, c0, eos, o_t, i_h, BKT, H, K, BKT)
        ws = _w_times(w2, S2, ws, PREC, DOT_BF16, INTERPRET)
        if not PREFETCH:
            u_t = tile(u, c0 + o_t, c0 + o_t < eos, i_h, o_v, m_v, H, V)
        b_u = dot_operand(to_output_dtype(u_t.to(tl.float32) - ws, u, INTERPRET), DOT_BF16, INTERPRET)  # U - W S
        if not PREFETCH:
            kd1, g1 = _half(kd, c0, eos, o_t, i_h, 0, H, K, BKT), _g_last(glast, chunk, c0, eos, 0, K, BKT)
        S1 = _advance(S1, kd1, g1, b_u, PREC, DOT_BF16, INTERPRET)
        if not PREFETCH:
            kd2, g2 = _half(kd, c0, eos, o_t, i_h, BKT, H, K, BKT), _g_last(glast, chunk, c0, eos, BKT, K, BKT)
        S2 = _advance(S2, kd2, g2, b_u, PREC, DOT_BF16, INTERPRET)
    if STORE_HT:
        _store_state(ht, S1, state, 0, o_v, K, V, BKT, INTERPRET)
        _store_state(ht, S2, state, BKT, o_v, K, V, BKT, INTERPRET)


def chunk_state(w, u, kd, glast, cu_seqlens, chunk_first, n_chunks, *, BT, initial_state, output_final_state, h_dtype,
                prec, interpret):
    """Stage-1 outputs [T, H, *] (bf16 or fp32) and G's last row per chunk glast [n_chunks, H, K] -> h
    [n_chunks, H, K, V] (h_dtype: the state each chunk starts from) and the final state [N, H, K, V] fp32 (or None)."""
    T, H, K = w.shape
    V = u.shape[-1]
    N = cu_seqlens.numel() - 1
    h = torch.empty(n_chunks, H, K, V, dtype=h_dtype, device=w.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=w.device) if output_final_state else None
    meta, options = split(CONFIGS.pick(K=K, V=V, dtype=str(h_dtype), NH=N * H))
    if widen():  # one program at a time in Python: the whole of V at once
        meta["BV"] = max(16, triton.next_power_of_2(V))
    meta["BV"] = min(meta["BV"], max(16, triton.next_power_of_2(V)))
    if prec == "ieee" and not interpret:
        prec = "tf32x3"
    h0 = initial_state.contiguous() if initial_state is not None else h
    if N > MAX_GRID_YZ:  # grid dimension 2's cap
        raise ValueError(f"{N} sequences in one chunked prefill: at most {MAX_GRID_YZ}")
    _chunk_state[(triton.cdiv(V, meta["BV"]), H, N)](
        w, u, kd, glast, cu_seqlens, chunk_first, h0, h, ht if ht is not None else h,
        H=H, K=K, V=V, BT=BT, BKT=max(16, triton.next_power_of_2(K) // 2),
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, PREC=prec, DOT_BF16=w.dtype == torch.bfloat16,
        INTERPRET=interpret,
        **meta, **options)
    return h, ht
