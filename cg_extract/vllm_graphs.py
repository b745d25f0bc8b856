"""The speculator's graphs as vLLM's worker sees them: a ``CudaGraphManager``.

vLLM finds a speculator's graphs by walking its attributes for instances of
its own ``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager``:

* ``profile_cudagraph_memory`` sets each such attribute to None after the
  profiling capture, so the throwaway graph pool, and everything the
  profiling graphs hold, is freed before the real KV cache is allocated;
* elastic EP's ``_release_cuda_graphs`` calls ``release_graphs()`` on each,
  then captures again (``speculator.capture()``).

:class:`SpeculatorGraphs` is that attribute. It owns the only reference to
the torch-only :class:`~cg_extract.write_graphs.WriteGraphs` (static buffers,
graphs, the views of the target's buffers), so dropping or releasing it drops
all of them. It builds them in :meth:`capture`, inside the window vLLM's
``capture_model`` measures (and ``profile_cudagraph_memory`` reserves), and
captures as vLLM's own managers do: inside ``graph_capture(device)``, each
graph inside ``capture_pool(...)`` on vLLM's capture stream, into vLLM's
global graph pool (the profiler's throwaway pool while it profiles), so that
sleep mode's cuMem pool holds them when it offloads graphs.

vLLM's descriptor planning is not used: the base class is built with
``CUDAGraphMode.NONE`` (no descriptors, no pool looked up), our sizes are our
own. That also keeps construction free of CUDA, so the emulated backend runs
the same lifecycle on CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from cg_extract.capture_sizes import CaptureSizes
from cg_extract.write_graphs import GraphInputs, Write, WriteGraphs


class SpeculatorGraphs(CudaGraphManager):
    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        backend: str,
        capture_sizes: CaptureSizes,
        num_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        write: Write,
    ):
        super().__init__(
            vllm_config,
            device,
            CUDAGraphMode.NONE,
            decode_query_len=vllm_config.uniform_decode_query_len,
        )
        self.backend = backend
        self.capture_sizes = capture_sizes
        self._shape = (num_layers, hidden_size, dtype)
        self.write = write  # the captured step, as WriteGraphs takes it
        self.write_graphs: WriteGraphs | None = None

    def needs_capture(self) -> bool:
        return self.write_graphs is None

    def capture(  # type: ignore[override]  # vLLM's takes a forward factory
        self,
        persistent: GraphInputs | None,
        zero_copy_sizes: Sequence[int],
        progress: bool,
    ) -> WriteGraphs:
        """Allocate the static buffers and capture every graph."""
        if self.write_graphs is not None:
            raise RuntimeError(
                "speculator graphs already captured; release_graphs() first"
            )
        cuda = self.backend == "cuda"
        if cuda:
            from vllm.platforms import current_platform

            # Looked up now, not at construction: while vLLM profiles, the
            # global pool is its throwaway pool.
            self.pool = current_platform.get_global_graph_pool()
        with self._graph_capture() if cuda else contextlib.nullcontext():
            graphs = WriteGraphs(
                self.capture_sizes,
                self.device,
                self.backend,
                *self._shape,
                write=self.write,
                pool=self.pool,
                # A function of the config, not a method: the graphs keep
                # it, and a bound method would tie them to this manager in
                # a cycle that outlives vLLM dropping it.
                graph_scope=functools.partial(vllm_graph_scope, self.vllm_config),
            )
            graphs.capture(persistent, zero_copy_sizes, progress=progress)
        self.write_graphs = graphs
        self._graphs_captured = True
        return graphs

    def release_graphs(self) -> None:
        """Drop graphs, static buffers and views of the target's buffers; a
        later :meth:`capture` builds them again."""
        super().release_graphs()
        if self.write_graphs is not None:
            self.write_graphs.release()
        self.write_graphs = None

    def _graph_capture(self) -> contextlib.AbstractContextManager[Any]:
        from vllm.distributed.parallel_state import graph_capture

        return graph_capture(self.device)


@contextlib.contextmanager
def vllm_graph_scope(vllm_config: VllmConfig, pool: Any) -> Iterator[tuple[Any, Any]]:
    """One capture as ``CudaGraphManager.capture`` makes it: the pool
    ``capture_pool`` picks (sleep mode's cuMem pool when it offloads graphs)
    and vLLM's current stream (``graph_capture``'s)."""
    from vllm.compilation.cudagraph_pool import capture_pool
    from vllm.utils.torch_utils import current_stream

    with capture_pool(pool, vllm_config) as chosen:
        yield chosen, current_stream()
