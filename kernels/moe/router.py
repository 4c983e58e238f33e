"""DeepSeek-V3-style sigmoid router: fp32 logits, biased group-limited top-k selection, unbiased weights.

Two kernels:
  _router_logits  partial logits [S, T, E] f32 = x @ gate_w.T over S slices of D (bf16 operands, fp32
                  accumulation: every bf16 product is exact in fp32, so this is x.float() @ gate_w.float().T up to
                  summation order). Slicing D keeps a decode batch (T = 1) spread over many programs.
  _router_select  sums the slices, sigmoid, + bias, group-limited mask (dropped groups = -inf), K argmax passes,
                  weights from the UNBIASED scores, renormalised and scaled. Ties go to the lowest expert id.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, next_pow2, row_block
from spark_bench.kernels.configs import ConfigSpace, declare, split

from spark_bench import triton_env

# Logits tiles; D is split into slices until the (T, E) tiles x slices reach 2 programs per SM. The prefill
# candidate is a whole-row-block tile (64 tokens x 128 experts, wgmma on sm_90a) that re-reads w 4x less.
LOGITS_CONFIGS = declare(ConfigSpace(
    "moe.router._router_logits", key=("T", "E", "D"), default={"BT": 16, "BE": 32, "BD": 64, "num_warps": 4},
    candidates=[{"BT": 16, "BE": 64, "BD": 64, "num_warps": 4},  # 16x64x128 spilled 8-12 B on sm_90a
                {"BT": 64, "BE": 128, "BD": 64, "num_warps": 8, "num_stages": 3}],
    doc="BT tokens x BE experts per program, BD of D per step"))
# Selection: BT = BUDGET // next_pow2(E) rows per program (the whole expert row in registers).
SELECT_CONFIGS = declare(ConfigSpace(
    "moe.router._router_select", key=("T", "E"), default={"BUDGET": 2048, "num_warps": 4},
    candidates=[{"BUDGET": 1024, "num_warps": 4}, {"BUDGET": 4096, "num_warps": 8}],
    doc="elements of the [BT, next_pow2(E)] score tile per program"))


@triton.jit
def _router_logits(x, w, partial, T, E, D, D_SPLIT, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                   UPCAST_DOT: tl.constexpr):
    i_t, i_e, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_e = (i_e * BE + tl.arange(0, BE)).to(tl.int64)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    d_end = tl.minimum(D, (i_s + 1) * D_SPLIT)
    for d0 in range(i_s * D_SPLIT, d_end, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < d_end
        a = tl.load(x + o_t[:, None] * D + o_d[None, :], mask=(o_t[:, None] < T) & m_d[None, :], other=0.0)
        b = tl.load(w + o_e[None, :] * D + o_d[:, None], mask=(o_e[None, :] < E) & m_d[:, None], other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    tl.store(partial + (i_s * T + o_t[:, None]) * E + o_e[None, :], acc,
             mask=(o_t[:, None] < T) & (o_e[None, :] < E))


@triton.jit
def _router_select(partial, bias, out_w, out_ids, T, S, scale, E: tl.constexpr, K: tl.constexpr,
                   G: tl.constexpr, TG: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                   BG: tl.constexpr):
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_e = tl.arange(0, BE)
    m_t = o_t < T
    m_e = o_e < E
    mask = m_t[:, None] & m_e[None, :]
    logits = tl.zeros([BT, BE], dtype=tl.float32)
    for s in range(S):
        logits += tl.load(partial + (s * T + o_t[:, None]) * E + o_e[None, :], mask=mask, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(bias + o_e, mask=m_e, other=0.0)[None, :]
    choice = tl.where(m_e[None, :], choice, float("-inf"))
    if G > 1:
        # group score = sum of the top-2 biased scores of the group; keep the best TG groups, -inf the rest
        group = o_e // (E // G)
        o_g = tl.arange(0, BG)
        gscore = tl.full([BT, BG], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            c = tl.where((group == g)[None, :], choice, float("-inf"))
            first = tl.argmax(c, axis=1)
            top1 = tl.max(c, axis=1)
            top2 = tl.max(tl.where(o_e[None, :] == first[:, None], float("-inf"), c), axis=1)
            gscore = tl.where(o_g[None, :] == g, (top1 + top2)[:, None], gscore)
        keep = tl.zeros([BT, BE], dtype=tl.int1)
        for _ in tl.static_range(TG):
            best = tl.argmax(gscore, axis=1)
            keep = keep | (group[None, :] == best[:, None])
            gscore = tl.where(o_g[None, :] == best[:, None], float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    o_k = tl.arange(0, BK)
    ids = tl.zeros([BT, BK], dtype=tl.int32)
    wts = tl.zeros([BT, BK], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = o_e[None, :] == best[:, None]
        wk = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        ids = tl.where(o_k[None, :] == k, best[:, None].to(tl.int32), ids)
        wts = tl.where(o_k[None, :] == k, wk[:, None], wts)
        choice = tl.where(hit, float("-inf"), choice)
    wts = wts / tl.sum(wts, axis=1)[:, None] * scale
    m_out = m_t[:, None] & (o_k[None, :] < K)
    tl.store(out_w + o_t[:, None] * K + o_k[None, :], wts, mask=m_out)
    tl.store(out_ids + o_t[:, None] * K + o_k[None, :], ids, mask=m_out)


def router_logits_partial(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """[S, T, E] f32 partial logits over S slices of D (S = 1 unless the T x E tiles alone underfill the GPU)."""
    T, D = x.shape
    E = gate_w.shape[0]
    meta, options = split(LOGITS_CONFIGS.pick(T=T, E=E, D=D))
    BT, BE, BD = (16, min(64, max(16, next_pow2(E))), min(256, max(16, next_pow2(D)))) if INTERPRET else \
        (meta["BT"], meta["BE"], meta["BD"])
    tiles = triton.cdiv(T, BT) * triton.cdiv(E, BE)
    want = max(1, min(triton.cdiv(D, BD), triton.cdiv(2 * triton_env.sm_count(x.device), tiles)))
    d_split = triton.cdiv(triton.cdiv(D, want), BD) * BD
    S = triton.cdiv(D, d_split)
    partial = torch.empty((S, T, E), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(E, BE), S)
    _router_logits[grid](x, gate_w, partial, T, E, D, d_split, BT=BT, BE=BE, BD=BD, UPCAST_DOT=INTERPRET,
                         **options)
    return partial


def route(x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, topk: int, groups: int = 1,
          topk_groups: int = 1, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] bf16, gate_w [E, D] bf16, gate_bias [E] f32 -> (topk_weights [T, K] f32, topk_ids [T, K] int32)."""
    x, gate_w = x.contiguous(), gate_w.contiguous()
    T = x.shape[0]
    E = gate_w.shape[0]
    if E % groups or topk_groups > groups:
        raise ValueError(f"{E} experts cannot form {groups} groups keeping {topk_groups}")
    partial = router_logits_partial(x, gate_w)
    weights = torch.empty((T, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, topk), dtype=torch.int32, device=x.device)
    BE = next_pow2(E)
    meta, options = split(SELECT_CONFIGS.pick(T=T, E=E))
    BT = row_block(BE, budget=meta["BUDGET"])
    _router_select[(triton.cdiv(T, BT),)](partial, gate_bias.float().contiguous(), weights, ids, T,
                                          partial.shape[0], float(routed_scaling_factor), E=E, K=topk, G=groups,
                                          TG=topk_groups, BT=BT, BE=BE, BK=next_pow2(topk),
                                          BG=next_pow2(groups), **options)
    return weights, ids
