"""One `spark-bench tune`: a run directory whose cases are the plan's configs, timed in rounds, then the tuned table.

Round 0 times every base case with its declared configs; round r times the r-th best-ranked surviving candidate of
each (case, kernel) with that kernel's config forced (spark_bench/tune/space.py); a closing round times the base cases
again (`repeat` 1), so the defaults bracket their candidates in time and a clock or thermal drift between the
rounds is measured, not taken for a speedup. Without a budget the rounds run as one pass, in that order (one set
of workers, a point's cases back to back; its inputs and reference are built once). Every case goes
through `run`'s own path (spark_bench/runner.py: crash-isolated workers, the reference check before timing, flushed
timing) and is journaled in results.jsonl, so a killed tune resumes (`tune --resume DIR`) without re-timing anything.
`--budget S` bounds the whole search (planning included, and the earlier invocations of a resumed tune): a round is
cut to the cases the remaining time is expected to cover, from the mean duration of the cases timed so far.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np

from spark_bench import results
from spark_bench.stats import MIN_CI_SAMPLES, Z95, median_ci
from spark_bench.sweep import Case, SweepSpec, UsageError
from spark_bench.timing import TimingConfig
from spark_bench.tune import plan as planning
from spark_bench.tune.space import config_id, key_id

PRUNE_DEADLINE_S = 900.0  # offline compiles of a tune without --budget
# A candidate replaces the declared default only when faster by more than MIN_GAIN and than the noise: the two
# timings' relative CIs summed, each at the level the number of candidates compared asks (Bonferroni: 95% for one),
# plus half the default's drift between its two timings (median over the key's cases). A win inside the noise would
# make the table churn from tune to tune.
MIN_GAIN = 0.01
ALPHA = 0.05  # the CIs' level is 1 - ALPHA
UNRANKABLE = ("throttled", "recompiled-in-timing")  # labels of a timing that says little about the config


@dataclasses.dataclass
class TuneSession:
    store: results.RunStore
    spec: SweepSpec
    cfg: TimingConfig
    timeout_s: float
    tune: dict[str, Any]  # {"plan", "budget_s", "spent_s", "out", "target", "target_note"}

    @classmethod
    def create(cls, spec: SweepSpec, cfg: TimingConfig, *, run_dir: Path | None, out: Path | None,
               budget_s: float | None, target: str | None, jobs: int | None, timeout: float | None,
               command: list[str], results_root: Path, say) -> TuneSession:
        from spark_bench.fingerprint import fingerprint
        from spark_bench.runner import default_timeout
        from spark_bench.session import Session
        from spark_bench.tune.store import default_path, open_out

        t0 = time.monotonic()
        base = [c for c in Session._cases(spec) if not c.skip and (spec.backends or fnmatch(c.backend, "triton*"))]
        if not base:
            raise UsageError("nothing to tune: the selection has no runnable Triton backend case")
        fp = fingerprint(spec.device, weights=spec.weights)
        out = out if out is not None else default_path(fp["device"], results_root)
        open_out(out, fp["device"])  # a table that could not be written must not cost the tune first
        run_id = "tune-" + results.new_run_id(spec.device) if run_dir is None else Path(run_dir).name
        store = results.RunStore(run_dir if run_dir is not None else results_root / run_id)
        _claim(store)  # an unusable --run-dir is one line before the planning's compiles, not after them
        target, note = planning.prune_target(spec.device, target, fp["device"])
        say(f"tune: {note}")
        # a compile stuck in Triton's passes must not eat the budget: what has not compiled by then is timed unjudged
        deadline = max(30.0, budget_s / 3) if budget_s else PRUNE_DEADLINE_S
        the_plan = planning.build(base, target, jobs=jobs, say=say, deadline_s=deadline)
        for line in planning.summary_lines(the_plan):
            say(line)
        planning_s = round(time.monotonic() - t0, 3)
        tune = {"plan": the_plan, "budget_s": budget_s, "spent_s": planning_s, "planning_s": planning_s,
                "out": str(out), "target": target, "target_note": note}
        timeout_s = timeout if timeout is not None else default_timeout(spec.device)
        store.create({"run_id": run_id, "kind": "tune", "created": results.now(), "finished": None,
                      "fingerprint": fp, "command": list(command),
                      "spec": {**spec.to_dict(), "timing": cfg.to_dict(), "timeout_s": timeout_s},
                      "roofline": None, "summary": None, "tune": tune})
        return cls(store, spec, cfg, timeout_s, tune)

    @classmethod
    def resume(cls, path: Path, out: Path | None = None) -> TuneSession:
        """The tune in `path`, writing its table to `out` (default: the --out it was started with), checked first."""
        from spark_bench.tune.store import open_out

        store = results.RunStore(path)
        run = store.read_run()
        if run.get("kind") != "tune" or not isinstance(run.get("tune"), dict):
            raise results.ResultsError(f"{path} is a run, not a tune directory (resume it with `spark-bench run "
                                       "--resume`)")
        store.lock()
        run = store.read_run()
        from spark_bench.session import check_same_device, check_weights_unchanged, stored_sweep

        spec, cfg, timeout_s = stored_sweep(store, run)
        check_same_device(path, run, spec.device, "tuned")
        check_weights_unchanged(path, run, spec)
        tune = run["tune"]
        if out is not None:
            tune["out"] = str(out)
        open_out(tune["out"], run["fingerprint"]["device"])
        store.repair_tail()
        return cls(store, spec, cfg, timeout_s, tune)

    def rounds(self) -> list[list[Case]]:
        """Round 0: the base cases; round r: the r-th surviving candidate of every (case, kernel); the last: the
        base cases that have candidates, again (`repeat` 1: drift between the rounds)."""
        items = self.tune["plan"]["items"]
        base = list({c.case_id: c for c in (Case(**i["case"]) for i in items)}.values())
        out = [base]
        depth = max((len([c for c in i["candidates"] if c["status"] == "ok"]) for i in items), default=0)
        for r in range(depth):
            cases = []
            for item in items:
                ok = [c for c in item["candidates"] if c["status"] == "ok"]
                if r < len(ok):
                    cases.append(dataclasses.replace(Case(**item["case"]), configs={item["kernel"]: ok[r]["config"]}))
            out.append(cases)
        if depth:
            out.append(list({c.case_id: dataclasses.replace(c, repeat=1)
                             for c in (Case(**i["case"]) for i in items if _runs_candidates(i))}.values()))
        return out

    def execute(self, executor: Any = None, say=print) -> tuple[int, Path | None]:
        """Time what the journal lacks, round by round within the budget; write the table. Returns (exit code,
        table path): 1 when a default config failed its check or crashed, else 0."""
        from spark_bench.console import SweepProgress, console
        from spark_bench.runner import Runner, pending
        from spark_bench.session import estimates, interrupt_says_what_is_kept

        start, spent0 = time.monotonic(), self.spent_so_far()
        budget = self.tune.get("budget_s")
        untimed = 0
        walls: list[tuple[float, int]] = []  # (seconds, cases) of each round timed by this invocation
        rounds = self.rounds()
        if budget is None:  # one pass over every round: the workers (and their cached inputs) serve them all
            rounds = [[c for r in rounds for c in r]]
        for number, cases in enumerate(rounds):
            todo = pending(self.store, cases)
            if budget is not None and todo:
                left = budget - spent0 - (time.monotonic() - start)
                # a candidate round leaves time for the closing one: without it, drift is unknown
                reserve = len(pending(self.store, rounds[-1])) if 0 < number < len(rounds) - 1 else 0
                fit = max(0, self._fit(len(todo) + reserve, left, walls) - reserve)
                untimed += len(todo) - fit
                todo = todo[:fit]
            if not todo:
                continue
            closing = number == len(rounds) - 1 and number > 1
            say(f"tune: timing {len(todo)} case(s)" + ("" if budget is None else f" (round {number}"
                + (": the declared configs)" if number == 0 else ": the declared configs again)" if closing
                   else ")")))
            round_start = time.monotonic()
            total = sum(len(r) for r in rounds)
            with interrupt_says_what_is_kept(self.store, total, "spark-bench tune --resume"), \
                    SweepProgress(len(todo), console(), expected=estimates(todo)) as progress:
                Runner(self.store, self.cfg, timeout_s=self.timeout_s, device=self.spec.device,
                       on_phase=progress.phase, on_result=progress.result, executor=executor).run(todo)
            walls.append((time.monotonic() - round_start, len(todo)))
        if untimed:
            say(f"tune: the budget ({budget:g} s) left {untimed} candidate case(s) untimed; --resume with a larger "
                "--budget to time them")
        records = self.store.read_results()
        run = self.store.read_run()
        self.tune["spent_s"] = round(spent0 + time.monotonic() - start, 3)
        run.update(finished=results.now(), summary=results.summarize_statuses(records), tune=self.tune)
        self.store.write_run(run)
        entries = select(self.tune["plan"], records)
        path = self._write(entries, run) if entries else None
        base_ids = {Case(**i["case"]).case_id for i in self.tune["plan"]["items"]}
        failed = [r for r in records if r["case_id"] in base_ids and r["status"] in results.FAILED]
        return (1 if failed else 0), path

    def spent_so_far(self) -> float:
        """Seconds of the budget spent before this invocation: what the last one to end stored, or, when a killed
        one timed cases after that (its spent_s is written only when it ends), planning plus the journal's case
        durations (worker start-ups aside: a lower bound)."""
        journal = sum(float(r.get("duration_s") or 0.0) for r in self.store.read_results())
        return max(float(self.tune.get("spent_s") or 0.0), float(self.tune.get("planning_s") or 0.0) + journal)

    def _fit(self, n: int, left: float, walls: list[tuple[float, int]] = ()) -> int:
        """How many of n cases the `left` seconds cover: at the wall time per case of this invocation's rounds
        (worker start-up included), else at the mean recorded case duration (a resumed tune's first round)."""
        if left <= 0:
            return 0
        if walls:
            mean = sum(w for w, _ in walls) / max(1, sum(k for _, k in walls))
        else:
            done = [r.get("duration_s") or 0.0 for r in self.store.read_results()]
            mean = sum(done) / len(done) if done else 0.0
        return n if mean <= 0 else max(0, min(n, int(left // mean)))

    def _write(self, entries: list[tuple[str, dict[str, Any]]], run: dict[str, Any]) -> Path:
        from spark_bench.tune.store import TunedStore, locked, open_out

        out = Path(self.tune["out"])
        fp = run["fingerprint"]
        fresh = TunedStore.new(fp["device"], {k: fp.get("versions", {}).get(k) for k in ("torch", "triton")})
        for kernel, entry in entries:
            fresh.put(kernel, {**entry, "run": str(self.store.path)})
        with locked(out):  # another tune of this device may be writing it now
            table = open_out(out, fp["device"])  # again: it may have changed while the tune ran
            if table is None:
                table = fresh
            else:
                table.merge(fresh)
            return table.save(out, results.now())


def _claim(store: results.RunStore) -> None:
    """Lock a new tune's directory: ResultsError (one line) when it cannot be created or already holds results."""
    store.lock()
    if store.results_file.exists() and store.results_file.stat().st_size > 0:
        raise results.ResultsError(f"{store.path} already holds results; use `spark-bench tune --resume "
                                   f"{store.path}` or another --run-dir")


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
            "candidates_timed": len(times), "within_noise": within_noise, "labels": sorted(labels),
            "drift": {"max": round(max(drifts, key=abs), 4), "cases": len(drifts)} if drifts else None,
            "unranked": bucket["unranked"], "untimed": len(bucket["untimed"]), "measured": results.now()}
