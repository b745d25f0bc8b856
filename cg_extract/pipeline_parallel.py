"""Extraction across pipeline stages: the two places vLLM stops it, changed
as little as works, and one check moved to where the config is built.

With pipeline parallelism only the last stage builds the speculator and holds
the hidden-state layer and its cache. Earlier stages compute the aux hidden
states of their layers and send them on inside the intermediate tensors,
which the last stage receives into the runner's persistent
``intermediate_tensors`` and hands to ``propose`` with its own. Decoders opt
in with ``supports_aux_hidden_states_over_pp`` (Llama, Qwen2 and so Qwen3
dense, ...). vLLM 0.32 and 0.33 still refuse extraction there:

* **the draft's SupportsPP check.** The speculative config gives the draft of
  ``extract_hidden_states`` the target's parallel config and checks its
  architecture, ``ExtractHiddenStatesModel``, for SupportsPP. The draft has no
  layers to split; it lives on the last stage, as every draft model does
  (their parallel config has ``pipeline_parallel_size=1``). The plugin answers
  vLLM's registry for that one architecture: it runs under pipeline
  parallelism (:func:`_install_draft_answer`).
* **the KV connector on a stage without the layer.** Every hidden-states
  connector (vLLM's ``ExampleHiddenStatesConnector``, the ``speculators``
  project's FP8 and Mooncake ones) reads only the hidden-state cache and
  asserts in ``register_kv_caches`` that its worker holds that layer; no
  stage but the last does. So on such a stage the runner gets
  :class:`HiddenStatesOnLastStage` in place of the connector, the runner's own
  kind of KV connector, as it gets a no-op one while profiling: one change at
  the runner, for every connector, none of whose code then runs there.

vLLM checks the target's ``supports_aux_hidden_states_over_pp`` only when the
worker loads the model. :func:`refuse_target_without_aux_relay` makes the same
check when the config is built, where the user's other mistakes are reported.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from vllm.v1.worker.gpu.kv_connector import KVConnector

from cg_extract.config import METHOD

DRAFT_ARCHITECTURE = "ExtractHiddenStatesModel"
# The flag vLLM's decoders set (EagleModelMixin), read where vLLM reads it.
AUX_RELAY_FLAG = "supports_aux_hidden_states_over_pp"


def extracts_across_stages(vllm_config: Any) -> bool:
    spec = vllm_config.speculative_config
    return (
        spec is not None
        and spec.method == METHOD
        and vllm_config.parallel_config.pipeline_parallel_size > 1
    )


def install() -> None:
    """Idempotent; on a tested vLLM only."""
    _install_draft_answer()
    _install_stage_connector()


# ----------------------------------------------------------------------
# The draft's SupportsPP check


def _install_draft_answer() -> None:
    from vllm.model_executor.models.registry import _ModelRegistry

    original = _ModelRegistry.is_pp_supported_model
    if getattr(original, "_cg_extract", False):
        return

    @functools.wraps(original)
    def is_pp_supported_model(
        self: Any, architectures: str | list[str], model_config: Any
    ) -> bool:
        names = [architectures] if isinstance(architectures, str) else architectures
        if list(names) == [DRAFT_ARCHITECTURE]:
            return True  # it runs on the last stage alone
        return original(self, architectures, model_config)

    is_pp_supported_model._cg_extract = True  # type: ignore[attr-defined]
    _ModelRegistry.is_pp_supported_model = is_pp_supported_model


# ----------------------------------------------------------------------
# The KV connector on a stage without the hidden-state layer


def _install_stage_connector() -> None:
    from vllm.v1.worker.gpu import model_runner

    original = model_runner.get_kv_connector
    if getattr(original, "_cg_extract", False):
        return

    @functools.wraps(original)
    def get_kv_connector(vllm_config: Any, kv_caches_dict: dict[str, Any]) -> Any:
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

    get_kv_connector._cg_extract = True  # type: ignore[attr-defined]
    model_runner.get_kv_connector = get_kv_connector


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
# The target: does its decoder relay aux hidden states between stages?


def check_config(vllm_config: Any) -> None:
    """Refuse, when the config is built, what extraction across pipeline
    stages cannot do."""
    if not extracts_across_stages(vllm_config):
        return
    _refuse_target_without_aux_relay(vllm_config)
    _refuse_connectors_of_other_layers(vllm_config)


def _refuse_connectors_of_other_layers(vllm_config: Any) -> None:
    """On a stage without the hidden-state layer the runner runs no KV
    connector (:class:`HiddenStatesOnLastStage`). A MultiConnector may hold
    one that moves the target's own KV cache, which those stages do need."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_connector == "MultiConnector":
        pp = vllm_config.parallel_config.pipeline_parallel_size
        raise ValueError(
            f"kv_transfer_config kv_connector 'MultiConnector' with method "
            f"'{METHOD}' and pipeline_parallel_size={pp}: cg_extract runs no KV "
            "connector on the pipeline stages before the last, which hold no "
            "hidden states, and a MultiConnector may hold a connector that "
            "moves their KV cache. Use one hidden-states connector (e.g. "
            "ExampleHiddenStatesConnector), or pipeline_parallel_size=1"
        )


def _refuse_target_without_aux_relay(vllm_config: Any) -> None:
    """vLLM's load-time check (``verify_supports_aux_hidden_states_over_pp``),
    made when the config is built. Where the decoder cannot be told from the
    model's class (a multimodal wrapper, a decoder built some other way),
    nothing is refused here and vLLM's own check stays the judge."""
    model_config = vllm_config.model_config
    model_cls, arch = model_config.registry.resolve_model_cls(
        model_config.architectures, model_config=model_config
    )
    decoder = decoder_class(model_cls)
    if decoder is None or getattr(decoder, AUX_RELAY_FLAG, False):
        return
    pp = vllm_config.parallel_config.pipeline_parallel_size
    raise ValueError(
        f"pipeline_parallel_size={pp} with method '{METHOD}' needs a target "
        "whose decoder passes its aux hidden states between pipeline stages "
        f"(vLLM's {AUX_RELAY_FLAG}); {arch}'s decoder {decoder.__name__} does "
        "not. Decoders that do, in this vLLM: "
        f"{', '.join(relaying_decoders())}, and models built on them. Use "
        "pipeline_parallel_size=1 with this model (tensor or data parallelism "
        "split it too), or a model whose decoder is one of those"
    )


def decoder_class(model_cls: type) -> type | None:
    """The class ``model_cls`` builds its ``self.model`` from, read from the
    source of the first class of its MRO that assigns it: ``X(...)``,
    ``self.model_cls(...)`` (a class attribute) or ``self.method(...)``
    returning ``X(...)``. None for a multimodal model (vLLM reads its
    language model's decoder) or where no such assignment is found."""
    if hasattr(model_cls, "get_language_model") or hasattr(model_cls, "language_model"):
        return None
    for klass in model_cls.__mro__:
        for call in _calls_assigned_to_self_model(klass):
            found = _class_called(call.func, klass, model_cls)
            if found is not None:
                return found
    return None


def _parsed(obj: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None


def _calls_assigned_to_self_model(klass: type) -> list[ast.Call]:
    tree = _parsed(klass) if klass.__module__.startswith("vllm.") else None
    if tree is None:
        return []
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and any(_is_self_attr(target, "model") for target in node.targets)
    ]


def _is_self_attr(node: ast.AST, name: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (name is None or node.attr == name)
    )


def _class_called(func: ast.AST, klass: type, model_cls: type) -> type | None:
    """The class a call in ``klass``'s source constructs: a name of its
    module, a class attribute, or what a method of ``model_cls`` returns."""
    if isinstance(func, ast.Name):
        return _class_named(func.id, klass.__module__)
    if not _is_self_attr(func):
        return None
    found = inspect.getattr_static(model_cls, func.attr, None)
    if isinstance(found, type):
        return found
    tree = _parsed(found) if inspect.isfunction(found) else None
    for node in ast.walk(tree) if tree is not None else ():
        if (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and (returned := _class_named(node.value.func.id, found.__module__))
        ):
            return returned
    return None


def _class_named(name: str, module: str) -> type | None:
    found = vars(sys.modules[module]).get(name)
    return found if isinstance(found, type) else None


@functools.cache
def relaying_decoders() -> tuple[str, ...]:
    """The decoder classes of the installed vLLM's models that set the flag,
    and their subclasses that do not unset it, read from vLLM's source
    (importing every model would take long, for an error message)."""
    import vllm

    root = Path(vllm.__file__).parent
    sources = [
        path.read_text(errors="replace")
        for folder in ("model_executor/models", "models")
        for path in sorted((root / folder).rglob("*.py"))
    ]
    parsed: dict[int, list[ast.ClassDef]] = {}
    relaying: set[str] = set()
    unset: set[str] = set()
    while True:
        grown = set(relaying)
        for i, text in enumerate(sources):
            if not any(name in text for name in relaying | {AUX_RELAY_FLAG}):
                continue
            if i not in parsed:
                parsed[i] = [
                    node
                    for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.ClassDef)
                ]
            for node in parsed[i]:
                flag = _flag_set(node)
                if flag is False:
                    unset.add(node.name)
                elif flag or any(
                    isinstance(base, ast.Name) and base.id in relaying
                    for base in node.bases
                ):
                    grown.add(node.name)
        grown -= unset
        if grown == relaying:
            return tuple(sorted(relaying))
        relaying = grown


def _flag_set(node: ast.ClassDef) -> bool | None:
    for statement in node.body:
        targets = (
            statement.targets
            if isinstance(statement, ast.Assign)
            else [statement.target]
            if isinstance(statement, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == AUX_RELAY_FLAG for t in targets):
            value = statement.value
            return bool(value.value) if isinstance(value, ast.Constant) else None
    return None
