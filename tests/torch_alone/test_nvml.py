"""The NVML sampler, against a fake of pynvml (the real one on a GPU:
tests/cuda/test_nvml_cuda.py)."""

from __future__ import annotations

import inspect
import math
import sys
import time

import pynvml
import pytest

from perf.fake_nvml import FakeNvml
from perf.nvml import COLUMNS, NvmlSampler, nvml_index

USED = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetTotalEnergyConsumption",
)


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# --------------------------------------------------------------------------
# The fake is faithful where the sampler depends on it


@pytest.mark.parametrize("name", USED)
def test_fake_has_the_real_signatures(name):
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNvml(), name))
    assert list(fake.parameters) == list(real.parameters)


def test_fake_raises_what_real_nvml_raises():
    nvml = FakeNvml(device_count=1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(1)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 42
    assert isinstance(nvml.nvmlDeviceGetMemoryInfo(handle).used, int)
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetPowerUsage(handle)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml(driver_loaded=False).nvmlInit()


# --------------------------------------------------------------------------
# Sampling


def test_samples_in_a_thread_while_a_segment_is_open():
    nvml = FakeNvml()
    with NvmlSampler(nvml, interval_s=0.005) as sampler:
        assert sampler.available
        with sampler.segment("row"):
            wait_for(lambda: nvml.calls.count("nvmlDeviceGetPowerUsage") >= 3)
        summary = sampler.summary("row", steps=10)
    assert summary == {
        "gpu_util_pct": 42.0,
        "gpu_mem_used_mib": 3072.0,
        "power_w": 250.0,
        "sm_clock_mhz": 1755.0,
        # one energy read at each edge of the segment, 1000 mJ apart
        "energy_mj_per_step": 100.0,
    }
    assert nvml.initialized == 0  # nvmlShutdown balanced nvmlInit


def test_thread_is_idle_outside_segments_and_stops_on_close():
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml, interval_s=0.005).start()
    time.sleep(0.05)
    assert "nvmlDeviceGetPowerUsage" not in nvml.calls
    sampler.close()
    assert not sampler._thread.is_alive()
    assert nvml.calls[-1] == "nvmlShutdown"


def test_interleaved_segments_keep_their_own_samples_and_energy():
    nvml = FakeNvml()
    with NvmlSampler(nvml, interval_s=0.005) as sampler:
        for _ in range(2):
            with sampler.segment("a"):
                nvml.power_mw = 100_000
                time.sleep(0.02)
            with sampler.segment("b"):
                nvml.power_mw = 300_000
                time.sleep(0.02)
        a, b = sampler.summary("a", steps=4), sampler.summary("b", steps=4)
    # A sample in flight when a segment closes may still read the old power,
    # but most of each row's samples are its own.
    assert 100 <= a["power_w"] < 200 < b["power_w"] <= 300
    assert a["energy_mj_per_step"] == b["energy_mj_per_step"] == 2 * 1000 / 4


def test_unsupported_counter_is_nan_and_the_rest_still_reported():
    nvml = FakeNvml(unsupported=("nvmlDeviceGetTotalEnergyConsumption",))
    with NvmlSampler(nvml, interval_s=0.005) as sampler:
        with sampler.segment("row"):
            pass
        summary = sampler.summary("row", steps=5)
    assert math.isnan(summary["energy_mj_per_step"])
    assert summary["power_w"] == 250.0


def test_a_rows_readings_are_means_and_its_memory_the_peak():
    """Over a row's samples, skipping a counter's NaN (one that raised)."""
    sampler = NvmlSampler(FakeNvml())
    sampler._rows["row"].samples = [
        {"gpu_util_pct": 10, "gpu_mem_used_mib": 9, "power_w": 100, "sm_clock_mhz": 1000},
        {"gpu_util_pct": 30, "gpu_mem_used_mib": 5, "power_w": 300, "sm_clock_mhz": math.nan},
    ]  # fmt: skip
    summary = sampler.summary("row", steps=2)
    assert [summary[c] for c in COLUMNS] == [20, 9, 200, 1000, 0]


def assert_all_nan(sampler: NvmlSampler) -> None:
    with sampler.segment("row"):
        pass
    summary = sampler.summary("row", steps=3)
    assert list(summary) == list(COLUMNS)
    assert all(math.isnan(v) for v in summary.values()), summary  # NaN, not zero


def test_no_driver_gives_nan_columns_not_zeros():
    sampler = NvmlSampler(FakeNvml(driver_loaded=False)).start()
    assert not sampler.available
    assert "Library Not Found" in sampler.reason
    assert_all_nan(sampler)
    sampler.close()


def test_missing_device_gives_nan_and_shuts_nvml_down():
    nvml = FakeNvml(device_count=1)
    sampler = NvmlSampler(nvml, index=3).start()
    assert not sampler.available
    assert "no device 3" in sampler.reason
    assert nvml.initialized == 0
    assert_all_nan(sampler)


def test_without_pynvml_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises
    sampler = NvmlSampler().start()
    assert "not installed" in sampler.reason
    assert_all_nan(sampler)


def test_row_never_opened_is_nan():
    with NvmlSampler(FakeNvml()) as sampler:
        assert all(math.isnan(v) for v in sampler.summary("never", 1).values())


@pytest.mark.parametrize(
    ("visible", "cuda_index", "expected"),
    [(None, 1, 1), ("", 0, 0), ("2,3", 1, 3), ("GPU-1234", 0, 0), ("5", 0, 5)],
)
def test_nvml_index_follows_cuda_visible_devices(visible, cuda_index, expected):
    assert nvml_index(cuda_index, visible) == expected
