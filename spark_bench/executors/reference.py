"""Case durations of a reference machine, for `run --dry-run` on a CPU with no stored results of its own.

Measured: `spark-bench run` (the default quick CPU sweep, 226 cases) on the 2-core AMD EPYC VM the CI runs on,
2026-12-04, commit dbf3423, Inductor's cache warm (the day's first run also compiles every torch.compile graph, about
3 more minutes there). Per (op, backend): (median duration_s, the largest cost-model bytes, that case's duration_s);
the bytes let an interpreted Triton case of a larger point be scaled by its work (executors/plan.py). A machine's own
results/ always come first. Regenerate from a run directory with `python -m spark_bench.executors.reference DIR`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SOURCE = "the quick CPU sweep on a 2-core EPYC, 2026-12-04, Inductor's cache warm"

CPU_QUICK: dict[tuple[str, str], tuple[float, int, float]] = {
    ("kda.block_decode", "torch"): (0.281, 170440, 0.281),
    ("kda.block_decode", "torch_compile"): (3.6, 170440, 3.6),
    ("kda.block_decode", "triton"): (1.16, 170440, 1.16),
    ("kda.block_decode", "triton_unfused"): (0.964, 170440, 0.964),
    ("kda.block_prefill", "torch"): (0.584, 179080, 0.584),
    ("kda.block_prefill", "torch_compile"): (2.55, 179080, 2.55),
    ("kda.block_prefill", "triton"): (5.65, 179080, 5.65),
    ("kda.chunk_prefill", "torch"): (0.528, 308814, 0.528),
    ("kda.chunk_prefill", "torch_compile"): (1.02, 308814, 1.02),
    ("kda.chunk_prefill", "triton"): (11.7, 308814, 11.7),
    ("kda.gate", "torch"): (0.0328, 923664, 0.0419),
    ("kda.gate", "torch_compile"): (0.147, 923664, 0.146),
    ("kda.gate", "triton"): (0.578, 923664, 0.59),
    ("kda.gated_rmsnorm", "torch"): (0.033, 72480, 0.034),
    ("kda.gated_rmsnorm", "torch_compile"): (0.117, 72480, 0.141),
    ("kda.gated_rmsnorm", "triton"): (0.0859, 72480, 0.0859),
    ("kda.recurrent_decode", "fla"): (2.58, 282790, 2.58),
    ("kda.recurrent_decode", "torch"): (0.0257, 282790, 0.0257),
    ("kda.recurrent_decode", "torch_compile"): (0.278, 282790, 0.278),
    ("kda.recurrent_decode", "triton"): (1.62, 282790, 1.62),
    ("kda.short_conv", "torch"): (0.023, 298080, 0.0232),
    ("kda.short_conv", "torch_compile"): (0.168, 298080, 0.25),
    ("kda.short_conv", "triton"): (0.753, 298080, 0.911),
    ("kda.short_conv_decode", "torch"): (0.0553, 64800, 0.0306),
    ("kda.short_conv_decode", "torch_compile"): (0.14, 64800, 0.104),
    ("kda.short_conv_decode", "triton"): (0.368, 64800, 0.376),
    ("moe.align", "torch"): (0.0318, 1624, 0.0274),
    ("moe.align", "torch_compile"): (0.133, 1624, 0.218),
    ("moe.align", "triton"): (0.0711, 1624, 0.071),
    ("moe.experts", "torch"): (0.0368, 664999, 0.0351),
    ("moe.experts", "torch_compile"): (0.161, 664999, 0.289),
    ("moe.experts", "triton"): (0.975, 664999, 1.1),
    ("moe.experts_gguf", "torch"): (0.0681, 603094, 0.53),
    ("moe.experts_gguf", "torch_compile"): (0.502, 603094, 0.394),
    ("moe.experts_gguf", "triton"): (1.13, 603094, 2.59),
    ("moe.layer", "torch"): (0.224, 1020159, 0.145),
    ("moe.layer", "torch_compile"): (0.763, 1020159, 0.763),
    ("moe.layer", "triton"): (1.23, 1020159, 1.84),
    ("moe.layer", "triton_host"): (1.08, 1020159, 1.62),
    ("moe.router", "host"): (0.0481, 14184, 0.0523),
    ("moe.router", "torch"): (0.037, 14184, 0.0455),
    ("moe.router", "torch_compile"): (0.128, 14184, 0.131),
    ("moe.router", "triton"): (0.177, 14184, 0.467),
    ("moe.shared_expert", "torch"): (0.0322, 427008, 0.0975),
    ("moe.shared_expert", "torch_compile"): (0.14, 427008, 0.104),
    ("moe.shared_expert", "triton"): (0.356, 427008, 0.284),
    ("quant.dequant", "gguf"): (0.0382, 125874, 0.0259),
    ("quant.dequant", "torch"): (0.0552, 125874, 0.0959),
    ("quant.dequant", "torch_compile"): (0.173, 125874, 0.145),
    ("quant.dequant", "triton"): (0.777, 125874, 0.809),
}


def from_run(run_dir: Path) -> dict[tuple[str, str], tuple[float, float, float]]:
    """The table above, from a run directory's results.jsonl (skipped cases left out)."""
    found: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for line in (Path(run_dir) / "results.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("status") not in (None, "skipped") and rec.get("duration_s") is not None:
            found[(rec["op"], rec["backend"])].append((float((rec.get("cost") or {}).get("bytes") or 0.0),
                                                       float(rec["duration_s"])))
    return {key: (statistics.median(s for _, s in rows), *max(rows)) for key, rows in sorted(found.items())}


if __name__ == "__main__":
    for (op, backend), (median, nbytes, seconds) in from_run(Path(sys.argv[1])).items():
        print(f'    ("{op}", "{backend}"): ({median:.3g}, {math.ceil(nbytes)}, {seconds:.3g}),')
