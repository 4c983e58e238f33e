"""Robust statistics of timing samples: median, quantiles, IQR and a distribution-free CI of the median."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054
MIN_CI_SAMPLES = 6  # below this the median's "CI" is the full range, which covers the median less than 95% of the time


def _ci_ranks(n: int, z: float = Z95) -> tuple[int, int]:
    """0-based order statistics bounding the median's CI (binomial, normal approximation); the full range below 6."""
    if n < MIN_CI_SAMPLES:
        return 0, n - 1
    half = z * math.sqrt(n) / 2.0
    return max(0, int(math.floor(n / 2.0 - half)) - 1), min(n - 1, int(math.ceil(n / 2.0 + half)))


def median_ci(sorted_samples: np.ndarray, z: float = Z95) -> tuple[float, float]:
    """Order-statistic confidence interval of the median; needs no distribution assumption. With fewer than 6
    samples it is the full range (see `median_ci_coverage` for how often that covers the median)."""
    n = len(sorted_samples)
    if n == 0:
        return math.nan, math.nan
    lo, hi = _ci_ranks(n, z)
    return float(sorted_samples[lo]), float(sorted_samples[hi])


def metric_ci(sorted_samples: np.ndarray, metric: str, z: float = Z95) -> tuple[float, float] | None:
    """A ~95% CI of a timing statistic (`compare --metric`): the median's and a quantile's (p10, p90) from order
    statistics, the mean's from its standard error; None for the min (an extreme has no such interval) or too few
    samples."""
    s, n = sorted_samples, len(sorted_samples)
    if n == 0:
        return None
    if metric == "median":
        return median_ci(s, z)
    if metric == "mean":
        half = z * float(np.std(s, ddof=1)) / math.sqrt(n) if n > 1 else math.inf
        return (float(np.mean(s)) - half, float(np.mean(s)) + half) if math.isfinite(half) else None
    q = {"p10": 0.1, "p90": 0.9}.get(metric)
    if q is None or n < MIN_CI_SAMPLES:
        return None
    half = z * math.sqrt(n * q * (1.0 - q))
    lo, hi = max(0, int(math.floor(n * q - half)) - 1), min(n - 1, int(math.ceil(n * q + half)))
    return float(s[lo]), float(s[hi])


def median_ci_coverage(n: int, z: float = Z95) -> float | None:
    """Exact probability that `median_ci` of n independent samples of a continuous distribution covers its median:
    P(lo < B <= hi) for B ~ Binomial(n, 1/2). About 0.95 from 6 samples on; 0.5 at 2, 0.75 at 3, 0.94 at 5."""
    if n < 2:
        return None
    lo, hi = _ci_ranks(n, z)
    return sum(math.comb(n, j) for j in range(lo + 1, hi + 1)) / 2**n  # exact integers: 2.0**n overflows


def rel_ci(samples: Sequence[float]) -> float:
    """Half-width of the median's 95% CI relative to the median (inf when undefined)."""
    s = np.sort(np.asarray(samples, dtype=np.float64))
    if len(s) < 2:
        return math.inf
    med = float(np.median(s))
    lo, hi = median_ci(s)
    return (hi - lo) / (2.0 * med) if med > 0 else math.inf


def summarize(samples: Sequence[float]) -> dict:
    """Statistics stored with every timed case (same unit as the samples)."""
    s = np.sort(np.asarray(samples, dtype=np.float64))
    if len(s) == 0:
        raise ValueError("no samples")
    p10, p25, med, p75, p90 = np.percentile(s, [10, 25, 50, 75, 90])
    lo, hi = median_ci(s)
    return {
        "median": float(med), "mean": float(s.mean()), "min": float(s[0]), "max": float(s[-1]),
        "p10": float(p10), "p90": float(p90), "iqr": float(p75 - p25),
        "ci_low": lo, "ci_high": hi, "ci_level": median_ci_coverage(len(s)),
        "rel_ci": float((hi - lo) / (2.0 * med)) if med > 0 and len(s) > 1 else None,
        "n": int(len(s)),
    }
