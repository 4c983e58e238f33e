"""The regression gate: pytest-benchmark's --benchmark-compare / --benchmark-compare-fail made safe for spark-bench.

- Options: the --spark-* timing values are checked like `spark-bench run`'s (one line, exit 4).
- Baselines: a --benchmark-compare file that is missing or malformed, or (with --benchmark-compare-fail) loads no
  baseline at all, stops the run before any case runs, instead of passing or ending in a traceback.
- Verdicts: `--benchmark-compare-fail=median:10%` (also mean, min) judges a spark-bench case with `spark-bench
  compare`'s statistics (report.compare.case_verdict: Mann-Whitney U on the raw samples, or the stored CIs, and the
  threshold), so a `noisy` case does not fail and a `slower` one fails the session (exit 1, without pytest-benchmark's
  traceback); other fields and plain benchmarks keep pytest-benchmark's check.
- A gate fails when its baseline holds none of the timed cases (nothing was compared), or when a case timed in the
  baseline was skipped in this run (a backend that became unavailable), as `spark-bench compare` fails on `missing`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from spark_bench.pytest_plugin.replay import ReplayTimer
from spark_bench.results import is_number

VERDICT_FIELDS = ("median", "mean", "min")  # the fields both pytest-benchmark's compare-fail and compare.METRICS know
STATS_FIELDS = ("min", "max", "mean", "median", "stddev", "iqr")  # what --benchmark-compare-fail may read
RUN_OPTIONS = ("max-time", "min-samples", "target-ci", "quick", "full", "device", "backend", "dtype", "set", "preset",
               "weights", "layer", "routing", "activations", "seed")


def usage_error(message: object) -> pytest.UsageError:
    """A spark-bench usage error as pytest's, naming the --spark-* options (`--layer` -> `--spark-layer`)."""
    text = re.sub(rf"(?<![\w-])--({'|'.join(RUN_OPTIONS)})\b", r"--spark-\1", str(message))
    return pytest.UsageError(f"spark-bench: {text}")


def check_options(config: pytest.Config) -> None:
    """The timing options' values, as `spark-bench run` checks its own (imports nothing heavy when none is given)."""
    opt = config.getoption
    values = {k: opt(f"spark_{k}") for k in ("max_time", "min_samples", "target_ci")}
    if all(v is None for v in values.values()) and not (opt("spark_quick") and opt("spark_full")):
        return
    from spark_bench.options import check_run_options
    from spark_bench.sweep import UsageError

    try:
        check_run_options(timeout=None, quick=opt("spark_quick"), full=opt("spark_full"), **values)
    except UsageError as exc:
        raise usage_error(exc) from None


def keep_raw_samples(config: pytest.Config) -> None:
    """A saved run of spark-bench cases keeps its raw samples (--benchmark-save-data): a later gate on it then uses
    Mann-Whitney on both sides, as `spark-bench compare` does, instead of the stored CIs alone."""
    if (config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None)) \
            and hasattr(config.option, "benchmark_save_data"):
        config.option.benchmark_save_data = True


def check_compare_path(config: pytest.Config) -> None:
    """A --benchmark-compare that names a file which is not there (pytest-benchmark would match nothing, or raise)."""
    compare = config.getoption("benchmark_compare", None)
    if not isinstance(compare, str) or Path(compare).is_file():
        return
    if compare.endswith(".json") or len(Path(compare).parts) > 2:
        raise pytest.UsageError(f"spark-bench: --benchmark-compare {compare}: no such baseline file")


def check_baseline_loaded(config: pytest.Config) -> None:
    """With --benchmark-compare-fail, a --benchmark-compare that loaded nothing is an error before the run, not a
    traceback after it (or, for a file pytest-benchmark could not read, a warning and a pass)."""
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not bs.compare or not bs.compare_fail or bs.compared_mapping:
        return
    what = "the latest saved run" if bs.compare is True else repr(bs.compare)
    reason = f"no saved run in {bs.storage} matches"
    if isinstance(bs.compare, str) and Path(bs.compare).is_file():
        reason = _unreadable(Path(bs.compare)) or "pytest-benchmark could not load it"
    raise pytest.UsageError(f"spark-bench: --benchmark-compare {what}: {reason}; --benchmark-compare-fail has no "
                            "baseline to gate on")


def _unreadable(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text(encoding="utf8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"not a readable JSON file ({exc})"
    return baseline_problem(data)


def baseline_problem(data: Any) -> str | None:
    """What makes a loaded pytest-benchmark JSON unusable as a baseline (pytest-benchmark would raise), or None."""
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        return "not a pytest-benchmark JSON (no 'benchmarks' list)"
    if not isinstance(data.get("machine_info"), dict):
        return "no 'machine_info' object"
    for bench in data["benchmarks"]:
        name = bench.get("fullname") if isinstance(bench, dict) else None
        if not isinstance(name, str):
            return "a benchmark without a 'fullname'"
        stats = bench.get("stats")
        if not isinstance(stats, dict):
            return f"{name}: no 'stats' object"
        bad = [k for k in STATS_FIELDS if not is_number(stats.get(k))]
        if bad:
            return f"{name}: {', '.join(bad)} not a number"
    return None


def fingerprint_problem(baseline: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a (well-formed) baseline's timings are not comparable with this run's, or None: another device
    fingerprint, or spark-bench cases without one (a baseline without spark-bench cases is not ours to judge)."""
    from spark_bench.pytest_plugin.cases import NODE_ID
    from spark_bench.pytest_plugin.replay import fingerprint_difference

    saved = baseline["machine_info"].get("spark_bench")
    if not saved:
        if any(str(b.get("fullname")).startswith(f"{NODE_ID}::") for b in baseline["benchmarks"]):
            return ("the baseline holds spark-bench cases but no device fingerprint (machine_info.spark_bench): it "
                    "cannot be told apart from a run on another device or stack")
        return None
    if not isinstance(saved, dict):
        return f"the baseline's device fingerprint (machine_info.spark_bench) is malformed: {saved!r:.60}"
    difference = fingerprint_difference(saved, current)
    if difference is None:
        return None
    return (f"the baseline was measured on another device fingerprint ({saved.get('fingerprint_id')}, this run "
            f"{current.get('fingerprint_id')}): {difference}; its timings are not comparable with this run's")


def is_spark(bench: Any) -> bool:
    return isinstance((getattr(bench, "options", None) or {}).get("timer"), ReplayTimer)


class SparkCheck:
    """One of pytest-benchmark's --benchmark-compare-fail checks. A spark-bench case under a percentage on
    median/mean/min gets `spark-bench compare`'s verdict instead, recorded in `results`: the plugin fails the session
    on it (pytest-benchmark's own failure is an exception with a traceback); other benchmarks keep the check."""

    def __init__(self, check: Any, config: pytest.Config) -> None:
        self.check, self.config = check, config
        self.field, self.threshold = check.field, check.threshold
        self.results: list[tuple[str, str, Any, str | None]] = []  # (name, baseline, Verdict, failure)

    def fails(self, current: Any, compared: dict[str, Any]) -> str | None:
        from pytest_benchmark.utils import PercentageRegressionCheck

        if not (is_spark(current) and isinstance(self.check, PercentageRegressionCheck)
                and self.field in VERDICT_FIELDS):
            return self.check.fails(current, compared)
        self.results.append((current.name, str(compared.get("source") or ""), *self.judge(current, compared)))
        return None

    def judge(self, current: Any, compared: dict[str, Any]) -> tuple[Any, str | None]:
        """(the Verdict, why it fails the gate or None) of a spark-bench case against its baseline entry."""
        from spark_bench.report.compare import Verdict, case_verdict, pct

        base = self._baseline(current.fullname, compared.get("path"))
        if not is_number((base.get("stats") or {}).get(self.field)):
            return Verdict("broken"), f"the baseline has no number for {self.field!r}: nothing to compare"
        stats = current.stats
        old = _timing(base.get("stats") or {}, base.get("extra_info") or {})
        new = _timing({"median": stats.median, "mean": stats.mean, "min": stats.min, "data": stats.data},
                      current.extra_info)
        if not old["samples"]:  # saved without --benchmark-save-data: both sides by their stored CIs
            new["samples"] = []
        v = case_verdict({"status": "ok", "timing": old}, {"status": "ok", "timing": new}, self.threshold / 100.0,
                         self.field)
        if v.verdict != "slower":
            return v, None
        p = f"p={v.p_value:.1g}, " if v.p_value is not None else ""
        return v, (f"{self.field} {v.ratio:.3f}x the baseline's, slower by more than {pct(self.threshold / 100.0)} "
                   f"({p}timer {new['timer']}){'; ' + v.note if v.note else ''}")

    def _baseline(self, fullname: str, path: Any) -> dict[str, Any]:
        mapping = self.config._benchmarksession.compared_mapping
        return next((m[fullname] for key, m in mapping.items() if str(key) == str(path) and fullname in m), {})


def _timing(stats: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A `timing` record (us) from pytest-benchmark stats (seconds) and a spark-bench extra_info."""
    t = {k: stats[k] * 1e6 for k in VERDICT_FIELDS if is_number(stats.get(k))}
    t["samples"] = [s * 1e6 for s in stats.get("data") or [] if is_number(s)]
    t.update({k: extra.get(k) for k in ("ci_low", "ci_high", "timer", "l2_flush")})
    return t


def install(config: pytest.Config) -> None:
    """Wrap --benchmark-compare-fail's checks (before pytest-benchmark's session reads them)."""
    checks = getattr(config.option, "benchmark_compare_fail", None)
    if checks:
        config.option.benchmark_compare_fail = [c if isinstance(c, SparkCheck) else SparkCheck(c, config)
                                                for c in checks]


def summary(config: pytest.Config, skipped: dict[str, str], spark: bool) -> tuple[list[str], list[str]]:
    """(lines about what the gate compared, lines of what fails it) once pytest-benchmark has compared; `skipped`:
    the node ids of this run's skipped spark-bench cases, with the reasons; `spark`: the session used spark-bench
    (a plain session keeps pytest-benchmark's behaviour)."""
    bs = getattr(config, "_benchmarksession", None)
    checks = [c for c in (getattr(bs, "compare_fail", None) or []) if isinstance(c, SparkCheck)]
    if checks and bs.disabled and spark:  # --benchmark-disable, or xdist (-n): nothing timed, nothing compared
        return [], ["FAILED: --benchmark-compare-fail compared nothing: pytest-benchmark is disabled "
                    "(--benchmark-disable, or xdist's -n); gate without them"]
    if not checks or not bs.compared_mapping:
        return [], []
    from spark_bench.report.compare import ALPHA, pct

    timed = [b for b in bs.benchmarks if b and is_spark(b)]
    known = {name for m in bs.compared_mapping.values() for name in m}
    gone = [f"  {nodeid.partition('::')[2]}: {reason}" for nodeid, reason in skipped.items() if nodeid in known]
    failures = [f"FAILED: {len(gone)} case(s) timed in the baseline were skipped in this run:", *gone] if gone else []
    missing = [b.name for b in timed if b.fullname not in known]
    if len(missing) == len(timed):
        return [], failures + ([f"FAILED: the baseline holds none of the {len(timed)} timed spark-bench case(s) "
                                "(another selection, or renamed cases): nothing was compared; refresh the baseline"]
                               if timed else [])
    lines, regressed = [], []
    timers = ", ".join(sorted({str(b.extra_info.get("timer")) for b in timed}))
    for check in checks:
        counts: dict[str, int] = {}
        rows = []
        for name, source, v, failure in check.results:
            counts[v.verdict] = counts.get(v.verdict, 0) + 1
            if failure:
                regressed.append(f"  {name} vs {source}: {failure}")
            elif v.verdict != "same":
                ratio = f" {v.ratio:.3f}x" if v.ratio is not None else ""
                rows.append(f"  {name} vs {source}: {v.verdict}{ratio}" + (f" ({v.note})" if v.note else ""))
        tally = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"
        lines += [f"{check.field} vs the baseline, threshold {pct(check.threshold / 100.0)}, Mann-Whitney "
                  f"p < {ALPHA} (as `spark-bench compare`), timer {timers}: {tally}", *rows]
    if missing:
        lines.append(f"{len(missing)} timed case(s) not in the baseline, measured but not compared: "
                     + ", ".join(missing))
    if regressed:
        failures += [f"Performance has regressed ({len(regressed)} case(s)), FAILED:", *regressed]
    return lines, failures
