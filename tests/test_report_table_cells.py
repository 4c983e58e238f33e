"""The report's case table puts each record's values under the right headers: GB/s and TFLOP/s (and the timing
columns beside them) are not swapped, in the table rows and in the data block the HTML page ships."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report import load_runs, write_report  # noqa: E402
from spark_bench.report.tables import cases_table  # noqa: E402

GBPS, TFLOPS = 1234.5, 6.75  # distinct, and neither derivable from the other


def one_case_run(path: Path) -> Path:
    samples = np.array([10.0, 11.0, 12.0, 13.0, 14.0])  # us: median 12
    rec = fx.case("kda.gate", "triton", {"tokens": 64, "heads": 4, "head_dim": 128}, samples=samples,
                  flops=1e6, nbytes=1e6)
    rec.update(gbps=GBPS, tflops=TFLOPS)  # stored values win over any recomputation from the cost
    return fx.write_run(path, [rec])


def cells(table: dict) -> dict:
    (row,) = table["rows"]
    names = [c["name"] for c in table["columns"]]
    assert len(names) == len(row)
    return dict(zip(names, row, strict=True))


def test_case_table_gbps_and_tflops_columns(tmp_path):
    """cases_table: the 'GB/s' cell holds the record's gbps and the 'TFLOP/s' cell its tflops; the median sits under
    the median column (12 us: the middle of 10..14)."""
    table = cases_table(load_runs([one_case_run(tmp_path / "run")]), "torch")
    row = cells(table)
    assert row["GB/s"] == GBPS
    assert row["TFLOP/s"] == TFLOPS
    assert row["median_us"] == 12.0
    assert row["op"] == "kda.gate" and row["backend"] == "triton" and row["status"] == "ok"


def test_page_data_case_table_cells(tmp_path):
    """The same cells in the page's embedded data (what the page script sorts and exports to CSV)."""
    page = write_report([one_case_run(tmp_path / "run")], tmp_path / "r.html").read_text()
    m = re.search(r'<script type="application/json" id="sb-data">(.*?)</script>', page, re.S)
    assert m, "no data block"
    row = cells(json.loads(m.group(1))["tables"]["cases"])
    assert row["GB/s"] == GBPS
    assert row["TFLOP/s"] == TFLOPS
