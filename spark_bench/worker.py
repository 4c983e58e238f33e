"""The worker process: runs cases one at a time for the runner (spark_bench/runner.py) and reports back.

Per case: inputs (seeded; cached with the reference output for the next backend of the same point) -> backend setup
(compile, autotune: timed as setup_s, never in the latency) -> correctness check on poisoned allocations -> timing
(only when the check passed) -> the checked call again, compared with the first (`recheck`) -> per-stage timing for
composite backends (not for interpreted ones: a breakdown of the interpreter's time says nothing of the kernels',
and costs about one more call of the whole backend). The worker
sends a `phase` message at each step (the runner's per-phase deadline and progress bar use them) and one `result`
message per case.
Its stderr goes to a log file whose tail the runner stores with a crash.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import os
import signal
import sys
import time
import traceback
from typing import Any

from spark_bench import results, triton_env
from spark_bench.devices import use_device
from spark_bench.sweep import Case
from spark_bench.timing import TimingConfig, capture_failed, on_device

ENERGY_ENV = "SPARK_BENCH_ENERGY"
OOM_MARKERS = ("out of memory", "not enough memory", "cannot allocate memory", "outofmemoryerror")


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or any(m in text for m in OOM_MARKERS):
        return "oom"
    return "error"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class CaseRunner:
    """Runs cases in this process (the worker's loop, and the in-process mode used by tests and the pytest plugin)."""

    def __init__(self, reg=None, phase=lambda case_id, phase: None) -> None:
        if reg is None:
            from spark_bench.registry import registry

            reg = registry()
        self.reg = reg
        self.phase = phase
        self._cache: tuple[str, list[dict[str, Any]], Any, dict[str, Any]] | None = None
        self._refs: dict[int, Any] = {}  # the references of the point's rotated input sets, built when first checked
        self._tuned: tuple[dict[str, Any], Any] | None = None
        self._seeded: dict[tuple[str, str], bool] = {}

    def _inputs(self, op, case: Case, n_sets: int):
        if self._cache is not None and self._cache[0] == case.group:
            return self._cache[1:]
        self._cache, self._refs = None, {}
        self.phase(case.case_id, "inputs")
        seed = case.input_seed()
        inputs = op.make_inputs(case.params, device=case.device, dtype=case.dtype, seed=seed)
        sets = [inputs]
        for i in range(1, n_sets if op.rotate else 1):
            draw = op.redraw or op.make_inputs_fn
            other = draw(case.params, device=case.device, dtype=case.dtype, seed=seed + i)
            sets.append({**inputs, **{k: other[k] for k in op.rotate}})
        self.phase(case.case_id, "reference")
        ref = _reference(op, inputs)
        extra = op.extra_info(inputs, case.params) if op.extra_info else {}
        self._cache = (case.group, sets, ref, extra)
        return sets, ref, extra

    def _seeded_factory(self, op, device: str) -> bool:
        from spark_bench.check import factory_is_seeded

        if (op.name, device) not in self._seeded:  # once per op and device
            self._seeded[(op.name, device)] = factory_is_seeded(op, device)
        return self._seeded[(op.name, device)]

    def _table(self, data: dict[str, Any] | None):
        """The tuned-config table of `run --tuned` (built once per worker)."""
        if data is None:
            return None
        if self._tuned is None or self._tuned[0] is not data:
            from spark_bench.tune.store import TunedStore

            self._tuned = (data, TunedStore(data))
        return self._tuned[1]

    def run(self, case: Case, cfg: TimingConfig, n_sets: int = 4) -> dict[str, Any]:
        started, t0 = results.now(), time.perf_counter()
        record: dict[str, Any] = {
            **case.record_fields(), "status": None, "error": None, "labels": [],
            "check": None, "timing": None, "cost": None, "gbps": None, "tflops": None, "stages": None,
            "extra": {}, "power": None, "roofline": None, "recompiles_during_timing": None, "recheck": None,
            "started": started, "worker_pid": os.getpid(),
        }
        op = self.reg.ops.get(case.op)  # probed before the case's memory peak counts
        if op is not None and case.weights is None and not self._seeded_factory(op, case.device):
            record["labels"].append("unseeded-inputs")
        memory = _memory_start(case.device)
        try:
            from spark_bench.tune.space import applied
            from spark_bench.weights import using  # --weights: the ops build their inputs from the file's layer

            # on_device: in-process callers (pytest --spark-device cuda:1) may have another GPU current
            with using(case.weights), applied(case.configs, self._table(case.tuned)), on_device(case.device):
                self._run(case, cfg, n_sets, record)
        except BaseException as exc:  # noqa: BLE001 - every failure of a case is recorded, never raised
            if isinstance(exc, KeyboardInterrupt):
                raise
            record["status"] = classify(exc)
            record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            record["traceback"] = traceback.format_exc()[-4000:]
            if "cuda error" in record["error"].lower() or "illegal memory" in record["error"].lower():
                record["restart_worker"] = True  # a CUDA context error poisons every later case of this process
        if capture_failed():  # a failed graph capture: no later capture in this process works
            record["restart_worker"] = True
        record["duration_s"] = round(time.perf_counter() - t0, 4)
        record["memory"] = _memory_end(case.device, memory)
        return record

    def _run(self, case: Case, cfg: TimingConfig, n_sets: int, record: dict[str, Any]) -> None:
        from spark_bench.check import check_outputs, clone_inputs, output_snapshot
        from spark_bench.compiled import compile_count
        from spark_bench.timing import for_interpreted, for_stages, measure, with_kept_timer
        from spark_bench.triton_env import interpreted_launches
        from spark_bench.tune.space import recording, summarize

        op = self.reg.get(case.op)
        backend = op.backends[case.backend]
        record["labels"] = backend.labels_for(case.device) + record["labels"]  # then those run() added
        interpreted = "interpreted" in record["labels"]
        if interpreted:
            cfg = for_interpreted(cfg)
        cfg = with_kept_timer(cfg, case.timer)  # run --like: the base's timer, not a new probe's (near 50 us it flips)
        sets, ref, extra = self._inputs(op, case, n_sets)
        record["extra"] = dict(extra)
        cost = op.cost(case.params, case.dtype)
        record["cost"] = {"flops": cost.flops, "bytes": cost.bytes, "tokens": cost.tokens}

        self.phase(case.case_id, "setup")
        s0 = time.perf_counter()
        fn = backend.prepared(clone_inputs(sets[0]))
        _sync(case.device)
        setup_s = time.perf_counter() - s0

        self.phase(case.case_id, "check")
        with recording() as picks, interpreted_launches() as launches:
            out, check_inputs = _poisoned_call(backend, fn, case, sets[0])
        if launches[0] and not interpreted:  # Triton ran interpreted, undeclared: its time is the interpreter's
            record["labels"].append("interpreted")
            interpreted, cfg = True, for_interpreted(cfg)
        if picks:  # which config each declared kernel ran with, and why (spark_bench/tune/space.py)
            record.update(summarize(picks))
        record["check"] = check_outputs(op, out, ref, check_inputs, case.dtype, pristine=sets[0], backend=case.backend)
        if not record["check"]["ok"]:
            record["status"] = "mismatch"
            record["error"] = record["check"]["message"]
            return
        checked = None if interpreted else output_snapshot(op, out, check_inputs)  # what the recheck compares with
        del out, check_inputs
        if interpreted and len(sets) > 1:
            record["check"]["input_sets"] = {"checked": 1, "skipped": "interpreted"}
        elif not self._check_rotated(op, backend, fn, case, sets, record):
            return

        self.phase(case.case_id, "timing")
        timed_sets = [clone_inputs(s) for s in sets]
        calls = [functools.partial(fn, **s) for s in timed_sets]
        before = compile_count()
        timing = measure(calls, case.device, cfg)
        record["recompiles_during_timing"] = compile_count() - before
        if record["recompiles_during_timing"]:
            record["labels"].append("recompiled-in-timing")
        timing["setup_s"] = round(setup_s, 4)
        timing["input_sets"] = len(calls)
        record["timing"] = timing
        seconds = timing["median"] * 1e-6
        record["gbps"] = cost.bytes / seconds / 1e9 if seconds > 0 else None
        record["tflops"] = cost.flops / seconds / 1e12 if seconds > 0 else None

        record["power"] = self._energy(case, calls, timing, cost)
        if (record["power"] or {}).get("throttled"):
            record["labels"].append("throttled")

        if interpreted:  # sequential, so no race to show; one more call made the CPU sweep 24% longer (measured)
            record["recheck"] = {"skipped": "interpreted"}
        else:
            self.phase(case.case_id, "recheck")
            if not self._recheck(op, backend, fn, case, sets[0], ref, checked, record):
                return

        if backend.stages is not None and not interpreted:
            self.phase(case.case_id, "stages")
            stage_calls = backend.stages(clone_inputs(sets[0]))
            stage_cfg = for_stages(cfg, len(stage_calls))
            record["stages"] = [{"name": name, "timing": measure([call], case.device, stage_cfg)}
                                for name, call in stage_calls]
        record["status"] = "ok"

    def _check_rotated(self, op, backend, fn, case: Case, sets, record: dict[str, Any]) -> bool:
        """The other input sets the timing rotates through (another routing, other decode rows) checked against their
        own references, as set 0 was: a kernel wrong for one routing is timed on it otherwise. Not for interpreted
        Triton (a CPU run's kernel tests cover routings; each call there costs seconds). False when the case ends."""
        from spark_bench.check import check_outputs

        for i, inputs in enumerate(sets[1:], start=1):
            if i not in self._refs:
                self.phase(case.case_id, "reference")
                self._refs[i] = _reference(op, inputs)
            self.phase(case.case_id, "check")
            out, call_inputs = _poisoned_call(backend, fn, case, inputs)
            result = check_outputs(op, out, self._refs[i], call_inputs, case.dtype, pristine=inputs,
                                   backend=case.backend)
            del out, call_inputs
            if not result["ok"]:
                record["check"]["input_sets"] = {"checked": i + 1, "failed": i,
                                                 **{k: result.get(k) for k in ("err_ratio", "max_abs", "cosine")}}
                record.update(status="mismatch", error=f"right on input set 0, wrong on input set {i} of {len(sets)} "
                                                       f"(rotated: {', '.join(op.rotate)}): {result['message']}")
                return False
        record["check"]["input_sets"] = {"checked": len(sets)}
        return True

    def _recheck(self, op, backend, fn, case: Case, inputs, ref, checked, record: dict[str, Any]) -> bool:
        """The checked call once more after the timing and energy calls (`check.recheck_outputs`). Wrong now: the
        case is a `mismatch` and its numbers are dropped (the median is kept in `recheck.discarded_median_us`);
        right with other bits: labelled `nondeterministic`. False when the case ends here."""
        from spark_bench.check import recheck_outputs

        out, again = _poisoned_call(backend, fn, case, inputs)
        record["recheck"] = recheck_outputs(op, out, checked, ref, again, case.dtype, pristine=inputs,
                                            backend=case.backend)
        if record["recheck"]["ok"]:
            if not record["recheck"]["identical"]:
                record["labels"].append("nondeterministic")
            return True
        record["recheck"]["discarded_median_us"] = record["timing"]["median"]
        record.update(status="mismatch", timing=None, gbps=None, tflops=None, power=None,
                      error=f"right when checked, wrong on the same inputs after its timing: "
                            f"{record['recheck']['message']}")
        return False

    def _energy(self, case: Case, calls, timing: dict[str, Any], cost) -> dict[str, Any]:
        """Energy per call from NVML over an amplified window (spark_bench/telemetry/energy.py); null with the
        reason on CPU, without NVML, or with SPARK_BENCH_ENERGY=0 (`spark-bench run --no-energy`)."""
        from spark_bench.telemetry import measure_energy, null_power

        if not case.device.startswith("cuda"):
            return null_power("CPU device: NVML measures GPU power only")
        if os.environ.get(ENERGY_ENV, "1") == "0":
            return null_power("energy measurement disabled (--no-energy)")
        import torch

        # one invocation = k calls then one sync, ~1 ms of work, so launch gaps do not dilute small ops
        k = max(1, min(10000, int(1000.0 / max(timing["median"], 0.1))))

        def invocation() -> None:
            for i in range(k):
                calls[i % len(calls)]()
            torch.cuda.synchronize()

        self.phase(case.case_id, "energy")
        power = measure_energy(invocation, case.device, calls_per_invocation=k, flops=cost.flops, tokens=cost.tokens,
                               retries=2)
        if power["avg_w"] is not None:  # not the latency's regime (one flushed call, maybe a graph): say so
            power["regime"] = (f"{k} eager calls per sync, back to back over {len(calls)} rotating input set(s), "
                               "no L2 flush (warm L2)")
        return power


def _rss_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _poisoned_call(backend, fn, case: Case, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(outputs, the inputs it ran on) of one checked call: on a fresh copy of `inputs`, with new allocations
    poisoned (NaN) so unwritten elements show, synchronised."""
    from spark_bench.check import clone_inputs, poisoned_allocations

    call_inputs = clone_inputs(inputs)
    with poisoned_allocations(patch_torch=not backend.traced):
        out = fn(**call_inputs)
        _sync(case.device)
    return out, call_inputs


def _reference(op, inputs: dict[str, Any]) -> Any:
    """The op's reference outputs on a copy of `inputs` (an in-place op's declared outputs taken from that copy)."""
    from spark_bench.check import clone_inputs

    ref_inputs = clone_inputs(inputs)
    ref = op.reference(**ref_inputs)
    return op.outputs(ref, ref_inputs) if op.outputs is not None else ref


def _memory_start(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        try:
            torch.cuda.reset_peak_memory_stats(torch.device(device))  # the case's GPU, current or not
        except RuntimeError:
            pass
    return _rss_peak_bytes()


def _memory_end(device: str, rss_peak_before: int) -> dict[str, Any]:
    """Peak memory of the case: device bytes (torch.cuda.max_memory_allocated) on CUDA; on the host, how much the
    case raised the worker's peak RSS (a high-water mark: 0 when an earlier case of the worker peaked higher)."""
    peak = _rss_peak_bytes()
    out: dict[str, Any] = {"rss_peak_bytes": peak, "rss_peak_increase_bytes": max(0, peak - rss_peak_before),
                           "device_peak_bytes": None}
    if device.startswith("cuda"):
        import torch

        try:
            out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(torch.device(device)))
        except RuntimeError:  # a poisoned context: the case's error says why
            pass
    return out


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the runner dies (kill -9 of the sweep leaves no orphan running)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log_to(path: str, moved_from: str | None = None) -> None:
    """stdout and stderr (a backend's too, never the user's terminal) append to `path`; with `moved_from`, what was
    logged there so far is copied over first and that file removed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if moved_from:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(moved_from, "rb") as old:
            os.write(fd, old.read())
        os.unlink(moved_from)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)
    if not moved_from:
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)


def main(conn, device: str, log_path: str | None) -> None:
    """Entry point of a spawned worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and stops its workers itself
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # spawned with it blocked (executors/local.py)
    _die_with_parent()
    try:
        os.setpgid(0, 0)  # its own process group: the runner ends whatever a backend started with it
    except OSError:
        pass
    if log_path:
        _log_to(log_path)
    faulthandler.enable(all_threads=True)
    triton_env.configure(device)
    use_device(device)
    runner = CaseRunner(phase=lambda case_id, phase: conn.send(("phase", case_id, phase)))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        if message[0] == "log":  # started before its run directory existed: log there from now on
            _log_to(message[1], moved_from=log_path)
            log_path = message[1]
            conn.send(("log",))
            continue
        _, case_dict, cfg_dict, n_sets = message
        record = runner.run(Case(**case_dict), TimingConfig(**cfg_dict), n_sets)
        conn.send(("result", record))
