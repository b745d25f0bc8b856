"""The ``split_kv_cache_groups`` key: the hidden-state layer's KV-cache group
billed at its own width.

On vLLM's uniform-page-size path (hybrid targets: sliding window beside full
attention, Mamba or linear attention beside attention) the hidden-state layer
gets a KV-cache group of its own, every group draws its blocks from one pool
whose blocks are as wide as the widest group (its layers' pages side by
side), and admission and capacity charge a whole pool block for each block a
group holds. A one-layer hidden-state group beside 24-layer groups is billed
24 pages for each page it uses: a Kimi-K3 at TP=16 cannot start
(vllm-project/vllm#56774). With the key, the target's groups are split into
one-layer groups, so a pool block is one page; the target's layers take the
same bytes a request as before, in more groups, each with its per-step work
(docs/design.md, "Splitting the KV-cache groups").

vLLM groups the layers in ``get_kv_cache_groups`` (0.32:
``vllm.v1.core.kv_cache_utils``; 0.33: ``vllm.v1.core.kv_cache_planning``,
which its default ``KVCacheConfigBuilder`` calls), in the engine core and in
each worker's profiling layout; :func:`install` wraps it there and splits
what it returns. The split is the one vLLM's own path would make had it
grouped one layer a group before adding the hidden-state layer (the page,
the hidden-state block size and any scaling depend only on the groups' specs,
which splitting keeps).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

from cg_extract import get_logger, wrap_once
from cg_extract.cache_size import SPLIT_DOCS, split_hint
from cg_extract.config import ADDITIONAL_CONFIG_KEY, METHOD, ExtractGraphConfig

logger = get_logger(__name__)

KEY = "split_kv_cache_groups"


def asked(vllm_config: Any) -> bool:
    """Whether the user gave the key true (only with extraction: the config
    refuses our keys with any other method)."""
    return ExtractGraphConfig.from_vllm_config(vllm_config).split_kv_cache_groups


def with_key(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` with the key true."""
    other = copy.copy(vllm_config)
    additional = dict(vllm_config.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = {
        **additional.get(ADDITIONAL_CONFIG_KEY, {}),
        KEY: True,
    }
    other.additional_config = additional
    return other


def why_unsplit(groups: list[Any]) -> str | None:
    """Why splitting ``groups`` (vLLM's grouping with a hidden-state layer)
    would change nothing; None when it would."""
    hidden = [g for g in groups if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if not hidden:
        return (
            "the hidden-state layer shares the target's KV-cache group "
            "(all-attention target), so it is billed its page of each block "
            "and no pool width"
        )
    if hidden[0].kv_cache_spec.page_size_padded is None:
        # vLLM pads the layer's page to the common one on the uniform-page-
        # size path alone; on its packed path (block-outermost layouts, mixed
        # pages) the group's blocks are strided by the widest group, which
        # splitting is not made for.
        return (
            "vLLM packed the KV-cache groups block-outermost (pages of "
            "different sizes), a grouping cg_extract does not split"
        )
    if all(len(g.layer_names) == 1 for g in groups):
        return "the target's KV-cache groups have one layer each already"
    return None


def split(groups: list[Any]) -> list[Any]:
    """``groups`` with each of the target's split into one-layer groups, in
    order; the hidden-state group as it is. Unchanged where :func:`why_unsplit`
    gives a reason."""
    if why_unsplit(groups) is not None:
        return groups
    return [
        dataclasses.replace(group, layer_names=[name])
        for group in groups
        for name in group.layer_names
    ]


def check_config(vllm_config: Any) -> None:
    """Refuse the key where the groups it splits would not be vLLM's
    default grouping on one pipeline stage."""
    if not asked(vllm_config):
        return
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise ValueError(
            f"{KEY} needs pipeline_parallel_size 1, got {pp}: a one-layer group "
            "whose layer is on another stage would still hold pool blocks on "
            f"this one. Drop {KEY}, or use pipeline_parallel_size 1"
        )
    model = vllm_config.model_config
    if getattr(model, "supports_kv_cache_grouping", False):
        raise ValueError(
            f"{KEY}: {model.architectures[0]} groups its own KV cache layers "
            f"(SupportsKVCacheGrouping), so cg_extract cannot split them; drop {KEY}"
        )
    builder = _builder_grouping(vllm_config)
    if builder is not None:
        raise ValueError(
            f"{KEY}: this platform's KV-cache config builder, {builder}, groups "
            f"the layers itself, so cg_extract cannot split them; drop {KEY}"
        )


def _builder_grouping(vllm_config: Any) -> str | None:
    """The platform's KV-cache config builder (vLLM 0.33), where it groups the
    layers otherwise than vLLM's default builder."""
    try:
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
        from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder
    except ImportError:  # vLLM 0.32: no builders
        return None
    builder = type(get_kv_cache_config_builder(vllm_config))
    default = DefaultKVCacheConfigBuilder.get_kv_cache_groups
    if builder.get_kv_cache_groups is default:
        return None
    return f"{builder.__module__}.{builder.__qualname__}"


def _grouping_module() -> Any:
    try:  # vLLM 0.33
        from vllm.v1.core import kv_cache_planning as module
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as module
    return module


def original_grouping() -> Callable[..., list[Any]]:
    """vLLM's ``get_kv_cache_groups``, even after :func:`install`."""
    grouping = _grouping_module().get_kv_cache_groups
    return getattr(grouping, "__wrapped__", grouping)


def install() -> None:
    """Idempotent; on a tested vLLM only."""

    @wrap_once(_grouping_module(), "get_kv_cache_groups")
    def get_kv_cache_groups(
        original: Callable, vllm_config: Any, kv_cache_spec: Any
    ) -> list[Any]:
        groups = original(vllm_config, kv_cache_spec)
        return split(groups) if asked(vllm_config) else groups

    _install_engine_core_layout()


def _install_engine_core_layout() -> None:
    """Wrap the ``get_kv_cache_configs`` the engine core calls (the name it
    imported): it says once what the key did, or why it did nothing, and
    adds the key to vLLM's refusal for lack of KV memory where the split
    layout would start."""
    from vllm.v1.engine import core

    @wrap_once(core, "get_kv_cache_configs")
    def get_kv_cache_configs(
        original: Callable,
        vllm_config: Any,
        kv_cache_specs: list[dict[str, Any]],
        available_memory: list[int],
        *args: Any,
        **kwargs: Any,
    ) -> list[Any]:
        try:
            configs = original(
                vllm_config, kv_cache_specs, available_memory, *args, **kwargs
            )
        except ValueError as error:
            hint = refusal_hint(vllm_config, kv_cache_specs, available_memory)
            if hint:
                error.args = (f"{error.args[0] if error.args else error} {hint}",)
            raise
        if asked(vllm_config):
            _say_what_splitting_did(vllm_config, kv_cache_specs)
        return configs


def _merged(kv_cache_specs: list[dict[str, Any]]) -> dict[str, Any]:
    return {name: spec for specs in kv_cache_specs for name, spec in specs.items()}


def _say_what_splitting_did(vllm_config: Any, kv_cache_specs: list[dict]) -> None:
    groups = original_grouping()(vllm_config, _merged(kv_cache_specs))
    why = why_unsplit(groups)
    if why is not None:
        logger.warning("%s is true but changes nothing here: %s", KEY, why)
        return
    logger.info(
        "%s: the target's %d KV-cache groups split into %d one-layer groups; the "
        "hidden-state group is billed one page a block",
        KEY,
        len(groups) - 1,
        len(split(groups)) - 1,
    )


def refusal_hint(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], memory: list[int]
) -> str | None:
    """For vLLM's refusal to start for lack of KV memory with extraction: the
    capacity the key would give, where it is off, would split the groups and
    the split layout starts."""
    spec = vllm_config.speculative_config
    if asked(vllm_config) or spec is None or spec.method != METHOD:
        return None
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return None
    if why_unsplit(original_grouping()(vllm_config, _merged(kv_cache_specs))):
        return None
    try:
        tokens, concurrency = split_capacity(vllm_config, kv_cache_specs, memory)
    except ValueError:
        return None
    return f"{split_hint(tokens, concurrency)} and starts; see {SPLIT_DOCS}."


def split_capacity(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], memory: list[int]
) -> tuple[int, float]:
    """The target's KV capacity (tokens, requests at once) by vLLM's layout of
    the workers' specs with the groups split, on ``memory`` bytes each; vLLM's
    ValueError where that layout cannot serve one request."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    split_config = with_key(vllm_config)
    # Its own model config, at the engine's max_model_len: no auto-fit.
    model = split_config.model_config = copy.copy(vllm_config.model_config)
    model.original_max_model_len = model.max_model_len
    layout, *_ = vllm_layout(split_config, kv_cache_specs, memory)
    return get_kv_cache_capacity(split_config, layout)


def vllm_layout(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], memory: list[int]
) -> list[Any]:
    """vLLM's own layout of the workers' ``kv_cache_specs`` on ``memory``
    bytes each, as its engine core makes it, for a config that is not the
    engine's: vLLM's logs about it are kept out of the engine's."""
    import logging

    specs = [dict(one) for one in kv_cache_specs]  # vLLM may unify them in place
    try:  # vLLM 0.33: the groups are made first
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        def layout() -> list[Any]:
            return get_kv_cache_configs(vllm_config, specs, memory)

    else:

        def layout() -> list[Any]:
            groups = get_global_kv_cache_groups(vllm_config, specs)
            return get_kv_cache_configs(vllm_config, specs, memory, groups)

    vllm_log = logging.getLogger(get_kv_cache_configs.__module__)
    disabled, vllm_log.disabled = vllm_log.disabled, True
    try:
        return layout()
    finally:
        vllm_log.disabled = disabled
