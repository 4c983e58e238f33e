"""One small read-only interface over NVML (nvidia-ml-py, import name `pynvml`), and how to open it.

`Source` is everything the energy, clock and sampler code reads: a clock (`now`, `sleep`, `every`) and one getter per
reading. A getter returns None when the device or driver does not provide the reading, and records why in
`source.missing[field]`. `NvmlSource` reads a real GPU; `spark_bench.telemetry.fake.FakeSource` replays a scripted
device on a virtual clock for tests. `open_source(device)` returns (source, None) or (None, reason) and never raises.

Nothing here changes clocks or power settings: every NVML call is a read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("spark_bench.telemetry")

ENERGY_MODULUS = 2**64  # nvmlDeviceGetTotalEnergyConsumption is an unsigned 64-bit count of mJ

# nvmlClocksEventReason* bits (stable NVML ABI), named for results and reports.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the clock was pulled down by a power or thermal limit (nvbench discards such samples).
CAP_REASONS_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
SW_POWER_CAP = 0x4
# NVML errors that mean a reading will never work on this device or driver (NOT_SUPPORTED, NO_PERMISSION,
# FUNCTION_NOT_FOUND): asked once, then skipped. Any other error (UNKNOWN, TIMEOUT, ...) fails that one reading only.
PERMANENT_NVML_ERRORS = (3, 4, 13)
MIG_NOTE = ("MIG is enabled on this GPU: NVML's power and energy are the whole GPU's, other MIG instances' work "
            "included")


def reason_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


class Periodic:
    """Calls fn() every period_s in a daemon thread until stop(); an exception is kept in `error`, logged as a
    warning (a timeline that stops silently would claim nothing was throttled) and ends it."""

    def __init__(self, period_s: float, fn: Callable[[], None], name: str = "spark-bench-sampler") -> None:
        self.period_s, self.fn, self.error = period_s, fn, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.fn()
            except Exception as exc:  # a failing reading must not kill the process
                self.error = exc
                log.warning("%s stopped sampling: %s: %s", self._thread.name, type(exc).__name__, exc)
                return
            next_t += self.period_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow NVML call): restart the grid from now
                next_t, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class Source:
    """The readings spark-bench takes from a GPU. Units: mJ, W, MHz, degrees C; times in epoch seconds."""

    energy_modulus: int = ENERGY_MODULUS
    kind = "none"

    def __init__(self) -> None:
        self.missing: dict[str, str] = {}
        self.update_period_s: float | None = None  # energy counter update period, once inferred (energy.py)
        self.power_field: str | None = None  # which reading power_w() used last
        self.mig: bool | None = None  # MIG enabled on the GPU (power and energy then cover every instance)

    # --- clock ----------------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def every(self, period_s: float, fn: Callable[[], None]) -> Any:
        """Run fn() now and every period_s on this source's clock; returns a handle with .stop()."""
        return Periodic(period_s, fn)

    # --- readings (None: not available here; see self.missing) ----------------------------------------------------
    def energy_mj(self) -> int | None:
        return self._absent("energy")

    def power_instant_w(self) -> float | None:
        return self._absent("power_instant")

    def power_average_w(self) -> float | None:
        return self._absent("power_average")

    def sm_clock_mhz(self) -> float | None:
        return self._absent("sm_clock")

    def mem_clock_mhz(self) -> float | None:
        return self._absent("mem_clock")

    def default_sm_clock_mhz(self) -> float | None:
        return self._absent("default_sm_clock")

    def temperature_c(self) -> float | None:
        return self._absent("temperature")

    def power_limit_w(self) -> float | None:
        return self._absent("power_limit")

    def default_power_limit_w(self) -> float | None:
        return self._absent("default_power_limit")

    def clock_event_reasons(self) -> int | None:
        return self._absent("clock_event_reasons")

    def processes(self) -> list[dict[str, Any]] | None:
        """Processes using the GPU: [{"pid": int, "used_memory_bytes": int | None}]."""
        return self._absent("processes")

    def device_name(self) -> str | None:
        return None

    def driver_version(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    # --- derived --------------------------------------------------------------------------------------------------
    def power_w(self) -> tuple[float | None, str | None]:
        """Instant power where the device has it, else NVML's default (on GA100+ ~1 s averaged) reading."""
        value, field = self.power_instant_w(), "nvml-power-instant"
        if value is None:
            value, field = self.power_average_w(), "nvml-power-usage"
        self.power_field = field if value is not None else None
        return value, self.power_field

    def snapshot(self) -> dict[str, Any]:
        """One timeline row: t, power_w, sm_mhz, mem_mhz, temp_c, reasons."""
        power, _ = self.power_w()
        return {"t": self.now(), "power_w": power, "sm_mhz": self.sm_clock_mhz(), "mem_mhz": self.mem_clock_mhz(),
                "temp_c": self.temperature_c(), "reasons": self.clock_event_reasons()}

    def _absent(self, field: str, reason: str = "not provided by this source") -> None:
        self.missing.setdefault(field, reason)
        return None


class NvmlSource(Source):
    """A real GPU through pynvml. Fields the device does not support are asked once, then skipped."""

    kind = "nvml"

    def __init__(self, index: int = 0, uuid: str | None = None) -> None:
        super().__init__()
        import pynvml

        self.nvml = pynvml
        self._unsupported: set[str] = set()  # fields asked once and refused for good (PERMANENT_NVML_ERRORS)
        pynvml.nvmlInit()
        try:
            self.handle = self._by_uuid(uuid) or pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self.index = index
        self.handle, self.mig = self._whole_gpu(self.handle)

    def _by_uuid(self, uuid: str | None) -> Any:
        # torch spells a MIG instance's UUID without NVML's "MIG-" prefix (nvml_index adds "GPU-"): try both
        spellings = [uuid, "MIG-" + uuid[4:]] if uuid and uuid.startswith("GPU-") else [uuid] if uuid else []
        for spelling in spellings:
            try:
                return self.nvml.nvmlDeviceGetHandleByUUID(spelling)
            except Exception:  # an oddly spelled UUID: fall back to the index
                continue
        return None

    def _whole_gpu(self, handle: Any) -> tuple[Any, bool | None]:
        """(the GPU's handle, whether MIG is enabled on it): a MIG instance's handle has no power readings of its own;
        its parent GPU's readings are the whole GPU's. None: NVML could not say (an older driver or library)."""
        try:
            if self.nvml.nvmlDeviceIsMigDeviceHandle(handle):
                return self.nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle), True
            return handle, self.nvml.nvmlDeviceGetMigMode(handle)[0] == self.nvml.NVML_DEVICE_MIG_ENABLE
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) == self.nvml.NVML_ERROR_NOT_SUPPORTED:  # a GPU without MIG
                return handle, False
            return handle, None
        except Exception:
            return handle, None

    def _read(self, field: str, fn: Callable[[], Any], scale: float = 1.0) -> Any:
        if field in self._unsupported:
            return None
        try:
            value = fn()
        except self.nvml.NVMLError as exc:
            self.missing[field] = f"{type(exc).__name__}: {exc}"
            if getattr(exc, "value", None) in PERMANENT_NVML_ERRORS:
                self._unsupported.add(field)
            return None
        except AttributeError as exc:  # an older nvidia-ml-py without this call
            self.missing[field] = f"nvidia-ml-py lacks it: {exc}"
            self._unsupported.add(field)
            return None
        return value * scale if scale != 1.0 else value

    def energy_mj(self) -> int | None:
        return self._read("energy", lambda: int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)))

    def power_instant_w(self) -> float | None:
        def field() -> float:
            value = self.nvml.nvmlDeviceGetFieldValues(self.handle, [self.nvml.NVML_FI_DEV_POWER_INSTANT])[0]
            if value.nvmlReturn != self.nvml.NVML_SUCCESS:
                raise self.nvml.NVMLError(value.nvmlReturn)
            member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
            return float(getattr(value.value, member.get(value.valueType, "uiVal")))

        return self._read("power_instant", field, 1e-3)

    def power_average_w(self) -> float | None:
        return self._read("power_average", lambda: self.nvml.nvmlDeviceGetPowerUsage(self.handle), 1e-3)

    def sm_clock_mhz(self) -> float | None:
        return self._read("sm_clock", lambda: self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))

    def mem_clock_mhz(self) -> float | None:
        return self._read("mem_clock", lambda: self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_MEM))

    def default_sm_clock_mhz(self) -> float | None:
        """The default applications SM clock, else the maximum SM clock."""
        value = self._read("default_sm_clock", lambda: self.nvml.nvmlDeviceGetDefaultApplicationsClock(
            self.handle, self.nvml.NVML_CLOCK_SM))
        if value is None:
            value = self._read("max_sm_clock", lambda: self.nvml.nvmlDeviceGetMaxClockInfo(
                self.handle, self.nvml.NVML_CLOCK_SM))
        return value

    def temperature_c(self) -> float | None:
        return self._read("temperature", lambda: self.nvml.nvmlDeviceGetTemperature(
            self.handle, self.nvml.NVML_TEMPERATURE_GPU))

    def power_limit_w(self) -> float | None:
        return self._read("power_limit", lambda: self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle), 1e-3)

    def default_power_limit_w(self) -> float | None:
        return self._read("default_power_limit",
                          lambda: self.nvml.nvmlDeviceGetPowerManagementDefaultLimit(self.handle), 1e-3)

    def clock_event_reasons(self) -> int | None:
        getter = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return self._read("clock_event_reasons", lambda: int(getter(self.handle)))

    def processes(self) -> list[dict[str, Any]] | None:
        def both() -> list[dict[str, Any]]:
            found: dict[int, dict[str, Any]] = {}
            for getter in (self.nvml.nvmlDeviceGetComputeRunningProcesses,
                           self.nvml.nvmlDeviceGetGraphicsRunningProcesses):
                for proc in getter(self.handle):
                    found.setdefault(int(proc.pid), {"pid": int(proc.pid),
                                                     "used_memory_bytes": getattr(proc, "usedGpuMemory", None)})
            return list(found.values())

        return self._read("processes", both)

    def device_name(self) -> str | None:
        name = self._read("name", lambda: self.nvml.nvmlDeviceGetName(self.handle))
        return name.decode() if isinstance(name, bytes) else name

    def driver_version(self) -> str | None:
        version = self._read("driver", self.nvml.nvmlSystemGetDriverVersion)
        return version.decode() if isinstance(version, bytes) else version

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def nvml_index(device: int | str | Any) -> tuple[int, str | None]:
    """NVML index (and, where CUDA is already initialised, the UUID) of 0, 'cuda', 'cuda:N' or a torch.device.
    CUDA numbers devices after CUDA_VISIBLE_DEVICES; NVML does not, so the UUID (or the visible list) maps them."""
    if isinstance(device, int):
        return device, None
    text = str(device)
    if text == "cuda":
        n = 0
    elif text.startswith("cuda:") and text[5:].isdigit():
        n = int(text[5:])
    elif text.isdigit():
        return int(text), None
    else:
        raise ValueError(f"not a GPU device: {device!r}")
    uuid = None
    try:
        import torch

        if torch.cuda.is_initialized():
            uuid = str(torch.cuda.get_device_properties(n).uuid)
            uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:
        uuid = None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible) and n < len(visible):
        return int(visible[n]), uuid
    if uuid is None and n < len(visible) and visible[n].startswith(("GPU-", "MIG-")):
        uuid = visible[n]  # CUDA_VISIBLE_DEVICES by UUID: NVML's index n is another GPU
    return n, uuid


_OPEN: dict[Any, NvmlSource] = {}  # by UUID where known, else NVML index
_FAILURE: str | None = None


def open_source(device: int | str | Any = 0) -> tuple[Source | None, str | None]:
    """The NVML source of a GPU (cached per process), or (None, why not). Never raises."""
    global _FAILURE
    if _FAILURE is not None:
        return None, _FAILURE
    try:
        index, uuid = nvml_index(device)
    except ValueError as exc:
        return None, str(exc)
    key = uuid or index
    if key in _OPEN:
        return _OPEN[key], None
    try:
        import pynvml  # noqa: F401
    except ImportError:
        _FAILURE = "NVML unavailable: nvidia-ml-py (pynvml) is not installed"
        return None, _FAILURE
    try:
        source = NvmlSource(index, uuid)
    except Exception as exc:
        reason = f"NVML unavailable: {type(exc).__name__}: {exc}".splitlines()[0]
        if type(exc).__name__ in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"):
            _FAILURE = reason  # no driver in this process: do not ask again
        return None, reason
    _OPEN[key] = source
    return source, None
