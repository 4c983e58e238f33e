"""Specialisations outside the GPU sweep and presets (a user's --set) that spilled on sm_90a, compiled offline as the
README's gate compiles the sweep's (docs/kernels-moe.md, "Shapes outside the presets"). Exit 1 of `kernels` is a
spill."""

import pytest
from conftest import run_cli


@pytest.mark.parametrize("args", [
    # moe.align with 2-32 experts at prefill: the scatter's [16384 / BE, BE] cumsum spilled 92-208 B
    ["--op", "moe.align", "--set", "experts=4,8,32", "--set", "topk=2", "--set", "tokens=4096", "--set",
     "block_m=16", "--set", "routing=uniform"],
    # the chunk state pass, fp32 inputs, head_dim 64: the default spilled 308 B
    ["--op", "kda.chunk_prefill", "--set", "head_dim_k=64", "--set", "head_dim_v=64", "--set", "heads=4",
     "--set", "seq_len=64", "--set", "batch=1", "--set", "varlen=fixed", "--set", "fused=True", "--dtype", "fp32"],
])
def test_shapes_outside_the_presets_compile_without_spills(args):
    code, out, err = run_cli("kernels", *args, "--no-presets", "--target", "sm_90a")
    assert code == 0 and "0 with spills" in out, out[-2000:] + err
