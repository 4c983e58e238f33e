"""kda.block_prefill and kda.block_decode: composed backends against the fp32 block reference, prefill(T) equal to
prefill(T - k) followed by k decode steps (outputs and both states), pools, stages, cost."""

import pytest
import torch
from spark_bench.plugins.kda import block_common as bc

import spark_bench

PREFILL = spark_bench.get_op("kda.block_prefill")
DECODE = spark_bench.get_op("kda.block_decode")
BACKENDS = ["triton", "torch"]
SMALL = {"heads": 3, "head_dim": 16, "hidden": 40}


def err_ratio(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def assert_close(outs, refs, tol):
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and torch.isfinite(o.float()).all()
        assert err_ratio(o, r) <= tol, err_ratio(o, r)


def weights_of(inputs):
    return {k: inputs[k] for k in bc.WEIGHT_NAMES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params,seed", [
    ({"batch": 1, "seq_len": 1, "varlen": "fixed"}, 0),
    ({"batch": 2, "seq_len": 3, "varlen": "fixed", "head_dim_k": 16, "head_dim_v": 32}, 1),
    ({"batch": 1, "seq_len": 65, "varlen": "fixed"}, 2),
    ({"batch": 1, "seq_len": 1, "varlen": "tiny5", "head_dim_k": 32, "head_dim_v": 16}, 3),
])
def test_prefill_backends(backend, params, seed):
    inputs = PREFILL.make_inputs({**SMALL, **params}, dtype="bf16", seed=seed)
    assert_close(PREFILL.backends[backend].fn(**inputs), PREFILL.reference(**inputs), 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_new_sequences(backend):
    """No states (new sequences) equals zero states."""
    inputs = PREFILL.make_inputs({**SMALL, "batch": 1, "seq_len": 1, "varlen": "tiny3"}, dtype="bf16", seed=4)
    fresh = {**inputs, "conv_state": None, "recurrent_state": None}
    zeros = {**inputs, "conv_state": torch.zeros_like(inputs["conv_state"]),
             "recurrent_state": torch.zeros_like(inputs["recurrent_state"])}
    out = PREFILL.backends[backend].fn(**fresh)
    assert_close(out, PREFILL.reference(**zeros), 1e-2)
    assert_close(out, PREFILL.reference(**fresh), 1e-2)


@pytest.mark.parametrize("backend", [*BACKENDS, "triton_unfused"])
@pytest.mark.parametrize("batch,shape,seed", [(1, {"head_dim_v": 32}, 0), (4, {"head_dim_v": 32}, 1),
                                              (7, {"heads": 5, "head_dim_k": 24, "head_dim_v": 40}, 2),
                                              (2, {"heads": 1, "head_dim": 32, "hidden": 56}, 3)])
def test_decode_backends_and_pools(backend, batch, shape, seed):
    """triton: the two-launch fused step (kernels/kda/block_decode.py); triton_unfused: the three per-op kernels."""
    inputs = DECODE.make_inputs({**SMALL, **shape, "batch": batch}, dtype="bf16", seed=seed)
    before = {k: inputs[k].clone() for k in ("conv_state_pool", "state_pool")}
    ref_inputs = {k: v.clone() for k, v in inputs.items()}
    ref = DECODE.outputs(DECODE.reference(**ref_inputs), ref_inputs)
    out = DECODE.outputs(DECODE.backends[backend].fn(**inputs), inputs)
    assert_close(out, ref, 1e-2)
    untouched = torch.ones(before["state_pool"].shape[0], dtype=torch.bool)
    untouched[inputs["slots"].long()] = False
    for name, pool in before.items():
        assert torch.equal(inputs[name][untouched], pool[untouched])
        assert not torch.equal(inputs[name][~untouched], pool[~untouched])


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_prefill_then_decode_equals_prefill(backend, dtype, tol):
    """prefill over [5, 3] tokens == prefill over [3, 1] + 2 decode steps (slots 4 and 1 of a 6-slot pool)."""
    k, full_lens = 2, [5, 3]
    params = {**SMALL, "batch": 1, "seq_len": 1, "varlen": "fixed", "head_dim_v": 32}
    inputs = PREFILL.make_inputs({**params, "batch": 2, "seq_len": 5}, dtype=dtype, seed=9)
    x = inputs["x"][:sum(full_lens)]
    w = weights_of(inputs)
    cu = bc.cu_seqlens(full_lens, "cpu")
    prefill, decode = PREFILL.backends[backend].fn, DECODE.backends[backend].fn
    y_full, conv_full, state_full = prefill(x=x, cu_seqlens=cu, conv_state=inputs["conv_state"],
                                            recurrent_state=inputs["recurrent_state"], **w)
    heads = [0, 5]  # sequence starts
    head_lens = [n - k for n in full_lens]
    x_head = torch.cat([x[s:s + n] for s, n in zip(heads, head_lens, strict=True)])
    y_head, conv_mid, state_mid = prefill(x=x_head, cu_seqlens=bc.cu_seqlens(head_lens, "cpu"),
                                          conv_state=inputs["conv_state"], recurrent_state=inputs["recurrent_state"],
                                          **w)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    conv_pool = torch.randn(6, *conv_mid.shape[1:]).to(conv_mid.dtype)
    state_pool = torch.randn(6, *state_mid.shape[1:])
    conv_pool[slots.long()] = conv_mid.to(conv_pool.dtype)
    state_pool[slots.long()] = state_mid.float()
    steps = [decode(x=torch.stack([x[s + n + i] for s, n in zip(heads, head_lens, strict=True)]),
                    conv_state_pool=conv_pool, state_pool=state_pool, slots=slots, **w) for i in range(k)]
    pieces = []
    for n, (s, m) in enumerate(zip([0, head_lens[0]], head_lens, strict=True)):
        pieces += [y_head[s:s + m], torch.stack([step[n] for step in steps])]
    assert_close([torch.cat(pieces)], [y_full], tol)
    assert_close([conv_pool[slots.long()], state_pool[slots.long()]], [conv_full, state_full], tol)


def test_stages_compose_the_backend():
    inputs = PREFILL.make_inputs({**SMALL, "batch": 1, "seq_len": 1, "varlen": "tiny3"}, dtype="bf16", seed=5)
    backend = PREFILL.backends["torch"]
    calls = backend.stages(inputs)
    assert [name for name, _ in calls] == ["projections", "conv", "core", "norm", "out_proj"]  # gate in the core
    results = [call() for _, call in calls]
    assert torch.equal(results[-1]["out"], backend.fn(**inputs)[0])
    assert PREFILL.backends["triton"].stages is not None and DECODE.backends["triton"].stages is not None


def test_swapped_gate_broadcast_fails():
    """kda.md pitfall 1: dt_bias read in the wrong channel order (d*H + h) by the core's fused gate must fail the
    whole-block check."""
    from spark_bench.plugins.kda import block_prefill, chunk_prefill, gated_rmsnorm, short_conv

    def swapped_core(**kw):
        H, K = kw["g"].shape[-2:]
        return chunk_prefill.torch_chunk_prefill(**{**kw, "dt_bias": kw["dt_bias"].view(K, H).T.reshape(-1)})

    steps = block_prefill.stages(short_conv.torch_short_conv, swapped_core, gated_rmsnorm.torch_gated_rmsnorm)
    inputs = PREFILL.make_inputs({**SMALL, "batch": 1, "seq_len": 30, "varlen": "fixed"}, dtype="fp32", seed=6)
    ref = PREFILL.reference(**inputs)
    out = bc.run_stages(steps, inputs)
    assert err_ratio(out["out"], ref[0]) > 0.05
    assert err_ratio(out["new_recurrent_state"], ref[2]) > 0.05


def test_cost_and_availability():
    kimi = {"batch": 1, "seq_len": 1, "varlen": "fixed", "heads": 32, "head_dim": 128, "hidden": 2304}
    weight_bytes = PREFILL.cost(kimi, "bf16").bytes - 2 * 2 * 2304 - 2 * (2 * 12288 * 3 + 4 * 32 * 128 * 128)
    assert 78e6 < weight_bytes < 80e6  # kda.md: 79 MB per layer at TP1
    decode = DECODE.cost({"batch": 4, "heads": 32, "head_dim": 128, "hidden": 2304}, "bf16")
    assert decode.flops > 2 * 4 * 39e6 and decode.tokens == 4
    for op in (PREFILL, DECODE):
        assert op.backends["fla"].unavailable("cpu")
        assert "torch_compile" in op.backends
