"""The MRv2 ``extract_hidden_states`` speculator, with CUDA graphs.

Every step it writes the target's auxiliary hidden states into the
hidden-state KV cache through vLLM's ``ExtractHiddenStatesModel`` (one
cache-only attention layer) and returns ``last_sampled`` as the draft token,
which verification always accepts. Connectors read the cache when a request
finishes.

One step, from ``propose`` to the KV cache:

1. ``draft_tokens = last_sampled[idx_mapping, :1]``.
2. The aux hidden states are stacked into ``self.hidden_states[:n]`` (one
   kernel, no temporary).
3. Graph path, when ``pad(n)`` has a graph: the draft layer's slots and the
   padding mask are copied into static buffers, the tail up to ``pad(n)`` is
   set to the padding slot (-1, which the layer sends to the null block 0),
   and the captured forward is replayed. Eager path otherwise: the model runs
   under a fresh forward context, exactly as vLLM's own class does.
4. The cache-only layer scatters ``hidden_states[i]`` into
   ``kv_cache[slot // block_size, :, slot % block_size]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from vllm.compilation.backends import set_model_tag
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import (
    create_forward_context,
    override_forward_context,
    set_forward_context,
)
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionMetadata,
)
from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.worker.gpu.dp_utils import DPSyncState
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from cg_extract.capture_sizes import CaptureSizes
from cg_extract.config import ExtractGraphConfig
from cg_extract.cudagraph_manager import CudaGraphManager

logger = init_logger(__name__)


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
        if self.speculative_config.disable_padded_drafter_batch:
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
        self.hidden_states = torch.zeros(
            self.max_num_tokens,
            self.num_hidden_states,
            vllm_config.model_config.get_hidden_size(),
            dtype=self.dtype,
            device=device,
        )
        self.graphs: CudaGraphManager | None = None
        self.replays = 0
        self.eager_fallbacks = 0

    def load_draft_model(
        self, target_model: nn.Module, target_attn_layer_names: set[str]
    ) -> nn.Module:
        del target_model, target_attn_layer_names
        with set_model_tag("extract_hidden_states"):
            return get_model(
                vllm_config=self.vllm_config, model_config=self.draft_model_config
            )

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        if len(self.draft_attn_layer_names) != 1:
            raise ValueError(
                "ExtractHiddenStatesModel should have exactly one attention "
                f"layer, found {len(self.draft_attn_layer_names)}"
            )
        (self.layer_name,) = self.draft_attn_layer_names

    # ------------------------------------------------------------------
    # CUDA graphs

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        backend, reason = self._graph_backend(cudagraph_mode)
        if backend is None:
            logger.info_once("extract_hidden_states runs eagerly: %s.", reason)
            return
        pool = None
        if backend == "cuda":
            from vllm.platforms import current_platform

            pool = current_platform.get_global_graph_pool()
        self.graphs = CudaGraphManager(
            self._capture_sizes(), self.device, backend=backend, pool=pool
        )
        # Static inputs besides self.hidden_states, whose prefix the graphs read.
        self.slot_mapping = self.graphs.static_buffer(
            "slot_mapping", (), torch.int64, fill_value=PAD_SLOT_ID
        )
        self.is_padding = self.graphs.static_buffer(
            "is_padding", (), torch.bool, fill_value=True
        )

    def _graph_backend(self, mode: CUDAGraphMode) -> tuple[str | None, str]:
        if not self.graph_config.cudagraph:
            return None, "'cudagraph' is false in the speculative config"
        if self.speculative_config.enforce_eager:
            return None, "the speculative config sets enforce_eager"
        if not mode.has_full_cudagraphs():
            return None, (
                f"the runner's cudagraph_mode is {mode.name}, which has no FULL "
                "graphs (needs FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE)"
            )
        backend = self.graph_config.cudagraph_backend
        if backend == "auto":
            if self.device.type != "cuda":
                return None, f"backend 'auto' found no CUDA device ({self.device})"
            backend = "cuda"
        return backend, ""

    def _capture_sizes(self) -> CaptureSizes:
        if self.graph_config.cudagraph_capture_sizes is not None:
            return CaptureSizes(self.graph_config.cudagraph_capture_sizes)
        # Pad exactly as the target did, so a graph-padded target batch
        # needs no further padding here.
        return CaptureSizes.from_vllm_inputs(
            self.vllm_config.compilation_config.cudagraph_capture_sizes,
            self.max_num_tokens,
            self.max_num_reqs,
            self.vllm_config.uniform_decode_query_len,
        )

    def capture(self) -> None:
        if self.graphs is None:
            return
        from vllm.distributed.parallel_state import graph_capture, is_global_first_rank

        contexts = {
            size: self._graph_forward_context(size)
            for size in self.graphs.capture_sizes.sizes
        }

        def step(size: int) -> None:
            with override_forward_context(contexts[size]):
                self.model(hidden_states=self.hidden_states[:size])

        if self.graphs.backend == "cuda":
            with graph_capture(self.device):
                self.graphs.capture(step, progress=is_global_first_rank())
        else:
            self.graphs.capture(step, progress=is_global_first_rank())
        logger.info(
            "extract_hidden_states: captured %d %s graphs (sizes %d..%d) in "
            "%.2f s, %.1f MiB",
            len(self.graphs.captured_sizes),
            self.graphs.backend,
            self.graphs.captured_sizes[0],
            self.graphs.max_size,
            self.graphs.capture_time_s,
            self.graphs.graph_memory_bytes / 2**20,
        )

    def _graph_forward_context(self, size: int):
        """The forward context the cache-only layer reads, over static views."""
        slots = self.slot_mapping[:size]
        return create_forward_context(
            {self.layer_name: CacheOnlyAttentionMetadata(slot_mapping=slots)},
            self.vllm_config,
            slot_mapping={self.layer_name: slots},
            is_padding=self.is_padding[:size],
        )

    def cudagraph_stats(self) -> dict[str, Any]:
        return {
            "captured_sizes": self.graphs.captured_sizes if self.graphs else [],
            "replays": self.replays,
            "eager_fallbacks": self.eager_fallbacks,
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
        num_tokens = aux_hidden_states[0].shape[0]
        torch.stack(aux_hidden_states, dim=1, out=self.hidden_states[:num_tokens])
        slots = slot_mappings[self.layer_name][:num_tokens]
        is_padding = input_batch.is_padding[:num_tokens]

        padded = self._graph_size(num_tokens, dp_sync_state)
        if padded is None:
            if self.graphs is not None:
                self.eager_fallbacks += 1
            with set_forward_context(
                {self.layer_name: attn_metadata[self.layer_name]},
                self.vllm_config,
                num_tokens=num_tokens,
                num_tokens_across_dp=dp_sync_state
                and dp_sync_state.num_tokens_across_dp,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
                slot_mapping={self.layer_name: slots},
                is_padding=is_padding,
            ):
                self.model(hidden_states=self.hidden_states[:num_tokens])
            return draft_tokens

        assert self.graphs is not None
        self._copy_inputs(slots, is_padding, padded)
        self.graphs.replay(padded)
        self.replays += 1
        return draft_tokens

    def _copy_inputs(
        self, slots: torch.Tensor, is_padding: torch.Tensor, padded: int
    ) -> None:
        """Fill the graph's static inputs; the padded tail goes to the null block."""
        num_tokens = slots.shape[0]
        self.slot_mapping[:num_tokens].copy_(slots)
        self.slot_mapping[num_tokens:padded].fill_(PAD_SLOT_ID)
        self.is_padding[:num_tokens].copy_(is_padding)
        self.is_padding[num_tokens:padded].fill_(True)

    def _graph_size(
        self, num_tokens: int, dp_sync_state: DPSyncState | None
    ) -> int | None:
        """The captured size to replay, or None to run eagerly."""
        if self.graphs is None:
            return None
        if dp_sync_state is not None:
            # Every DP rank must pick the same graph size.
            num_tokens = max(num_tokens, int(dp_sync_state.num_tokens_across_dp.max()))
        return self.graphs.padded_size(num_tokens)
