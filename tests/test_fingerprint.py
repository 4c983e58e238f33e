"""The device fingerprint: what fingerprint_id tells apart and how a difference is named (fingerprint.py)."""

from __future__ import annotations

import pytest

import spark_bench.fingerprint as fingerprint_module
import spark_bench.telemetry.nvml as nvml
from spark_bench.fingerprint import fingerprint, stack_difference
from spark_bench.report.compare import CompareError, check_same_device
from spark_bench.report.model import RunData
from spark_bench.telemetry.fake import FakeSource

H200 = {"type": "cuda", "index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_bytes": 150_000_000_000,
        "sm_count": 132, "l2_bytes": 62_914_560, "cuda": "12.8", "driver": "570.1"}


@pytest.fixture
def gpu(monkeypatch):
    """fingerprint("cuda:0") on a simulated H200 whose NVML reads the power limit set in `limits` (None: no NVML)."""
    limits: dict[str, float | bool | None] = {"limit": 700.0, "mig": False}
    real = fingerprint_module.device_info
    monkeypatch.setattr(fingerprint_module, "device_info",
                        lambda device: dict(H200) if device.startswith("cuda") else real(device))

    def open_source(device):
        if limits["limit"] is None:
            return None, "NVML unavailable: simulated"
        return FakeSource(power_limit_w=limits["limit"], default_power_limit_w=700.0, mig=limits["mig"]), None

    monkeypatch.setattr(nvml, "open_source", open_source)
    return limits


def test_a_capped_gpu_is_another_fingerprint(gpu):
    full = fingerprint("cuda:0")
    gpu["limit"] = 500.0
    capped = fingerprint("cuda:0")
    assert capped["power"] == {"limit_w": 500, "default_limit_w": 700, "mig": False}
    assert full["power"]["limit_w"] == 700
    assert capped["fingerprint_id"] != full["fingerprint_id"]
    assert stack_difference(full, capped) == "power.limit_w 700 -> 500"
    gpu["limit"] = 700.0
    assert fingerprint("cuda:0")["fingerprint_id"] == full["fingerprint_id"]  # stable for one setting


def test_mig_mode_is_recorded_and_shown_but_not_hashed(gpu):
    """MIG on: NVML's power and energy are the whole GPU's; the run says so where its power limit is shown. A MIG
    slice is already another id by its name, memory and SM count, so the flag itself is not hashed."""
    from spark_bench.report.html import _power_limit_text

    off = fingerprint("cuda:0")
    gpu["mig"] = True
    on = fingerprint("cuda:0")
    assert on["power"]["mig"] is True and off["power"]["mig"] is False
    assert on["fingerprint_id"] == off["fingerprint_id"]
    assert _power_limit_text(on["power"]) == "700 W (default 700 W); MIG enabled: the whole GPU's"
    assert _power_limit_text(off["power"]) == "700 W (default 700 W)"
    gpu["mig"] = None  # NVML could not say (no MIG query on this GPU or driver): not recorded
    assert "mig" not in fingerprint("cuda:0")["power"]
    from spark_bench.results_schema import RUN_NESTED, schema_problem

    assert schema_problem({"fingerprint": on}, RUN_NESTED) is None  # a stored run.json of another type is refused
    assert "fingerprint.power.mig" in schema_problem({"fingerprint": {**on, "power": {"mig": "yes"}}}, RUN_NESTED)


def test_without_nvml_the_fingerprint_is_what_it_was(gpu):
    gpu["limit"] = None
    fp = fingerprint("cuda:0")
    assert "power" not in fp
    cpu = fingerprint("cpu")
    assert "power" not in cpu and cpu["device"]["type"] == "cpu"
    assert stack_difference(fp, fp) == "fingerprint_id differs"  # nothing stored tells them apart


def test_compare_names_what_differs(gpu):
    def run(fp):
        return RunData(path=None, run={"fingerprint": fp}, results=[], label="r")

    full = fingerprint("cuda:0")
    gpu["limit"] = 450.0
    with pytest.raises(CompareError, match=r"power\.limit_w 700 -> 450\); pass --allow-different-device"):
        check_same_device(run(full), run(fingerprint("cuda:0")))


def test_a_cpu_with_fewer_usable_cores_is_another_fingerprint(monkeypatch):
    """A CPU run's times are host code: one CPU model with 2 usable cores (a container's share) and with 16 is two
    devices; compare and resume name the difference."""
    monkeypatch.setattr(fingerprint_module, "usable_cores", lambda: 2)
    two = fingerprint("cpu")
    monkeypatch.setattr(fingerprint_module, "usable_cores", lambda: 16)
    sixteen = fingerprint("cpu")
    assert two["device"]["cores"] == 2 and sixteen["device"]["cores"] == 16
    assert two["fingerprint_id"] != sixteen["fingerprint_id"]
    assert stack_difference(two, sixteen) == "device.cores 2 -> 16"
    assert fingerprint("cpu")["fingerprint_id"] == sixteen["fingerprint_id"]


def test_triton_codegen_environment_is_another_fingerprint(gpu, monkeypatch):
    """DISABLE_MMA_V3=1 (the GPU check sets it after a fault with Hopper's wgmma) compiles other machine code for
    the same kernels: runs with and without it are not compared as one environment, and the difference is named."""
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    plain = fingerprint("cuda:0")
    assert "triton_codegen_env" not in plain
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    no_wgmma = fingerprint("cuda:0")
    assert no_wgmma["triton_codegen_env"] == {"DISABLE_MMA_V3": "1"}
    assert no_wgmma["fingerprint_id"] != plain["fingerprint_id"]
    assert stack_difference(plain, no_wgmma) == "triton_codegen_env {} -> {'DISABLE_MMA_V3': '1'}"
    from spark_bench.telemetry.roofline import device_identity

    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    assert device_identity("cuda:0")["fingerprint_id"] == plain["fingerprint_id"]  # peaks: the hardware's id
    assert "triton_codegen_env" not in fingerprint("cpu")  # the interpreter compiles nothing
    monkeypatch.delenv("DISABLE_MMA_V3")
    for name, value in (("DISABLE_MMA_V3", "0"), ("DISABLE_MMA_V3", "false"), ("MLIR_ENABLE_TIMING", "1"),
                        ("LLVM_IR_ENABLE_DUMP", "1")):  # off, or a timing/dump switch: the same machine code
        monkeypatch.setenv(name, value)
        assert fingerprint("cuda:0")["fingerprint_id"] == plain["fingerprint_id"], (name, value)
        monkeypatch.delenv(name)
