"""Which stored records a command shows: op and backend globs, dtypes and `--set AXIS=V1,V2` values, the same
syntax as `run` (show, report, compare)."""

from __future__ import annotations

import fnmatch
from typing import Any

from spark_bench.results import ResultsError


def record_matches(record: dict[str, Any], ops: tuple[str, ...] = (), backends: tuple[str, ...] = (),
                   dtypes: tuple[str, ...] = ()) -> bool:
    """Whether a record's op and backend match one of their globs and its dtype is listed (an empty filter: any)."""
    return all(not globs or any(fnmatch.fnmatchcase(str(record.get(field)), g) for g in globs)
               for field, globs in (("op", ops), ("backend", backends), ("dtype", dtypes)))


def select_records(records: list[dict[str, Any]], ops: tuple[str, ...] = (), backends: tuple[str, ...] = (),
                   dtypes: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The records matching every given filter: op and backend globs, dtypes, and AXIS=V1,V2 values (compared by
    value: `sweep.select_by_sets`). A filter that matches nothing in the run raises ResultsError naming what the run
    has; an unknown axis, or a value it cannot take, UsageError."""
    from spark_bench.sweep import dtype_list, select_by_sets  # run's own --set syntax (sweep imports this module)

    dtypes = tuple(dtype_list(dtypes))
    found = list(records)
    for field, globs in (("op", ops), ("backend", backends), ("dtype", dtypes)):
        if not globs:  # no filter: a run with no finished case yet (Ctrl-C in its first case) is an empty table
            continue
        kept = [r for r in found if record_matches(r, **{f"{field}s": globs})]
        if not kept:
            names = sorted({str(r.get(field)) for r in found})
            raise ResultsError(f"no case matches --{field} {' '.join(globs)}; the run has: {', '.join(names)}")
        found = kept
    return select_by_sets(found, sets, key=lambda r: (r["op"], r.get("params") or {}))

