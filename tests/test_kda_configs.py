"""The KDA kernels' declared config spaces: every kernel our KDA backends launch declares one, and every candidate
(default and buckets included) is correct when forced, run at its own block sizes (the interpreter's widening off for
its module; the op's other kernels keep theirs, which is several times faster under the interpreter), on shapes where
those blocks tile rows, channels and columns unevenly. `spark-bench tune` times these candidates."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from spark_bench.kernels.configs import SPACES, ConfigSpace  # noqa: E402
from spark_bench.kernels.kda import (  # noqa: E402
    chunk_intra,
    chunk_output,
    chunk_prep,
    chunk_state,
    gate,
    gated_rmsnorm,
    recurrent_decode,
    short_conv,
)

import spark_bench  # noqa: E402
from spark_bench.check import check_outputs, clone_inputs  # noqa: E402

MODULES = (gate, gated_rmsnorm, recurrent_decode, short_conv, chunk_prep, chunk_intra, chunk_state, chunk_output)
CHUNK = ("kda.chunk_prefill", {"batch": 1, "seq_len": 1, "varlen": "tiny4", "heads": 2, "head_dim_k": 100,
                               "head_dim_v": 48, "fused": True})
# kernel -> (op, params): odd sizes against every candidate's blocks
CASES = {
    "kda.gate._kda_gate_fwd": ("kda.gate", {"tokens": 67, "heads": 2, "head_dim": 100}),
    "kda.gated_rmsnorm._gated_rmsnorm_fwd": ("kda.gated_rmsnorm", {"tokens": 23, "heads": 3, "head_dim": 60}),
    "kda.recurrent_decode._recurrent_decode": ("kda.recurrent_decode", {
        "batch": 3, "seq_len": 2, "heads": 2, "head_dim_k": 32, "head_dim_v": 80, "fused": True}),
    "kda.short_conv._short_conv_decode": ("kda.short_conv_decode", {"batch": 3, "heads": 3, "head_dim": 60}),
    "kda.short_conv._short_conv_prefill": ("kda.short_conv", {"batch": 1, "seq_len": 1, "varlen": "tiny5",
                                                               "heads": 3, "head_dim": 20}),
    "kda.chunk_intra._chunk_intra": CHUNK,
    "kda.chunk_state._chunk_state": CHUNK,
    "kda.chunk_output._chunk_output": CHUNK,
}


def spaces():
    """kernel name -> (module, attribute) of every ConfigSpace the KDA kernel modules declare."""
    found = {}
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, ConfigSpace):
                found[value.kernel] = (module, name)
    return found


def test_every_launched_kda_kernel_declares_a_space():
    """Each @triton.jit kernel a KDA wrapper launches (the `_`-prefixed entry points) has a registered space."""
    jit = ("JITFunction", "InterpretedFunction")
    launched = {f"kda.{m.__name__.rpartition('.')[2]}.{name}" for m in MODULES for name, fn in vars(m).items()
                if type(fn).__name__ in jit and f"{name}[" in open(m.__file__).read()}
    assert launched == set(CASES), launched ^ set(CASES)
    assert launched <= set(spaces()) and launched <= set(SPACES)


def test_decode_buckets():
    assert recurrent_decode.CONFIGS.pick(N=1, K=128, V=128)["BV"] == 16
    assert recurrent_decode.CONFIGS.pick(N=2, K=128, V=128)["BV"] == 16
    assert recurrent_decode.CONFIGS.pick(N=3, K=128, V=128) == recurrent_decode.CONFIGS.default
    assert gated_rmsnorm.CONFIGS.pick(R=32, V=128)["BR"] == 4  # T = 1, H = 32: 8 programs
    assert gated_rmsnorm.CONFIGS.pick(R=65536, V=128) == gated_rmsnorm.CONFIGS.default
    assert short_conv.DECODE_CONFIGS.pick(N=1, D=12288)["BD"] == 64
    # fp32 prefill: 8 x 128 tiles at 4 warps (>= 2 CTAs/SM on sm_90a); 16-bit keeps the default
    assert short_conv.PREFILL_CONFIGS.pick(D=12288, dtype="torch.float32") == {"BT": 8, "BD": 128, "num_warps": 4}
    assert short_conv.PREFILL_CONFIGS.pick(D=12288, dtype="torch.bfloat16") == short_conv.PREFILL_CONFIGS.default


def test_chunk_intra_buckets():
    """16-bit inputs: BKD 8 at K <= 32, BKD 16 above (each the one that does not spill under triton 3.6 there),
    persistent; fp32 inputs keep the default (one program per chunk and head)."""
    pick = chunk_intra.CONFIGS.pick
    assert pick(K=32, V=48, elem=2) == {"BKD": 8, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1}
    assert pick(K=128, V=128, elem=2) == {"BKD": 16, "PROGRAMS_PER_SM": 2, "num_warps": 4, "num_stages": 1}
    assert pick(K=32, V=48, elem=4) == pick(K=128, V=128, elem=4) == chunk_intra.CONFIGS.default


def test_chunk_state_buckets():
    """16-bit inputs prefetch the next chunk's operands into registers; fp32 loads at use (the default)."""
    pick = chunk_state.CONFIGS.pick
    for dtype in ("torch.bfloat16", "torch.float16"):
        assert pick(K=128, V=128, dtype=dtype, NH=32)["PREFETCH"] == 1
        # few sequences x heads: twice the serial chains (BV 16), NH x V / 16 <= 128 CTAs on an H200's 132 SMs
        assert [pick(K=128, V=128, dtype=dtype, NH=nh)["BV"] for nh in (1, 4, 16, 17, 32, 128)] == [16] * 3 + [32] * 3
    assert pick(K=128, V=128, dtype="torch.float32", NH=4) == chunk_state.CONFIGS.default
    assert chunk_state.CONFIGS.default["PREFETCH"] == 0
    assert chunk_state.CONFIGS.declared(target="sm_80", K=128, V=128, dtype="torch.bfloat16")["PREFETCH"] == 0  # spills


def candidate_params():
    for kernel, (module, attr) in sorted(spaces().items(), key=lambda kv: kv[0]):
        for seed, config in enumerate(getattr(module, attr).candidates):
            yield pytest.param(kernel, attr, module, dict(config), seed, id=f"{kernel.rpartition('.')[2]}-"
                               + ",".join(f"{k}={v}" for k, v in config.items()))


@pytest.mark.parametrize("kernel, attr, module, config, seed", list(candidate_params()))
def test_candidate_is_correct(monkeypatch, kernel, attr, module, config, seed):
    picked = []
    monkeypatch.setattr(module, attr, types.SimpleNamespace(pick=lambda **key: picked.append(key) or dict(config)))
    monkeypatch.setattr(module, "widen", lambda: False)
    op_name, params = CASES[kernel]
    op = spark_bench.get_op(op_name)
    inputs = op.make_inputs(params, dtype="bf16", seed=seed)
    ref_inputs = clone_inputs(inputs)
    ref = op.reference(**ref_inputs)
    if op.outputs is not None:
        ref = op.outputs(ref, ref_inputs)
    out = op.backends["triton"].fn(**inputs)
    assert picked, f"{kernel}: the wrapper did not pick from its space"
    check = check_outputs(op, out, ref, inputs, "bf16")
    assert check["ok"], f"{kernel} {config}: {check['message']}"
    for t in (out if isinstance(out, tuple) else (out,)):
        assert t is None or torch.isfinite(t.float()).all()
