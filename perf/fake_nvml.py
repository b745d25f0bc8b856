"""A FAKE of the pynvml calls :class:`perf.nvml.NvmlSampler` makes, for tests.

It is not NVML and measures nothing. It keeps the real module's signatures,
return types (structs with ``.gpu``, ``.used``; power in milliwatts; energy in
millijoules; clocks in MHz) and error behaviour: it raises ``pynvml.NVMLError``
with the code real NVML returns: ``Uninitialized`` for any call before
``nvmlInit`` or after ``nvmlShutdown``, ``InvalidArgument`` for a device index
it does not have, ``LibraryNotFound`` from ``nvmlInit`` on a machine without the
driver, ``NotSupported`` for a counter the GPU lacks (energy before Volta).
``tests/torch_alone/test_nvml.py`` checks the signatures against the installed pynvml.
"""

from __future__ import annotations

import threading
import types

import pynvml

NVMLError = pynvml.NVMLError
NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM


class FakeNvml(types.ModuleType):
    """``FakeNvml()`` stands where ``import pynvml`` would."""

    NVMLError = NVMLError
    NVML_CLOCK_SM = NVML_CLOCK_SM

    # Its readings; a test may set them on an instance.
    util_pct = 42
    mem_used_bytes = 3 * 2**30
    power_mw = 250_000
    sm_clock_mhz = 1755
    energy_step_mj = 1000  # the counter's rise per read

    def __init__(self, device_count=1, driver_loaded=True, unsupported=()):
        super().__init__("fake_pynvml", "A fake of pynvml for tests; not NVML.")
        self.device_count = device_count
        self.driver_loaded = driver_loaded
        self.unsupported = set(unsupported)  # names of calls that raise NotSupported
        self.initialized = 0  # NVML counts nested nvmlInit calls
        self.calls: list[str] = []
        self._energy_mj = 10**9
        self._lock = threading.Lock()

    # -- library --------------------------------------------------------

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if not self.driver_loaded:
            raise NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized += 1

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")
        self._check_initialized()
        self.initialized -= 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < self.device_count:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("fake-handle", index)

    # -- counters -------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = self.util_pct, self.util_pct // 2
        return util

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = 141 * 2**30
        memory.used = self.mem_used_bytes
        memory.free = memory.total - memory.used
        return memory

    def nvmlDeviceGetPowerUsage(self, handle):
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return self.power_mw

    def nvmlDeviceGetClockInfo(self, handle, type):
        self._enter("nvmlDeviceGetClockInfo", handle)
        if type != NVML_CLOCK_SM:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.sm_clock_mhz

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        with self._lock:
            self._energy_mj += self.energy_step_mj
            return self._energy_mj

    # -- checks real NVML makes -----------------------------------------

    def _enter(self, name: str, handle=None) -> None:
        self.calls.append(name)
        self._check_initialized()
        if handle is not None and (
            not isinstance(handle, tuple) or handle[0] != "fake-handle"
        ):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if name in self.unsupported:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _check_initialized(self) -> None:
        if self.initialized <= 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
