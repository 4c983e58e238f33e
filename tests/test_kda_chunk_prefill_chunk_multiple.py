"""kernels/kda/chunk_state.py under memcheck: a sequence whose length is a whole number of 64-token chunks ends
exactly at a chunk boundary, where the bf16 path's prefetch of the (empty) next chunk must read none of its rows:
with the sequence last in the batch, a row at its end is one past the tensor (the quick sweep's 65 and 70 never
end on a boundary). Checked as the GPU configs run it (test_gpu_configs_interpreted.py) and against the reference."""

import dataclasses

import pytest

import spark_bench
from spark_bench.check import check_outputs
from spark_bench.kernelgate.memcheck import memcheck
from spark_bench.kernelgate.targets import TARGETS
from spark_bench.worker import _reference


@pytest.mark.parametrize("seq_len", [64, 128])
def test_a_sequence_of_whole_chunks_reads_nothing_past_its_end(seq_len):
    op = spark_bench.get_op("kda.chunk_prefill")
    params = {"batch": 1, "seq_len": seq_len, "varlen": "fixed", "heads": 2, "head_dim_k": 32, "head_dim_v": 32,
              "fused": True}
    inputs = op.make_inputs(params, device="cpu", dtype="bf16", seed=0)
    ref = _reference(op, inputs)
    with memcheck(dataclasses.replace(TARGETS["sm_90a"], sm_count=132)) as counts:
        out = op.backends["triton"].fn(**inputs)
    assert counts["launches"] > 0
    check = check_outputs(op, out, ref, inputs, "bf16", backend="triton")
    assert check["ok"], check["message"]
