"""One `spark-bench run`: the run directory, its spec, the sweep, the closing summary and report.

The spec and timing config are stored in run.json before the first case runs; `--resume DIR` rebuilds the same case
list from them and runs only what the journal lacks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import signal
import threading
from pathlib import Path
from typing import Any

from spark_bench import results, triton_env
from spark_bench.console import console, failures_table, results_table, summary_line
from spark_bench.executors.worker_process import WorkersCannotStart
from spark_bench.results_schema import FAILED
from spark_bench.runner import Runner, default_timeout
from spark_bench.stored_run import check_same_device, check_weights_unchanged, kept_timers, stored_sweep
from spark_bench.sweep import Case, SweepSpec, UsageError, build_cases
from spark_bench.telemetry import RunTelemetry, percent_of_peak
from spark_bench.timing import TimingConfig


def estimates(todo: list[Case], sources: collections.Counter[str] | None = None) -> dict[str, float]:
    """Each case's estimated seconds for the progress's ETA (executors/plan.py, as `--dry-run`; `sources` counts their
    origins); {} on any error: an ETA is never worth failing a sweep for."""
    from spark_bench.executors.plan import case_estimates
    from spark_bench.options import RESULTS_ROOT

    try:
        return case_estimates(todo, RESULTS_ROOT, sources)
    except Exception:  # noqa: BLE001 - a broken plugin cost model or an unreadable results tree
        return {}


def estimate_note(expected: dict[str, float], sources: collections.Counter[str]) -> str:
    """The estimate in the run's first line: ' (estimate ~1m 17s of case time, ...)', the sum `--dry-run` prints,
    with how many cases it guessed at the flat default; a different note when it knows no case at all."""
    from spark_bench.executors.plan import DEFAULT_CASE_S, fmt_duration

    guessed, known = sources["default"], sum(n for k, n in sources.items() if k not in ("default", "skipped"))
    if not known:
        return " (no stored durations for these cases to estimate from: the ETA learns as they run)" if guessed else ""
    flat = f", {guessed} of them guessed at {DEFAULT_CASE_S:g}s each" if guessed else ""
    return f" (estimate ~{fmt_duration(sum(expected.values()))} of case time{flat}; --dry-run has the breakdown)"


class Terminated(KeyboardInterrupt):
    """SIGTERM during a sweep, raised as an interrupt: the run stops as on Ctrl-C and says so; exit code 143."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises Terminated while the block runs (main thread only: elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kept(store: results.RunStore) -> int | str:
    try:
        return len(store.read_results())
    except results.ResultsError:
        return "?"


@contextlib.contextmanager
def interrupt_says_what_is_kept(store: results.RunStore, total: int, resume: str):
    """Ctrl-C or SIGTERM (a CI timeout, `kill`) during the block: the sweep stops (workers retired, the journal
    kept), one line says what is kept and `{resume} DIR` to go on, and the process exits 130 / 143."""
    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as exc:
        console(stderr=True).print(
            f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'}: {kept(store)} of {total} cases are "
            f"kept in {store.path} (each was written when it ended); go on with "
            f"`{resume} {results.shell_path(store.path)}`",
            markup=False, soft_wrap=True)
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None


class PhaseTimeline:
    """Marks each case's phases (as the runner hears of them) on the run's power/clock timeline, when there is one."""

    def __init__(self, tele: RunTelemetry | None, one_device: bool = True) -> None:
        self.tele, self.current = tele, None
        self.one_device = one_device  # the timeline's GPU runs every case: its clocks are the timed case's

    def wrap(self, on_phase):
        def marked(case: Case, phase: str) -> None:
            if self.tele is not None:
                self._close()
                self.current = (case.case_id, phase, self.tele.now())
                if self.one_device:
                    self.tele.watch(case.case_id, phase)
            on_phase(case, phase)

        return marked

    def annotate(self, record: dict[str, Any]) -> None:
        """`timing.clocks`: what the timeline saw of the clocks while the case was timed (nvbench discards throttled
        samples; here the case keeps them and says so, with the label `throttled-timing`)."""
        clocks = self.tele.timing_clocks(record["case_id"]) if self.tele is not None else None
        if clocks is not None and record.get("timing"):
            record["timing"]["clocks"] = clocks
            if clocks["throttled_samples"]:
                record.setdefault("labels", []).append("throttled-timing")

    def _close(self) -> None:
        if self.tele is not None and self.current is not None:
            case_id, phase, start = self.current
            self.tele.mark(case_id, phase, start, self.tele.now())
            self.current = None

    def __enter__(self) -> PhaseTimeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()
        if self.tele is not None:
            self.tele.stop()


def shapes_note(spec: SweepSpec, cfg: TimingConfig | None = None) -> str:
    """What the header says of the shapes and the timing: a preset's model shapes are not quick ones, whatever
    --quick says; quick timing only when the timing is (`run` on a CPU takes quick shapes and quick timing without
    --quick, --max-time etc. change the timing); and that Triton runs interpreted on a CPU."""
    interpreted = "; Triton interpreted" if spec.device.startswith("cpu") else ""
    quick_timing = cfg == TimingConfig.quick() if cfg is not None else spec.quick
    if spec.preset is not None:
        return f"  (preset {spec.preset} shapes" + (", quick timing" if quick_timing else "") + f"{interpreted})"
    if spec.quick:
        return "  (quick shapes" + (" and timing" if quick_timing else "") + f"{interpreted})"
    return f"  ({interpreted[2:]})" if interpreted else ""


def weight_labels(cases: list[Case], spec: SweepSpec) -> dict[str, str]:
    """{case_id: its weights label} (spark_bench/weights/label.py) when the sweep has a weight source, else {}."""
    if not spec.weights:
        return {}
    from spark_bench.registry import registry
    from spark_bench.weights.label import labels_of

    return labels_of(cases, registry())


def add_weights(record: dict[str, Any], labels: dict[str, str]) -> None:
    """`weights`: the compact label of what the case ran on (absent for synthetic weights and without a source)."""
    label = labels.get(record.get("case_id"))
    if label:
        record["weights"] = label


def add_roofline(record: dict[str, Any], roofline: dict[str, Any] | None) -> None:
    """% of the measured and datasheet peaks, beside the achieved GB/s and TFLOP/s."""
    if record.get("status") == "ok" and roofline:
        record["roofline"] = percent_of_peak(record.get("gbps"), record.get("tflops"), record.get("dtype"), roofline)


@dataclasses.dataclass
class Session:
    store: results.RunStore
    spec: SweepSpec
    cfg: TimingConfig
    timeout_s: float
    cases: list[Case]

    @staticmethod
    def _cases(spec: SweepSpec) -> list[Case]:
        from spark_bench.registry import registry

        triton_env.configure(spec.device)  # before plugins import triton: probes must see the interpreter
        reg = registry()
        for err in reg.errors:  # `list` shows them too; a run must not hide a plugin that is missing
            console(stderr=True).print(f"warning: plugin {err.source} failed to load: {err.message}", markup=False)
        notes: list[str] = []
        cases = build_cases(reg, spec, notes)
        if not cases:  # one line: what the notes say is why
            raise UsageError("the selection has no cases (no backend or parameter point matches)"
                             + "".join(f"; {note}" for note in notes))
        for note in notes:
            console(stderr=True).print(f"note: {note}", markup=False)
        from spark_bench.memory import guard

        cases, warning = guard(reg, cases)  # model-size points on a CPU: refused with the figure, not swapped
        if warning:
            console(stderr=True).print(f"warning: {warning}", markup=False)
        return cases

    @classmethod
    def create(cls, spec: SweepSpec, cfg: TimingConfig, out: Path | None, timeout: float | None,
               command: list[str], results_root: Path, own_pids: set[int] | frozenset[int] = frozenset(),
               roofline: dict[str, Any] | None = None) -> Session:
        """A new run: its cases, directory and run.json, after the GPU's preflight (`own_pids`: the run's
        prestarted workers, which are not "other processes" on the GPU; `roofline`: the peaks, when the caller got
        them before starting the workers, as a CPU's must be)."""
        cases = cls._cases(spec)
        from spark_bench.fingerprint import fingerprint
        from spark_bench.telemetry import preflight, roofline_for
        from spark_bench.telemetry.calibrate import busy_text, clock_notes

        timeout_s = timeout if timeout is not None else default_timeout(spec.device)
        run_id = results.new_run_id(spec.device) if out is None else Path(out).name
        store = results.RunStore(out if out is not None else results_root / run_id)
        store.lock()  # before anything is written: a second run of this directory is refused, naming this one
        check = preflight(spec.device, own_pids=own_pids) if spec.device.startswith("cuda") else None
        for warning in (check or {}).get("warnings", []):
            console(stderr=True).print(f"warning: {warning}", markup=False)
        if roofline is None:
            roofline = roofline_for(spec.device, measure=True)  # once per device fingerprint, cached
        busy = busy_text(roofline.get("measured") or {})
        if busy:
            console(stderr=True).print(f"warning: the roofline peaks were measured while the machine was {busy}: "
                                       "likely low, so % of roofline reads high", markup=False)
        for note in clock_notes(roofline.get("measured") or {}):
            console(stderr=True).print(f"warning: roofline peak measured slowed, {note}: likely low", markup=False)
        store.create({
            "run_id": run_id, "created": results.now(), "finished": None,
            "fingerprint": fingerprint(spec.device, weights=spec.weights),  # with --weights: the file and layer hash
            "command": list(command), "spec": {**spec.to_dict(), "timing": cfg.to_dict(), "timeout_s": timeout_s},
            "roofline": roofline, "preflight": check, "summary": None,
        })
        return cls(store, spec, cfg, timeout_s, cases)

    @staticmethod
    def stored(path: Path) -> tuple[SweepSpec, TimingConfig, float]:
        """(spec, timing config, phase timeout) of the run in `path`, for `run --like`; ResultsError if unusable."""
        if not Path(path).is_dir():
            raise results.ResultsError(f"{path}: no such run directory")
        store = results.RunStore(path)
        run = store.read_run()
        if run.get("kind") == "tune":
            raise results.ResultsError(f"{path} is a tune directory, not a sweep to run again")
        spec, cfg, timeout_s = stored_sweep(store, run)
        if cfg.mode == "auto":
            spec.timers = kept_timers(store.read_results())
        return spec, cfg, timeout_s

    @classmethod
    def resume(cls, path: Path) -> Session:
        store = results.RunStore(path)
        store.read_run()  # a directory that is not a run is refused before it is locked (no .lock left in it)
        store.lock()  # held until this process ends: a resume while the run is still going is refused
        run = store.read_run()  # again, under the lock: what the previous owner left
        if run.get("kind") == "tune":  # its cases are the tune's plan, not the sweep's
            raise results.ResultsError(f"{path} is a tune directory; resume it with `spark-bench tune --resume "
                                       f"{results.shell_path(path)}`")
        spec, cfg, timeout_s = stored_sweep(store, run)
        check_same_device(path, run, spec.device)
        check_weights_unchanged(path, run, spec)
        store.repair_tail()
        return cls(store, spec, cfg, timeout_s, cls._cases(spec))

    def execute(self, report: bool = True, executor: Any = None, confirm_crashes: bool = True,
                budget_s: float | None = None, deadline: float | None = None) -> int:
        """Run what is left (on `executor`, default: local worker processes; no new parameter point after
        `deadline`, `budget_s` after the command started); print the tables; write the report.
        Exit code: 0 all passed, 1 any case failed. A full disk raises DiskFullError (one line, exit 2), workers that
        cannot start WorkersCannotStart (one line, exit 1), each saying what is kept and how to resume."""
        try:
            with interrupt_says_what_is_kept(self.store, len(self.cases), "spark-bench run --resume"):
                return self._execute(report, executor, confirm_crashes, budget_s, deadline)
        except results.DiskFullError as exc:
            raise results.DiskFullError(
                f"{exc}: {kept(self.store)} of {len(self.cases)} cases are kept in {self.store.path}; free some "
                f"space, then run `spark-bench run --resume {results.shell_path(self.store.path)}`") from None
        except WorkersCannotStart as exc:
            raise WorkersCannotStart(f"{exc}; {kept(self.store)} of {len(self.cases)} cases are kept in "
                                     f"{self.store.path}: fix it, then `spark-bench run --resume "
                                     f"{results.shell_path(self.store.path)}`") from None

    def _execute(self, report: bool, executor: Any, confirm_crashes: bool, budget_s: float | None,
                 deadline: float | None) -> int:
        from spark_bench.console import SweepProgress
        from spark_bench.executors.plan import to_run_text
        from spark_bench.runner import budget_left_note, pending

        out = console()
        todo = pending(self.store, self.cases)
        sources: collections.Counter[str] = collections.Counter()
        expected = estimates(todo, sources)
        out.print(f"spark-bench: {len(self.cases)} cases on {self.spec.device}, {to_run_text(todo)}"
                  f"{estimate_note(expected, sources)} -> {self.store.path}" + shapes_note(self.spec, self.cfg),
                  markup=False, soft_wrap=True)  # one line, however long
        tele, _ = RunTelemetry.start(self.store.path, self.spec.device) if self.spec.device.startswith("cuda") \
            else (None, "CPU device")
        labels = weight_labels(todo, self.spec)
        slots = getattr(executor, "slots", None) or [None]
        timeline = PhaseTimeline(tele, one_device=getattr(executor, "name", "local") != "ray" and len(slots) == 1)
        with SweepProgress(len(todo), out, expected=expected, deadline=deadline) as progress, timeline:
            roofline = self.store.read_run().get("roofline")
            Runner(self.store, self.cfg, timeout_s=self.timeout_s, device=self.spec.device,
                   on_phase=timeline.wrap(progress.phase), on_result=progress.result, executor=executor,
                   decorate=lambda record: (add_weights(record, labels), add_roofline(record, roofline),
                                            timeline.annotate(record)),
                   confirm_crashes=confirm_crashes, deadline=deadline).run(todo)
        records = self.store.read_results()
        summary = results.summarize_statuses(records)
        run = self.store.read_run()
        budget_note = budget_left_note(run, self.store, self.cases, budget_s)
        if todo or run.get("finished") is None:  # resuming a finished run changes nothing: it keeps its end time
            run.update(finished=results.now(), summary=summary)
            self.store.write_run(run)
        out.print(results_table(records, title=f"spark-bench run {run['run_id']}"))
        fails = failures_table(records)
        if fails is not None:
            out.print(fails)
        out.print(summary_line(summary))
        out.print(f"results: {self.store.path}", markup=False, soft_wrap=True)
        if budget_note:
            out.print(budget_note, markup=False, soft_wrap=True)
        if report:
            self._report(out)  # the report's path is printed last
        return 1 if any(summary[s] for s in FAILED) else 0

    def _report(self, out: Any) -> None:
        """Write the run's report.html; when that fails (plotly missing, a bug, a full disk) say so in one line: the
        sweep's results are kept and its exit code stands."""
        target = self.store.path / "report.html"
        try:
            from spark_bench.report import write_report

            path = write_report([self.store.path], target)
        except Exception as exc:  # noqa: BLE001 - after a long sweep, a report is never worth a traceback
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            hint = " (pip install plotly)" if isinstance(exc, ImportError) else ""
            console(stderr=True).print(f"report: not written ({why}){hint}; the results are kept in {self.store.path};"
                                       f" `spark-bench report {self.store.path} -o {target}` writes it",
                                       markup=False, soft_wrap=True)
            return
        out.print(f"report: {path}", markup=False, soft_wrap=True)
