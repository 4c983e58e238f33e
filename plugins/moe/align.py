"""`moe.align`: vLLM's moe_align_block_size, the permutation step in front of a grouped expert GEMM.

Calling convention: backend(topk_ids=[T, K] int32, num_experts, block_m) -> (sorted_ids [T*K + E*(BM-1)] int32,
expert_ids [cdiv(len(sorted_ids), BM)] int32, num_tokens_post_pad [1] int32). sorted_ids holds flat slot indices
t*K + k grouped by expert in ascending expert order, each expert's segment padded to a multiple of BM with the
sentinel T*K (experts without tokens take no tile); expert_ids[b] is the expert of tile b for b < post_pad / BM;
everything past num_tokens_post_pad is sentinel in sorted_ids and unspecified in expert_ids.
compare= checks these semantics (per-expert slot sets, padding, tile experts), not one arbitrary order.
"""

import torch
from spark_bench.plugins.moe.common import (
    REPLAY_ROUTINGS,
    TOKENS,
    draw_topk_ids,
    model_presets,
    moe_binding,
    moe_fixed,
    replay_routing,
    routing_axis,
    routing_extra_info,
    topk_constraint,
)

from spark_bench import Axis, Cost, Op, Tolerance, probes
from spark_bench.compiled import add_torch_compile
from spark_bench.inputs import generator


def make_inputs(p, *, device, dtype, seed):
    gen = generator(device, seed)
    ids = draw_topk_ids(p["routing"], p["tokens"], p["experts"], p["topk"], gen, device)
    return {"topk_ids": ids, "num_experts": p["experts"], "block_m": p["block_m"]}


def reference(topk_ids, num_experts, block_m):
    """One expert at a time: its slots in order, then sentinels up to the next multiple of block_m."""
    flat = topk_ids.flatten().long().cpu()
    N = flat.numel()
    max_padded = N + num_experts * (block_m - 1)
    sorted_ids, tiles = [], []
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten().tolist()
        pad = -len(slots) % block_m
        sorted_ids += slots + [N] * pad
        tiles += [e] * ((len(slots) + pad) // block_m)
    post = len(sorted_ids)
    n_tiles = -(-max_padded // block_m)
    sorted_ids += [N] * (max_padded - post)
    tiles += [-1] * (n_tiles - len(tiles))
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(tiles, dtype=torch.int32),
            torch.tensor([post], dtype=torch.int32))


def compare(out, ref, inputs, dtype):
    (s, t, n), (rs, rt, rn) = [tuple(x.cpu().long().flatten() for x in o) for o in (out, ref)]
    bm, N = inputs["block_m"], inputs["topk_ids"].numel()
    post = int(rn[0])
    problems = []
    if int(n[0]) != post:
        problems.append(f"num_tokens_post_pad {int(n[0])} != {post}")
    elif s.shape != rs.shape or t.shape[0] < post // bm:
        problems.append(f"sorted_ids {tuple(s.shape)} / expert_ids {tuple(t.shape)} have the wrong size")
    else:
        if not torch.equal(t[:post // bm], rt[:post // bm]):
            problems.append("the expert of some tiles differs")
        if (s[post:] != N).any():
            problems.append(f"{int((s[post:] != N).sum())} non-sentinel entries past the padded count")
        # each expert's segment holds the same multiset of slots and sentinels; order within it is free
        segment = rt[:post // bm].repeat_interleave(bm) * (N + 1)
        if not torch.equal((s[:post] + segment).sort().values, (rs[:post] + segment).sort().values):
            problems.append("some expert segments hold different slots or padding")
    metrics = {"num_tokens_post_pad": post, "tiles": post // bm, "padding": post - N,
               "err_ratio": 0.0 if not problems else 1.0}
    return metrics, not problems, "; ".join(problems)


def cost(p, dtype):
    N, E, bm = p["tokens"] * p["topk"], p["experts"], p["block_m"]
    return Cost(flops=0, bytes=4 * N + 4 * (N + E * (bm - 1)) + 4 * E, tokens=p["tokens"])


def from_file(p, src, gen, *, device, dtype, seed, factory):
    """--weights / --routing: ids of the replayed routings (model, file); the others as without a file."""
    if p["routing"] not in REPLAY_ROUTINGS:
        return factory(p, device=device, dtype=dtype, seed=seed)
    ids, _ = replay_routing(p, src, gen, device)
    return {"topk_ids": ids, "num_experts": p["experts"], "block_m": p["block_m"]}


op = Op(
    name="moe.align",
    doc=__doc__,
    from_weights=moe_binding(from_file, moe_fixed("experts", "topk")),
    make_inputs_fn=make_inputs,
    reference=reference,
    cost=cost,
    axes=[
        Axis("tokens", TOKENS, quick=[1, 5, 33]),
        Axis("experts", [256, 160], quick=[13]),
        Axis("topk", [8], quick=[3]),
        Axis("block_m", [16, 64], quick=[16], doc="rows per tile of the grouped GEMM (BLOCK_M)"),
        routing_axis(quick=["uniform", "worst"]),
    ],
    presets=model_presets(("experts", "topk")),
    dtypes=["bf16"],
    tolerance={"bf16": Tolerance(0.0)},
    compare=compare,
    extra_info=routing_extra_info,
    constraints=[topk_constraint],
)


@op.backend("triton", probe=probes.triton_kernel, labels=probes.triton_labels)
def triton_align(topk_ids, num_experts, block_m):
    """Ours: kernels/moe/align.py (one launch for a single chunk; else chunk histograms, a per-expert parallel prefix,
    and a scatter that also writes the tile experts and the padding sentinels)."""
    from spark_bench.kernels.moe.align import moe_align

    return moe_align(topk_ids, num_experts, block_m)


@op.backend("torch")
def torch_align(topk_ids, num_experts, block_m):
    """Eager torch: bincount, stable argsort, scatter; no host sync (searchsorted for the tile experts)."""
    flat = topk_ids.flatten().long()
    N, E = flat.numel(), num_experts
    max_padded = N + E * (block_m - 1)
    n_tiles = -(-max_padded // block_m)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    end = padded.cumsum(0)
    start = end - padded
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(N, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((max_padded,), N, dtype=torch.int32, device=flat.device)
    sorted_ids[start[expert] + rank] = order.to(torch.int32)
    tile_row = torch.arange(n_tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(end, tile_row, right=True)
    total = end[-1:]
    expert_ids = torch.where(tile_row < total, tile_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


add_torch_compile(op)


def _vllm_probe(device):
    return probes.package("vllm", "vllm")(device) or (
        "vLLM's moe_align_block_size is a CUDA op" if probes.needs_cuda(device) else None)


@op.backend("vllm", probe=_vllm_probe)
def vllm_align(topk_ids, num_experts, block_m):
    """vLLM's moe_align_block_size (its CUDA kernel; order within an expert unspecified)."""
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, num_experts)
    return sorted_ids, expert_ids, num_post.reshape(1)
