"""kda.chunk_prefill: every CPU backend against our fp32 token loop and fla's naive references (odd lengths,
K != V, varlen, with and without initial state, extreme gates), plus the checks that catch a transposed state and
swapped gate broadcasts, and the prefill -> decode state handoff."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402
from spark_bench.plugins.kda import chunk_prefill as prefill  # noqa: E402
from spark_bench.plugins.kda import core_common as cc  # noqa: E402
from spark_bench.plugins.kda import recurrent_decode as decode  # noqa: E402

from spark_bench.kernelgate.traffic import counting  # noqa: E402

op = prefill.op
BACKENDS = {"triton": prefill.triton_chunk_prefill, "torch": prefill.torch_chunk_prefill}


def make(T, *, H=3, K=32, V=16, B=1, fused=True, dtype="fp32", seed=0, lens=None, h0=True):
    """Inputs for B x T tokens, or for the sequences `lens` packed with cu_seqlens."""
    params = {"batch": 1 if lens else B, "seq_len": sum(lens) if lens else T, "varlen": "fixed", "heads": H,
              "head_dim_k": K, "head_dim_v": V, "fused": fused, "initial_state": h0}
    inputs = op.make_inputs(params, dtype=dtype, seed=seed)
    if lens:
        inputs["cu_seqlens"] = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        gen = torch.Generator().manual_seed(seed + 1)
        inputs["initial_state"] = torch.randn(len(lens), H, K, V, generator=gen) * 0.5 if h0 else None
    return inputs


def run(name, inputs):
    return BACKENDS[name](**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})


def fla_naive(inputs, chunked=False):
    """fla's naive references, sequence by sequence, on independently pre-processed inputs."""
    x = cc.naive_inputs(inputs)
    B, T, H, K = x["q"].shape
    cu = inputs["cu_seqlens"]
    bounds = cu.tolist() if cu is not None else [0, T]
    h0 = inputs["initial_state"]
    naive = naive_chunk_kda if chunked else naive_recurrent_kda
    outs, states = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        rows = slice(n, n + 1) if cu is not None else slice(None)
        state = h0[rows] if h0 is not None else None
        seg = {name: t[:, bos:eos] for name, t in x.items()}
        if eos == bos:
            outs.append(seg["v"])
            states.append(state if state is not None else torch.zeros(1, H, K, x["v"].shape[-1]))
            continue
        o, s = naive(**seg, scale=inputs["scale"], initial_state=state, output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def assert_close(out, ref, tol, what):
    for name, a, b in zip(("o", "final_state"), out, ref, strict=True):
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        err = cc.err_ratio(a, b)
        assert err <= tol, f"{what}: {name} error ratio {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 130, 500, 1000])  # kda.md's edge lengths, and 130
def test_backends_match_references_at_odd_lengths(T):
    fused = T % 2 == 1
    inputs = make(T, fused=fused, seed=T, B=2 if T < 8 else 1, H=2 if T >= 500 else 3)  # long T: interpreted
    ref = op.reference(**inputs)
    naive = fla_naive(inputs)
    assert_close(ref, naive, 1e-5, "our reference vs fla naive_recurrent_kda")
    if T == 64:
        assert_close(ref, fla_naive(inputs, chunked=True), 1e-5, "our reference vs fla naive_chunk_kda")
    for name in BACKENDS:
        assert_close(run(name, inputs), ref, 1e-4, f"{name} T={T} fused={fused}")


@pytest.mark.parametrize("h0", [True, False])
def test_varlen_bf16(h0):
    lens = [3, 0, 70, 1]
    inputs = make(None, lens=lens, H=2, dtype="bf16", seed=3, h0=h0, fused=h0)
    ref = op.reference(**inputs)
    assert_close(ref, fla_naive(inputs), 1e-5, "reference vs fla naive (varlen)")
    for name in BACKENDS:
        out = run(name, inputs)
        assert_close(out, ref, 5e-3, f"{name} varlen")
        if not h0:  # the empty sequence keeps its (zero) initial state
            assert torch.count_nonzero(out[1][1]) == 0


@pytest.mark.parametrize("A_log, dt_bias", [(2.77, -1.0), (6.0, 6.0)])
def test_extreme_gates(A_log, dt_bias):
    """g ~ -3 per token (a decay split at the chunk start would need exp(190)) and g ~ -2400 (all state forgotten)."""
    inputs = make(70, H=1, seed=7)
    inputs["A_log"] = torch.full_like(inputs["A_log"], A_log)
    inputs["dt_bias"] = torch.full_like(inputs["dt_bias"], dt_bias)
    ref = op.reference(**inputs)
    assert_close(ref, fla_naive(inputs), 1e-5, "reference vs fla naive (extreme gates)")
    for name in BACKENDS:
        assert_close(run(name, inputs), ref, 1e-4, f"{name} extreme gates")


def _near_zero_decay(seed):
    """bf16, every channel's decay ~0 (A_log -12) and beta ~1 (logit 8): (I + L) is ill-conditioned there."""
    inputs = make(64, H=1, K=16, V=32, dtype="bf16", seed=seed)
    inputs["A_log"] = torch.full_like(inputs["A_log"], -12.0)
    inputs["beta"] = torch.full_like(inputs["beta"], 8.0)
    return run("triton", inputs), op.reference(**inputs)


@pytest.mark.parametrize("seed", [0, 1])
def test_near_zero_decay_stays_near_the_bf16_bound(seed):
    """The recorded shortfall (docs/known-issues.md, 'precision at an extreme'): 5.5e-3 (o) and 8.2e-3-8.7e-3
    (state) against the 5e-3 bound; it must not grow past 1.2e-2 (the torch backend: 1.7e-3 / 4e-7)."""
    assert_close(*_near_zero_decay(seed), 1.2e-2, "triton near-zero decay")


@pytest.mark.xfail(strict=True, reason="known issue: bf16 W and U carry an ill-conditioned (I + L)'s rounding "
                   "(docs/known-issues.md); passing means the bound is met and the docs are stale")
def test_near_zero_decay_meets_the_bf16_bound():
    assert_close(*_near_zero_decay(0), 5e-3, "triton near-zero decay")


def test_transposed_state_layout_is_caught():
    """With K != V a [V, K] state has K*V elements too; reading it as [K, V] must fail the check."""
    inputs = make(65, K=32, V=16, seed=11, fused=False)
    ref = op.reference(**inputs)
    out = run("triton", inputs)
    assert_close(out, ref, 1e-4, "triton, K-first state")
    N, H, K, V = inputs["initial_state"].shape
    swapped = dict(inputs, initial_state=inputs["initial_state"].transpose(-1, -2).contiguous().view(N, H, K, V))
    assert cc.err_ratio(run("torch", swapped)[0], ref[0]) > 0.05
    assert cc.err_ratio(out[1].view(N, H, V, K).transpose(-1, -2), ref[1]) > 0.05


def test_swapped_gate_broadcasts_are_caught():
    """A_log is per head and dt_bias per channel: a kernel that swaps either broadcast fails the check."""
    inputs = make(70, H=4, K=16, V=16, seed=5)
    ref = op.reference(**inputs)
    assert_close(run("triton", inputs), ref, 1e-4, "triton with the fused gate")
    H, K = 4, 16
    A_log, dt_bias = inputs["A_log"], inputs["dt_bias"]
    wrong = {
        "dt_bias read [K, H]": (A_log.view(H, 1), dt_bias.view(K, H).t()),
        "A_log repeated per channel": (A_log.repeat(K).view(H, K), dt_bias.view(H, K)),
    }
    for what, (a, b) in wrong.items():
        g = -a.exp() * torch.nn.functional.softplus(inputs["g"].float() + b)
        bad = dict(inputs, g=g, use_gate_in_kernel=False, A_log=None, dt_bias=None)
        err = cc.err_ratio(run("torch", bad)[0], ref[0])
        assert err > 0.05, f"{what}: error ratio {err:.2e} would pass"


def test_prefill_then_decode_hands_over_the_state():
    T, k = 67, 3
    inputs = make(T, H=2, seed=13)
    o_full, s_full = run("triton", inputs)
    head = {n: (t[:, : T - k] if n in ("q", "k", "v", "g", "beta") else t) for n, t in inputs.items()}
    o_head, s_head = run("triton", head)
    pool = torch.randn(3, *s_head.shape[1:])
    pool[1] = s_head[0]
    slots = torch.tensor([1], dtype=torch.int32)
    tail = {n: inputs[n][:, T - k:] for n in ("q", "k", "v", "g", "beta")}
    flags = cc.fused_flags(inputs)
    o_tail = [decode.triton_recurrent_decode(**{n: t[:, i:i + 1] for n, t in tail.items()}, initial_state=pool,
                                             ssm_state_indices=slots, scale=inputs["scale"], **flags)[0]
              for i in range(k)]
    assert cc.err_ratio(torch.cat([o_head, *o_tail], 1), o_full) < 1e-5
    assert cc.err_ratio(pool[1], s_full[0]) < 1e-5


def test_cost_model_and_sweep():
    p = {"batch": 1, "seq_len": 8192, "varlen": "fixed", "heads": 32, "head_dim_k": 128, "head_dim_v": 128,
         "fused": False}
    d, C, T, H = 128, 64, 8192, 32
    assert op.cost(p, "bf16").flops == pytest.approx(H * T * (6 * d * d + 3 * C * d + C * C))
    assert op.cost(p, "bf16").bytes == pytest.approx(T * H * (3 * 2 * d + 4 * d + 2 + 2 * d) + 2 * H * d * d * 4)
    points = op.points()
    assert {q["varlen"] for q in points} >= {"fixed", "prefill+decode"}
    assert all(q["batch"] == 1 and q["seq_len"] == 64 for q in points if q["varlen"] != "fixed")
    assert op.points(quick=True)
    assert "needs a GPU" in op.backends["fla"].unavailable("cpu")


@pytest.mark.parametrize("fused", [True, False])
def test_fla_recurrent_peer(fused):
    inputs = make(5, H=2, fused=fused, seed=17)
    assert_close(prefill.fla_recurrent_prefill(**inputs), op.reference(**inputs), 1e-4, "fla_recurrent")


def test_chunk_core_bytes_per_token_head():
    """The chunk core's traffic per token and head (the unique bytes each kernel's loads and stores touch, counted
    under the interpreter; the difference of T = 256 and T = 128 drops the per-sequence state bytes and the intra
    kernel's G slots, a fixed [programs, 64, K] fp32 scratch rewritten per chunk: both runs fill every slot) at
    K = V = 128 in bf16: 4771 B with the fused gate, 3.7x the cost model's 1282 B (6.9x before the bf16
    intermediates and the fused cumsum, 4.4x while G was stored whole, 4.0x while the state pass wrote U - W h)."""
    totals = {}
    for T in (128, 256):
        inputs = make(T, H=1, K=128, V=128, dtype="bf16", seed=19)
        with counting() as kernels:
            run("triton", inputs)
        totals[T] = {name: (k.read_unique, k.written_unique) for name, k in kernels.items()}
    read, written = ({name: (totals[256][name][i] - totals[128][name][i]) / 128 for name in totals[256]}
                     for i in (0, 1))
    assert set(read) == {"_chunk_intra", "_chunk_state", "_chunk_output"}
    _, minimum = cc.core_cost(64, 1, 128, 128, states=0, dtype="bf16", fused=True, chunk=64)
    _, params = cc.core_cost(0, 1, 128, 128, states=0, dtype="bf16", fused=True, chunk=64)
    minimum = (minimum - params) / 64
    assert minimum == 1282
    assert sum(read.values()) + sum(written.values()) <= 3.75 * minimum, (read, written)
    # q, k, v, raw g, beta in; W, U, Q', Kd bf16, A_qk's lower block triangle (80 B) and G's last row per chunk out
    assert read["_chunk_intra"] <= 1026 + 1 and written["_chunk_intra"] <= 4 * 256 + 80 + 8, written
    assert written["_chunk_state"] == 512  # h only (bf16 [K, V] per chunk of 64 tokens); U - W h stays in registers
    # Q', U, h and Tril(A_qk): 64 x 65 / 2 of its 64 x 64 entries per chunk (the upper blocks are never read)
    assert read["_chunk_output"] <= 2 * 256 + 512 + 65 + 1, read


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_chunk_intra_programs_do_not_change_the_result(dtype):
    """The intra grid: one persistent program looping over every (chunk, head), two, as many as items (the GPU's
    layout at small sizes), and the non-persistent launch (PROGRAMS_PER_SM 0, the fp32 default) give bit-identical
    outputs; varlen with a 1-token sequence and empty spare chunks in the table."""
    from spark_bench.tune.space import applied

    inputs = make(None, H=3, K=32, V=16, dtype=dtype, seed=29, lens=[70, 1, 9])  # 12 (chunk, head) items
    kernel = "kda.chunk_intra._chunk_intra"
    outs = []
    for per_sm in (0, 1, 2, 64):
        with applied({kernel: {"BKD": 8, "PROGRAMS_PER_SM": per_sm, "num_warps": 4, "num_stages": 1}}):
            outs.append(run("triton", inputs))
    for o, s in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1])
    assert_close(outs[0], op.reference(**inputs), 5e-3 if dtype == "bf16" else 1e-4, "triton")


def test_chunk_intra_exponentials_per_chunk_head():
    """The SFU work of the intra kernel, counted in the interpreter (transcendental elements, masked lanes
    included) per chunk of 64 tokens and head at K = V = 128, fused gate: 176,196 exponentials with the diagonal
    16 x 16 blocks pairwise (256 per K column); 86,596 with their recursive halving (96 per column) and exp(G) of
    a row block formed from exp(G - G_r) exp(G_r)."""
    inputs = make(128, H=1, K=128, V=128, dtype="bf16", seed=23)
    with counting() as kernels:
        run("triton", inputs)
    intra = kernels["_chunk_intra"].transcendentals / 2  # 2 chunks
    # exps + the gate's softplus logs (8,192) + the L2-norm rsqrts (224) + beta's sigmoid taken again (64) where
    # U = (I + L)^-1 Diag(beta) V is formed after the solve
    assert intra <= 86_596 + 8_192 + 224 + 64, intra
    assert intra >= 4 * 96 * 128, intra  # at least the diagonal blocks' share: the count sees the kernel's work
