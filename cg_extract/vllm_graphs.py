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

What the speculator's ``init_cudagraph_manager`` and ``capture`` decide is
here too, as vLLM's own managers decide it from the config: whether there are
graphs at all and on which backend (:func:`graph_backend`), for which token
counts (:func:`capture_sizes`), and which of the target's persistent buffers
the zero-copy graphs read (:meth:`SpeculatorGraphs.persistent_inputs`). Its
lines go out once per process, from the rank that speaks for the speculator
(:func:`cg_extract.speaks`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from cg_extract import get_logger, speaks, target_buffers
from cg_extract.cache_size import MiB
from cg_extract.capture_sizes import CaptureSizes
from cg_extract.config import ExtractGraphConfig, given_keys
from cg_extract.write_graphs import GraphInputs, Write, WriteGraphs

logger = get_logger(__name__)

# Our lines open with the method's name (the plugin's with cg_extract): a
# reader, and the tests, find ours in an engine's log by it. An INFO line is
# at most 200 characters, with its longest reason.
EAGER = "extract_hidden_states runs eagerly: %s."
NO_ZERO_COPY = "extract_hidden_states: no zero-copy graphs: %s."
ABOVE_ROWS = (
    "extract_hidden_states: no zero-copy graphs above the target's %s buffer "
    "rows: %s of its FULL sizes, %s."
)


def info_once(vllm_config: VllmConfig, msg: str, *args: Any) -> None:
    """Once per process, from the rank that speaks for the speculator
    (vLLM's default scope, each node's first rank, holds none of it
    with pipeline parallelism)."""
    if speaks(vllm_config):
        logger.info_once(msg, *args, scope="process")


def graph_backend(
    vllm_config: VllmConfig,
    graph_config: ExtractGraphConfig,
    mode: CUDAGraphMode,
    device: torch.device,
    rebuilds_metadata: bool = False,
) -> tuple[str | None, str]:
    """The backend to capture on, or None and why the speculator runs eagerly
    (what to change, for the user who wants graphs). ``rebuilds_metadata``:
    the speculator builds its step's metadata on the host every step (vLLM
    0.34 under micro-batching)."""
    if not graph_config.cudagraph:
        if "cudagraph" in given_keys(vllm_config):
            return None, "'cudagraph' is false"
        return None, (
            'graph mode is off by default; add "cudagraph": true to the '
            "speculative config to capture the write as CUDA graphs"
        )
    assert vllm_config.speculative_config is not None
    if vllm_config.speculative_config.enforce_eager:
        return None, "the speculative config sets enforce_eager"
    if rebuilds_metadata:
        return None, (
            "micro-batching (enable_dbo or ubatch_size > 1): it rebuilds each "
            "step's attention metadata, as vLLM's own speculator does; graphs "
            "need both off"
        )
    # Any mode with graphs will do: copy-in graphs need nothing of the
    # target's, and zero-copy ones are captured only where the target
    # has FULL graphs (see SpeculatorGraphs.persistent_inputs).
    if mode == CUDAGraphMode.NONE:
        return None, (
            "the runner's cudagraph_mode is NONE (enforce_eager, or a "
            "platform without CUDA graphs)"
        )
    backend = graph_config.cudagraph_backend
    if backend == "auto":
        if device.type != "cuda":
            return None, f"backend 'auto' found no CUDA device ({device})"
        backend = "cuda"
    return backend, ""


def capture_sizes(
    vllm_config: VllmConfig, graph_config: ExtractGraphConfig
) -> CaptureSizes:
    """Our sizes when given, else the token counts of the target's graphs,
    so that a graph-padded target batch needs no further padding. vLLM 0.34
    (which has the split prefill / decode fields) derives them from those."""
    if graph_config.cudagraph_capture_sizes is not None:
        return CaptureSizes(graph_config.cudagraph_capture_sizes)
    from vllm.platforms import current_platform

    from cg_extract.capture_sizes import SplitSizes

    scheduler = vllm_config.scheduler_config
    compilation = vllm_config.compilation_config
    split = None
    if hasattr(compilation, "decode_cudagraph_capture_request_sizes"):
        split = SplitSizes(
            compilation.prefill_cudagraph_capture_token_sizes,
            compilation.max_prefill_cudagraph_capture_tokens,
            compilation.decode_cudagraph_capture_request_sizes,
            compilation.max_decode_cudagraph_capture_requests,
            compilation.max_decode_cudagraph_capture_tokens,
        )
    return CaptureSizes.from_vllm_inputs(
        compilation.cudagraph_capture_sizes,
        scheduler.max_num_batched_tokens,
        scheduler.max_num_seqs,
        vllm_config.uniform_decode_query_len,
        sm100=bool(current_platform.is_device_capability_family(100)),
        split=split,
    )


def capture_line(graphs: WriteGraphs) -> str:
    """The one INFO line of a capture: counts and ranges, not the lists
    (those go to DEBUG), numbers as vLLM writes its own."""
    sizes, zero_copy = graphs.captured_sizes, graphs.zero_copy_sizes
    zero = (
        f"{len(zero_copy):,} zero-copy for {_span(zero_copy)}"
        if zero_copy
        else "no zero-copy"
    )
    return (
        f"extract_hidden_states: captured {len(sizes):,} {graphs.copy_in.backend} "
        f"graphs for {_span(sizes)} tokens ({zero}) in {graphs.capture_time_s:,.2f} s, "
        f"{graphs.static_bytes / MiB:,.2f} MiB static buffers, "
        f"{graphs.graph_memory_bytes / MiB:,.2f} MiB graphs"
    )


def _span(sizes: Sequence[int]) -> str:
    low, high = min(sizes), max(sizes)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


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
            vllm_config, device, CUDAGraphMode.NONE, **decode_query_kwargs(vllm_config)
        )
        self.backend = backend
        self.capture_sizes = capture_sizes
        self._shape = (num_layers, hidden_size, dtype)
        self.write = write  # the captured step, as WriteGraphs takes it
        self.write_graphs: WriteGraphs | None = None

    @classmethod
    def plan(
        cls,
        vllm_config: VllmConfig,
        graph_config: ExtractGraphConfig,
        mode: CUDAGraphMode,
        device: torch.device,
        num_layers: int,
        dtype: torch.dtype,
        write: Write,
        rebuilds_metadata: bool = False,
    ) -> SpeculatorGraphs | None:
        """The manager for the runner's ``mode``, allocating nothing; None,
        and a line saying why, when the speculator runs eagerly."""
        backend, reason = graph_backend(
            vllm_config, graph_config, mode, device, rebuilds_metadata
        )
        if backend is None:
            info_once(vllm_config, EAGER, reason)
            return None
        return cls(
            vllm_config,
            device,
            backend,
            capture_sizes(vllm_config, graph_config),
            num_layers,
            vllm_config.model_config.get_hidden_size(),
            dtype,
            write,
        )

    def needs_capture(self) -> bool:
        return self.write_graphs is None

    def capture(  # type: ignore[override]  # vLLM's takes a forward factory
        self,
        kv_cache: torch.Tensor,
        block_tables: Any,
        kv_cache_config: KVCacheConfig | None,
        layer_name: str,
        quiet: bool = False,
    ) -> WriteGraphs:
        """Allocate the static buffers and capture every graph: copy-in
        graphs at our sizes, zero-copy ones over the target's persistent
        buffers (:meth:`persistent_inputs`). Says what it captured, unless
        ``quiet`` (the memory profiler's throwaway capture)."""
        if self.write_graphs is not None:
            raise RuntimeError(
                "speculator graphs already captured; release_graphs() first"
            )
        persistent, zero_copy_sizes = self.persistent_inputs(
            kv_cache, block_tables, kv_cache_config, layer_name
        )
        loud = speaks(self.vllm_config) and not quiet
        cuda = self.backend == "cuda"
        if cuda:
            from vllm.platforms import current_platform

            # Looked up now, not at construction: while vLLM profiles, the
            # global pool is its throwaway pool.
            self.pool = current_platform.get_global_graph_pool()
        # A function of the config, not a method: the graphs keep it, and a
        # bound method would tie them to this manager in a cycle that
        # outlives vLLM dropping it.
        scope = functools.partial(vllm_graph_scope, self.vllm_config)
        with self._graph_capture() if cuda else contextlib.nullcontext():
            sizes, device, backend = self.capture_sizes, self.device, self.backend
            graphs = WriteGraphs(
                sizes, device, backend, *self._shape, self.write, self.pool, scope
            )
            graphs.capture(persistent, zero_copy_sizes, progress=loud)
        self.write_graphs = graphs
        self._graphs_captured = True
        if loud:
            logger.info(capture_line(graphs))
            logger.debug(
                "extract_hidden_states: captured sizes %s, zero-copy sizes %s",
                graphs.captured_sizes,
                graphs.zero_copy_sizes,
            )
        return graphs

    def persistent_inputs(
        self,
        kv_cache: torch.Tensor,
        block_tables: Any,
        kv_cache_config: KVCacheConfig | None,
        layer_name: str,
    ) -> tuple[GraphInputs | None, list[int]]:
        """The target's persistent aux buffers and ``layer_name``'s slot row,
        and the token counts of the target's planned FULL graphs: after a
        FULL replay of the target, ``propose`` gets views of exactly those.

        Present only once the runner has called ``set_attn`` (its
        ``block_tables``, None before) and its graph manager has planned FULL
        graphs with aux outputs (published by the plugin's capture hook).
        """
        target = target_buffers.get(self.device)
        why = zero_copy_refusal(target, block_tables, kv_cache, self._shape[0])
        if why is not None:
            info_once(self.vllm_config, NO_ZERO_COPY, why)
            return None, []
        assert target is not None and block_tables is not None
        assert kv_cache_config is not None
        groups = kv_cache_config.kv_cache_groups
        (group,) = [i for i, g in enumerate(groups) if layer_name in g.layer_names]
        persistent = GraphInputs(
            target.aux_hidden_states, block_tables.slot_mappings[group]
        )
        # vLLM sizes its buffers for its largest FULL graph, so all fit;
        # should one not, that size takes the copy-in path.
        sizes = [s for s in target.full_sizes if s <= persistent.rows]
        if above := [s for s in target.full_sizes if s > persistent.rows]:
            info_once(
                self.vllm_config,
                ABOVE_ROWS,
                f"{persistent.rows:,}",
                f"{len(above):,}",
                _span(above),
            )
        return persistent, sizes

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


def decode_query_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
    """vLLM's graph managers' uniform-decode argument, for the runner's
    decode query length: the length before vLLM 0.34, from 0.34 a map of
    each length to the most requests a batch of it has."""
    query_len = vllm_config.uniform_decode_query_len
    if "decode_query_lens" in inspect.signature(CudaGraphManager).parameters:
        return {
            "decode_query_lens": {query_len: vllm_config.scheduler_config.max_num_seqs}
        }
    return {"decode_query_len": query_len}


def zero_copy_refusal(
    target: target_buffers.TargetGraphs | None,
    block_tables: Any,
    kv_cache: torch.Tensor,
    num_layers: int,
) -> str | None:
    """Why there are no zero-copy graphs over ``target``'s buffers, or None."""
    if target is None or not target.full_sizes:
        return "the target has no FULL graphs with aux hidden states"
    if block_tables is None:
        return "the runner has not shared its block tables"
    if len(target.aux_hidden_states) != num_layers or any(
        a.dim() != 2 or a.shape[1] != kv_cache.shape[-1]
        for a in target.aux_hidden_states
    ):
        return "the target's aux buffers do not match the hidden-state cache"
    if other := sorted(
        {str(a.dtype) for a in target.aux_hidden_states} - {str(kv_cache.dtype)}
    ):
        # propose converts such states first, as vLLM's speculator does
        # (_as_model_dtype): what the write then reads is not these buffers.
        named = ", ".join(other[:2]) + (", ..." if len(other) > 2 else "")
        return (
            f"the target's aux hidden states are {named}, the hidden-state "
            f"cache {kv_cache.dtype}; they are converted and copied in"
        )
    return None


@contextlib.contextmanager
def vllm_graph_scope(vllm_config: VllmConfig, pool: Any) -> Iterator[tuple[Any, Any]]:
    """One capture as ``CudaGraphManager.capture`` makes it: the pool
    ``capture_pool`` picks (sleep mode's cuMem pool when it offloads graphs)
    and vLLM's current stream (``graph_capture``'s)."""
    from vllm.compilation.cudagraph_pool import capture_pool
    from vllm.utils.torch_utils import current_stream

    with capture_pool(pool, vllm_config) as chosen:
        yield chosen, current_stream()
