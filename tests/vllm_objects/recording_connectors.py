"""KV connectors for tests, loaded by vLLM through ``kv_connector_module_path``
("tests.vllm_objects.recording_connectors"), as users load the ``speculators`` project's.

Each records the worker-side calls it gets into :data:`CALLS`, with what a
per-forward connector would read: the layer name, the KV cache tensor it is
handed, the slot mapping of its attention metadata, the forward context's slot
mapping and padding mask. ``save_kv_layer`` also copies the step's rows out of
the layer, as a per-forward offloader would, through the hidden-state
connector's own reader.

Tests set :data:`in_graph_work` while graphs capture or replay; a hook called
then raises :class:`HookInGraphWork` at once, before touching any tensor (an
emulated capture would otherwise stop at the hook's own ops for another
reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.forward_context import get_forward_context

CALLS: list[Call] = []
in_graph_work = False


class HookFailed(RuntimeError):
    """What a hook configured with ``raise_in`` raises."""


class HookInGraphWork(AssertionError):
    """A hook ran while graphs were capturing or replaying."""


def check_not_in_graph_work(connector: str, method: str) -> None:
    if in_graph_work:
        raise HookInGraphWork(
            f"{connector}.{method} ran during a graph capture or replay"
        )


@dataclass
class Call:
    connector: str  # the instance's name (kv_connector_extra_config "name")
    method: str
    layer_name: str | None = None
    kv_cache: torch.Tensor | None = None  # the tensor handed to save_kv_layer
    layer_kv_cache: torch.Tensor | None = None  # the layer's bound cache then
    metadata_slots: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None
    context_is_padding: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # the step's rows, copied out

    def same_as(self, other: Call) -> bool:
        """Equal observations, each against its own speculator's cache."""

        def eq(a, b):
            if a is None or b is None:
                return a is b
            return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
                a.view(torch.uint8), b.view(torch.uint8)
            )

        return (
            (self.connector, self.method, self.layer_name)
            == (other.connector, other.method, other.layer_name)
            and (self.kv_cache is self.layer_kv_cache)
            == (other.kv_cache is other.layer_kv_cache)
            and all(
                eq(getattr(self, f), getattr(other, f))
                for f in ("metadata_slots", "context_slots", "context_is_padding")
            )
            and eq(self.rows, other.rows)
        )


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """Does nothing but record; ``raise_in`` (extra config) names a hook that
    raises :class:`HookFailed`."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.name = extra.get("name", type(self).__name__)
        self.raise_in = extra.get("raise_in")

    # Worker side: what the model runner and the attention layers call.

    def bind_connector_metadata(self, connector_metadata):
        self._record("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self):
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        check_not_in_graph_work(self.name, "wait_for_layer_load")
        self._record("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        check_not_in_graph_work(self.name, "save_kv_layer")
        context = get_forward_context()
        slots = context.slot_mapping[layer_name]
        real = slots[slots >= 0]  # padding tokens have no slot of their own
        self._record(
            "save_kv_layer",
            layer_name=layer_name,
            kv_cache=kv_layer,
            layer_kv_cache=context.no_compile_layers[layer_name].kv_cache,
            metadata_slots=attn_metadata.slot_mapping.clone(),
            context_slots=slots.clone(),
            context_is_padding=context.is_padding.clone(),
            rows=extract_from_kv_cache(kv_layer, real, len(real)).clone(),
        )

    def wait_for_save(self):
        self._record("wait_for_save")

    def _record(self, method: str, **observed: Any) -> None:
        CALLS.append(Call(self.name, method, **observed))
        if method == self.raise_in:
            raise HookFailed(f"{self.name}.{method} failed")

    # Scheduler side: only build_connector_meta is called in these tests.

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None


class PiecewiseRecordingConnector(RecordingConnector):
    """Declares layerwise work that needs PIECEWISE graphs, as LMCache's
    layerwise mode does."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True


class RecordingHiddenStatesConnector(ExampleHiddenStatesConnector):
    """A subclass of vLLM's hidden-states connector, as the ``speculators``
    project's FP8HiddenStatesConnector is, that records its hooks."""

    name = "hidden_states"

    def wait_for_layer_load(self, layer_name: str) -> None:
        check_not_in_graph_work(self.name, "wait_for_layer_load")
        CALLS.append(Call(self.name, "wait_for_layer_load", layer_name))
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        check_not_in_graph_work(self.name, "save_kv_layer")
        CALLS.append(Call(self.name, "save_kv_layer", layer_name, kv_layer))
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)


# Every method of the connector interface, worker and scheduler side.
INTERFACE = frozenset(
    name
    for name, member in vars(KVConnectorBase_V1).items()
    if not name.startswith("_") and callable(member)
)


class EveryCallRecordingConnector(RecordingConnector):
    """Declares that it moves the hidden-state cache alone (the series'
    ``hidden_states_only``) and records each method of the connector
    interface it is asked for, hooks or not, by name."""

    hidden_states_only = True

    def __getattribute__(self, name: str) -> Any:
        if name in INTERFACE:
            CALLS.append(Call(vars(self).get("name", "?"), name))
        return super().__getattribute__(name)
