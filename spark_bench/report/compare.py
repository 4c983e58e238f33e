"""Two runs side by side: match cases by (op, backend, params, dtype) and give each a robust verdict.

A case is `slower`/`faster` only when BOTH hold: the raw samples differ (two-sided Mann-Whitney U: exact without ties
up to 40 samples in all, else the normal approximation with tie correction; p < alpha) AND the metric moved by more
than the threshold. It is `same` when the change is below the threshold with confidence (the ratio's 95% CI lies inside
±threshold, or the shift is significant but small), and `noisy` when the samples cannot tell (the ratio's CI reaches
past the threshold without a significant test). Few samples (3 to 5 a side: no U test reaches p < 0.01) still give
`slower`/`faster` when every new sample is beyond every base sample by more than the threshold; fewer than 3 samples
on a side are always `noisy`.
Correctness changes have their own verdicts: `broken` (ok before, failing now: a regression), `fixed`, `failing`,
plus `missing` (only in the base run) and `new` (only in the new run).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_bench.console import fmt_pct
from spark_bench.report.compare_checks import (  # noqa: F401  (re-exported: the checks were defined here)
    CompareError,
    check_common_cases,
    check_same_device,
    check_same_weights,
    device_difference,
    weights_identity,
)
from spark_bench.report.model import (
    RunData,
    geomean,
    match_key,
    natural_key,
    number,
    params_text,
    time_unit,
    timing,
)
from spark_bench.stats import metric_ci

ALPHA = 0.01
METRICS = ("median", "mean", "min", "p10", "p90")
REGRESSIONS = ("slower", "broken")
VERDICT_STYLE = {"faster": "green", "slower": "bold red", "same": "dim", "noisy": "yellow", "broken": "bold red",
                 "fixed": "green", "failing": "red", "missing": "magenta", "new": "cyan"}


# --- statistics ------------------------------------------------------------------------------------------------------
EXACT_MAX_N = 40


@functools.cache  # at most EXACT_MAX_N^2 / 4 pairs, each a few ms
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """How many of the C(n1 + n2, n1) orderings give each U = 0 .. n1*n2 (the Gaussian binomial's coefficients)."""
    counts = [[1] + [0] * (n1 * n2) for _ in range(n1 + 1)]  # counts[i][u]: orderings of i x's and j y's, built on j
    for j in range(1, n2 + 1):
        for i in range(1, n1 + 1):  # the last element is a y (U unchanged) or an x (U grows by j)
            counts[i] = [counts[i][u] + (counts[i - 1][u - j] if u >= j else 0) for u in range(n1 * n2 + 1)]
    return tuple(counts[n1])


def _exact_p(u1: float, n1: int, n2: int) -> float:
    counts = _u_counts(n1, n2)
    u = round(u1)
    low, high = sum(counts[: u + 1]), sum(counts[u:])
    return min(1.0, 2.0 * min(low, high) / sum(counts))


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of `a`, p), exact when there are no ties and at most EXACT_MAX_N samples in
    all (3 vs 3 can reach no lower than p = 0.1), else the normal approximation with tie and continuity correction."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return math.nan, 1.0
    both = np.concatenate([x, y])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1, dtype=np.float64)
    uniq, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    if len(uniq) < len(both):  # average the ranks of ties
        sums = np.bincount(inverse, weights=ranks)
        ranks = (sums / counts)[inverse]
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    n = n1 + n2
    if len(uniq) == n and n <= EXACT_MAX_N:
        return u1, _exact_p(u1, n1, n2)
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if var <= 0:
        return u1, 1.0
    z = (abs(u1 - n1 * n2 / 2.0) - 0.5) / math.sqrt(var)
    return u1, float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def pct(fraction: float) -> str:
    """A threshold as the user gave it: 0.004 -> '0.4%', 0.05 -> '5%' (not rounded to whole percents)."""
    return fmt_pct(fraction * 100)


def rel_iqr(samples: Sequence[float]) -> float:
    s = np.asarray(samples, dtype=np.float64)
    med = float(np.median(s))
    q1, q3 = np.percentile(s, [25, 75])
    return float((q3 - q1) / med) if med > 0 else math.inf


@dataclasses.dataclass
class Verdict:
    verdict: str
    ratio: float | None = None  # new / base of the metric: > 1 is slower
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    p_value: float | None = None
    note: str = ""


def log_halfwidth(lo: float, hi: float) -> float:
    """Half the width of the CI [lo, hi] on a log scale (inf when it is not positive): a relative uncertainty."""
    return (math.log(hi) - math.log(lo)) / 2.0 if lo > 0 and hi > 0 else math.inf


def ratio_ci(ratio: float, ci_a: tuple[float, float], ci_b: tuple[float, float]) -> tuple[float, float] | None:
    """The CI of a ratio of two medians from their CIs, combined on a log scale; None when either is unknown."""
    half = math.hypot(log_halfwidth(*ci_a), log_halfwidth(*ci_b))
    return (ratio * math.exp(-half), ratio * math.exp(half)) if math.isfinite(half) else None


def timing_verdict(base: dict[str, Any], new: dict[str, Any], threshold: float, metric: str = "median",
                   alpha: float = ALPHA) -> Verdict:
    """Verdict for two `timing` records, from their raw samples when stored (else their stored CIs)."""
    b_val, n_val = number(base.get(metric)), number(new.get(metric))
    if not b_val or n_val is None:
        return Verdict("noisy", note=f"no {metric} recorded")
    ratio = n_val / b_val
    a, b = base.get("samples") or [], new.get("samples") or []
    if a and sorted(a) == sorted(b) and ratio == 1.0:  # the very same measurement (a run compared with itself)
        return Verdict("same", 1.0, 1.0, 1.0, 1.0, "identical samples")
    if (a or b) and min(len(a), len(b)) < 3:
        return Verdict("noisy", ratio, p_value=None, note=f"too few samples to compare ({len(a)} vs {len(b)})")
    if len(a) >= 3 and len(b) >= 3:
        _, p = mann_whitney(a, b)
        ci_a, ci_b = (metric_ci(np.sort(np.asarray(x, float)), metric) for x in (a, b))  # the metric's own CIs
        note = ""
    elif metric == "median":  # no raw samples: the stored (median) CIs are all we have; non-overlap stands in
        ci_a = (number(base.get("ci_low")) or b_val, number(base.get("ci_high")) or b_val)
        ci_b = (number(new.get("ci_low")) or n_val, number(new.get("ci_high")) or n_val)
        p = 0.0 if (ci_b[0] > ci_a[1] or ci_b[1] < ci_a[0]) else 1.0
        note = "no raw samples: stored CIs compared"
    else:
        return Verdict("noisy", ratio, note=f"no raw samples: the stored CIs are the median's, not the {metric}'s")
    bounds = ratio_ci(ratio, ci_a, ci_b) if ci_a and ci_b else None  # None: the metric has no CI (min)
    lo, hi = bounds or (0.0, math.inf)
    v = Verdict("noisy", ratio, *(bounds or (None, None)), p, note)
    separated = bool(a) and bool(b) and (min(b) > max(a) * (1.0 + threshold) or max(b) < min(a) * (1.0 - threshold))
    if (p < alpha or separated) and abs(ratio - 1.0) > threshold:
        v.verdict = "slower" if ratio > 1.0 else "faster"
        if p >= alpha:
            v.note = f"every new sample beyond every base sample by > {pct(threshold)} ({len(a)} vs {len(b)} samples)"
    elif p < alpha or (lo >= 1.0 - threshold and hi <= 1.0 + threshold):
        v.verdict = "same"
    else:
        spread = max(rel_iqr(a), rel_iqr(b)) if len(a) >= 3 and len(b) >= 3 else math.nan
        v.note = v.note or ((f"ratio CI {lo:.3f}-{hi:.3f} reaches past ±{pct(threshold)}" if bounds else
                             f"the {metric} has no CI and the test is not significant")
                            + (f"; relative IQR up to {spread:.0%}" if math.isfinite(spread) else ""))
    return v


def case_verdict(base: dict[str, Any] | None, new: dict[str, Any] | None, threshold: float,
                 metric: str = "median") -> Verdict:
    if new is None:
        return Verdict("missing", note="not in the new run")
    if base is None:
        return Verdict("new", note="not in the base run")
    b_ok, n_ok = base.get("status") == "ok", new.get("status") == "ok"
    if b_ok and not n_ok:
        return Verdict("broken", note=f"ok -> {new.get('status')}: {new.get('error') or ''}".rstrip(": "))
    if not b_ok and n_ok:
        return Verdict("fixed", note=f"{base.get('status')} -> ok")
    if not b_ok:
        return Verdict("failing", note=f"{base.get('status')} -> {new.get('status')}")
    tb, tn = timing(base), timing(new)
    if tb is None or tn is None:
        return Verdict("same", note="ok in both, not timed")
    v = timing_verdict(tb, tn, threshold, metric)
    how = [f"{k} {tb.get(k)} -> {tn.get(k)}" for k in ("timer", "l2_flush") if tb.get(k) != tn.get(k)]
    if how:  # e.g. `--timer auto` moved a case across 50 us: launch overhead is in one time and not the other
        v.note = "; ".join([*how, "not timed alike (--timer pins it)", *([v.note] if v.note else [])])
    return v


# --- runs ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CaseDiff:
    op: str
    backend: str
    params: dict[str, Any]
    dtype: str
    base: dict[str, Any] | None
    new: dict[str, Any] | None
    verdict: Verdict

    @property
    def sort_key(self) -> tuple:
        return self.op, self.backend, natural_key({"params": self.params, "dtype": self.dtype})

    @property
    def regressed(self) -> bool:
        return self.verdict.verdict in REGRESSIONS


def parse_threshold(text: str | float) -> float:
    """'5%', '0.05' and '5' all mean 5%."""
    s = str(text).strip()
    try:
        v = float(s.rstrip("%"))
    except ValueError:
        raise CompareError(f"threshold {text!r} is not a number or a percentage") from None
    v = v / 100.0 if s.endswith("%") or v >= 1.0 else v
    if not 0.0 < v < 10.0:
        raise CompareError(f"threshold {text!r} out of range")
    return v


def compare_runs(base: RunData, new: RunData, threshold: float, metric: str = "median") -> list[CaseDiff]:
    if metric not in METRICS:
        raise CompareError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
    a = {match_key(r): r for r in base.results}
    b = {match_key(r): r for r in new.results}
    diffs = []
    for key in sorted(set(a) | set(b)):
        rb, rn = a.get(key), b.get(key)
        some = rb or rn
        if rb is not None and rn is not None and rb.get("status") == "skipped" and rn.get("status") == "skipped":
            continue
        diffs.append(CaseDiff(key[0], key[1], some.get("params") or {}, key[3], rb, rn,
                              case_verdict(rb, rn, threshold, metric)))
    return diffs


def tally(diffs: Sequence[CaseDiff]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d in diffs:
        counts[d.verdict.verdict] = counts.get(d.verdict.verdict, 0) + 1
    return counts


def _metric_text(r: dict[str, Any] | None, metric: str) -> str:
    t = timing(r) if r else None
    v = number(t.get(metric)) if t is not None else None
    if v is not None:
        return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"
    return str(r.get("status")) if r else "-"


def print_table(console: Any, diffs: Sequence[CaseDiff], metric: str, threshold: float,
                base_label: str, new_label: str, show_all: bool = False) -> None:
    """The ratio table on a rich console, regressions first; `same` rows are folded away unless show_all."""
    from rich.table import Table
    from rich.text import Text  # plain Text cells: plugin names and params are never parsed as markup

    order = {"broken": 0, "slower": 1, "faster": 2, "fixed": 3, "noisy": 4, "failing": 5, "missing": 6, "new": 7}
    rows = sorted(diffs, key=lambda d: (order.get(d.verdict.verdict, 8), *d.sort_key))
    shown = [d for d in rows if show_all or d.verdict.verdict != "same"]
    unit = time_unit(d.base for d in diffs)
    title = f"{new_label} vs {base_label}: {metric} ({unit}), threshold ±{pct(threshold)}, p < {ALPHA}"
    table = Table(title=Text(title))
    table.add_column("case (op backend dtype params)", overflow="fold")
    for col in ("base", "new", "ratio", "p"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True, min_width=7)
    notes = any(d.verdict.note for d in shown)  # why a verdict is what it is: timed differently, no samples, ...
    if notes:
        table.add_column("note", overflow="fold")
    for d in shown:
        v = d.verdict
        ratio = f"{v.ratio:.3f}" if v.ratio is not None else ""
        p = f"{v.p_value:.1g}" if v.p_value is not None else ""
        case = f"{d.op} {d.backend} {d.dtype} {params_text(d.params)}"
        cells = (case, _metric_text(d.base, metric), _metric_text(d.new, metric), ratio, p)
        table.add_row(*(Text(c) for c in cells), Text(v.verdict, style=VERDICT_STYLE.get(v.verdict, "")),
                      *([Text(v.note, style="dim")] if notes else []))
    if shown:
        console.print(table)
    summary = geomean_table(diffs)
    if summary is not None:
        console.print(summary)
    hidden = len(rows) - len(shown)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(tally(diffs).items()))
    folded = f" ({hidden} 'same' not listed; --all lists them)" if hidden else ""
    both = sum(d.base is not None and d.new is not None for d in diffs)
    console.print(f"{len(diffs)} cases, {both} in both runs: {counts or 'none'}{folded}", markup=False,
                  highlight=False)


def geomean_table(diffs: Sequence[CaseDiff]) -> Any:
    """Per op and backend, the geometric mean of the new / base time over the cases both runs timed, with its
    verdict counts: the one-line answer to 'did my change make triton faster on this op'. None without ratios."""
    from rich.table import Table
    from rich.text import Text

    groups: dict[tuple[str, str], list[CaseDiff]] = {}
    for d in diffs:
        if d.verdict.ratio is not None and d.verdict.ratio > 0:
            groups.setdefault((d.op, d.backend), []).append(d)
    if not groups:
        return None
    table = Table(title=Text("geomean new / base time per op and backend (< 1: faster)"))
    for col, justify in (("op", "left"), ("backend", "left"), ("cases", "right"), ("geomean", "right"),
                         ("slower", "right"), ("faster", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    rows = []
    for (op, backend), ds in groups.items():
        mean = geomean([d.verdict.ratio for d in ds])
        verdicts = [d.verdict.verdict for d in ds]
        rows.append((mean, op, backend, len(ds), verdicts.count("slower"), verdicts.count("faster")))
    for mean, op, backend, n, slower, faster in sorted(rows, key=lambda r: (-r[0], r[1], r[2])):  # worst first
        table.add_row(Text(op), Text(backend), str(n), f"{mean:.3f}x", str(slower), str(faster))
    return table

