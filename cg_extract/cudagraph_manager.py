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
    For machines without CUDA, to prove callers keep the contract: each size's
    step is recorded at capture and checked at every replay
    (:mod:`cg_extract.emulated_graph`, which says what it cannot see).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from tqdm import tqdm

from cg_extract.capture_sizes import CaptureSizes
from cg_extract.emulated_graph import EmulatedGraph, GraphCaptureError, Step

BACKENDS = ("cuda", "emulated")


# Given the manager's pool, enter whatever must surround one capture and yield
# the (pool, stream) that ``torch.cuda.graph`` captures with.
GraphScope = Callable[[Any], AbstractContextManager[tuple[Any, Any]]]


@contextlib.contextmanager
def default_graph_scope(pool: Any) -> Iterator[tuple[Any, Any]]:
    """The manager's pool and torch's own capture stream."""
    yield pool, None


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
        self.capture_time_s = 0.0
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
