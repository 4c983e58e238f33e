"""bf16 routed experts, decode path (few slots): weight tiles streamed once per expert, no alignment launches.

A slot p = t*K + k with expert e = ids[p] LEADS when no earlier slot has the same expert; a program of a slot that
does not lead exits at once, and the leader's programs serve every slot q with ids[q] == e (its "group", found in
the [P] ids, P <= 64): each weight tile is loaded once and multiplied by the group's [BK, BP] activations on tensor
cores (a [BN, BK] x [BK, BP] dot, BP = next_pow2(P) >= 16). So routing that repeats an expert (T > 1 with skew,
the shared expert's T slots on its one expert) reads that expert once, not once per slot; unique routing reads the
same bytes as a per-slot GEMV. Grids count every slot (the host cannot see repeats without a sync) unless E = 1.
Past 64 slots (only when the path is forced) groups are found within windows of 64 slots.
  _decode_swiglu  h[q, n] = silu(w1[e, n] . x[t_q]) * (w3[e, n] . x[t_q]) for the leader's group: one program per
                  (slot, slice of D, BN rows of I). With S1 > 1 slices of D the gate / up dots go out as fp32
                  partials h[q*S1 + s] = [gate | up] that _decode_down sums in order and activates as it loads h.
  _decode_down    part[q*S + s] = w[q] * (w2[e][:, slice s] @ h[q, slice s]) in fp32: one program per (slot, slice of
                  I, BN rows of D). Kimi-Linear T = 1: 8 slots x 144 D tiles = 1152 programs.
  _sum_slots      y[t] = the token's K*S partials summed in a fixed order (kernels/moe/slots.py): deterministic.
                  At decode sizes (FUSE) the last _decode_down program of each D tile does it instead: no launch.
S1 and S (slices of D and of I) are the smallest splits that reach MIN_CTAS programs over min(P, E) leaders.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, round_bf16, rounds_bf16, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split
from spark_bench.kernels.moe.slots import FusedSum, sum_tile

# BN >= 16 (the dot's M); BK shrinks so the [BK, BP] activation tile stays within TILE elements.
SWIGLU_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_swiglu", key=("P", "D", "I"),
    default={"BN": 16, "BK": 256, "TILE": 4096, "MIN_CTAS": 1024, "num_warps": 4},
    candidates=[{"BN": 16, "BK": 128, "TILE": 4096, "MIN_CTAS": 1024, "num_warps": 4},
                {"BN": 32, "BK": 256, "TILE": 8192, "MIN_CTAS": 2048, "num_warps": 8}],
    doc="BN rows of w1 and of w3 per program, BK columns of D per step (BK * BP <= TILE), D split until MIN_CTAS"))
DOWN_CONFIGS = declare(ConfigSpace(
    "moe.experts_decode._decode_down", key=("P", "D", "I"),
    default={"BN": 16, "BK": 256, "TILE": 4096, "MIN_CTAS": 1024, "num_warps": 4},
    buckets=[({"P": 2}, {"BN": 16, "BK": 128, "TILE": 4096, "MIN_CTAS": 1024, "num_warps": 4}),
             ({"D": 256}, {"BN": 16, "BK": 512, "TILE": 8192, "MIN_CTAS": 2048, "num_warps": 8})],
    candidates=[{"BN": 16, "BK": 512, "TILE": 8192, "MIN_CTAS": 2048, "num_warps": 8},
                {"BN": 32, "BK": 256, "TILE": 8192, "MIN_CTAS": 1024, "num_warps": 8}],
    doc="BN rows of w2 per program, BK columns of I per step (BK * BP <= TILE), I split until MIN_CTAS programs"))


PARTS_BUDGET = 32  # slices of D x slots: bounds the partials' re-reads (see decode)


@triton.jit
def _group(topk_ids, p, P, E, BP: tl.constexpr, ONE: tl.constexpr):
    """(leads, e, streams, o_q, in_group, in_group_routed): slot p's expert, whether p is its first slot within its
    window of BP slots, whether its group has a slot routed to an expert, the window's slots routed to e, and those
    of them routed to an expert. An id outside [0, E) (vLLM's -1 for another rank's expert) adds nothing: its group
    streams no weights (e clamped to 0 for the addresses) and stores zeros. ONE (E = 1): the grid holds only each
    window's first slot, which leads all of the window whatever its id."""
    o_q = p // BP * BP + tl.arange(0, BP)
    e = tl.load(topk_ids + p)
    ids = tl.load(topk_ids + o_q, mask=o_q < P, other=e + 1)  # the window's padding lanes are never e's
    if ONE:
        return p >= 0, (e * 0).to(tl.int64), p >= 0, o_q, o_q < P, (o_q < P) & (ids == 0)
    same = ids == e
    leads = tl.sum((same & (o_q < p)).to(tl.int32), axis=0) == 0
    routed = (e >= 0) & (e < E)
    return leads, tl.where(routed, e, 0).to(tl.int64), routed, o_q, same, same & (ids >= 0) & (ids < E)


@triton.jit
def _decode_swiglu(x, w13, h, topk_ids, P, D, I, E, D_SPLIT, S1, LEAD_STRIDE, K: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, BP: tl.constexpr, PARTS: tl.constexpr, UPCAST_DOT: tl.constexpr,
                   RNE: tl.constexpr, ONE: tl.constexpr):
    """Program (p*S1 + s, n-tile): the gate and up dots of slot p's group over slice s of D. PARTS (S1 > 1): fp32
    partials h[q*S1 + s] = [gate | up] ([P*S1, 2I]) for _decode_down to finish; else bf16 h[q] = SwiGLU."""
    i_ps, i_n = tl.program_id(0), tl.program_id(1)
    leads, e, streams, o_q, same, routed = _group(topk_ids, i_ps // S1 * LEAD_STRIDE, P, E, BP, ONE)
    if leads:
        s = i_ps % S1
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < I
        w_gate = w13 + e * 2 * I * D + o_n[:, None].to(tl.int64) * D
        x_col = x + (o_q // K).to(tl.int64)[None, :] * D
        acc_g = tl.zeros([BN, BP], dtype=tl.float32)
        acc_u = tl.zeros([BN, BP], dtype=tl.float32)
        k_end = tl.where(streams, tl.minimum(D, (s + 1) * D_SPLIT), s * D_SPLIT)
        for k0 in range(s * D_SPLIT, k_end, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < k_end
            xt = tl.load(x_col + o_k[:, None], mask=m_k[:, None] & routed[None, :], other=0.0)
            m_w = m_n[:, None] & m_k[None, :]
            wg = tl.load(w_gate + o_k[None, :], mask=m_w, other=0.0)
            wu = tl.load(w_gate + I * D + o_k[None, :], mask=m_w, other=0.0)
            if UPCAST_DOT:
                xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(wg, xt, acc_g)
            acc_u = tl.dot(wu, xt, acc_u)
        m_out = m_n[:, None] & same[None, :]
        if PARTS:
            row = h + (o_q * S1 + s).to(tl.int64)[None, :] * 2 * I + o_n[:, None]
            tl.store(row, acc_g, mask=m_out)
            tl.store(row + I, acc_u, mask=m_out)
        else:
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(h + o_q.to(tl.int64)[None, :] * I + o_n[:, None], round_bf16(act, RNE).to(h.dtype.element_ty),
                     mask=m_out)


@triton.jit
def _h_tile(h, o_q, same, o_k, m_k, I, S1, PARTS: tl.constexpr):
    """h[o_q, o_k] as a [BK, BP] tile (fp32 when PARTS: SwiGLU of the S1 gate / up partials summed in order)."""
    mask = m_k[:, None] & same[None, :]
    if PARTS:
        g = tl.zeros([o_k.shape[0], o_q.shape[0]], dtype=tl.float32)
        u = tl.zeros([o_k.shape[0], o_q.shape[0]], dtype=tl.float32)
        for s in range(S1):
            row = h + (o_q * S1 + s).to(tl.int64)[None, :] * 2 * I + o_k[:, None]
            g += tl.load(row, mask=mask, other=0.0)
            u += tl.load(row + I, mask=mask, other=0.0)
        hv = g / (1.0 + tl.exp(-g)) * u
    else:
        hv = tl.load(h + o_q.to(tl.int64)[None, :] * I + o_k[:, None], mask=mask, other=0.0)
    return hv


@triton.jit
def _decode_down(h, w2, topk_ids, topk_weights, part, y, tickets, T, R, P, D, I, E, I_SPLIT, S, S1, LEAD_STRIDE,
                 BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, PARTS: tl.constexpr, FUSE: tl.constexpr,
                 RP: tl.constexpr, RNE: tl.constexpr, UPCAST_DOT: tl.constexpr, ONE: tl.constexpr):
    """part[q*S + s, n-tile] for the group of the program's slot; FUSE: the tile's last program sums y (slots.py)."""
    i_ps, i_n = tl.program_id(0), tl.program_id(1)
    i_s = i_ps % S
    leads, e, streams, o_q, same, routed = _group(topk_ids, i_ps // S * LEAD_STRIDE, P, E, BP, ONE)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    if leads:
        w_row = w2 + e * D * I + o_n[:, None].to(tl.int64) * I
        acc = tl.zeros([BN, BP], dtype=tl.float32)
        k_end = tl.where(streams, tl.minimum(I, (i_s + 1) * I_SPLIT), i_s * I_SPLIT)
        for k0 in range(i_s * I_SPLIT, k_end, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < k_end
            hv = _h_tile(h, o_q, same, o_k, m_k, I, S1, PARTS)
            w = tl.load(w_row + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            if UPCAST_DOT:
                w = w.to(tl.float32)
                hv = hv.to(tl.float32)
            else:
                hv = hv.to(w.dtype)  # bf16 operands (PARTS: the activation rounded once, as h is without PARTS)
            acc = tl.dot(w, hv, acc)
        acc *= tl.load(topk_weights + o_q, mask=routed, other=0.0)[None, :]  # not 0 x an inf weight
        tl.store(part + (o_q * S + i_s).to(tl.int64)[None, :] * D + o_n[:, None], acc,
                 mask=m_n[:, None] & same[None, :])
    if FUSE:
        sum_tile(part, y, tickets, i_n, tl.num_programs(0), o_n, m_n, T, D, R, RP, RNE)


def _block(n: int, cap: int) -> int:
    return max(16, min(next_pow2(n), cap))


def down_split(P: int, D: int, I: int, BN: int, BK: int, min_ctas: int) -> tuple[int, int]:
    """(S, I_SPLIT): the fewest slices of I (I_SPLIT a multiple of BK) that give P*S*cdiv(D, BN) >= min_ctas."""
    want = max(1, min(triton.cdiv(I, BK), triton.cdiv(min_ctas, P * triton.cdiv(D, BN))))
    i_split = triton.cdiv(triton.cdiv(I, want), BK) * BK
    return triton.cdiv(I, i_split), i_split


def up_split(P: int, D: int, I: int, BN: int, min_ctas: int, max_slices: int = 64) -> tuple[int, int]:
    """(S1, D_SPLIT): slices of D (D_SPLIT a multiple of 64, rounded down so S1 reaches the want) giving
    P*S1*cdiv(I, BN) >= min_ctas programs where D and max_slices allow."""
    want = max(1, min(triton.cdiv(D, 64), max_slices, triton.cdiv(min_ctas, P * triton.cdiv(I, BN))))
    d_split = max(64, D // want // 64 * 64) if want > 1 else D
    return triton.cdiv(D, d_split), d_split


def _step(meta: dict, BP: int) -> int:
    """BK of a config for BP group columns: at most TILE // BP, at least 16 (the dot's K)."""
    return max(16, min(meta["BK"], meta["TILE"] // BP))


def decode(x, topk_ids, topk_weights, w13, w2, split_i: int | None = None, split_d: int | None = None):
    """y [T, D] for few slots (P = T*K <= 64 on the auto path; more run in windows of 64). split_i / split_d: force
    the slice width of I (down) and of D (gate/up; tests). Under the interpreter D is not split unless forced."""
    T, D = x.shape
    E, K, I = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    P = T * K
    BP = _block(P, 64)
    stride = 1 if E > 1 else BP  # E = 1: each window's first slot leads it, and the grid holds only those
    leaders = triton.cdiv(P, stride)
    meta, options = split(SWIGLU_CONFIGS.pick(P=P, D=D, I=I))
    BN, BK = (_block(I, 128), _block(D, 256) if split_d is None else 16) if widen() else (meta["BN"],
                                                                                          _step(meta, BP))
    # every down program re-reads its slice of the S1 partials for all P slots (cdiv(D, BN) * S1 * I * P * 8 B of
    # L2 reads in all): S1 * P <= PARTS_BUDGET keeps that within ~3x the weights at Kimi-Linear sizes
    S1, d_split = (1, D) if widen() else up_split(min(P, E), D, I, BN, meta["MIN_CTAS"],
                                                    max(1, PARTS_BUDGET // P))
    if split_d is not None:
        S1, d_split = triton.cdiv(D, split_d), split_d
    if S1 > 1:
        BK = max(16, min(BK, d_split & -d_split))  # a power of two dividing the slice: no half-masked steps
    parts = S1 > 1
    h = torch.empty((P * S1, 2 * I) if parts else (P, I), dtype=torch.float32 if parts else x.dtype,
                    device=x.device)
    _decode_swiglu[(leaders * S1, triton.cdiv(I, BN))](x, w13, h, topk_ids, P, D, I, E, d_split, S1, stride, K=K,
                                                       BN=BN, BK=BK, BP=BP, PARTS=parts, UPCAST_DOT=INTERPRET,
                                                       RNE=rounds_bf16(h.dtype), ONE=E == 1, **options)
    meta, options = split(DOWN_CONFIGS.pick(P=P, D=D, I=I))
    # PARTS: the gate and up sums are two more fp32 [BK, BP] tiles. At BK * BP = 4096 and 2048 ptxas spilled 4 B on
    # sm_90a (at 168 registers for 3 CTAs/SM, quick shapes, triton 3.6); at 1024: 96 registers, 5 CTAs/SM
    BN, BK = (_block(D, 128), _block(I, 256) if split_i is None else 16) if widen() else (
        meta["BN"], _step(meta, BP * (4 if parts else 1)))
    S, i_split = down_split(min(P, E), D, I, BN, BK, meta["MIN_CTAS"])
    if split_i is not None:
        S, i_split = triton.cdiv(I, split_i), split_i
    part = torch.empty((P * S, D), dtype=torch.float32, device=x.device)
    slot_sum = FusedSum("moe.experts_decode._decode_down", T, D, K * S, x.dtype, x.device)
    _decode_down[(leaders * S, triton.cdiv(D, BN))](h, w2, topk_ids, topk_weights, part, P=P, D=D, I=I,
                                                    E=E, I_SPLIT=i_split, S=S, S1=S1, LEAD_STRIDE=stride, BN=BN, BK=BK,
                                                    BP=BP, PARTS=parts, UPCAST_DOT=INTERPRET, ONE=E == 1,
                                                    **slot_sum.kernel_args(part, triton.cdiv(D, BN)), **options)
    return slot_sum.finish(part)
