"""What a stored run's run.json fixes for a run or tune that goes on from it (`run --resume`, `run --like`, `tune
--resume`): its sweep spec, its cases' timers, and the device, stack and weight files it must still be measured with.
Each refusal is a one-line ResultsError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spark_bench import results
from spark_bench.results_schema import SPEC_NESTED, schema_problem
from spark_bench.sweep import SweepSpec
from spark_bench.timing import TimingConfig


def stored_sweep(store: results.RunStore, run: dict[str, Any]) -> tuple[SweepSpec, TimingConfig, float]:
    """(spec, timing config, phase timeout) of a run directory's run.json, for `--resume`; ResultsError if unusable."""
    def unusable(why: str) -> results.ResultsError:
        return results.ResultsError(f"{store.run_file}: no usable sweep spec ({why}); this run cannot be resumed")

    raw = dict(run.get("spec") or {})
    problem = schema_problem(raw, SPEC_NESTED)
    if problem:
        raise unusable(f"spec's {problem}")
    try:
        cfg, timeout_s = TimingConfig(**raw.pop("timing")), float(raw.pop("timeout_s"))
        return SweepSpec.from_dict(raw), cfg, timeout_s
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise unusable(f"{type(exc).__name__}: {exc}") from None


def kept_timers(records: list[dict[str, Any]]) -> dict[str, str]:
    """case id -> the CUDA timer each timed case of a run used ('events', 'graph:N'), for `run --like` to keep:
    `--timer auto` picks by a 5-sample probe at 50 us, so a case near that line could change timer between the two
    runs, and `compare` would set a graph time against an event time."""
    from spark_bench.timing import kept_timer

    out = {}
    for r in records:
        mode = kept_timer(r.get("timing"))
        if mode is not None:
            out[r["case_id"]] = mode
    return out


def check_same_device(path: Path, run: dict[str, Any], device: str, what: str = "measured") -> None:
    """A resumed run or tune must time on the device and stack its first cases timed on: ResultsError (one line,
    naming what differs) when this machine's fingerprint is not its run.json's: one run would mix two devices."""
    from spark_bench.devices import check_device
    from spark_bench.fingerprint import fingerprint, stack_difference, stack_differences

    stored, now = run.get("fingerprint") or {}, fingerprint(check_device(device))
    if stack_differences(stored, now) or stored.get("fingerprint_id") != now["fingerprint_id"]:
        name, here = (stored.get("device") or {}).get("name") or "another device", now["device"].get("name")
        where = f"on this {here} with another stack" if name == here else f"on {name}, not on this {here}"
        raise results.ResultsError(f"{path} was {what} {where} ({stack_difference(stored, now)}): "
                                   "resuming here would mix two devices' timings in one run; start a new one")


def check_weights_unchanged(path: Path, run: dict[str, Any], spec: SweepSpec) -> None:
    """A resumed run or tune must time the weights its first cases timed: ResultsError (one line) when a weight file
    (the layer, the routing trace, the activations) hashes differently now than in its run.json."""
    stored = (run.get("fingerprint") or {}).get("weights")
    if not stored or not spec.weights:
        return
    from spark_bench.weights import describe

    now = describe(spec.weights)
    for part in ("layer", "routing", "activations"):
        before, after = (stored, now) if part == "layer" else (stored.get(part) or {}, now.get(part) or {})
        if before.get("sha256") != after.get("sha256"):
            raise results.ResultsError(f"{path}: the {part} file {before.get('path') or after.get('path')} changed "
                                       "since this run started; its results would mix two weight sets: start a new "
                                       "run")
