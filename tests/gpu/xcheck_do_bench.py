"""Cross-check of our CUDA timers against triton.testing.do_bench on the same kernel (issue 2's GPU check).

Times kda.gate's Triton kernel at a few sizes with: our event timer, our graph timer (both with L2 flush), and
triton.testing.do_bench / do_bench_cudagraph (do_bench flushes with a 256 MiB buffer; do_bench_cudagraph does not).
Writes one JSON object with every number and the device name, again after each size (a `timeout` that stops the
script keeps the sizes done). GPU only.
"""

import functools
import json
import sys

import torch
import triton.testing

from spark_bench import get_op
from spark_bench.fingerprint import fingerprint
from spark_bench.timing import TimingConfig, measure


def main(out_path: str) -> None:
    op = get_op("kda.gate")
    fn = op.backends["triton"].fn
    rows, fp = [], fingerprint("cuda")
    for tokens in (64, 4096, 65536):
        inputs = op.make_inputs({"tokens": tokens, "heads": 32, "head_dim": 128}, device="cuda", dtype="bf16", seed=0)
        call = functools.partial(fn, **inputs)
        call()
        row = {"tokens": tokens, "bytes": op.cost({"tokens": tokens, "heads": 32, "head_dim": 128}, "bf16").bytes}
        for mode in ("events", "graph"):
            rec = measure([call], "cuda", TimingConfig(mode=mode, max_time_s=1.0))  # 6 of them within 30 s
            row[f"ours_{mode}_median_us"] = rec["median"]
            row[f"ours_{mode}_rel_ci"] = rec["rel_ci"]
            row[f"ours_{mode}_n"] = rec["n"]
        row["do_bench_mean_us"] = triton.testing.do_bench(call) * 1e3
        row["do_bench_median_us"] = triton.testing.do_bench(call, return_mode="median") * 1e3
        row["do_bench_cudagraph_us"] = triton.testing.do_bench_cudagraph(call) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "fingerprint": fp, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
