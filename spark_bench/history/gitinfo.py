"""What the git repository at hand knows about the commits of stored runs: commit times, the branch, and the commits
between the last good and the first bad run. Every helper answers None or [] when there is no repository (or it does
not know the commit): history works without one, it only knows less."""

from __future__ import annotations

import datetime as dt
import subprocess
from collections.abc import Iterable
from pathlib import Path


def _git(repo: Path, *args: str, stdin: str | None = None, timeout: float = 30.0) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def find_repo(path: Path | str | None) -> Path | None:
    """The top of the work tree containing `path` (default: the current directory), or None."""
    top = _git(Path(path) if path is not None else Path.cwd(), "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top and top.strip() else None


def utc(text: str | None) -> str | None:
    """An ISO timestamp in UTC with seconds (`2026-11-30T10:15:00+00:00`), so timestamps sort as strings."""
    if not text:
        return None
    try:
        t = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def commit_times(repo: Path | None, commits: Iterable[str]) -> dict[str, str]:
    """Full sha given (abbreviated or full) -> committer time in UTC, for the commits the repository knows."""
    wanted = sorted({c for c in commits if c})
    if repo is None or not wanted:
        return {}
    check = _git(repo, "cat-file", "--batch-check=%(objectname) %(objecttype)", stdin="\n".join(
        f"{c}^{{commit}}" for c in wanted) + "\n")
    if check is None:
        return {}
    full = {c: line.split()[0] for c, line in zip(wanted, check.splitlines(), strict=False) if line.endswith(" commit")}
    shas = sorted(set(full.values()))  # `git show` prints a commit once however often (and however spelled) named
    times: dict[str, str] = {}
    for i in range(0, len(shas), 500):  # one git call per 500 commits
        text = _git(repo, "show", "-s", "--format=%H %cI", *shas[i:i + 500])
        for line in (text or "").splitlines():
            sha, _, when = line.partition(" ")
            if utc(when):
                times[sha] = utc(when)  # type: ignore[assignment]
    return {given: times[sha] for given, sha in full.items() if sha in times}


def branch_of(repo: Path | None, commits: Iterable[str]) -> dict[str, str]:
    """commit -> the repository's current branch, for the commits that are ancestors of its HEAD."""
    if repo is None:
        return {}
    name = _git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    if not name or name.strip() in ("", "HEAD"):
        return {}
    ancestors = _git(repo, "rev-list", "HEAD", timeout=60.0)
    if ancestors is None:
        return {}
    full = set(ancestors.split())
    out = {}
    for c in commits:
        if c and (c in full or (len(c) < 40 and any(a.startswith(c) for a in full))):
            out[c] = name.strip()
    return out


def log_range(repo: Path | None, last_good: str | None, first_bad: str | None, limit: int = 50) -> list[str] | None:
    """`git log --oneline last_good..first_bad` (the suspects of a step), or None when the repository cannot tell."""
    if repo is None or not first_bad:
        return None
    spec = f"{last_good}..{first_bad}" if last_good else first_bad
    text = _git(repo, "log", f"--max-count={limit}", "--format=%h %an: %s", spec)
    return None if text is None else text.splitlines()


def commit_time_of(repo: Path | None, rev: str) -> str | None:
    return commit_times(repo, [rev]).get(rev)
