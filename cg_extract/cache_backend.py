"""The draft's cache-only attention backend, as our speculator reports it to vLLM.

MRv2 resolves the runner's CUDA graph mode from the weakest metadata builder
of every KV-cache group, the draft's cache-only group included
(``get_attn_cg_support``, then ``resolve_cudagraph_mode_and_sizes``). vLLM's
``CacheOnlyAttentionMetadataBuilder`` declares no support, so it inherits
``AttentionCGSupport.NEVER``, and with it FULL_AND_PIECEWISE and
FULL_DECODE_ONLY fall to PIECEWISE and FULL is refused: the target loses its
FULL decode graphs for a layer that never runs inside them.

That NEVER constrains nothing real:

* the layer never runs inside a target graph. The runner calls the
  speculator after the target's forward (captured or not), and the
  speculator's write is its own step, eager or in its own graph;
* its metadata is ``CacheOnlyAttentionMetadata(slot_mapping)``, a view of the
  runner's persistent slot-mapping row (``block_tables.slot_mappings``), built
  by ``build_for_cudagraph_capture`` at capture as at every step. No
  host-side value of a batch is baked into anything.

So the layer of *our* speculator gets a backend whose builder reports
``ALWAYS``, the strongest level: the minimum over the runner's groups is then
the target's own, and vLLM resolves the mode exactly as for the target alone.
The subclass is set on our draft layer only (:func:`report_graph_support`),
after our ``load_model`` and before the runner builds its attention groups;
vLLM's shared classes, which MRv1's proposer and every other user of them
see, are untouched. Name, impl, KV-cache layout and metadata are vLLM's.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionBackend,
    CacheOnlyAttentionLayer,
    CacheOnlyAttentionMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport

from cg_extract import get_logger

logger = get_logger(__name__)


class ExtractCacheMetadataBuilder(CacheOnlyAttentionMetadataBuilder):
    """vLLM's builder; only its CUDA graph support level differs (see the
    module docstring for why ``ALWAYS`` holds)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS


class ExtractCacheBackend(CacheOnlyAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[ExtractCacheMetadataBuilder]:
        return ExtractCacheMetadataBuilder


def report_graph_support(layer: CacheOnlyAttentionLayer, warn: bool = True) -> None:
    """Give our draft layer the backend that does not constrain the runner's
    graph mode. Call before the runner builds its attention groups; ``warn``
    on the rank that logs for the speculator."""
    if not isinstance(layer, CacheOnlyAttentionLayer):
        raise TypeError(
            f"extract_hidden_states expects its draft layer to be vLLM's "
            f"CacheOnlyAttentionLayer, got {type(layer).__name__}"
        )
    if layer.attn_backend is not CacheOnlyAttentionBackend:
        # Another plugin or a newer vLLM chose this layer's backend; keep it
        # (and its graph support) rather than guess at its semantics.
        if warn:
            logger.warning_once(
                "extract_hidden_states: the draft layer's attention backend is "
                "%s, not vLLM's CacheOnlyAttentionBackend; its CUDA graph "
                "support is left as it reports it, which may lower the "
                "runner's graph mode.",
                layer.attn_backend.__name__,
                scope="process",
            )
        return
    layer.attn_backend = ExtractCacheBackend
