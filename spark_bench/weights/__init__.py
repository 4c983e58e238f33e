"""Benchmark on a real model's layer: KDA and MoE weights from safetensors or GGUF files, and routing replay.

A weight spec is a plain dict stored in the sweep spec and in every case (so spawned workers, Ray actors and
`--resume` see it): {"path": file or None, "layer": N or None, "routing": routing file or None}. In a worker,
`using(spec)` makes it the active source while a case runs; an op that declares `from_weights`
(spark_bench.op.Op) then builds its inputs from `active()`: the file's tensors (memory-mapped, the requested layer
only, loaded once per process) with seeded random activations. See docs/weights.md.
"""

# The API lives in layer.py, which needs torch; it is imported on first use so that the command line (which only
# declares the options) starts without torch.
__all__ = ["FromWeights", "LayerSource", "WeightError", "active", "describe", "make_spec", "source", "using"]


def __getattr__(name: str):
    if name in __all__:
        from spark_bench.weights import layer

        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
