"""The GPU side of the wrappers, run on the CPU: every Triton backend at the quick sweep's points, launched with the
block sizes, splits, persistent grids and paths a GPU would take (no interpreter widening; an sm_90a target: its 132
SMs, or 2 so persistent grids loop), under `memcheck` (every load, store and atomic bounds-checked) and checked
against the op's reference as `run` checks it.

Without this, what only a GPU launch takes (the MoE decode GEMVs' D / I splits with their partial sums and tickets,
the router's row path, the align kernel's chunked offsets, the kernels' declared tiles instead of whole rows) ran
only on a GPU, where a wrong result is first seen as a `mismatch` of the sweep."""

from __future__ import annotations

import dataclasses

import pytest

import spark_bench
from spark_bench.check import check_outputs
from spark_bench.kernelgate.memcheck import memcheck
from spark_bench.kernelgate.targets import TARGETS
from spark_bench.sweep import SweepSpec, build_cases, dtype_list
from spark_bench.worker import _reference


def _cases():
    reg = spark_bench.registry()
    spec = SweepSpec(ops=[], backends=["triton*"], preset=None, overrides={}, dtypes=dtype_list(()), device="cpu",
                     quick=True)
    return [c for c in build_cases(reg, spec) if not c.skip]


# the ops whose wrappers size grids or choose paths by the SM count (kernels/kda/chunk_intra.py's persistent grid, the
# router's rows path): also run as on a 2-SM part, where a persistent program loops over many items and the router
# takes its rows path at the quick sweep's token counts
BY_SM_COUNT = ("kda.chunk_prefill", "kda.block_prefill", "moe.router", "moe.layer")
# the GGUF decode past its fused slot sum's bucket (T > 8) at T = 9, not the quick sweep's 33: the same launches and
# specialisations (one slice of I and of D, the slot sum its own launch) with a quarter of the interpreted programs
# (P * I / BR up, P * D / BR down: 82 s -> 22 s here, the suite's slowest case)
SMALLER = {("moe.experts_gguf", "triton_decode", 33): 9}


def _smaller(case):
    tokens = SMALLER.get((case.op, case.backend, case.params.get("tokens")))
    return dataclasses.replace(case, params={**case.params, "tokens": tokens}) if tokens else case


CASES = [(_smaller(case), sms) for case in _cases() for sms in (132, 2) if sms == 132 or case.op in BY_SM_COUNT]
# head_dim 64 (outside the presets) takes configs of its own (docs/kernels-moe.md, "Shapes outside the presets"): the
# chunk core's 16-bit BKD 8 without the persistent loop, fp32 state BV 16 at 8 warps
_CHUNK = next(c for c in _cases() if c.op == "kda.chunk_prefill" and c.backend == "triton")
CASES += [(dataclasses.replace(_CHUNK, dtype=dtype, params={**_CHUNK.params, "head_dim_k": 64, "head_dim_v": 64}), 132)
          for dtype in ("bf16", "fp32")]
# past 256 experts (moe.layer's routed experts plus its shared one) and 2048 slots the align scatter walks its tiles
# two at a time (kernels/moe/align.py, OFFSETS_CONFIGS' bucket): 144 chunks of 32 slots, as at T = 512 (run and
# checked by the test at the end of this file)
_ALIGN = next(c for c in _cases() if c.op == "moe.align" and c.backend == "triton")
ALIGN_PAST_256 = dataclasses.replace(_ALIGN, params={**_ALIGN.params, "tokens": 512, "experts": 257, "topk": 9,
                                                     "block_m": 64})


@pytest.mark.parametrize("case,sms", CASES, ids=lambda v: f"{v.op}-{v.backend}-{v.dtype}-"
                         + "-".join(f"{k}={x}" for k, x in v.params.items()) if hasattr(v, "op") else f"{v}sms")
def test_gpu_configs_match_the_reference(case, sms):
    op = spark_bench.get_op(case.op)
    inputs = op.make_inputs(case.params, device="cpu", dtype=case.dtype, seed=case.seed)
    ref = _reference(op, inputs)
    with memcheck(dataclasses.replace(TARGETS["sm_90a"], sm_count=sms)) as counts:
        out = op.backends[case.backend].fn(**inputs)
    assert counts["launches"] > 0
    check = check_outputs(op, out, ref, inputs, case.dtype, backend=case.backend)
    assert check["ok"], check["message"]


def test_the_smaller_gguf_decode_case_launches_what_the_quick_sweeps_does():
    """T = 9 stands in for 33 (SMALLER): both past the fused slot sum's bucket, one slice of I and of D."""
    from spark_bench.kernels.moe import experts_gguf_decode as gd
    from spark_bench.kernels.moe.slots import SUM_CONFIGS

    case = next(c for c, _ in CASES if (c.op, c.backend) == ("moe.experts_gguf", "triton_decode")
                and c.params["tokens"] == 9)
    D, I, K = case.params["hidden"], case.params["inter"], case.params["topk"]
    # (space, rows per pair, super-blocks split): gate/up split D, the down projection I (as decode() does)
    for config, rows, blocks in ((gd.DECODE_UP_CONFIGS, I, D // 256), (gd.DECODE_DOWN_CONFIGS, D, I // 256)):
        picks = [config.pick(P=T * K, D=D, I=I) for T in (9, 33)]
        assert picks[0] == picks[1]
        slices = [gd.down_split(T * K, rows, blocks, picks[0]["BR"], picks[0]["MIN_CTAS"]) for T in (9, 33)]
        assert slices[0] == slices[1]
    assert SUM_CONFIGS.pick(T=9, D=D) == SUM_CONFIGS.pick(T=33, D=D) and not SUM_CONFIGS.pick(T=9, D=D)["FUSE"]


def test_the_launches_are_a_gpus_not_the_interpreters():
    """The same call launches other grids as on a GPU than interpreted: the bf16 decode GEMVs split D and I over many
    programs for >= 1,000 CTAs on a GPU, and take whole rows in one program per slot when interpreting."""
    from spark_bench.kernels import common

    op = spark_bench.get_op("moe.experts")
    params = {"tokens": 1, "hidden": 136, "experts": 11, "topk": 3, "inter": 72, "routing": "uniform"}
    grids: dict[str, list] = {"gpu": [], "interpreter": []}
    for where in grids:
        inputs = op.make_inputs(params, device="cpu", dtype="bf16", seed=0)
        with memcheck(TARGETS["sm_90a"], on_launch=lambda name, ran, grid, s, w=where: grids[w].append((name, ran))):
            if where == "interpreter":
                common.WIDEN_WHEN_INTERPRETING = True  # memcheck turned it off: the interpreter's own choice
            op.backends["triton_decode"].fn(**inputs)
    gpu, interpreted = dict(grids["gpu"]), dict(grids["interpreter"])
    assert set(gpu) == set(interpreted) == {"_decode_swiglu", "_decode_down"}
    assert all(gpu[k] > 4 * interpreted[k] for k in gpu), (gpu, interpreted)


def test_past_256_experts_the_align_scatter_steps_two_tiles_at_a_time():
    """ALIGN_PAST_256 matches the reference under memcheck with the bucket it was added for (TB = 4 at BM = 64 spilled
    4 B under triton 3.9)."""
    from spark_bench.tune.space import recording

    with recording() as picks:
        test_gpu_configs_match_the_reference(ALIGN_PAST_256, 132)
    offsets = [p for p in picks if p["kernel"] == "moe.align._align_offsets"]
    assert offsets and all(p["config"]["BUDGET"] == 1024 for p in offsets), offsets
