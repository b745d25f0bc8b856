"""Extraction across pipeline stages: the two places vLLM stops it, changed
for extraction alone, and what else it needs refused when the config is built.

With pipeline parallelism only the last stage builds the speculator and holds
the hidden-state layer and its cache. Earlier stages compute the aux hidden
states of their layers and send them on inside the intermediate tensors,
which the last stage receives into the runner's persistent
``intermediate_tensors`` and hands to ``propose`` with its own. Decoders opt
in with ``supports_aux_hidden_states_over_pp`` (Llama, Qwen2 and so Qwen3
dense, ...); for any other target vLLM's own check refuses when the worker
loads the model ("... does not support extract_hidden_states with pipeline
parallelism"), and the engine stops. vLLM (0.32 to 0.34) refuses extraction
there in two places:

* **the draft's SupportsPP check.** The speculative config gives the draft of
  ``extract_hidden_states`` the target's parallel config and checks its
  architecture, ``ExtractHiddenStatesModel``, for SupportsPP. The draft has no
  layers to split; it lives on the last stage, as every draft model does
  (their parallel config has ``pipeline_parallel_size=1``). The draft model
  the plugin registers declares SupportsPP (:mod:`cg_extract.draft_model`).
* **the KV connector on a stage without the layer.** A hidden-states
  connector (:func:`is_hidden_states_connector`) reads only the hidden-state
  cache and asserts in ``register_kv_caches`` that its worker holds that
  layer; no stage but the last does. So on such a stage the runner gets
  :class:`HiddenStatesOnLastStage` in place of the connector, the runner's own
  kind of KV connector, as it gets a no-op one while profiling: none of the
  connector's code then runs there.

Lifting them must reach nothing else, so :func:`check_config` refuses, when
the engine config is built, what the lifted paths cannot serve: vLLM's V1
model runner (it builds the drafter on the last stage only, then calls it on
every stage), and any connector but a hidden-states one (it may move the
earlier stages' own KV cache, which the stand-in would silently drop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.worker.gpu.kv_connector import KVConnector

from cg_extract import wrap_once
from cg_extract.config import METHOD

# The class attribute by which a connector declares it moves the hidden-state
# cache alone (upstream/0003 defines it on vLLM's KVConnectorBase_V1).
HIDDEN_STATES_ONLY = "hidden_states_only"
# Hidden-states connectors that cannot have declared it yet: vLLM's, and
# hs-connectors' (the speculators project's), by class; subclasses too.
HIDDEN_STATES_CONNECTORS = frozenset(
    {
        "vllm.distributed.kv_transfer.kv_connector.v1."
        "example_hidden_states_connector.ExampleHiddenStatesConnector",
        "hs_connectors.fp8_hidden_states_connector.FP8HiddenStatesConnector",
        "hs_connectors.mooncake_hidden_states_connector.MooncakeHiddenStatesConnector",
    }
)


def extracts_across_stages(vllm_config: Any) -> bool:
    spec = vllm_config.speculative_config
    return (
        spec is not None
        and spec.method == METHOD
        and vllm_config.parallel_config.pipeline_parallel_size > 1
    )


# The modules that make the runner's KV connector, each under the name it
# imported: the runner at KV-cache initialisation, and (vLLM 0.34) the
# extensible KV cache once it commits its final size (``extend_kv_cache``).
CONNECTOR_MAKERS = (
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.extensible_kv_cache",
)


def install() -> None:
    """Idempotent; on a tested vLLM only."""
    import importlib

    for name in CONNECTOR_MAKERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # vLLM 0.32, 0.33: no extensible KV cache
            continue
        _install_stage_connector(module)


# ----------------------------------------------------------------------
# The KV connector on a stage without the hidden-state layer


def _install_stage_connector(module: Any) -> None:
    @wrap_once(module, "get_kv_connector")
    def get_kv_connector(
        original: Callable, vllm_config: Any, kv_caches_dict: dict[str, Any]
    ) -> Any:
        if extracts_across_stages(vllm_config) and not _holds_hidden_state_layer(
            vllm_config, kv_caches_dict
        ):
            from vllm.distributed.kv_transfer import (
                get_kv_transfer_group,
                has_kv_transfer_group,
            )

            if has_kv_transfer_group():
                count = get_kv_transfer_group().get_finished_count()
                return HiddenStatesOnLastStage(every_worker_reports=count is None)
        return original(vllm_config, kv_caches_dict)


def _holds_hidden_state_layer(vllm_config: Any, kv_caches_dict: dict[str, Any]) -> bool:
    """What every hidden-states connector asserts in ``register_kv_caches``."""
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionLayer,
    )

    context = vllm_config.compilation_config.static_forward_context
    return any(
        isinstance(context.get(name), CacheOnlyAttentionLayer)
        for name in kv_caches_dict
    )


class HiddenStatesOnLastStage(KVConnector):
    """The runner's KV connector on a pipeline stage that holds no
    hidden-state layer: no hook of the hidden-states connector runs here.

    Its one duty is vLLM's count of finished transfers. The executor frees a
    request's blocks once as many workers have reported it sent as the
    connector's ``get_finished_count()`` says, or every worker where that is
    None. A connector counting only its writers (vLLM's: 1, TP rank 0 of the
    stage that has the cache) must hear nothing from here, or the blocks
    would be freed before the write; one counting every worker (Mooncake's)
    must hear from every stage, or they would never be freed. So this stage
    reports each finished request at once in the second case, as that
    connector's workers that write nothing do, and nothing in the first.
    That leaves nothing counted in vLLM's aggregator because such a
    connector delays every finished request (Mooncake's does), so the last
    stage reports each one too.
    """

    def __init__(self, every_worker_reports: bool):
        self.every_worker_reports = every_worker_reports

    def post_forward(
        self, finished_req_ids: set[str], defer_finalize: bool = False
    ) -> Any:
        # defer_finalize (vLLM 0.33): nothing of a connector's to finalize.
        if not (self.every_worker_reports and finished_req_ids):
            return None
        from vllm.v1.outputs import KVConnectorOutput

        return KVConnectorOutput(finished_sending=set(finished_req_ids))

    def no_forward(self, scheduler_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput.with_kv_conn_output_only(
            self.post_forward(scheduler_output.finished_req_ids)
        )


# ----------------------------------------------------------------------
# What the lifted paths cannot serve, refused when the config is built


def is_hidden_states_connector(connector_cls: type) -> bool:
    """A connector that moves only the hidden-state cache, so that a stage
    without it may run none of its hooks: one that declares it
    (:data:`HIDDEN_STATES_ONLY`), or one of :data:`HIDDEN_STATES_CONNECTORS`
    or a subclass."""
    return getattr(connector_cls, HIDDEN_STATES_ONLY, False) is True or any(
        f"{klass.__module__}.{klass.__qualname__}" in HIDDEN_STATES_CONNECTORS
        for klass in connector_cls.__mro__
    )


def check_config(vllm_config: Any) -> None:
    """Refuse extraction across stages where vLLM's V1 model runner would
    run, or a connector other than a hidden-states one."""
    if not extracts_across_stages(vllm_config):
        return
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if not getattr(vllm_config, "use_v2_model_runner", True):  # 0.34: MRv2 only
        raise ValueError(
            f"pipeline_parallel_size={pp} with method '{METHOD}' needs Model "
            "Runner V2, and this config gets vLLM's V1 model runner, which "
            "builds the drafter on the last stage only (its workers would "
            "fail at start). Use Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1 "
            "where vLLM can run it), or pipeline_parallel_size=1"
        )
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if not is_hidden_states_connector(KVConnectorFactory.get_connector_class(transfer)):
        raise ValueError(
            f"kv_transfer_config kv_connector {transfer.kv_connector!r} with "
            f"method '{METHOD}' and pipeline_parallel_size={pp}: the stages "
            "before the last hold no hidden states and run no KV connector, "
            "so a connector of other layers' KV cache would miss theirs. "
            "Accepted: ExampleHiddenStatesConnector and its subclasses, "
            "hs-connectors' FP8HiddenStatesConnector and "
            "MooncakeHiddenStatesConnector, and connector classes that set "
            f"{HIDDEN_STATES_ONLY} = True. Use one of them, or "
            "pipeline_parallel_size=1"
        )
