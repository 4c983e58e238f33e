"""HTML reports of result runs and the two-run comparison (docs/report.md).

    write_report(run_dirs, out_path, baseline="torch") -> Path   one self-contained offline HTML file
    compare_runs(base, new, threshold, metric) -> [CaseDiff]      matched cases with robust verdicts
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from spark_bench.report.compare import CaseDiff, CompareError, compare_runs
from spark_bench.report.model import ResultsError, RunData, load_runs

__all__ = ["CaseDiff", "CompareError", "ResultsError", "RunData", "compare_runs", "load_runs", "write_report"]


def write_report(run_dirs: Iterable[str | Path], out_path: str | Path, baseline: str = "torch",
                 ops: tuple[str, ...] = (), backends: tuple[str, ...] = (), threshold: float | None = None,
                 metric: str = "median", warn: Callable[[str], None] | None = None) -> Path:
    """Render the runs (the first is the base of any comparison) into one offline HTML file; returns its path.
    `ops` / `backends`: only the cases those globs select (ResultsError when they select none); `threshold` (default
    5%) and `metric`: the comparison's verdicts, as `compare` gives them. Raises ResultsError
    (one line) for a missing or malformed run directory. `warn` is told of each run measured on another device
    fingerprint than the first (the page says so too; `compare` refuses such runs)."""
    from spark_bench.report.html import COMPARE_THRESHOLD, render
    from spark_bench.report.model import select_runs

    runs = load_runs(run_dirs)
    if not runs:
        raise ResultsError("no run directory given")
    select_runs(runs, ops, backends)
    if warn is not None:
        from spark_bench.report.compare import device_difference

        for run in runs[1:]:
            differs = device_difference(runs[0], run)
            if differs:
                warn(f"{run.path} was measured on another machine than {runs[0].path} ({differs}): the comparison "
                     "measures hardware as much as code")
    out = Path(out_path)
    for run in runs:  # `-o RUN/results.jsonl` would replace the results with the page about them
        if out.resolve().parent == Path(run.path).resolve() and out.name != "report.html":
            raise ResultsError(f"-o {out} is inside the run directory {run.path}: a report there is report.html "
                               "(the run's own files are never overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    from spark_bench.results import write_text_atomic

    page = render(runs, baseline, COMPARE_THRESHOLD if threshold is None else threshold, metric)
    write_text_atomic(out, page)  # a failed write (disk full) leaves no partial file
    return out
