"""CUDA graphs for one step function: static buffers, capture, replay.

The contract, PyTorch's, obeyed by every caller of this module:

* the captured ``step(size)`` reads only static inputs and writes only static
  outputs: tensors that outlive the graphs (the buffers this manager owns, a KV
  cache, weights). It allocates nothing it hands back and runs no host sync;
* before ``replay(n)`` the caller copies new data into the static inputs;
* after it the caller reads results from the static outputs.

Python inside ``step`` runs at warm-up and capture only; a replay runs the
recorded device work, nothing else.

Backends:

``cuda``
    ``torch.cuda.CUDAGraph``: one graph per size, captured largest first into
    one memory pool (the caller's, e.g. vLLM's global graph pool, or our own).
    A caller that must route each capture (vLLM's ``capture_pool`` for sleep
    mode, its capture stream) passes a ``graph_scope``.
``emulated``
    For machines without CUDA, to prove callers keep the contract. Capture
    runs the step under a dispatch mode that records every aten op with its
    non-tensor arguments, the address, offset, shape, stride and dtype of every
    tensor that was not allocated inside the step, and the size of everything
    it allocates. Replay runs the step again and raises
    :class:`StaticMemoryViolation` before the first op that differs: another
    tensor (a fresh one instead of the static buffer), another shape, a
    Python value baked in at capture (a scalar argument that changed), or an
    allocation capture did not make. Ops a CUDA graph cannot hold (host
    syncs, data-dependent shapes) raise at capture.

    What it does not catch: Python side effects that issue no aten op (a
    counter, a log line, a connector callback that touches no tensor) still run
    at every emulated replay, whereas a real replay skips them; stream and
    event misuse; reads of memory a real graph would see stale because an
    asynchronous copy had not finished. Those need a GPU run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from tqdm import tqdm

from cg_extract.capture_sizes import CaptureSizes

BACKENDS = ("cuda", "emulated")

Step = Callable[[int], None]

# Given the manager's pool, enter whatever must surround one capture and yield
# the (pool, stream) that ``torch.cuda.graph`` captures with.
GraphScope = Callable[[Any], AbstractContextManager[tuple[Any, Any]]]


@contextlib.contextmanager
def default_graph_scope(pool: Any) -> Iterator[tuple[Any, Any]]:
    """The manager's pool and torch's own capture stream."""
    yield pool, None


class GraphCaptureError(RuntimeError):
    """The step cannot be captured as a CUDA graph."""


class StaticMemoryViolation(GraphCaptureError):
    """A replay touched memory, shapes or values other than its capture did."""


class CudaGraphManager:
    """Static buffers sized for the largest capture size, one graph per size."""

    def __init__(
        self,
        capture_sizes: CaptureSizes | Iterable[int],
        device: torch.device | str,
        backend: str = "cuda",
        pool: Any = None,
        graph_scope: GraphScope = default_graph_scope,
    ):
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown CUDA graph backend {backend!r}; use one of {BACKENDS}"
            )
        if backend == "cuda" and not torch.cuda.is_available():
            raise GraphCaptureError(
                "backend 'cuda' needs a CUDA device and none is available; "
                "use backend 'emulated' to check the graph contract on CPU"
            )
        if not isinstance(capture_sizes, CaptureSizes):
            capture_sizes = CaptureSizes(capture_sizes)
        self.capture_sizes = capture_sizes
        self.device = torch.device(device)
        self.backend = backend
        self.pool = pool
        self.graph_scope = graph_scope
        self.buffers: dict[str, torch.Tensor] = {}
        self._graphs: dict[int, Any] = {}
        self.capture_time_s = 0.0
        self.capture_times_s: dict[int, float] = {}  # warm-up + capture, per size
        # What the captures themselves took, static buffers not included:
        # device memory for ``cuda``, the step's own allocations when emulated.
        self.graph_memory_bytes = 0

    @property
    def max_size(self) -> int:
        return self.capture_sizes.max_size

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def static_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def static_buffer(
        self,
        name: str,
        trailing_shape: tuple[int, ...],
        dtype: torch.dtype,
        fill_value: float = 0,
    ) -> torch.Tensor:
        """Allocate ``[max_size, *trailing_shape]`` once; graphs read views of it."""
        if name in self.buffers:
            raise ValueError(f"static buffer {name!r} already allocated")
        buf = torch.full(
            (self.max_size, *trailing_shape),
            fill_value,
            dtype=dtype,
            device=self.device,
        )
        self.buffers[name] = buf
        return buf

    def padded_size(self, num_tokens: int) -> int | None:
        """The size ``replay(num_tokens)`` would replay, or None if it cannot."""
        padded = self.capture_sizes.pad(num_tokens)
        return padded if padded in self._graphs else None

    def capture(
        self, step: Step, desc: str = "Capturing CUDA graphs", progress: bool = True
    ) -> None:
        """Warm up and capture ``step`` for every size, largest first."""
        if self._graphs:
            raise GraphCaptureError("graphs already captured; call release() first")
        sizes = sorted(self.capture_sizes.sizes, reverse=True)
        start = time.perf_counter()
        free_before = self._free_device_memory()
        for size in tqdm(sizes, desc=f"{desc} ({self.backend})", disable=not progress):
            begin = time.perf_counter()
            step(size)  # eager warm-up: lazy init and autotuning stay out of the graph
            self._graphs[size] = self._capture_one(step, size)
            self._sync()
            self.capture_times_s[size] = time.perf_counter() - begin
        self.capture_time_s = time.perf_counter() - start
        if self.backend == "cuda":
            # Another process may free memory meanwhile; the graphs took none.
            self.graph_memory_bytes = max(free_before - self._free_device_memory(), 0)
        else:
            self.graph_memory_bytes = max(g.held_bytes for g in self._graphs.values())

    def replay(self, num_tokens: int) -> int:
        """Replay the graph for ``pad(num_tokens)``; returns that padded size."""
        padded = self.padded_size(num_tokens)
        if padded is None:
            raise GraphCaptureError(
                f"no graph for {num_tokens} tokens (captured: {self.captured_sizes}); "
                "check padded_size() and run the step eagerly instead"
            )
        self._graphs[padded].replay()
        return padded

    def release(self) -> None:
        self._graphs.clear()
        self.capture_times_s.clear()
        self.graph_memory_bytes = 0

    def _capture_one(self, step: Step, size: int) -> Any:
        if self.backend == "cuda":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with (
                self.graph_scope(self.pool) as (pool, stream),
                torch.cuda.graph(graph, pool=pool, stream=stream),
            ):
                step(size)
            return graph
        return EmulatedGraph.capture(step, size)

    def _sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_device_memory(self) -> int:
        """Free device memory with the allocator's cache emptied first: every
        ``torch.cuda.graph`` empties it on entry, so a sample taken with cached
        blocks would count their release against the graphs."""
        if self.backend != "cuda":
            return 0
        self._sync()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]


# --------------------------------------------------------------------------
# Emulation


# Ops a CUDA graph cannot contain: they wait for the device or size their
# output from device data.
_UNCAPTURABLE = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::bincount",
}


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    """``x[mask]``: a boolean index sizes the output from device data."""
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in args[1]
    )


@dataclass(frozen=True)
class _TensorRef:
    """Where an op's tensor argument lives. External memory is named by its
    address, internal (step-allocated) memory by its allocation index."""

    kind: str  # "external" | "internal" | "empty"
    where: int  # data pointer of the storage, or allocation index
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        place = (
            f"external tensor at 0x{self.where:x}"
            if self.kind == "external"
            else f"step-allocated tensor #{self.where}"
        )
        return (
            f"{place} (offset {self.offset}, shape {list(self.shape)}, "
            f"stride {list(self.stride)}, {self.dtype})"
        )


@dataclass(frozen=True)
class _OpRecord:
    name: str
    args: tuple[Any, ...]  # _TensorRef or plain values, in pytree order
    allocs: tuple[tuple[int, torch.dtype], ...]  # (nbytes, dtype) of new storages


class _Recorder(TorchDispatchMode):
    """Records (at capture) or checks against a record (at replay) every op."""

    def __init__(self, size: int, expected: list[_OpRecord] | None = None):
        super().__init__()
        self.size = size
        self.expected = expected
        self.records: list[_OpRecord] = []
        # Every storage touched is held so that no address is reused while the
        # graph lives: a real graph pins the memory it captured the same way.
        self.held: dict[int, torch.UntypedStorage] = {}
        self.internal: dict[int, int] = {}  # data_ptr -> allocation index

    def _ref(self, t: torch.Tensor) -> _TensorRef:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0:
            # Empty tensors own no memory; they all share address 0.
            return _TensorRef("empty", 0, 0, tuple(t.shape), tuple(t.stride()), t.dtype)
        self.held.setdefault(ptr, storage)
        kind, where = (
            ("internal", self.internal[ptr])
            if ptr in self.internal
            else (
                "external",
                ptr,
            )
        )
        return _TensorRef(
            kind,
            where,
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _UNCAPTURABLE or (name == "aten::index" and _has_mask_index(args)):
            raise GraphCaptureError(
                f"{name} (size {self.size}) synchronises with the host or sizes "
                "its output from device data; a CUDA graph cannot capture it"
            )
        leaves, _ = tree_flatten((args, kwargs))
        refs = tuple(self._ref(x) if isinstance(x, torch.Tensor) else x for x in leaves)
        index = len(self.records)
        if self.expected is not None:
            self._check_inputs(index, name, refs)

        out = func(*args, **kwargs)

        allocs = []
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() and ptr not in self.held:
                self.held[ptr] = storage
                self.internal[ptr] = len(self.internal)
                allocs.append((storage.nbytes(), t.dtype))
        record = _OpRecord(name, refs, tuple(allocs))
        if self.expected is not None and record.allocs != self.expected[index].allocs:
            raise StaticMemoryViolation(
                f"replay of size {self.size}: op #{index} {name} allocated "
                f"{list(record.allocs)} but at capture {list(self.expected[index].allocs)}"
                "; a CUDA graph replays the allocations it captured"
            )
        self.records.append(record)
        return out

    def _check_inputs(self, index: int, name: str, refs: tuple[Any, ...]) -> None:
        expected = self.expected
        assert expected is not None
        where = f"replay of size {self.size}: op #{index} {name}"
        if index >= len(expected):
            raise StaticMemoryViolation(
                f"{where} was not captured (capture recorded {len(expected)} ops); "
                "the step's work must not depend on Python state that changes "
                "between capture and replay"
            )
        want = expected[index]
        if want.name != name:
            raise StaticMemoryViolation(
                f"{where}: capture ran {want.name} here; the step took another path "
                "than at capture, which a CUDA graph replay cannot do"
            )
        if len(want.args) != len(refs):
            raise StaticMemoryViolation(
                f"{where}: {len(refs)} arguments, {len(want.args)} at capture"
            )
        for i, (got, exp) in enumerate(zip(refs, want.args, strict=True)):
            if got == exp or (got != got and exp != exp):  # NaN == NaN here
                continue
            if isinstance(exp, _TensorRef) or isinstance(got, _TensorRef):
                raise StaticMemoryViolation(
                    f"{where} argument {i}: captured {_show(exp)}, replay passed "
                    f"{_show(got)}. A CUDA graph replays the addresses and shapes "
                    "it captured: copy new data into the static buffer instead"
                )
            raise StaticMemoryViolation(
                f"{where} argument {i}: captured value {exp!r}, replay {got!r}. "
                "A CUDA graph bakes Python values in at capture; pass them "
                "through a static tensor instead"
            )

    def finish(self) -> None:
        if self.expected is not None and len(self.records) != len(self.expected):
            raise StaticMemoryViolation(
                f"replay of size {self.size} ran {len(self.records)} ops, capture "
                f"recorded {len(self.expected)}; the replayed step skipped work "
                "that a CUDA graph would still do"
            )


def _show(arg: Any) -> str:
    return arg.describe() if isinstance(arg, _TensorRef) else repr(arg)


class EmulatedGraph:
    """A recorded step that replays by running again under inspection."""

    def __init__(self, step: Step, size: int, recorder: _Recorder):
        self.step = step
        self.size = size
        self.records = recorder.records
        self._held = recorder.held
        self.held_bytes = sum(
            recorder.held[p].nbytes() for p in recorder.internal if p in recorder.held
        )

    @classmethod
    def capture(cls, step: Step, size: int) -> EmulatedGraph:
        recorder = _Recorder(size)
        with recorder:
            step(size)
        return cls(step, size, recorder)

    def replay(self) -> None:
        recorder = _Recorder(self.size, expected=self.records)
        with recorder:
            self.step(self.size)
        recorder.finish()
