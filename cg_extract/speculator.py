"""The MRv2 ``extract_hidden_states`` speculator, with CUDA graphs.

Every step it stores the target's auxiliary hidden states in the hidden-state
KV cache of vLLM's cache-only draft layer and returns ``last_sampled`` as the
draft token, which verification always accepts. Connectors read the cache when
a request finishes.

One step, from ``propose`` to the KV cache:

1. ``draft_tokens = last_sampled[idx_mapping, :1]``.
2. Pick a path for the ``n`` tokens (:mod:`cg_extract.write_graphs`):

   * zero-copy graph: the target replayed a FULL graph, so the aux hidden
     states and slots are views of persistent buffers that a graph captured
     for exactly ``n`` tokens already reads. Replay, nothing else;
   * copy-in graph: ``pad(n)`` has a graph. Stack the aux hidden states into
     the static buffer, copy the slots, point the padded tail at slot -1,
     replay;
   * eager: no graph fits (``n`` above the largest size, nothing captured
     yet, graphs off).

3. Every path writes through :meth:`_write`: one op
   (:mod:`cg_extract.write_op`) scatters each aux hidden state straight to
   ``kv_cache[slot // block_size, layer, slot % block_size]`` and writes
   nothing for slot -1 (vLLM's cache-only layer sends it to the null block
   0).
4. Then the layer's KV-connector hooks run on the host, through vLLM's own
   ``dummy_attention`` under the step's forward context, as the cache-only
   layer runs them: after the write, eagerly or after the replay. A graph
   holds the write alone, so no hook runs at capture or inside a replay.

The graphs' life in the worker (memory profiling, re-initialisation,
elastic EP release and recapture) is :mod:`cg_extract.vllm_graphs`'s, and so
is their plan: whether there are graphs and on which backend, at which sizes,
over which of the target's buffers, and the lines that say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from vllm.compilation.backends import set_model_tag
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.utils import get_draft_load_config
from vllm.model_executor.models.extract_hidden_states import dummy_attention
from vllm.v1.worker.gpu.dp_utils import DPSyncState
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
from vllm.v1.worker.gpu.spec_decode.utils import get_pp_safe_draft_load_config

from cg_extract import get_logger, kv_cache_report, speaks
from cg_extract.cache_backend import report_graph_support
from cg_extract.config import ExtractGraphConfig
from cg_extract.vllm_graphs import SpeculatorGraphs
from cg_extract.write_graphs import WriteGraphs
from cg_extract.write_op import write_hidden_states

logger = get_logger(__name__)


class ExtractHiddenStatesSpeculator(DraftModelSpeculator):
    """Caches target hidden states; draft tokens are always accepted."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        assert vllm_config.speculative_config is not None
        if vllm_config.speculative_config.draft_sample_method != "greedy":
            raise ValueError(
                "extract_hidden_states only supports draft_sample_method='greedy'"
            )
        super().__init__(vllm_config, device)
        if self.num_speculative_steps != 1:
            raise ValueError(
                "extract_hidden_states requires num_speculative_tokens to be 1"
            )
        # vLLM 0.34 removed the option (it pads every drafter batch).
        if getattr(self.speculative_config, "disable_padded_drafter_batch", False):
            raise ValueError(
                "disable_padded_drafter_batch is not supported with "
                "extract_hidden_states method"
            )
        layer_ids = getattr(
            self.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None
        )
        if not layer_ids:
            raise ValueError(
                "eagle_aux_hidden_state_layer_ids must be set in the draft "
                "model config for extract_hidden_states method"
            )
        # Workers re-check what the front end checked: a config can reach
        # them without passing through EngineArgs.
        self.graph_config = ExtractGraphConfig.from_vllm_config(vllm_config)
        self.graph_config.validate_for(vllm_config, torch.cuda.is_available())

        self.supports_mm_inputs = False
        self.num_hidden_states = len(layer_ids)
        assert isinstance(self.dtype, torch.dtype)
        # vLLM's memory profiler and elastic EP find the graphs through this
        # attribute (a vLLM CudaGraphManager); it holds the only reference to
        # them. Nothing is allocated until capture().
        self.cudagraph_manager: SpeculatorGraphs | None = None
        self.counts = {"zero_copy": 0, "copy_in": 0, "eager": 0}
        self._cache_size_reported = False
        self._profiling = False  # see kv_cache_initialized

    @property
    def _rebuilds_metadata(self) -> bool:
        """Under micro-batching (``use_ubatching``) vLLM 0.34's speculators
        do not reuse the target's metadata (a micro-batched step hands
        ``propose`` none) and rebuild it and the slots each step from the
        block tables; ours does the same, and captures no graph."""
        return not getattr(self, "can_reuse_target_attn_metadata", True)

    @property
    def graphs(self) -> WriteGraphs | None:
        """The captured graphs, None before capture and once vLLM released
        or dropped them."""
        manager = self.cudagraph_manager
        return manager.write_graphs if manager is not None else None

    def load_draft_model(
        self, target_model: nn.Module, target_attn_layer_names: set[str]
    ) -> nn.Module:
        del target_model, target_attn_layer_names
        # As vLLM 0.34's speculator loads it: the draft lives on the last
        # pipeline stage alone, so its loader must not use collectives.
        load_config = get_pp_safe_draft_load_config(
            get_draft_load_config(self.vllm_config)
        )
        with set_model_tag("extract_hidden_states"):
            return get_model(
                vllm_config=self.vllm_config,
                model_config=self.draft_model_config,
                load_config=load_config,
            )

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        if len(self.draft_attn_layer_names) != 1:
            raise ValueError(
                "ExtractHiddenStatesModel should have exactly one attention "
                f"layer, found {len(self.draft_attn_layer_names)}"
            )
        (self.layer_name,) = self.draft_attn_layer_names
        forward_context = self.vllm_config.compilation_config.static_forward_context
        self.cache_layer = forward_context[self.layer_name]
        # Before the runner builds its attention groups, so the draft layer
        # does not lower the target's graph mode (see cache_backend).
        report_graph_support(self.cache_layer, warn=speaks(self.vllm_config))
        if self.cache_layer.kv_cache_torch_dtype != self.dtype:
            raise ValueError(
                f"the hidden-state cache is {self.cache_layer.kv_cache_torch_dtype} "
                f"but the model's hidden states are {self.dtype}; "
                "extract_hidden_states stores them unconverted"
            )
        # dummy_attention's placeholder: allocated once so graphs allocate nothing.
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------
    # The write

    # The op every path runs; the sweep's per-layer reference mode swaps it.
    write_cache = staticmethod(write_hidden_states)

    def _write(self, aux_hidden_states: Sequence[torch.Tensor], slots: torch.Tensor):
        """Scatter into the KV cache: the device work of the cache-only layer.

        Byte-identical to ``unified_kv_cache_update`` on the stacked states
        in every slot a token owns (padding lands nowhere, not even in block
        0), without stacking them. Graphs capture this and nothing else.
        """
        self.write_cache(aux_hidden_states, self.cache_layer.kv_cache, slots)

    def _run_connector_hooks(self) -> None:
        """The cache-only layer's connector hooks, by vLLM's own code path.

        ``dummy_attention``'s ``maybe_transfer_kv_layer`` decorator calls the
        connector's ``wait_for_layer_load`` then ``save_kv_layer`` with the
        current forward context's metadata and KV cache, when a v1 KV transfer
        group exists and has connector metadata, exactly as after the layer's
        eager write. Errors from a hook propagate to ``propose``'s caller.
        """
        dummy_attention(self.layer_name, self._placeholder)

    def _step_context(
        self,
        attn_metadata: dict[str, Any],
        slots: torch.Tensor,
        is_padding: torch.Tensor,
        dp_sync_state: DPSyncState | None,
    ):
        """The forward context vLLM's eager speculator gives the draft layer
        for ``len(is_padding)`` tokens."""
        return set_forward_context(
            {self.layer_name: attn_metadata[self.layer_name]},
            self.vllm_config,
            num_tokens=len(is_padding),
            num_tokens_across_dp=dp_sync_state and dp_sync_state.num_tokens_across_dp,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping={self.layer_name: slots},
            is_padding=is_padding,
        )

    # ------------------------------------------------------------------
    # The hidden-state cache's size

    def kv_cache_initialized(
        self,
        is_profiling: bool,
        kv_cache_specs: Callable[[], dict[str, Any]] | None = None,
        extensible: bool = False,
    ) -> None:
        """The runner initialised a KV cache: the memory profiler's
        (``is_profiling``), against which vLLM captures graphs, measures and
        drops them, or the real one, whose cost (given ``kv_cache_specs``,
        the runner's, also the capacity without extraction) is logged once
        per engine from the rank that speaks; ``extensible`` (vLLM 0.34's
        extensible KV cache): its blocks are reserved, not yet committed,
        and the line says so. The plugin calls this."""
        self._profiling = is_profiling
        if is_profiling or self._cache_size_reported or not speaks(self.vllm_config):
            return
        self._cache_size_reported = True
        kv_cache_report.report(
            self.vllm_config,
            self.layer_name,
            self.num_hidden_states,
            self.dtype,
            self.kv_cache_config,
            kv_cache_specs,
            extensible=extensible,
        )

    # ------------------------------------------------------------------
    # CUDA graphs

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """Plan the graphs; allocate nothing (see :meth:`capture`).

        The runner calls this again for every KV cache it initialises (the
        memory profiler's, then the real one): graphs of an earlier call hold
        that call's KV cache and are dropped first.
        """
        if self.cudagraph_manager is not None:
            self.cudagraph_manager.release_graphs()
        self.cudagraph_manager = SpeculatorGraphs.plan(
            self.vllm_config,
            self.graph_config,
            cudagraph_mode,
            self.device,
            self.num_hidden_states,
            self.dtype,
            # The captured step is the write alone: the connector hooks are
            # host work a replay would skip, so ``propose`` runs them after it.
            write=self._write,
            rebuilds_metadata=self._rebuilds_metadata,
        )

    def capture(self) -> None:
        """Allocate the static buffers and capture, inside the window that
        vLLM's ``capture_model`` measures (and its memory profiler reserves
        KV-cache headroom for); the zero-copy graphs read the target's
        persistent buffers and the slot row ``set_attn`` shared (neither
        before it)."""
        if self.cudagraph_manager is not None:
            self.cudagraph_manager.capture(
                self.cache_layer.kv_cache,
                getattr(self, "block_tables", None),
                getattr(self, "kv_cache_config", None),
                self.layer_name,
                quiet=self._profiling,
            )

    def cudagraph_stats(self) -> dict[str, Any]:
        graphs = self.graphs
        return {
            "captured_sizes": graphs.captured_sizes if graphs else [],
            "zero_copy_sizes": graphs.zero_copy_sizes if graphs else [],
            "replays": self.counts["zero_copy"] + self.counts["copy_in"],
            "eager_fallbacks": self.counts["eager"] if self.cudagraph_manager else 0,
            "zero_copy_replays": self.counts["zero_copy"],
            "copy_in_replays": self.counts["copy_in"],
            "eager_steps": self.counts["eager"],
        }

    # ------------------------------------------------------------------
    # The step

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        draft_tokens = last_sampled[input_batch.idx_mapping, :1]
        if skip_attn_for_dummy_run:
            return draft_tokens
        if aux_hidden_states is None:
            raise ValueError(
                "aux_hidden_states are required when using extract_hidden_states"
            )
        if len(aux_hidden_states) != self.num_hidden_states:
            raise ValueError(
                f"Expected {self.num_hidden_states} auxiliary hidden states, "
                f"got {len(aux_hidden_states)}"
            )
        if any(hidden.dtype is not self.dtype for hidden in aux_hidden_states):
            aux_hidden_states = self._as_model_dtype(aux_hidden_states)
        if self._rebuilds_metadata:
            attn_metadata, slot_mappings = self._build_drafter_attn_metadata(
                input_batch, attn_metadata, slot_mappings
            )
        num_tokens = aux_hidden_states[0].shape[0]
        slots = slot_mappings[self.layer_name][:num_tokens]
        is_padding = input_batch.is_padding[:num_tokens]

        padded = self._graph_size(num_tokens, dp_sync_state)
        if padded is None:
            self.counts["eager"] += 1
            with self._step_context(attn_metadata, slots, is_padding, dp_sync_state):
                self._write(aux_hidden_states, slots)
                self._run_connector_hooks()
            return draft_tokens
        path = self.graphs.run(aux_hidden_states, slots, padded)
        self.counts[path] += 1
        # The hooks' own first test, made before building a forward context:
        # without a KV transfer group a graph step does nothing more.
        if has_kv_transfer_group():
            with self._step_context(attn_metadata, slots, is_padding, dp_sync_state):
                self._run_connector_hooks()
        return draft_tokens

    def _as_model_dtype(
        self, aux_hidden_states: Sequence[torch.Tensor]
    ) -> Sequence[torch.Tensor]:
        """What vLLM's speculator stores for aux hidden states of another
        dtype: it stacks them (mixed dtypes promote) and copies the stack
        into its buffer of the model's dtype, so the cache gets the converted
        values. The write takes the cache's dtype only (why:
        :mod:`cg_extract.write_op`); every path then writes these (zero-copy
        cannot apply: they are not the target's buffers)."""
        return torch.stack(aux_hidden_states, dim=1).to(self.dtype).unbind(1)

    def _graph_size(
        self, num_tokens: int, dp_sync_state: DPSyncState | None
    ) -> int | None:
        """The captured size to replay, or None to run eagerly.

        From this rank's own count, with or without data parallelism: the
        write has no collective, so ranks need not agree on a graph. When they
        agreed on one, vLLM padded every rank's batch to it already (each
        ``num_tokens_across_dp`` entry is then ``num_tokens``); when they agreed
        to run eagerly (``dp_sync_state.eager``), the entries are the ranks'
        real counts, and padding to the largest would only waste a graph.
        """
        del dp_sync_state
        graphs = self.graphs
        return graphs.padded_size(num_tokens) if graphs is not None else None
