"""The tuned table from a tune's records: per (kernel, key), the config with the best geometric-mean time against the
declared default, kept only when faster beyond the noise (spark_bench/tune/session.py times the rounds).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import numpy as np

from spark_bench import results
from spark_bench.stats import MIN_CI_SAMPLES, Z95, median_ci
from spark_bench.sweep import Case
from spark_bench.tune.space import config_id, key_id

# A candidate replaces the declared default only when faster by more than MIN_GAIN and than the noise: the two
# timings' relative CIs summed, each at the level the number of candidates compared asks (Bonferroni: 95% for one),
# plus half the default's drift between its two timings (median over the key's cases). A win inside the noise would
# make the table churn from tune to tune.
MIN_GAIN = 0.01
ALPHA = 0.05  # the CIs' level is 1 - ALPHA
UNRANKABLE = ("throttled", "recompiled-in-timing")  # labels of a timing that says little about the config


def _rel_ci(timing: dict[str, Any], z: float = Z95) -> float:
    """A timing's relative CI half-width at the normal quantile z (1.96: 95%): from its raw samples (the order
    statistics of the median, as stats.median_ci) when it stores 6 or more, else its stored 95% one scaled by
    z / 1.96; inf when it has none (a single sample): its noise is unknown, so no candidate can be shown to beat
    the default with it."""
    samples = timing.get("samples")
    if isinstance(samples, list) and len(samples) >= MIN_CI_SAMPLES and all(map(results.is_number, samples)):
        s = np.sort(np.asarray(samples, dtype=np.float64))
        med = float(np.median(s))
        lo, hi = median_ci(s, z)
        return (hi - lo) / (2.0 * med) if med > 0 else math.inf
    value = timing.get("rel_ci")
    return float(value) * z / Z95 if results.is_number(value) else math.inf


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _runs_candidates(item: dict[str, Any]) -> bool:
    return any(c["status"] == "ok" for c in item["candidates"])


def _rankable(rec: dict[str, Any] | None) -> bool:
    """A timed ok record whose labels do not discount it (UNRANKABLE)."""
    return rec is not None and rec["status"] == "ok" and not set(rec.get("labels") or []) & set(UNRANKABLE)


def select(plan: dict[str, Any], records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The tuned entries: per (kernel, key), the config with the best geometric-mean time over the cases of that key
    that timed both it and the default. A config that failed its check (or crashed) in any case, or was pruned
    offline in any case (it would not compile, launch or fit there), is never chosen for that kernel, nor one the
    budget left untimed in a case of the key (a mismatch there would go unseen). A timing labelled throttled or
    recompiled-in-timing is not ranked (a default one takes its case out)."""
    by_id = {r["case_id"]: r for r in records}
    rejected: set[tuple[str, str]] = {(i["kernel"], c["id"]) for i in plan["items"] for c in i["candidates"]
                                      if c["status"] != "ok"}
    buckets: dict[tuple[str, str], dict[str, Any]] = {}
    for item in plan["items"]:
        base = Case(**item["case"])
        kernel = item["kernel"]
        default_rec = by_id.get(base.case_id)
        if default_rec is None or default_rec["status"] != "ok":
            continue
        timed, unranked, untimed = {}, 0, set()
        for cand in item["candidates"]:
            if cand["status"] != "ok":
                continue
            rec = by_id.get(dataclasses.replace(base, configs={kernel: cand["config"]}).case_id)
            if rec is None:
                untimed.add(cand["id"])  # the budget ran out first: unseen here, so not chosen for this key
                continue
            if rec["status"] != "ok":
                rejected.add((kernel, cand["id"]))
            elif _rankable(rec):
                timed[cand["id"]] = (cand["config"], rec)
            else:
                unranked += 1
        again = by_id.get(dataclasses.replace(base, repeat=1).case_id)
        ran = (default_rec.get("config") or {}).get(kernel)  # what round 0 launched, on the device it timed on
        for pick in item["keys"]:  # the declared config at this key, as the plan's capture picked it
            declared = _declared_ran(pick["config"], ran)
            if declared is None:
                continue  # the plan's capture target picked another config than the device ran: unknown default
            bucket = buckets.setdefault((kernel, key_id(pick["key"])), {"key": pick["key"], "cases": [],
                                                                        "unranked": 0, "untimed": set()})
            bucket["untimed"] |= untimed
            if not _rankable(default_rec):  # nothing to rank this case's candidates against
                bucket["unranked"] += 1 + len(timed) + unranked
                continue
            bucket["unranked"] += unranked
            bucket["cases"].append({"default": (declared, default_rec), "again": again if _rankable(again) else None,
                                    "candidates": timed})
    entries = []
    for (kernel, _), bucket in sorted(buckets.items()):
        entry = _best(kernel, bucket, rejected)
        if entry is not None:
            entries.append((kernel, entry))
    return entries


def _declared_ran(planned: dict[str, Any], ran: Any) -> dict[str, Any] | None:
    """The default config a key ran with: the one the default case recorded when it launched the kernel with one
    config (the plan's capture may have picked another: it captures for the pruning target, e.g. sm_90a rules with
    `--target none` on an A100); the planned one when the record lists it among several; else None."""
    if isinstance(ran, dict):
        return ran
    if ran is None or planned in ran:
        return planned
    return None


def _reference(case: dict[str, Any]) -> tuple[float, float | None, list[dict[str, Any]]]:
    """A case's default time (the geometric mean of its two timings when the closing round timed it again), the
    drift between them (again / first - 1; None: not timed again) and those timings."""
    first = case["default"][1]["timing"]
    again = (case["again"] or {}).get("timing")
    if not again or not again["median"] > 0 or not first["median"] > 0:
        return first["median"], None, [first]
    return math.sqrt(first["median"] * again["median"]), again["median"] / first["median"] - 1.0, [first, again]


def _z(compared: int) -> float:
    """The normal quantile of each of `compared` candidates' tests against the default at once (Bonferroni: each at
    ALPHA / compared; 1.96 for one)."""
    return statistics.NormalDist().inv_cdf(1 - ALPHA / (2 * max(1, compared)))


def _best(kernel: str, bucket: dict[str, Any], rejected: set[tuple[str, str]]) -> dict[str, Any] | None:
    times: dict[str, list[float]] = {}
    defaults: dict[str, list[float]] = {}
    spreads: dict[str, list[tuple[Any, list[Any], float]]] = {}  # per case: (its timing, the default's, drift)
    configs: dict[str, Any] = {}
    labels: set[str] = set()
    timers: set[str] = set()  # one, as session.pinned times every candidate with its default's timer
    drifts: list[float] = []
    for case in bucket["cases"]:
        reference, drift, default_timings = _reference(case)
        if not reference > 0:
            continue  # a graph-timed call no slower than the flush it follows: 0 us, nothing to rank it by
        if drift is not None:
            drifts.append(drift)
        default_config = case["default"][0]
        for name, (config, rec) in {"default": case["default"], **case["candidates"]}.items():
            if (kernel, name) in rejected or name in bucket["untimed"] or \
                    (name != "default" and config == default_config):
                continue
            if name != "default" and not rec["timing"]["median"] > 0:
                continue
            times.setdefault(name, []).append(reference if name == "default" else rec["timing"]["median"])
            defaults.setdefault(name, []).append(reference)
            spreads.setdefault(name, []).append((None if name == "default" else rec["timing"], default_timings,
                                                 abs(drift or 0.0)))
            configs[name] = config
            labels.update(rec.get("labels") or [])
            timers.add(str(rec["timing"].get("timer")))
    if "default" not in times:
        return None
    ratio = {n: _geomean([t / d for t, d in zip(times[n], defaults[n], strict=True)]) for n in times}
    ranked = sorted(times, key=lambda n: ratio[n])
    best, runner = ranked[0], ranked[1] if len(ranked) > 1 else None
    z = _z(len(times) - 1)
    noise = max(MIN_GAIN, statistics.median(
        (_rel_ci(timing, z) if timing else 0.0) + max(_rel_ci(d, z) for d in default) + drift / 2
        for timing, default, drift in spreads[best]))
    within_noise = None
    if best != "default" and 1.0 - ratio[best] <= noise:  # not faster beyond the noise: the default stays
        within_noise = {"id": config_id(configs[best]), "speedup": round(1.0 / ratio[best], 4),
                        "noise": round(noise, 4) if math.isfinite(noise) else None}
        best, runner = "default", best

    def timed_entry(name: str) -> dict[str, Any]:
        return {"config": configs[name], "time_us": round(_geomean(times[name]), 4)}

    default_us = _geomean(defaults[best])
    return {"key": bucket["key"], **timed_entry(best), "id": config_id(configs[best]),
            "default": {"config": configs["default"], "time_us": round(default_us, 4)},
            "runner_up": timed_entry(runner) if runner else None,
            "speedup": round(default_us / _geomean(times[best]), 4), "cases": len(times[best]),
            "candidates_timed": len(times) - 1, "noise": round(noise, 4) if math.isfinite(noise) else None,
            "timers": sorted(timers), "within_noise": within_noise, "labels": sorted(labels),
            "drift": {"max": round(max(drifts, key=abs), 4), "cases": len(drifts)} if drifts else None,
            "unranked": bucket["unranked"], "untimed": len(bucket["untimed"]), "measured": results.now()}
