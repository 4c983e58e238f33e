"""pytest plugin (entry point `pytest11`): spark-bench cases as pytest-benchmark tests, and a `spark_bench` fixture.

    pytest --spark-op 'kda.*' [--spark-backend triton] [--spark-preset kimi-linear] [--spark-set heads=4,8]
           [--spark-dtype bf16] [--spark-device cpu|cuda] [--spark-quick] --benchmark-json out.json

collects one test per case of the sweep `spark-bench run` would run (same options), named like
`kda.gate[triton-bf16-T67-H4-Dh128]` and grouped per op and parameter point, so pytest-benchmark's table puts the
backends of one shape side by side. Each test checks the backend against the reference (a mismatch fails it), then
times it with spark-bench's timing engine; those device-time samples become the benchmark's statistics, so
--benchmark-json/-save/-compare/-compare-fail work on them. The device fingerprint is added to the machine info and a
compare against a baseline of another fingerprint warns or fails (--spark-fingerprint-mismatch); --benchmark-compare-
fail judges the cases with `spark-bench compare`'s statistics, and refuses a baseline it cannot use (gate.py). See
docs/ci.md.

Inert unless a --spark-* option is given or a test uses the `spark_bench` fixture; importing it imports only pytest.
Cases run in the pytest process: a kernel that segfaults ends the session (`spark-bench run` isolates crashes).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

STATE = pytest.StashKey["SparkState"]()
MISMATCH_POLICIES = ("warn", "fail")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spark-bench", "spark-bench kernel benchmarks (docs/ci.md)")
    add = group.addoption
    add("--spark-op", action="append", default=[], metavar="GLOB",
        help="Collect one benchmark test per case of these ops (glob, repeatable), e.g. 'kda.*'.")
    add("--spark-backend", action="append", default=[], metavar="NAME",
        help="Only these backends (repeatable or comma-separated). Default: every default backend.")
    add("--spark-preset", default=None, metavar="NAME", help="Named model shape set, e.g. kimi-linear.")
    add("--spark-set", action="append", default=[], metavar="AXIS=V1,V2", help="Sweep these values of an axis.")
    add("--spark-dtype", action="append", default=[], metavar="DTYPE", help="bf16, fp16, fp32 (repeatable).")
    add("--spark-device", default=None, metavar="DEVICE", help="cpu or cuda[:N] (default: cuda if present, else cpu).")
    add("--spark-quick", action="store_true", help="Small shapes and a short timing budget per case.")
    add("--spark-full", action="store_true", help="On CPU, the full (GPU) shapes instead of the quick ones.")
    add("--spark-seed", type=int, default=0, metavar="N", help="Seed of every input factory (default 0).")
    add("--spark-max-time", type=float, default=None, metavar="S", help="Timing budget per case, seconds.")
    add("--spark-min-samples", type=int, default=None, metavar="N", help="Minimum timed samples per case.")
    add("--spark-target-ci", type=float, default=None, metavar="F",
        help="Stop timing when the median's 95%% CI is within this fraction.")
    add("--spark-timer", choices=("auto", "events", "graph"), default="auto", help="CUDA timer (default auto).")
    add("--spark-no-flush", action="store_true", help="Do not flush the cache before each timed call.")
    add("--spark-weights", default=None, metavar="PATH",
        help="A model's safetensors/GGUF weights: the KDA and MoE ops take this layer's tensors (docs/weights.md).")
    add("--spark-layer", type=int, default=None, metavar="N", help="The layer of --spark-weights to benchmark.")
    add("--spark-routing", default=None, metavar="FILE",
        help="Expert ids per token to replay (.npy/.jsonl): the routing axis value `file`.")
    add("--spark-activations", default=None, metavar="FILE",
        help="Captured activations (.npy [tokens, hidden]) fed to the --spark-weights layer's ops as x.")
    add("--spark-fingerprint-mismatch", choices=MISMATCH_POLICIES, default=None,
        help="When --benchmark-compare loads a baseline measured on another device fingerprint: warn, or fail "
             "before running anything (the default with --benchmark-compare-fail, else warn).")


def mismatch_default(config: pytest.Config) -> str:
    """A gate (--benchmark-compare-fail) refuses a baseline of another fingerprint unless told to warn, as
    `spark-bench compare` does; a comparison to look at only warns."""
    return "fail" if config.getoption("benchmark_compare_fail", default=None) else "warn"


class SparkState:
    """Per-session settings and lazily built heavy objects (registry, runner, fingerprints)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        opt = config.getoption
        self.ops: list[str] = opt("spark_op")
        self.fixture_used = False
        self.mismatches: list[str] = []
        self.gate_lines: list[str] = []
        self.gate_errors: list[str] = []
        self.skipped: dict[str, str] = {}  # node id -> reason, of the spark-bench cases skipped in this run
        self.explicit = bool(self.ops or opt("spark_device") or opt("spark_fingerprint_mismatch"))

    @property
    def active(self) -> bool:
        """Whether this session uses spark-bench at all (collected cases, the fixture, or a --spark option)."""
        return self.explicit or self.fixture_used

    @functools.cached_property
    def device(self) -> str:
        from spark_bench.devices import check_device, default_device
        from spark_bench.pytest_plugin.gate import usage_error
        from spark_bench.sweep import UsageError

        try:
            return check_device(self.config.getoption("spark_device") or default_device())
        except UsageError as exc:
            raise usage_error(f"--device: {exc}") from None

    def registry(self):
        from spark_bench import triton_env

        triton_env.configure(self.device)  # before plugins import triton: probes must see the interpreter
        from spark_bench.registry import registry

        return registry()

    @functools.cached_property
    def runner(self):
        from spark_bench.worker import CaseRunner

        return CaseRunner(self.registry())

    def timing_config(self, device: str, minimal: bool = False):
        from spark_bench.timing import TimingConfig, config_for

        if minimal:  # --benchmark-disable: check once, time one call
            return TimingConfig(warmup_s=0.0, min_samples=1, max_samples=1, min_time_s=0.0, max_time_s=0.0)
        opt = self.config.getoption
        return config_for(device, opt("spark_quick"), max_time_s=opt("spark_max_time"),
                          min_samples=opt("spark_min_samples"), target_rel_ci=opt("spark_target_ci"),
                          flush=False if opt("spark_no_flush") else None, mode=opt("spark_timer"))

    @functools.cache  # noqa: B019 - one state per session, a handful of devices
    def fingerprint(self, device: str) -> dict[str, Any]:
        from spark_bench.fingerprint import fingerprint

        return fingerprint(device)

    @functools.cache  # noqa: B019
    def roofline(self, device: str) -> dict[str, Any] | None:
        try:
            from spark_bench.telemetry.roofline import roofline_for
        except ImportError:
            return None
        return roofline_for(device)

    def machine_fingerprint(self) -> dict[str, Any]:
        """The fingerprint stored in pytest-benchmark's machine_info (the commit is in its commit_info); with
        --spark-weights also the weight file and its layer's content hash (docs/weights.md)."""
        fp = {k: v for k, v in self.fingerprint(self.device).items() if k != "git"}
        weights = self.weights_info()
        if weights:
            fp["weights"] = weights
        return fp

    @functools.cached_property
    def _weights_info(self) -> dict[str, Any] | None:
        from spark_bench.weights import WeightError, describe, make_spec

        opt = self.config.getoption
        try:
            spec = make_spec(opt("spark_weights"), opt("spark_layer"), opt("spark_routing"), opt("spark_activations"))
            return describe(spec) if spec else None
        except WeightError:  # reported (as a usage error) where the cases are collected
            return None

    def weights_info(self) -> dict[str, Any] | None:
        return self._weights_info


def state_of(config: pytest.Config) -> SparkState:
    return config.stash[STATE]


def pytest_configure(config: pytest.Config) -> None:
    state = config.stash[STATE] = SparkState(config)
    if state.ops and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = []  # `pytest --spark-op X` runs the spark-bench cases only, not the tests of the directory
    from spark_bench.pytest_plugin import gate

    gate.check_options(config)
    if state.ops:
        gate.keep_raw_samples(config)
    if state.explicit:
        gate.check_compare_path(config)  # before pytest-benchmark's pytest_configure (trylast) loads the baseline
    gate.install(config)


def pytest_sessionstart(session: pytest.Session) -> None:
    if state_of(session.config).explicit:
        from spark_bench.pytest_plugin.gate import check_baseline_loaded

        check_baseline_loaded(session.config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = state_of(config)
    lines = [f"spark-bench: WARNING: {m}" for m in state.mismatches]
    if state.ops:
        fp = state.fingerprint(state.device)
        device = f"{state.device} ({fp['device'].get('name')}), fingerprint {fp['fingerprint_id']}"
        lines.insert(0, f"spark-bench: {device}; cases run in this process (a crashing kernel ends the session; "
                        "`spark-bench run` isolates crashes)")
        lines += [f"spark-bench: plugin {e.source} failed to load: {e.message}" for e in state.registry().errors]
    return lines


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection and pytest-benchmark's --benchmark-skip/-only marks
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = state_of(config)
    if state.ops:
        from spark_bench.pytest_plugin.cases import collect

        items.extend(collect(session, state))
    users = [item for item in items if "spark_bench" in getattr(item, "fixturenames", ())]
    if users:
        from spark_bench.pytest_plugin.replay import attach_replay_timer

        state.fixture_used = True
        for item in users:
            attach_replay_timer(item)


@pytest.fixture
def spark_bench(request: pytest.FixtureRequest, benchmark: Any):
    """Benchmark your own callable with spark-bench's timing engine, fed into pytest-benchmark:
    `spark_bench(fn, *args, device=None, reference=None, tolerance=1e-3, flops=None, nbytes=None, **kwargs)`.
    See spark_bench.pytest_plugin.fixture.SparkBench."""
    from spark_bench.pytest_plugin.fixture import SparkBench

    return SparkBench(request, benchmark, state_of(request.config))


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    state = state_of(config)
    if state.active:
        machine_info["spark_bench"] = state.machine_fingerprint()


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before pytest-benchmark's, which raises on a malformed file
def pytest_benchmark_compare_machine_info(config: pytest.Config, benchmarksession: Any, machine_info: dict[str, Any],
                                          compared_benchmark: dict[str, Any]) -> None:
    from spark_bench.pytest_plugin.gate import baseline_problem, fingerprint_problem

    state = state_of(config)
    problem = baseline_problem(compared_benchmark)
    if problem:
        if state.explicit:
            raise pytest.UsageError(f"spark-bench: the --benchmark-compare baseline is malformed: {problem}")
        return
    message = fingerprint_problem(compared_benchmark, machine_info.get("spark_bench") or state.machine_fingerprint())
    if message is None:
        return
    policy = config.getoption("spark_fingerprint_mismatch") or mismatch_default(config)
    if policy == "fail":
        raise pytest.UsageError(f"spark-bench: {message} (--spark-fingerprint-mismatch=fail, the default of a "
                                "--benchmark-compare-fail gate; =warn compares anyway)")
    state.mismatches.append(message)
    state.explicit = True  # put our fingerprint in machine_info from now on


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.skipped and report.nodeid.startswith("spark-bench::"):  # cases.NODE_ID (not imported: stay cheap)
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        state_of(item.config).skipped[report.nodeid] = reason.removeprefix("Skipped: ")
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """After pytest-benchmark compared (its sessionfinish wrapper): a spark-bench case that regressed, or a gate
    that compared nothing, fails the session (exit 1, no traceback)."""
    from spark_bench.pytest_plugin.gate import summary

    state = state_of(session.config)
    state.gate_lines, state.gate_errors = summary(session.config, state.skipped, state.active)
    if state.gate_errors and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's summary, which raises on a regression
def pytest_terminal_summary(terminalreporter: Any) -> None:
    state = state_of(terminalreporter.config)
    write = terminalreporter.write_line
    for message in state.mismatches:
        terminalreporter.section("spark-bench: fingerprint mismatch", sep="!", red=True, bold=True)
        write(f"WARNING: {message}", red=True, bold=True)
        write("Pass --spark-fingerprint-mismatch=fail to make this an error.", red=True)
    if state.gate_lines or state.gate_errors:
        terminalreporter.section("spark-bench: regression gate", sep="-", red=bool(state.gate_errors))
    for line in state.gate_lines:
        write(line)
    for line in state.gate_errors:
        write(line, red=True, bold=True)
