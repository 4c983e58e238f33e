"""spark-bench: correctness-checked, crash-isolated benchmarks of KDA and MoE kernels.

Public API:
    get_op(name) -> Op with .backends (name -> Backend), .reference, .make_inputs(params, device=, dtype=, seed=)
    Op, Axis, Cost, Tolerance, Backend, Extension: the plugin API (docs/plugins.md)
"""

from spark_bench.op import Axis, Backend, Cost, Extension, Op, Tolerance
from spark_bench.registry import get_op, registry

__version__ = "0.1.0"
__all__ = ["Axis", "Backend", "Cost", "Extension", "Op", "Tolerance", "get_op", "registry", "__version__"]
