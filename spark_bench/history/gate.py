"""The nightly gate's rules: where `--since COMMIT|DATE` falls in a series, and which cases regressed after it
(stepped slower beyond the threshold, or stopped passing); `prune --older-than` ages."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from pathlib import Path

from spark_bench.history import detect, gitinfo
from spark_bench.history.store import HistoryError

DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ][0-9:]+(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?$")


def since_index(s: detect.Series, since: str, repo: Path | None) -> int:
    """Index of the first point after `since`: a commit (exclusive, as in `git log SINCE..`), or a date (inclusive;
    the first point whose first run was made on or after it, whatever its commit's age)."""
    if DATE.match(since):
        when = gitinfo.utc(since if "T" in since or " " in since else since + "T00:00:00+00:00")
        if when is None:
            raise HistoryError(f"--since {since!r} is not a valid date")
        return next((i for i, p in enumerate(s.points) if (p.created or p.time or "") >= when), len(s.points))
    if len(since) < 4:  # '' is a prefix of every commit; git itself wants 4 hex digits
        raise HistoryError(f"--since {since!r}: give at least 4 characters of a commit, or a date YYYY-MM-DD")
    hits = [i for i, p in enumerate(s.points) if p.commit and p.commit.startswith(since)]
    if len({s.points[i].commit for i in hits}) > 1:
        raise HistoryError(f"--since {since!r} is ambiguous: "
                           + ", ".join(sorted({str(s.points[i].commit)[:12] for i in hits})) + "; give more of it")
    if hits:
        return hits[-1] + 1
    when = gitinfo.commit_time_of(repo, since)
    if when is None:
        raise HistoryError(f"--since {since!r}: no stored run of {s.device} has that commit and the repository does "
                           "not know it (give a commit of a stored run, or a date YYYY-MM-DD)")
    return next((i for i, p in enumerate(s.points) if (p.time or "") > when), len(s.points))


def regressions(series: Sequence[detect.Series], since: str,
                repo: Path | None) -> list[tuple[detect.Series, str, detect.Step | None]]:
    """(series, 'slower' | 'broken', step) for every case that regressed after `since`; the suspects of each step
    are filled in from the repository. HistoryError when no series knows `since`."""
    found: list[tuple[detect.Series, str, detect.Step | None]] = []
    known = False
    for s in series:
        try:
            start = since_index(s, since, repo)
            known = True
        except HistoryError:
            continue  # this fingerprint never ran that commit; another may have
        for st in s.steps:
            if st.index >= start and st.direction == "slower":
                st.suspects = gitinfo.log_range(repo, st.last_good.commit, st.first_bad.commit)
                found.append((s, "slower", st))
        pts = s.points
        was_ok = any(p.status == "ok" for p in pts[:start])
        if pts and start < len(pts) and was_ok and pts[-1].status not in ("ok", "skipped"):
            found.append((s, "broken", None))
    if series and not known:
        since_index(series[0], since, repo)  # raises the one-line error
    return found


def parse_age(text: str) -> str:
    """'90d', '12w', '6m' (months of 30 days), '1y', or a date -> the UTC cut-off timestamp."""
    m = re.fullmatch(r"(\d+)\s*([dwmy])", text.strip())
    if m:
        days = int(m.group(1)) * {"d": 1, "w": 7, "m": 30, "y": 365}[m.group(2)]
        return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)).isoformat(timespec="seconds")
    if DATE.match(text.strip()) and gitinfo.utc(text.strip()):
        return gitinfo.utc(text.strip())  # type: ignore[return-value]
    raise HistoryError(f"--older-than {text!r}: expected an age like 90d, 12w, 6m, 1y or a date YYYY-MM-DD")
