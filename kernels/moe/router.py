"""DeepSeek-V3-style sigmoid router: fp32 logits, biased group-limited top-k selection, unbiased weights.

One launch per call, by T:
  _router_rows    prefill (a full wave of BT-row blocks): each program owns BT whole rows (all E experts in one
                  [BT, next_pow2(E)] tile, BD of D per step: x read once, wgmma at BT = 64) and runs the selection
                  in its epilogue: no partial logits in memory.
  _router_logits  decode: partial logits [S, T, E] f32 over S slices of D (tiles x slices reach MIN_CTAS programs,
                  at least 2 per SM: at T <= 4, 16 x 16 x 32 tiles spread the 1.2 MB of Kimi-Linear's gate_w over
                  1152 programs, the whole read in flight in one wave). With TICKET the last program of a row block
                  to finish (a per-row-block atomic ticket, reset by that program for the next call) sums the
                  slices in fixed order and selects, ROWS rows at a time: ROWS = 1 keeps its tiles 1-D, so the
                  grid's programs stay small (2 warps, many per SM) and the winner loads 16 slices per step; one
                  launch, deterministic. Without TICKET, _router_select is a second launch (the fallback candidate).
Selection (_select_rows): sigmoid, + bias, group-limited mask (dropped groups = -inf), K argmax passes, weights from
the UNBIASED scores, renormalised and scaled. Ties go to the lowest expert id. bf16 operands, fp32 accumulation:
every bf16 product is exact in fp32, so the logits are x.float() @ gate_w.float().T up to summation order.
"""

import torch
import triton
import triton.language as tl
from spark_bench.kernels.common import INTERPRET, last_to_arrive, next_pow2, row_block, tickets, widen
from spark_bench.kernels.configs import ConfigSpace, declare, split

from spark_bench import triton_env

# Decode logits tiles; D is split into slices until the (T, E) tiles x slices reach MIN_CTAS programs (and at least
# 2 per SM). ROWS: rows the ticket's winner selects at a time ([ROWS, next_pow2(E)] tiles: 16 needs 4 warps).
LOGITS_CONFIGS = declare(ConfigSpace(
    "moe.router._router_logits", key=("T", "E", "D"),
    default={"BT": 16, "BE": 32, "BD": 64, "ROWS": 16, "SB": 1, "MIN_CTAS": 0, "TICKET": 1, "num_warps": 4},
    buckets=[({"T": 4},
              {"BT": 16, "BE": 16, "BD": 32, "ROWS": 1, "SB": 16, "MIN_CTAS": 1024, "TICKET": 1, "num_warps": 2})],
    candidates=[{"BT": 16, "BE": 64, "BD": 64, "ROWS": 16, "SB": 1, "MIN_CTAS": 0, "TICKET": 1, "num_warps": 4},
                # (16x64x128 spilled 8-12 B on sm_90a)
                {"BT": 16, "BE": 32, "BD": 64, "ROWS": 16, "SB": 1, "MIN_CTAS": 0, "TICKET": 0, "num_warps": 4},
                {"BT": 16, "BE": 32, "BD": 64, "ROWS": 1, "SB": 8, "MIN_CTAS": 512, "TICKET": 1, "num_warps": 4}],
    doc="BT tokens x BE experts per program, BD of D per step, D split until MIN_CTAS programs; TICKET: the last "
        "program of a row block selects, ROWS rows at a time, summing SB slices per load"))
ROUTER_TICKETS = "moe.router._router_logits"
# Two-launch fallback's selection: BT = BUDGET // next_pow2(E) rows per program.
SELECT_CONFIGS = declare(ConfigSpace(
    "moe.router._router_select", key=("T", "E"), default={"BUDGET": 2048, "num_warps": 4},
    candidates=[{"BUDGET": 1024, "num_warps": 4}, {"BUDGET": 4096, "num_warps": 8}],
    doc="elements of the [BT, next_pow2(E)] score tile per program"))
# Prefill: whole rows per program. Taken once cdiv(T, BT) fills every SM (T >= 8448 on an H200 at BT = 64).
ROWS_CONFIGS = declare(ConfigSpace(
    "moe.router._router_rows", key=("T", "E", "D"), default={"BT": 64, "BD": 64, "num_warps": 16, "num_stages": 3},
    # 8 warps: the selection's [64, 256] fp32 tiles took 255 registers and spilled 28 B (E = 256, one group)
    candidates=[{"BT": 64, "BD": 32, "num_warps": 16, "num_stages": 4},
                {"BT": 32, "BD": 64, "num_warps": 8, "num_stages": 3}],
    # A100, B200: the 64-row selection spills there (8-84 B at E = 256 with groups, 8-24 B at E = 160); 32 rows: none
    per_target={t: [({}, {"BT": 32, "BD": 64, "num_warps": 8, "num_stages": 3})] for t in ("sm_80", "sm_100a")},
    doc="BT whole rows (all experts) per program, BD of D per step"))


@triton.jit
def _select_rows(logits, o_t, m_t, bias, out_w, out_ids, scale, E: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                 TG: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BG: tl.constexpr, SHARED: tl.constexpr):
    """Top-K selection of the [BT, BE] fp32 logits of rows o_t; stores weights [T, R] f32 and ids [T, R] int32 with
    R = K, or R = K + 1 when SHARED >= 0: slot K is then the shared expert (id SHARED, weight 1)."""
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(bias + o_e, mask=m_e, other=0.0)[None, :]
    # NaN (a NaN input row or bias) ranks below every number and above the padding lanes, so the K picks stay
    # distinct experts < E: argmax's NaN handling differs between the GPU and the interpreter, and a padding lane's
    # id would make the experts read past their weights. tl.maximum returns the non-NaN operand on the GPU and in
    # triton 3.9's interpreter (3.6's passes NaN through, and its np.argmax then takes NaN lanes first, still < E);
    # a nested tl.where spilled 4 B in `_router_rows` at E = 256, 16 warps under 3.9. -1e30, not -inf: two of them
    # still sum to a group score.
    choice = tl.where(m_e[None, :], tl.maximum(choice, -1e30), float("-inf"))
    if G > 1:
        # group score = sum of the top-2 biased scores of the group; keep the best TG groups, -inf the rest
        group = o_e // (E // G)
        o_g = tl.arange(0, BG)
        gscore = tl.full([logits.shape[0], BG], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            c = tl.where((group == g)[None, :], choice, float("-inf"))
            first = tl.argmax(c, axis=1)
            top1 = tl.max(c, axis=1)
            top2 = tl.max(tl.where(o_e[None, :] == first[:, None], float("-inf"), c), axis=1)
            gscore = tl.where(o_g[None, :] == g, (top1 + top2)[:, None], gscore)
        keep = tl.zeros(logits.shape, dtype=tl.int1)
        for _ in tl.static_range(TG):
            best = tl.argmax(gscore, axis=1)
            keep = keep | (group[None, :] == best[:, None])
            gscore = tl.where(o_g[None, :] == best[:, None], float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    o_k = tl.arange(0, BK)
    ids = tl.zeros([logits.shape[0], BK], dtype=tl.int32)
    wts = tl.zeros([logits.shape[0], BK], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = o_e[None, :] == best[:, None]
        wk = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        ids = tl.where(o_k[None, :] == k, best[:, None].to(tl.int32), ids)
        wts = tl.where(o_k[None, :] == k, wk[:, None], wts)
        choice = tl.where(hit, float("-inf"), choice)
    wts = wts / tl.sum(wts, axis=1)[:, None] * scale
    R: tl.constexpr = K + 1 if SHARED >= 0 else K
    if SHARED >= 0:
        ids = tl.where(o_k[None, :] == K, SHARED, ids)
        wts = tl.where(o_k[None, :] == K, 1.0, wts)
    m_out = m_t[:, None] & (o_k[None, :] < R)
    tl.store(out_w + o_t[:, None] * R + o_k[None, :], wts, mask=m_out)
    tl.store(out_ids + o_t[:, None] * R + o_k[None, :], ids, mask=m_out)


@triton.jit
def _summed_slices(partial, o_t, m_t, T, S, E: tl.constexpr, BE: tl.constexpr, SB: tl.constexpr):
    """[BT, BE] logits of rows o_t: the S partial slices summed in a fixed order, SB at a time ([BT, SB, BE] loads;
    SB = 1: [BT, BE] loads, which take fewer registers). L2 reads with .cg: written by other SMs."""
    o_e = tl.arange(0, BE)
    logits = tl.zeros([o_t.shape[0], BE], dtype=tl.float32)
    if SB == 1:
        mask = m_t[:, None] & (o_e < E)[None, :]
        for s in range(S):
            logits += tl.load(partial + (s * T + o_t[:, None]) * E + o_e[None, :], mask=mask, other=0.0,
                              cache_modifier=".cg")
    else:
        o_s = tl.arange(0, SB)
        for s0 in range(0, S, SB):
            s = s0 + o_s
            mask = m_t[:, None, None] & (s < S)[None, :, None] & (o_e < E)[None, None, :]
            tile = tl.load(partial + (s[None, :, None] * T + o_t[:, None, None]) * E + o_e[None, None, :],
                           mask=mask, other=0.0, cache_modifier=".cg")
            logits += tl.sum(tile, axis=1)
    return logits


@triton.jit
def _router_logits(x, w, partial, tickets, bias, out_w, out_ids, T, D, D_SPLIT, scale, E: tl.constexpr,
                   BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, TICKET: tl.constexpr, ROWS: tl.constexpr,
                   SB: tl.constexpr, K: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, BE_ALL: tl.constexpr,
                   BK: tl.constexpr, BG: tl.constexpr, SHARED: tl.constexpr, UPCAST_DOT: tl.constexpr):
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
    if TICKET:
        if last_to_arrive(tickets, i_t, tl.num_programs(1) * tl.num_programs(2)):
            if ROWS == BT:  # (no row loop: inside one, the [16, 256] selection spilled 28 B on sm_90a)
                m_t = o_t < T
                _select_rows(_summed_slices(partial, o_t, m_t, T, tl.num_programs(2), E, BE_ALL, SB), o_t, m_t,
                             bias, out_w, out_ids, scale, E, K, G, TG, BE_ALL, BK, BG, SHARED)
            else:
                for r0 in range(0, tl.minimum(BT, T - i_t * BT), ROWS):
                    o_r = (i_t * BT + r0 + tl.arange(0, ROWS)).to(tl.int64)
                    m_r = o_r < T
                    _select_rows(_summed_slices(partial, o_r, m_r, T, tl.num_programs(2), E, BE_ALL, SB), o_r,
                                 m_r, bias, out_w, out_ids, scale, E, K, G, TG, BE_ALL, BK, BG, SHARED)


@triton.jit
def _router_select(partial, bias, out_w, out_ids, T, S, scale, E: tl.constexpr, K: tl.constexpr,
                   G: tl.constexpr, TG: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                   BG: tl.constexpr, SHARED: tl.constexpr):
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = o_t < T
    _select_rows(_summed_slices(partial, o_t, m_t, T, S, E, BE, 1), o_t, m_t, bias, out_w, out_ids, scale, E, K,
                 G, TG, BE, BK, BG, SHARED)


@triton.jit
def _router_rows(x, w, bias, out_w, out_ids, T, D, scale, E: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                 TG: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                 BG: tl.constexpr, SHARED: tl.constexpr, UPCAST_DOT: tl.constexpr):
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_e = tl.arange(0, BE).to(tl.int64)
    m_t = o_t < T
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        a = tl.load(x + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
        b = tl.load(w + o_e[None, :] * D + o_d[:, None], mask=(o_e[None, :] < E) & m_d[:, None], other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    _select_rows(acc, o_t, m_t, bias, out_w, out_ids, scale, E, K, G, TG, BE, BK, BG, SHARED)


def slices(tiles: int, D: int, BD: int, min_ctas: int) -> tuple[int, int]:
    """(S, D_SPLIT): the slices of D (D_SPLIT a multiple of BD, rounded down) that give tiles * S >= min_ctas
    programs where D allows."""
    want = max(1, min(triton.cdiv(D, BD), triton.cdiv(min_ctas, tiles)))
    d_split = max(BD, D // want // BD * BD)
    return triton.cdiv(D, d_split), d_split


def _split_logits(x, gate_w, bias, weights, ids, selection):
    """The decode path: split-D partial logits; selection (K, G, TG, scale) by the ticket or a second launch."""
    T, D = x.shape
    E = gate_w.shape[0]
    meta, options = split(LOGITS_CONFIGS.pick(T=T, E=E, D=D))
    BT, BE, BD = (16, min(64, max(16, next_pow2(E))), min(256, max(16, next_pow2(D)))) if widen() else \
        (meta["BT"], meta["BE"], meta["BD"])
    S, d_split = slices(triton.cdiv(T, BT) * triton.cdiv(E, BE), D, BD,
                        max(meta["MIN_CTAS"], 2 * triton_env.sm_count(x.device)))
    partial = torch.empty((S, T, E), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(E, BE), S)
    ticket = bool(meta["TICKET"])
    rows = min(meta["ROWS"], BT)
    _router_logits[grid](x, gate_w, partial, tickets(ROUTER_TICKETS, x.device, grid[0]), bias, weights, ids, T, D,
                         d_split, selection["scale"], E=E, BT=BT, BE=BE, BD=BD, TICKET=ticket, ROWS=rows,
                         SB=max(1, min(meta["SB"], 4096 // (rows * next_pow2(E)))), **selection["meta"],
                         BE_ALL=next_pow2(E), UPCAST_DOT=INTERPRET, **options)
    if not ticket:
        meta, options = split(SELECT_CONFIGS.pick(T=T, E=E))
        BT = row_block(next_pow2(E), budget=meta["BUDGET"])
        _router_select[(triton.cdiv(T, BT),)](partial, bias, weights, ids, T, S, selection["scale"], E=E,
                                              BT=BT, BE=next_pow2(E), **selection["meta"], **options)


def _rows(x, gate_w, bias, weights, ids, selection, meta, options):
    T, D = x.shape
    E = gate_w.shape[0]
    BT, BD = (max(16, min(64, next_pow2(T))), min(256, max(16, next_pow2(D)))) if widen() else \
        (meta["BT"], meta["BD"])
    _router_rows[(triton.cdiv(T, BT),)](x, gate_w, bias, weights, ids, T, D, selection["scale"], E=E, BT=BT,
                                        BE=next_pow2(E), BD=BD, **selection["meta"], UPCAST_DOT=INTERPRET, **options)


def group_problem(experts: int, groups: int, topk_groups: int, topk: int) -> str | None:
    """Why this grouped selection is invalid, or None: groups of >= 2 experts (a one-expert group's second-best
    score is -inf, so every group would tie at -inf), 1 <= topk_groups <= groups, and topk within the kept groups'
    experts (past them the selection takes masked experts)."""
    if groups < 1 or experts % groups or (groups > 1 and experts // groups < 2):
        return f"{experts} experts do not split into groups of >= 2 ({groups} groups)"
    if not 1 <= topk_groups <= groups:
        return f"topk_groups {topk_groups} must be in [1, groups = {groups}]"
    if topk > topk_groups * (experts // groups):
        return f"topk {topk} exceeds the {topk_groups * (experts // groups)} experts of the kept groups"
    return None


def route(x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, topk: int, groups: int = 1,
          topk_groups: int = 1, routed_scaling_factor: float = 1.0, path: str = "auto",
          shared_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] bf16, gate_w [E, D] bf16, gate_bias [E] f32 -> (topk_weights [T, K] f32, topk_ids [T, K] int32).
    path: "auto" (rows once cdiv(T, BT) programs fill every SM, else split), "rows" or "split" (tests).
    shared_id: also route every token to this expert (the shared expert stacked after the routed ones) with weight
    1, as slot K of [T, K + 1] outputs, written by the same launch."""
    x, gate_w = x.contiguous(), gate_w.contiguous()
    T = x.shape[0]
    E = gate_w.shape[0]
    problem = group_problem(E, groups, topk_groups, topk)
    if problem:
        raise ValueError(problem)
    R = topk + (shared_id is not None)
    weights = torch.empty((T, R), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, R), dtype=torch.int32, device=x.device)
    if T == 0:
        return weights, ids
    selection = {"scale": float(routed_scaling_factor),
                 "meta": {"K": topk, "G": groups, "TG": topk_groups, "BK": next_pow2(R), "BG": next_pow2(groups),
                          "SHARED": -1 if shared_id is None else int(shared_id)}}
    bias = gate_bias.float().contiguous()
    meta, options = split(ROWS_CONFIGS.pick(T=T, E=E, D=x.shape[1]))
    if path == "auto":
        path = "rows" if triton.cdiv(T, meta["BT"]) >= triton_env.sm_count(x.device) and not widen() else "split"
    if path == "rows":
        _rows(x, gate_w, bias, weights, ids, selection, meta, options)
    elif path == "split":
        _split_logits(x, gate_w, bias, weights, ids, selection)
    else:
        raise ValueError(f"unknown path {path!r}: auto, rows or split")
    return weights, ids
