"""The three fused flags of the KDA core (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
each on its own and each off with the other two on, for the Triton chunk prefill and recurrent decode, against the
fp32 reference (core_common.reference_tokens, which applies each flag independently). draw_core_inputs sets all
three from one `fused` switch and test_kda_decode_flags_strides.py never turns the L2 norm on, so a kernel that
honours one flag for another passed. The inputs make every flag visible: q and k are not unit rows (k's norms in
[0.4, 1]), g is raw logits or a decay and beta logits or probabilities, as the flag says."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from spark_bench.plugins.kda import chunk_prefill, recurrent_decode, weights  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402

L2, GATE, SIG = cc.FLAGS
COMBOS = [{L2: a, GATE: b, SIG: c} for a, b, c in
          [(True, False, False), (False, True, False), (False, False, True),
           (False, True, True), (True, False, True), (True, True, False)]]
IDS = ["+".join({L2: "l2norm", GATE: "gate", SIG: "sigmoid"}[n] for n in c if c[n]) for c in COMBOS]


def draw(lead, H, K, V, flags, seed):
    """Core inputs for the given flags; A_log and dt_bias are passed even with the gate off (ignored there)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, H, K, generator=gen)
    k = cc.l2_normalize(torch.randn(*lead, H, K, generator=gen)) * (0.4 + 0.6 * torch.rand(*lead, H, 1, generator=gen))
    v = torch.randn(*lead, H, V, generator=gen)
    g_raw = torch.randn(*lead, H, K, generator=gen)
    b_logit = torch.randn(*lead, H, generator=gen)
    A_log, dt_bias = weights.a_log(H, gen, "cpu"), weights.dt_bias(H * K, gen, "cpu")
    g = g_raw if flags[GATE] else cc.kda_decay(g_raw, A_log, dt_bias)
    beta = b_logit if flags[SIG] else b_logit.sigmoid()
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias, "scale": K ** -0.5,
            **flags}


def copy(inputs):
    return {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}


@pytest.mark.parametrize("flags", COMBOS, ids=IDS)
def test_chunk_prefill_flag_alone(flags):
    B, T, H, K, V = 1, 70, 2, 24, 40  # two chunks, the second partial
    inputs = draw((B, T), H, K, V, flags, seed=len(IDS[COMBOS.index(flags)]))
    inputs.update(initial_state=torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(5)) * 0.5,
                  output_final_state=True)
    o, s = chunk_prefill.triton_chunk_prefill(**copy(inputs))
    o_r, s_r = chunk_prefill.reference_chunk_prefill(**copy(inputs))
    assert cc.err_ratio(o, o_r) <= 1e-4 and cc.err_ratio(s, s_r) <= 1e-4, (cc.err_ratio(o, o_r), cc.err_ratio(s, s_r))


@pytest.mark.parametrize("flags", COMBOS, ids=IDS)
def test_recurrent_decode_flag_alone(flags):
    N, T, H, K, V = 3, 2, 2, 24, 40
    inputs = draw((N, T), H, K, V, flags, seed=7 + COMBOS.index(flags))
    inputs.update(initial_state=torch.randn(2 * N, H, K, V, generator=torch.Generator().manual_seed(6)) * 0.5,
                  ssm_state_indices=torch.tensor([4, 0, 3], dtype=torch.int32))
    o, pool = recurrent_decode.triton_recurrent_decode(**copy(inputs))
    o_r, pool_r = recurrent_decode.reference_recurrent_decode(**copy(inputs))
    assert cc.err_ratio(o, o_r) <= 1e-4 and cc.err_ratio(pool, pool_r) <= 1e-4, (cc.err_ratio(o, o_r),
                                                                                 cc.err_ratio(pool, pool_r))


def test_each_flag_changes_the_reference():
    """The inputs make every flag visible: flipping any one of them moves the reference's output by > 5%."""
    base = {L2: False, GATE: False, SIG: False}
    for name in cc.FLAGS:
        inputs = draw((1, 5), 2, 24, 40, {**base, name: True}, seed=3)
        state = torch.zeros(1, 2, 24, 40)
        o_on, _ = cc.reference_tokens(**{n: x for n, x in inputs.items() if n != "scale"}, state=state)
        flipped = {n: x for n, x in inputs.items() if n not in ("scale", name)}
        o_off, _ = cc.reference_tokens(**flipped, state=state)
        assert cc.err_ratio(o_off, o_on) > 0.05, name
