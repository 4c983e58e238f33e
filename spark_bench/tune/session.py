"""One `spark-bench tune`: a run directory whose cases are the plan's configs, timed in rounds, then the tuned table.

Round 0 times every base case with its declared configs; round r times the r-th best-ranked surviving candidate of
each (case, kernel) with that kernel's config forced (spark_bench/tune/space.py); a closing round times the base cases
again (`repeat` 1), so the defaults bracket their candidates in time and a clock or thermal drift between the
rounds is measured, not taken for a speedup. Every candidate and re-timing is timed with its default's timer (`pinned`).
Without a budget the defaults run first, then the other rounds as one pass, in that order (one set of workers, a
point's cases back to back; its inputs and reference are built once). Every case goes
through `run`'s own path (spark_bench/runner.py: crash-isolated workers, the reference check before timing, flushed
timing) and is journaled in results.jsonl, so a killed tune resumes (`tune --resume DIR`) without re-timing anything.
`--budget S` bounds the whole search (planning included, and the earlier invocations of a resumed tune): a round is
cut to the cases the remaining time is expected to cover, from the mean duration of the cases timed so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from spark_bench import results
from spark_bench.results_schema import (
    FAILED,
    NULLABLE_NUMBER,
    NULLABLE_OBJECT,
    NULLABLE_STR,
    PARAM_VALUE,
    schema_problem,
)
from spark_bench.sweep import Case, SweepSpec, UsageError
from spark_bench.timing import TimingConfig
from spark_bench.tune import plan as planning
from spark_bench.tune.search import _runs_candidates, select

PRUNE_DEADLINE_S = 900.0  # offline compiles of a tune without --budget
# run.json's `tune` as a resumed tune reads it (schema_problem: path -> JSON types); PLAN_REQUIRED: the keys each
# plan item and candidate must hold
TUNE_NESTED: dict[str, tuple[type, ...]] = {
    "plan": (dict,), "plan.items": (list,), "plan.items[]": (dict,), "plan.items[].case": (dict,),
    "plan.items[].case.params": (dict,), "plan.items[].case.params.*": PARAM_VALUE,
    **{f"plan.items[].case.{k}": (str,) for k in ("op", "backend", "dtype", "device")},
    "plan.items[].case.seed": (int,), "plan.items[].case.configs": NULLABLE_OBJECT,
    "plan.items[].case.configs.*": (dict,), "plan.items[].case.weights": NULLABLE_OBJECT,
    "plan.items[].case.repeat": (int,), "plan.items[].kernel": (str,), "plan.items[].keys": (list,),
    "plan.items[].keys[]": (dict,), "plan.items[].keys[].key": (dict,), "plan.items[].keys[].config": (dict,),
    "plan.items[].candidates": (list,), "plan.items[].candidates[]": (dict,),
    "plan.items[].candidates[].config": (dict,), "plan.items[].candidates[].config.*": (int,),
    "plan.items[].candidates[].id": (str,), "plan.items[].candidates[].status": (str,),
    "plan.items[].candidates[].reason": NULLABLE_STR, "plan.untunable": (list,), "plan.capture_errors": (list,),
    "out": (str,), "budget_s": NULLABLE_NUMBER, "spent_s": NULLABLE_NUMBER, "planning_s": NULLABLE_NUMBER,
}
PLAN_REQUIRED = {"item": ("case", "kernel", "keys", "candidates"), "candidate": ("config", "id", "status"),
                 "key": ("key", "config"), "case": ("op", "backend", "params", "dtype", "device", "seed")}


def plan_problem(tune: dict[str, Any]) -> str | None:
    """Why run.json's `tune` (its plan above all) is not what `tune` wrote, as one line; else None."""
    problem = schema_problem(tune, TUNE_NESTED)
    if problem or not isinstance(tune.get("plan"), dict) or "items" not in tune["plan"] or "out" not in tune:
        return problem or "plan lacks its \"items\" (or the tune its \"plan\" object or \"out\")"
    for i, item in enumerate(tune["plan"].get("items", [])):
        parts = {"item": [item], "case": [item.get("case", {})], "key": item.get("keys", []),
                 "candidate": item.get("candidates", [])}
        for what, objs in parts.items():
            for obj in objs:
                missing = [k for k in PLAN_REQUIRED[what] if k not in obj]
                if missing:
                    return f"plan item {i}: a {what} without {missing[0]!r}"
        try:
            Case(**item["case"])
        except TypeError as exc:
            return f"plan item {i}: its case is not a sweep case ({exc})"
    return None


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
        fp = fingerprint(spec.device, weights=spec.weights)
        out = out if out is not None else default_path(fp["device"], results_root)
        open_out(out, fp["device"])  # a table that could not be written must not cost the tune first
        if run_dir is not None:  # nor a --run-dir: both refused before the cases' warnings
            results.RunStore(run_dir, option="--run-dir").check_new()
        base = [c for c in Session._cases(spec) if not c.skip and (spec.backends or fnmatch(c.backend, "triton*"))]
        if not base:
            raise UsageError("nothing to tune: the selection has no runnable Triton backend case")
        run_id = "tune-" + results.new_run_id(spec.device) if run_dir is None else Path(run_dir).name
        store = results.RunStore(run_dir if run_dir is not None else results_root / run_id, option="--run-dir")
        created = not store.path.exists()
        _claim(store)  # an unusable --run-dir is one line before the planning's compiles, not after them
        target, note = planning.prune_target(spec.device, target, fp["device"])
        say(f"tune: {note}")
        # a compile stuck in Triton's passes must not eat the budget: what has not compiled by then is timed unjudged
        deadline = max(30.0, budget_s / 3) if budget_s else PRUNE_DEADLINE_S
        with _planning_interrupt(store, created, say):
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
        from spark_bench.stored_run import check_same_device, check_weights_unchanged, stored_sweep

        spec, cfg, timeout_s = stored_sweep(store, run)
        check_same_device(path, run, spec.device, "tuned")
        check_weights_unchanged(path, run, spec)
        tune = run["tune"]
        if out is not None:
            tune["out"] = str(out)
        problem = plan_problem(tune)
        if problem:
            raise results.ResultsError(f"{store.run_file}: the tune's {problem}; this tune cannot be resumed")
        open_out(tune["out"], run["fingerprint"]["device"])
        store.repair_tail()
        store.read_results()  # a damaged journal is one line now, before the tune says anything
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
        table path): 1 when a default config failed its check or crashed, or the budget ran out before any entry
        could be written, else 0."""
        from spark_bench.console import SweepProgress, console
        from spark_bench.runner import Runner, pending
        from spark_bench.session import estimates, interrupt_says_what_is_kept

        start, spent0 = time.monotonic(), self.spent_so_far()
        budget = self.tune.get("budget_s")
        untimed = untimed_defaults = 0
        walls: list[tuple[float, int]] = []  # (seconds, cases) of each round timed by this invocation
        rounds = self.rounds()
        if budget is None:  # the defaults, then one pass over the other rounds (one set of workers serves them all)
            rounds = [rounds[0], [c for r in rounds[1:] for c in r]] if len(rounds) > 1 else rounds
        timed_defaults: list[dict[str, Any]] | None = None  # the journal once round 0 is done: the defaults' timers
        for number, cases in enumerate(rounds):
            if number:  # timed as their default was: a speedup is never the difference of two timers
                timed_defaults = self.store.read_results() if timed_defaults is None else timed_defaults
                cases = pinned(cases, timed_defaults)
            todo = pending(self.store, cases)
            if budget is not None and todo:
                left = budget - spent0 - (time.monotonic() - start)
                # a candidate round leaves time for the closing one: without it, drift is unknown
                reserve = len(pending(self.store, rounds[-1])) if 0 < number < len(rounds) - 1 else 0
                fit = max(0, self._fit(len(todo) + reserve, left, walls) - reserve)
                untimed += len(todo) - fit
                untimed_defaults += sum(not c.configs for c in todo[fit:])  # round 0 and the closing re-timing
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
        spent = round(spent0 + time.monotonic() - start, 3)
        if untimed:
            say(f"tune: the budget ({budget:g} s; {spent:.0f} s spent, planning included) left {untimed} case(s) "
                f"untimed ({untimed_defaults} timings of the declared configs, {untimed - untimed_defaults} "
                "candidates); --resume with a larger --budget to time them")
        records = self.store.read_results()
        run = self.store.read_run()
        self.tune["spent_s"] = spent
        run.update(finished=results.now(), summary=results.summarize_statuses(records), tune=self.tune)
        self.store.write_run(run)
        entries = select(self.tune["plan"], records)
        path = self._write(entries, run) if entries else None
        base_ids = {Case(**i["case"]).case_id for i in self.tune["plan"]["items"]}
        failed = [r for r in records if r["case_id"] in base_ids and r["status"] in FAILED]
        return (1 if failed or (untimed and path is None) else 0), path  # the budget left no entry: not done

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


def pinned(cases: list[Case], records: list[dict[str, Any]]) -> list[Case]:
    """Candidates (and the defaults' closing re-timing) with their default's timer kept (timing.kept_timer: events,
    or the graph at its calls per replay). Under `--timer auto` each case picks its timer from a probe at 50 us, so
    a default just above it (events, launch gaps included) and a candidate just below (graph, without them) would
    differ by the timers, not the configs."""
    from spark_bench.timing import kept_timer

    kept = {r["case_id"]: kept_timer(r.get("timing")) for r in records}
    return [dataclasses.replace(c, timer=kept.get(dataclasses.replace(c, configs=None, repeat=0).case_id) or c.timer)
            for c in cases]


@contextlib.contextmanager
def _planning_interrupt(store: results.RunStore, created: bool, say):
    """Ctrl-C or SIGTERM while planning (offline compiles, minutes at presets): nothing was timed and run.json is not
    written yet, so there is nothing to resume. One line says so, the directory this tune created is removed (it holds
    only its lock), and the process exits 130 / 143."""
    from spark_bench.session import Terminated, terminate_as_interrupt

    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as exc:
        store.unlock()
        removed = False
        if created:
            with contextlib.suppress(OSError):
                (store.path / results.LOCK_FILE).unlink(missing_ok=True)
                store.path.rmdir()
                removed = True
        say(f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'} while planning: nothing was timed, "
            f"so there is nothing to resume{f' ({store.path} removed)' if removed else ''}; run the command again")
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None


def _claim(store: results.RunStore) -> None:
    """Lock a new tune's directory: ResultsError (one line) when it cannot be created or already holds results."""
    store.lock()
    if store.results_file.exists() and store.results_file.stat().st_size > 0:
        raise results.ResultsError(f"{store.path} already holds results; use `spark-bench tune --resume "
                                   f"{results.shell_path(store.path)}` or another --run-dir")
