"""The run directories that `history add` paths name: a run directory itself, or the runs one level below a directory
of runs (such as results/)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from spark_bench.history.store import HistoryError
from spark_bench.results import RUN_FILE


def _is_tune(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / RUN_FILE).read_text()).get("kind") == "tune"
    except (OSError, ValueError, AttributeError):
        return False  # a broken run.json is load_run's to report


def expand_run_dirs(paths: Sequence[Path | str]) -> tuple[list[Path], set[Path]]:
    """(run directories, those of them found below a directory given rather than named). A `tune` directory is not a
    sweep (its cases are one point timed under many configs): left out when found below, refused when named."""
    out: list[Path] = []
    below: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if (path / RUN_FILE).is_file():
            if _is_tune(path):
                raise HistoryError(f"{path} is a tune directory: its candidates are not a sweep to keep a history of "
                                   "(`spark-bench tuned show` has what it chose)")
            out.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if (p / RUN_FILE).is_file() and not _is_tune(p))
            if not found:
                raise HistoryError(f"{path}: neither a run directory nor a directory of runs (no {RUN_FILE})")
            out.extend(found)
            below.update(found)
        else:
            raise HistoryError(f"{path}: no such run directory")
    return out, below
