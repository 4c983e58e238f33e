"""The nightly gate's rules: where `--since COMMIT|DATE` falls in a series, and which cases regressed after it
(stepped slower beyond the threshold, or stopped passing); `prune --older-than` ages."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Sequence
from pathlib import Path

from spark_bench.history import detect, gitinfo
from spark_bench.history.store import HistoryError

DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ][0-9:]+(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?$")


def since_date(since: str) -> str | None:
    """`--since` as a UTC timestamp when it is a date (midnight UTC for a bare day), None when it is a commit."""
    if not DATE.match(since):
        return None
    when = gitinfo.utc(since if "T" in since or " " in since else since + "T00:00:00+00:00")
    if when is None:
        raise HistoryError(f"--since {since!r} is not a valid date")
    return when


def since_index(s: detect.Series, since: str, repo: Path | None) -> int:
    """Index of the first point after the commit `since` (exclusive, as in `git log SINCE..`). (A date SINCE places
    no index: regressions judges each step and run by its own time.)"""
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


@dataclasses.dataclass
class GateResult:
    """What `history check` found: the regressions, and what it could not check (said, never silently passed)."""

    found: list[tuple[detect.Series, str, detect.Step | None]]
    unplaced: list[detect.Series]  # series whose fingerprint never ran SINCE (and the repository does not know it)
    in_window: int  # series with a point (or, for a date, a run) after SINCE


def _broken(s: detect.Series, since: str, start: int, when: str | None) -> bool:
    """The newest run of the series' newest commit fails where an earlier run passed, and that run is after SINCE:
    made on or after the date, or of a commit after SINCE (or of SINCE itself: a re-run of the last checked commit
    that fails tonight is a failure now). A point is `ok` when any of its runs passed, so a failed re-run of a
    commit that passed before is read from its newest run, not from the point."""
    if not s.points or s.points[-1].newest is None:
        return False
    last = s.points[-1]
    status, _, created = last.newest
    if status in ("ok", "skipped"):
        return False
    passed_before = last.status == "ok" or any(p.status == "ok" for p in s.points[:-1])
    if when:
        return passed_before and (created or "") >= when
    of_since = bool(last.commit and last.commit.startswith(since))
    return passed_before and (start < len(s.points) or of_since)


def regressions(series: Sequence[detect.Series], since: str, repo: Path | None) -> GateResult:
    """Every case that regressed after `since`: 'slower' (a step whose first slower point is after a commit SINCE,
    or was first measured on or after a date SINCE) or 'broken' (_broken); each step's suspects are filled in from
    the repository. HistoryError when no series knows `since`."""
    result, when = GateResult([], [], 0), since_date(since)
    for s in series:
        try:
            start = 0 if when else since_index(s, since, repo)
        except HistoryError:
            result.unplaced.append(s)  # this fingerprint never ran that commit; another may have
            continue
        newest = max((p.newest[2] or "" for p in s.points if p.newest), default="")
        result.in_window += (newest >= when) if when else start < len(s.points)
        for st in s.steps:
            new = (st.first_bad.created or st.first_bad.time or "") >= when if when else st.index >= start
            if new and st.direction == "slower":
                st.suspects = gitinfo.log_range(repo, st.last_good.commit, st.first_bad.commit)
                result.found.append((s, "slower", st))
        if _broken(s, since, start, when):
            result.found.append((s, "broken", None))
    if series and len(result.unplaced) == len(series):
        since_index(series[0], since, repo)  # raises the one-line error
    return result


def parse_age(text: str) -> str:
    """'90d', '12w', '6m' (months of 30 days), '1y', or a date -> the UTC cut-off timestamp."""
    m = re.fullmatch(r"(\d+)\s*([dwmy])", text.strip())
    if m:
        days = int(m.group(1)) * {"d": 1, "w": 7, "m": 30, "y": 365}[m.group(2)]
        try:
            return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)).isoformat(timespec="seconds")
        except OverflowError:  # before year 1: no date to compare with
            raise HistoryError(f"--older-than {text!r}: an age past year 1; give fewer days or a date "
                               "YYYY-MM-DD") from None
    if DATE.match(text.strip()) and gitinfo.utc(text.strip()):
        return gitinfo.utc(text.strip())  # type: ignore[return-value]
    raise HistoryError(f"--older-than {text!r}: expected an age like 90d, 12w, 6m, 1y or a date YYYY-MM-DD")
