"""Change detection on one case's series: level shifts of the median, where they happened, how big, how sure.

A series (one case on one device fingerprint) is aggregated to one point per commit (re-runs of a commit: the median
of their medians; a run without a commit is its own point), then segmented on log(median):

- The noise σ of a point is estimated twice and the larger is used: between runs, robustly from the median absolute
  deviation of successive differences (a step is one outlier among the differences, so it barely moves it), and
  within runs, from the raw samples' order-statistic CI of each median (stored with every run).
- The segmentation minimises the squared error plus a penalty of 2·σ²·ln(n) per change (the BIC penalty for a mean
  shift of known variance), solved exactly by dynamic programming (the optimum PELT also finds, without its pruning;
  n is at most a few thousand commits). A segment needs two points, except the newest one: today's run alone may
  already be a step, which is what a nightly gate asks.
- Each change is then confirmed: a pooled-variance t-test of the two neighbouring segments (their spread never taken
  below the within-run noise; exact Student t for the segments' degrees of freedom), Bonferroni-corrected for the
  n − 1 places a change could have been put (p_adj = p·(n − 1)). A change is kept when p_adj < alpha and the ratio of
  the segments' geometric means is beyond the threshold; the weakest failing change is dropped and the rest re-tested
  until every change passes. confidence = 1 − p_adj. On pure noise (log-normal, 1% spread) about 1% of 30-run series
  show a change at threshold 0 (alpha 0.01), none at the default 5% threshold.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_bench.history.query import CaseKey

Z95 = 1.959963984540054
ALPHA = 0.01
THRESHOLD = 0.05
PENALTY = 2.0


@dataclasses.dataclass
class Point:
    """One commit of a series (or one run without a commit)."""

    commit: str | None
    time: str | None  # commit time when the repository told us, else the run's creation time
    run_ids: list[str]
    status: str
    median: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    dirty: bool = False
    branch: str | None = None
    error: str | None = None
    created: str | None = None  # when the first of its runs was made
    timers: tuple[str, ...] = ()  # the timers of its passing runs (`--timer auto` picks one per run)
    newest: tuple[str, str | None, str | None] | None = None  # (status, error, created) of its newest run

    @property
    def label(self) -> str:
        return (self.commit[:10] + (" (dirty)" if self.dirty else "")) if self.commit else "no commit"


@dataclasses.dataclass
class Step:
    index: int  # index (into the series' points) of the first point after the shift
    last_good: Point  # the last point before it
    first_bad: Point  # "bad" = after the shift, slower or faster
    before: float  # geometric mean of the medians of the segment before
    after: float
    ratio: float  # after / before: > 1 is slower
    p_value: float  # Bonferroni-adjusted
    n_before: int
    n_after: int
    suspects: list[str] | None = None  # `git log last_good..first_bad`, when the repository is at hand

    @property
    def direction(self) -> str:
        return "slower" if self.ratio > 1 else "faster"

    @property
    def confidence(self) -> float:
        return 1.0 - self.p_value

    @property
    def timer_change(self) -> str | None:
        """'cuda-event -> cuda-graph' when the points either side of the step were timed differently: events inflate
        small kernels several-fold, so such a step may be the measurement's, not the code's."""
        before, after = self.last_good.timers, self.first_bad.timers
        if not before or not after or before == after:
            return None
        return f"{'/'.join(before)} -> {'/'.join(after)}"

    def cautions(self) -> list[str]:
        """Why the step may not be the code's: another timer either side, or uncommitted changes at either end."""
        out = [f"the timer changed at this step ({self.timer_change}): maybe the measurement's step; re-run both "
               "commits with one --timer to tell"] if self.timer_change else []
        dirty = [p.label for p in (self.last_good, self.first_bad) if p.dirty]
        if dirty:
            out.append(f"{' and '.join(dirty)} had uncommitted changes: the step may be in code no commit holds")
        return out

    def suspects_shown(self, most: int) -> list[str]:
        """The first `most` suspects, and a last line saying how many more `git log` lists."""
        s = self.suspects or []
        return s[:most] + ([f"... {len(s) - most} more: git log {self.last_good.label[:10]}.."
                            f"{self.first_bad.label[:10]}"] if len(s) > most else [])

    def to_dict(self) -> dict[str, Any]:
        """points_before/after: the commits (points: a commit's runs merged) either side, not runs."""
        return {"direction": self.direction, "ratio": self.ratio, "change_pct": (self.ratio - 1) * 100,
                "confidence": self.confidence, "p_value": self.p_value, "before": self.before, "after": self.after,
                "points_before": self.n_before, "points_after": self.n_after,
                "last_good_commit": self.last_good.commit, "last_good_dirty": self.last_good.dirty,
                "first_bad_commit": self.first_bad.commit, "first_bad_dirty": self.first_bad.dirty,
                "first_bad_time": self.first_bad.time, "first_bad_runs": self.first_bad.run_ids,
                "suspects": self.suspects, "timer_change": self.timer_change, "cautions": self.cautions()}


@dataclasses.dataclass
class Series:
    case: CaseKey
    fingerprint_id: str
    device: str
    unit: str
    points: list[Point]
    steps: list[Step]
    sigma: float | None  # noise of one point, on the log scale (≈ relative)

    def to_dict(self) -> dict[str, Any]:
        """The series as `history trend --json` prints it: its case, every point and the steps found."""
        return {"op": self.case.op, "backend": self.case.backend, "dtype": self.case.dtype, "params": self.case.params,
                "fingerprint_id": self.fingerprint_id, "device": self.device, "unit": self.unit, "noise": self.sigma,
                "points": [{"commit": p.commit, "time": p.time, "runs": p.run_ids, "status": p.status,
                            "median": p.median, "ci_low": p.ci_low, "ci_high": p.ci_high, "n": p.n, "dirty": p.dirty,
                            "timers": p.timers, "error": p.error} for p in self.points],
                "steps": [{"index": st.index, **st.to_dict()} for st in self.steps]}


def points_of(rows: Sequence[dict[str, Any]]) -> list[Point]:
    """Series rows (one per run, in commit order) -> one point per commit, in order of first appearance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["commit"] or f"run:{r['run_id']}", []).append(r)
    out = []
    for rs in groups.values():
        ok = [r for r in rs if r["status"] == "ok" and r["median"] is not None and r["median"] > 0]
        first = rs[0]

        def mid(key: str, rows=ok) -> float | None:
            vals = [r[key] for r in rows if r[key] is not None]
            return float(statistics.median(vals)) if vals else None  # lists of a few: faster than numpy

        out.append(Point(commit=first["commit"], time=first["commit_time"] or first["created"],
                         run_ids=[r["run_id"] for r in rs], status="ok" if ok else rs[-1]["status"],
                         median=mid("median"), ci_low=mid("ci_low"), ci_high=mid("ci_high"),
                         n=sum(int(r["n"] or 0) for r in ok), dirty=any(r["dirty"] for r in rs),
                         branch=first.get("branch"), error=None if ok else rs[-1].get("error"),
                         created=min((r["created"] for r in rs if r["created"]), default=None),
                         timers=tuple(sorted({r["timer"] for r in ok if r.get("timer")})),
                         newest=(rs[-1]["status"], rs[-1].get("error"), rs[-1]["created"])))  # rows: oldest first
    return out


def noise(y: np.ndarray, within: np.ndarray) -> float:
    """σ of one point on the log scale: the larger of the between-run (MAD of differences) and within-run estimates."""
    between = 0.0
    if len(y) >= 3:
        d = np.diff(y)
        between = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
    inside = float(np.median(within)) if len(within) and np.isfinite(within).any() else 0.0
    scale = float(np.median(np.abs(y))) if len(y) else 1.0
    return max(between, inside if math.isfinite(inside) else 0.0, 1e-6 * max(scale, 1.0), 1e-9)


def segment(y: np.ndarray, beta: float) -> list[int]:
    """Change positions (start indices of every segment but the first) minimising SSE + beta per change. Segments have
    at least 2 points, the last one at least 1."""
    n = len(y)
    s1 = np.concatenate([[0.0], np.cumsum(y)])
    s2 = np.concatenate([[0.0], np.cumsum(y * y)])
    best = np.full(n + 1, np.inf)
    best[0] = -beta
    prev = np.zeros(n + 1, dtype=np.int64)
    for t in range(1, n + 1):
        min_len = 1 if t == n else 2
        s = np.arange(0, t - min_len + 1)
        s = s[np.isfinite(best[s])]
        if len(s) == 0:
            continue
        length = t - s
        cost = (s2[t] - s2[s]) - (s1[t] - s1[s]) ** 2 / length
        total = best[s] + cost + beta
        k = int(np.argmin(total))
        best[t], prev[t] = total[k], s[k]
    cuts, t = [], n
    while t > 0:
        t = int(prev[t])
        if t > 0:
            cuts.append(t)
    return sorted(cuts)


def t_two_sided(t: float, df: int) -> float:
    """P(|T| > |t|) for Student's t with an integer number of degrees of freedom (exact finite series)."""
    if df < 1:
        return 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd
        term, acc = 1.0, 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        inside = (2 / math.pi) * (theta + (s * math.cos(theta) * acc if df > 1 else 0.0))
    else:
        term, acc = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        inside = s * acc
    return min(1.0, max(0.0, 1.0 - inside))


def _test(y: np.ndarray, lo: int, cut: int, hi: int, floor: float, n: int) -> tuple[float, float, float]:
    """(adjusted p, mean before, mean after) of the change at `cut` between segments [lo, cut) and [cut, hi):
    a pooled-variance t-test of the two segments (the spread never below the within-run noise `floor`)."""
    a, b = y[lo:cut], y[cut:hi]
    df = len(a) + len(b) - 2
    ss = float(((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum())
    sd = max(math.sqrt(ss / df) if df > 0 else 0.0, floor, 1e-12)
    t = (b.mean() - a.mean()) / (sd * math.sqrt(1.0 / len(a) + 1.0 / len(b)))
    return min(1.0, t_two_sided(t, df) * max(1, n - 1)), float(a.mean()), float(b.mean())


def find_steps(points: Sequence[Point], alpha: float = ALPHA, threshold: float = THRESHOLD,
               penalty: float = PENALTY) -> tuple[list[Step], float | None]:
    """The confirmed level shifts of a series of points, and its noise σ (None when too short to tell)."""
    idx = [i for i, p in enumerate(points) if p.status == "ok" and p.median]
    if len(idx) < 3:
        return [], None
    y = np.log(np.array([points[i].median for i in idx], dtype=np.float64))
    within = np.array([(math.log(p.ci_high) - math.log(p.ci_low)) / (2 * Z95)
                       if p.ci_low and p.ci_high and p.ci_low > 0 and p.ci_high >= p.ci_low else np.nan
                       for p in (points[i] for i in idx)])
    within = within[np.isfinite(within)]
    floor = float(np.median(within)) if len(within) else 0.0
    sigma = noise(y, within)
    n = len(y)
    cuts = segment(y, penalty * sigma * sigma * math.log(n))
    while cuts:
        bounds = [0, *cuts, n]
        tests = [(*_test(y, bounds[k], bounds[k + 1], bounds[k + 2], floor, n), k) for k in range(len(cuts))]
        failing = [t for t in tests if t[0] >= alpha or abs(math.exp(t[2] - t[1]) - 1) < threshold]
        if not failing:
            break
        worst = max(failing, key=lambda t: (t[0], -abs(t[2] - t[1])))
        cuts.pop(worst[3])
    steps = []
    bounds = [0, *cuts, n]
    for k, cut in enumerate(cuts):
        p, before, after = _test(y, bounds[k], cut, bounds[k + 2], floor, n)
        steps.append(Step(index=idx[cut], last_good=points[idx[cut - 1]], first_bad=points[idx[cut]],
                          before=math.exp(before), after=math.exp(after), ratio=math.exp(after - before), p_value=p,
                          n_before=cut - bounds[k], n_after=bounds[k + 2] - cut))
    return steps, sigma


def build_series(case: CaseKey, rows: Sequence[dict[str, Any]], alpha: float = ALPHA,
                 threshold: float = THRESHOLD) -> Series:
    points = points_of(rows)
    steps, sigma = find_steps(points, alpha, threshold)
    unit = next((r["unit"] for r in rows if r.get("unit")), "us")
    return Series(case, rows[0]["fingerprint_id"], str(rows[0]["device"]), unit, points, steps, sigma)


def all_series(cases: Sequence[CaseKey], rows: Sequence[dict[str, Any]], alpha: float = ALPHA,
               threshold: float = THRESHOLD) -> list[Series]:
    """Split rows (sorted by case, fingerprint, commit order) into one series per (case, fingerprint)."""
    by_id = {c.id: c for c in cases}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["case_ref"], r["fingerprint_id"]), []).append(r)
    return [build_series(by_id[cid], rs, alpha, threshold) for (cid, _), rs in groups.items() if cid in by_id]
