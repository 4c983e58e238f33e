"""Robust statistics of timing samples: median, quantiles, IQR and a distribution-free CI of the median."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054


def median_ci(sorted_samples: np.ndarray, z: float = Z95) -> tuple[float, float]:
    """Order-statistic confidence interval of the median (binomial, normal approximation); needs no distribution
    assumption. With fewer than 6 samples it is the full range."""
    n = len(sorted_samples)
    if n == 0:
        return math.nan, math.nan
    half = z * math.sqrt(n) / 2.0
    lo = max(0, int(math.floor(n / 2.0 - half)) - 1 if n >= 6 else 0)
    hi = min(n - 1, int(math.ceil(n / 2.0 + half)) if n >= 6 else n - 1)
    return float(sorted_samples[lo]), float(sorted_samples[hi])


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
        "ci_low": lo, "ci_high": hi, "ci_level": 0.95,
        "rel_ci": float((hi - lo) / (2.0 * med)) if med > 0 and len(s) > 1 else None,
        "n": int(len(s)),
    }
