"""How the sweep measures a step: timing, op counting, bytes, bandwidth.

Nothing here knows an engine or a mode; it takes a zero-argument ``step``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cg_extract.cudagraph_manager import CudaGraphManager

Step = Callable[[], Any]

# --------------------------------------------------------------------------
# Order of execution


def interleaved_schedule(
    modes: Sequence[str], iters: int, batch: int
) -> list[tuple[str, int]]:
    """``(mode, steps)`` in execution order: rounds of ``batch`` steps per
    mode, each round starting one mode later, so that drift (clocks, caches,
    neighbours on a shared machine) and position in the round hit every mode
    alike."""
    modes = list(modes)
    schedule = []
    for round_index, done in enumerate(range(0, iters, batch)):
        steps = min(batch, iters - done)
        start = round_index % len(modes)
        schedule += [(mode, steps) for mode in modes[start:] + modes[:start]]
    return schedule


# --------------------------------------------------------------------------
# Timing


@dataclass
class Timings:
    """Per-step samples in microseconds."""

    device_us: list[float] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)

    def extend(self, other: Timings) -> None:
        self.device_us += other.device_us
        self.host_us += other.host_us

    def percentile(self, q: float) -> float:
        return _percentile(self.device_us, q)

    @property
    def host_median_us(self) -> float:
        return _percentile(self.host_us, 50)

    def columns(self) -> dict[str, float]:
        """The report's latency columns (``host_us`` NaN without host samples)."""
        return {
            **{f"p{q}_us": self.percentile(q) for q in (50, 90, 99)},
            "host_us": self.host_median_us,
        }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


def time_steps(step: Step, count: int, device: torch.device) -> Timings:
    """Run ``step`` ``count`` times; device time per step from CUDA events
    where there is CUDA (else wall time, the same thing on a CPU), host time
    from ``perf_counter`` around the call (what the host spends dispatching)."""
    timings = Timings()
    if device.type != "cuda":
        for _ in range(count):
            start = time.perf_counter()
            step()
            timings.host_us.append((time.perf_counter() - start) * 1e6)
        timings.device_us = list(timings.host_us)
        return timings
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(count)
    ]
    for begin, end in events:
        begin.record()
        start = time.perf_counter()
        step()
        timings.host_us.append((time.perf_counter() - start) * 1e6)
        end.record()
    torch.cuda.synchronize(device)
    timings.device_us = [begin.elapsed_time(end) * 1e3 for begin, end in events]
    return timings


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second one large ``copy_`` moves (read + write), best of
    ``repeats``: the practical peak a step's memory traffic is held against."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and lazy init stay out of the timing
    best = math.inf
    for _ in range(repeats):
        timings = time_steps(lambda: dst.copy_(src), 1, device)
        best = min(best, timings.device_us[0] * 1e-6)
    return 2 * nbytes / best


# --------------------------------------------------------------------------
# Ops and bytes


@dataclass(frozen=True)
class OpRecord:
    name: str  # aten overload, e.g. "aten.index_put_.default"
    bytes: int  # bytes read + written, by the model in bytes_moved


@dataclass
class StepCount:
    """The aten ops one step dispatched from the host, and those its graph
    replays ran (a replay dispatches none: they were captured)."""

    dispatched: list[OpRecord] = field(default_factory=list)
    replayed: list[OpRecord] = field(default_factory=list)
    replayed_sizes: list[int] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(op.bytes for op in [*self.dispatched, *self.replayed])

    def padded_tokens(self, num_tokens: int) -> int:
        """The size the step's graph processed, or ``num_tokens`` if eager."""
        return max(self.replayed_sizes, default=num_tokens)


class _OpCounter(TorchDispatchMode):
    def __init__(self, count: StepCount):
        super().__init__()
        self.count = count
        self.target = count.dispatched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.target.append(OpRecord(str(func), bytes_moved(func, args, kwargs, out)))
        return out


@contextlib.contextmanager
def graph_steps_kept() -> Iterator[None]:
    """While runners are built, remember the step each graph manager captures,
    so that :func:`count_step` can run a replay's work eagerly."""
    capture = CudaGraphManager.capture

    def capture_and_keep(self, step, *args, **kwargs):
        self._perf_captured_step = step
        return capture(self, step, *args, **kwargs)

    with mock.patch.object(CudaGraphManager, "capture", capture_and_keep):
        yield


def count_step(step: Step) -> StepCount:
    """Count one step's ops. Each graph replay inside it runs its captured
    step eagerly instead, with those ops counted as replayed: the same work
    on the same memory, which a real replay would hide from the counter."""
    count = StepCount()
    counter = _OpCounter(count)

    def replay_eagerly(self, num_tokens: int) -> int:
        padded = self.padded_size(num_tokens)
        captured = getattr(self, "_perf_captured_step", None)
        if padded is None or captured is None:
            raise RuntimeError(
                "count_step: a replay of a graph captured outside "
                "graph_steps_kept(), or of a size it has no graph for"
            )
        counter.target = count.replayed
        try:
            captured(padded)
        finally:
            counter.target = count.dispatched
        count.replayed_sizes.append(padded)
        return padded

    with mock.patch.object(CudaGraphManager, "replay", replay_eagerly), counter:
        step()
    return count


# Ops that hand out uninitialised memory or metadata: no bytes move.
_NO_DATA = ("empty", "empty_strided", "empty_like", "new_empty")
_SCATTERS = ("index_put_", "index_put", "_index_put_impl_")
_GATHERS = ("index", "index_select", "gather")
# cg_extract.write_op: reads the slots, and the rows of owned (>= 0) slots only.
_SLOT_WRITES = ("write_hidden_states",)


def bytes_moved(func, args, kwargs, out) -> int:
    """Bytes an op reads plus bytes it writes, at element granularity.

    * views and allocations move nothing;
    * scatters (``x[idx] = v``) read ``v`` and the indices and write as many
      elements as the index selects, not the whole destination;
    * gathers (``x[idx]``) read as many elements as they return, plus the
      indices, and write their output;
    * the hidden-state write op reads every slot, and reads and writes the
      ``L`` rows of each token whose slot is not padding (reading the slots
      here is a host sync, fine for a step that is counted, never timed);
    * every other op reads its tensor arguments and writes either its mutable
      arguments (``copy_``, ``out=``) or, if it has none, its outputs.

    Caches, padding and index arithmetic at the byte level are out of scope:
    this is the traffic the program asks for, to hold against the floor.
    """
    name = func.overloadpacket.__name__
    schema = func._schema
    if name in _NO_DATA or _is_view(schema):
        return 0
    if name in _SCATTERS:
        dest, indices, values = args[0], args[1], args[2]
        index_bytes = sum(_nbytes(i) for i in indices if i is not None)
        written = _indexed_numel(dest.shape, indices) * dest.element_size()
        return _nbytes(values) + index_bytes + written
    if name in _SLOT_WRITES:
        aux, slots = args[0], args[2]
        owned = int((slots >= 0).sum())
        row_bytes = sum(h.shape[-1] * h.element_size() for h in aux)
        return _nbytes(slots) + 2 * owned * row_bytes
    outputs = sum(_nbytes(t) for t in _tensors(out))
    if name in _GATHERS:
        index_bytes = sum(_nbytes(t) for t in _tensors(args[1:]))
        return 2 * outputs + index_bytes
    read = written = 0
    for position, arg in enumerate(schema.arguments):
        value = args[position] if position < len(args) else kwargs.get(arg.name)
        size = sum(_nbytes(t) for t in _tensors(value))
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += size
        else:
            read += size
    return read + (written or outputs)


def _is_view(schema) -> bool:
    returns = schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _indexed_numel(shape: torch.Size, indices: Sequence[Any]) -> int:
    """Elements ``x[indices]`` selects: the broadcast index shape times the
    dimensions the index leaves whole (``None`` entries and trailing dims)."""
    index_shapes = [i.shape for i in indices if i is not None]
    selected = math.prod(torch.broadcast_shapes(*index_shapes)) if index_shapes else 1
    whole = [
        size
        for size, index in itertools.zip_longest(shape, indices[: len(shape)])
        if index is None
    ]
    return selected * math.prod(whole)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------
# Kernel launches (CUDA only)

# Runtime calls that put work on a stream: what a graph replay collapses.
_LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)


def count_launches(step: Step, device: torch.device) -> float:
    """Stream launches one step makes (kernels, copies, memsets, graph
    launches), from the profiler's CUDA runtime events; NaN off CUDA."""
    if device.type != "cuda":
        return math.nan
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    return float(sum(1 for e in prof.events() if e.name in _LAUNCH_CALLS))
