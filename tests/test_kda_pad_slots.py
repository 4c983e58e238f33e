"""Padding rows (slot < 0, vLLM's PAD_SLOT_ID) in our decode kernels: a batch padded with them gives, on its live
rows, what the reference gives for the live rows alone; the padding rows' outputs are zero and no pool slot other
than the live ones changes. Under memcheck: slot -1 would address the row before the pool, a read that lands in
other memory and passes unseen otherwise. The padding rows' inputs hold garbage (NaN and inf, as an uninitialised
padded batch may): the fused kernels' zeros do not depend on them; the unfused block path's gated norm, a row-wise
op that knows no slots, gives zeros for finite garbage only."""

import pytest
import torch

import spark_bench
from spark_bench.kernelgate.memcheck import memcheck

BLOCK = {"heads": 3, "head_dim": 16, "hidden": 40}
CASES = {  # op: (backend, params, the per-row inputs (the slot index first), the pools)
    "kda.short_conv_decode": ("triton", {"heads": 3, "head_dim": 20}, ("slots", "x"), ("conv_state_pool",)),
    "kda.recurrent_decode": ("triton", {"heads": 3, "head_dim_k": 24, "head_dim_v": 40, "seq_len": 2},
                             ("ssm_state_indices", "q", "k", "v", "g", "beta"), ("initial_state",)),
    "kda.block_decode": ("triton", BLOCK, ("slots", "x"), ("conv_state_pool", "state_pool")),
    "kda.block_decode ": ("triton_unfused", BLOCK, ("slots", "x"), ("conv_state_pool", "state_pool")),
}
FINITE_GARBAGE_ONLY = {"kda.block_decode "}


def err_ratio(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def copy(inputs, rows=None, per_row=()):
    """A copy of the inputs (of rows `rows` alone of the per-row ones)."""
    return {k: (v[rows] if rows is not None and k in per_row else v).clone() if torch.is_tensor(v) else v
            for k, v in inputs.items()}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("batch,pads,seed", [(5, [0, 3], 0), (3, [2], 1), (1, [0], 2)])
def test_padding_rows(name, batch, pads, seed):
    backend, params, per_row, pools = CASES[name]
    index = per_row[0]
    op = spark_bench.get_op(name.strip())
    inputs = op.make_inputs({**params, "batch": batch}, dtype="bf16", seed=seed)
    live = [r for r in range(batch) if r not in pads]
    padded = copy(inputs)
    padded[index][pads] = -1
    for row_input in per_row[1:]:
        if padded[row_input].is_floating_point():
            garbage = padded[row_input][pads]
            garbage.copy_(torch.randn(garbage.shape) * 1e4)
            if name not in FINITE_GARBAGE_ONLY:
                garbage.view(-1)[0::3], garbage.view(-1)[1::3] = float("nan"), float("inf")
            padded[row_input][pads] = garbage
    before = {p: padded[p].clone() for p in pools}
    with memcheck():
        out = op.outputs(op.backends[backend].fn(**padded), padded)
    ref_inputs = copy(inputs, live, per_row)
    ref = op.outputs(op.reference(**ref_inputs), ref_inputs) if live else None
    tol = op.tolerance_for("bf16").err_ratio
    outputs = out[:len(out) - len(pools)]
    for i, o in enumerate(outputs):
        assert torch.equal(o[pads].float(), torch.zeros_like(o[pads].float())), "a padding row's output is not zero"
        if live:
            assert err_ratio(o[live], ref[i]) <= tol
    live_slots = inputs[index][live].long()
    for p, pool in zip(pools, out[len(outputs):], strict=True):
        changed = (pool != before[p]).flatten(1).any(1).nonzero().flatten()
        assert set(changed.tolist()) <= set(live_slots.tolist()), f"{p}: a slot outside the live rows changed"
        if live:
            assert err_ratio(pool[live_slots], ref[len(outputs) + pools.index(p)][live_slots]) <= tol
