"""GPU counters from NVML while the sweep runs, attributed to rows.

A thread samples utilisation, memory used, power and SM clock every
``interval_s`` while a labelled segment is open; the sweep opens one segment
per batch of steps, labelled with its row, so interleaved rows never share a
sample. Energy comes from the total-energy counter read at the segment's edges.
Each segment's close also takes one sample in the calling thread, so a row too
short for the thread's interval still gets a reading.

NVML's own windows are coarse (utilisation averages over 1/6 s to 1 s, power
over up to 1 s, the energy counter moves in steps): for a row that lasts a few
milliseconds these columns describe its neighbourhood. Where NVML is absent
(no pynvml, no driver, no GPU) every column is NaN, never zero.

The ``nvml`` module is injectable: the sweep passes ``pynvml``, the tests a
fake (:mod:`perf.fake_nvml`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import defaultdict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

COLUMNS = (
    "gpu_util_pct",
    "gpu_mem_used_mib",
    "power_w",
    "sm_clock_mhz",
    "energy_mj_per_step",
)


@dataclass
class _Segments:
    samples: list[dict[str, float]] = field(default_factory=list)
    energy_mj: float = 0.0
    energy_known: bool = True


class NvmlSampler:
    def __init__(self, nvml: Any = None, index: int = 0, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.index = index
        self.reason = ""  # why the columns are NaN, when they are
        self._nvml = nvml
        self._handle = None
        self._label: Hashable | None = None
        self._rows: dict[Hashable, _Segments] = defaultdict(_Segments)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    # ------------------------------------------------------------------
    # Life cycle

    def start(self) -> NvmlSampler:
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py) is not installed"
                return self
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as why:
            self.reason = f"NVML did not start: {why}"
            return self
        try:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
        except nvml.NVMLError as why:
            nvml.nvmlShutdown()
            self.reason = f"NVML has no device {self.index}: {why}"
            return self
        self._nvml = nvml
        self._thread = threading.Thread(
            target=self._run, name="nvml-sampler", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if not self.available:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._nvml.nvmlShutdown()
        self._handle = None

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    # Attribution

    @contextlib.contextmanager
    def segment(self, label: Hashable) -> Iterator[None]:
        """Attribute samples and energy taken until exit to ``label``."""
        if not self.available:
            yield
            return
        before = self._energy_mj()
        self._label = label
        try:
            yield
        finally:
            self._label = None
            after = self._energy_mj()
            sample = self._sample()
            with self._lock:
                row = self._rows[label]
                row.samples.append(sample)
                if before is None or after is None:
                    row.energy_known = False
                else:
                    row.energy_mj += after - before

    def summary(self, label: Hashable, steps: int) -> dict[str, float]:
        """The row's columns: means over its samples, peak memory, energy per
        step over its segments. NaN where NVML or the counter is missing."""
        with self._lock:
            row = self._rows.get(label)
        if row is None or not row.samples:
            return dict.fromkeys(COLUMNS, math.nan)

        def over(key: str, reduce=lambda v: sum(v) / len(v)) -> float:
            values = [s[key] for s in row.samples if not math.isnan(s[key])]
            return reduce(values) if values else math.nan

        return {
            "gpu_util_pct": over("gpu_util_pct"),
            "gpu_mem_used_mib": over("gpu_mem_used_mib", max),
            "power_w": over("power_w"),
            "sm_clock_mhz": over("sm_clock_mhz"),
            "energy_mj_per_step": (
                row.energy_mj / steps if row.energy_known and steps else math.nan
            ),
        }

    # ------------------------------------------------------------------
    # Sampling

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            label = self._label
            if label is None:
                continue
            sample = self._sample()
            if self._label is not label:
                continue  # the segment closed while sampling: not its reading
            with self._lock:
                self._rows[label].samples.append(sample)

    def _sample(self) -> dict[str, float]:
        nvml, h = self._nvml, self._handle
        queries = {
            "gpu_util_pct": lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu_mem_used_mib": lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20,
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
            "sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
        }
        return {column: self._read(query) for column, query in queries.items()}

    def _energy_mj(self) -> float | None:
        value = self._read(
            lambda: self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        )
        return None if math.isnan(value) else value

    def _read(self, query) -> float:
        """One counter; NaN where this GPU does not support it (NVML raises)."""
        try:
            return float(query())
        except self._nvml.NVMLError:
            return math.nan


def nvml_index(cuda_index: int, visible_devices: str | None) -> int:
    """NVML numbers every GPU; CUDA only the visible ones, in the order of
    ``CUDA_VISIBLE_DEVICES`` when it lists indices."""
    if not visible_devices:
        return cuda_index
    entries = [e.strip() for e in visible_devices.split(",")]
    if cuda_index < len(entries) and entries[cuda_index].isdigit():
        return int(entries[cuda_index])
    return cuda_index
