"""The KDA ops' shared presets (plugins/models.py kda_presets): kda.md's shapes the default sweep leaves out."""

from __future__ import annotations

from spark_bench.registry import registry
from spark_bench.sweep import SweepSpec, build_cases

PREFILL = {"kda.chunk_prefill": "seq_len", "kda.block_prefill": "seq_len", "kda.short_conv": "seq_len",
           "kda.gate": "tokens", "kda.gated_rmsnorm": "tokens"}


def _points(preset: str) -> dict[str, list[dict]]:
    cases = build_cases(registry(), SweepSpec(ops=["kda.*"], backends=["torch"], preset=preset, device="cpu",
                                              quick=False))
    out: dict[str, list[dict]] = {}
    for c in cases:
        out.setdefault(c.op, []).append(c.params)
    return out


def test_long_context_reaches_128k_tokens_at_tp1_and_tp8_on_every_prefill_op():
    points = _points("long-context")
    assert set(points) == set(PREFILL)  # decode ops have no token axis to stretch
    for op, axis in PREFILL.items():
        assert sorted({p[axis] for p in points[op]}) == [32768, 65536, 131072], op
        assert {p["heads"] for p in points[op]} == {32, 4}, op
        assert all(p.get("batch", 1) == 1 and p.get("varlen", "fixed") == "fixed" for p in points[op]), op
    assert {p["head_dim_k"] for p in points["kda.chunk_prefill"]} == {128}


def test_stress_heads_covers_every_kda_op_at_64_and_96_heads():
    points = _points("stress-heads")
    assert set(points) == {op.name for op in registry().match(["kda.*"])}
    for op, ps in points.items():
        assert {p["heads"] for p in ps} == {64, 96}, op
    assert {p["hidden"] for p in points["kda.block_decode"]} == {2304}  # Kimi-Linear's, as kimi-linear has it
