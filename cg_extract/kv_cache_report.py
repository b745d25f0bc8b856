"""What extraction costs in KV cache, read from vLLM's layout and logged.

The adapter between vLLM's ``KVCacheConfig`` (as the runner got it) and the
arithmetic of :mod:`cg_extract.cache_size`: the hidden-state layer's spec,
pool and blocks, the blocks a request takes; and the target's capacity with
extraction and, by vLLM's own layout functions on the same specs less the
hidden-state layer and the Mamba groups' speculative blocks, without it.
Nothing here is recomputed from vLLM's grouping rules.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs

from cg_extract import get_logger, kv_cache_groups
from cg_extract.cache_size import (
    HiddenStateCacheSize,
    KVCapacity,
    Parallelism,
    breakdown,
    summary,
)

logger = get_logger(__name__)


def report(
    vllm_config: VllmConfig,
    layer_name: str,
    num_aux_layers: int,
    dtype: torch.dtype,
    kv_cache_config: KVCacheConfig,
    kv_cache_specs: Callable[[], dict[str, Any]] | None = None,
    extensible: bool = False,
) -> None:
    """Log what extraction costs: the bill and, given ``kv_cache_specs``
    (the runner's, what the engine core grouped), the target's capacity with
    and without extraction at INFO, a WARNING when the bill is more than
    twice the states, every figure at DEBUG. ``extensible``: the KV cache is
    vLLM 0.34's extensible one, whose ``num_blocks`` is still the capacity
    reserved (:func:`summary_line`). Never raises: a report must not stop an
    engine that vLLM could start."""
    try:
        specs = kv_cache_specs() if kv_cache_specs is not None else None
        size = hidden_state_cache_size(
            vllm_config, layer_name, num_aux_layers, dtype, kv_cache_config, specs
        )
    except Exception as why:  # a layout this reading does not know
        logger.warning("extract_hidden_states: cache size not reported: %s", _why(why))
        return
    capacity = None
    try:
        if specs is not None:
            capacity = kv_capacity(vllm_config, layer_name, kv_cache_config, specs)
    except Exception as why:  # vLLM's own functions, on specs it never saw
        logger.warning("extract_hidden_states: KV capacity not reported: %s", _why(why))
    logger.info(summary_line(size, capacity, extensible))
    if size.bill_more_than_doubles:
        logger.warning(size.bill_warning())
    logger.debug(breakdown(size, capacity))


def summary_line(
    size: HiddenStateCacheSize, capacity: KVCapacity | None, extensible: bool = False
) -> str:
    """The INFO line (:func:`cg_extract.cache_size.summary`). With vLLM 0.34's
    extensible KV cache (CUDA only) the runner's KV cache is initialised with
    ``num_blocks`` the capacity whose addresses are reserved; vLLM commits
    what fits only after warm-up and graph capture (``extend_kv_cache``,
    then its own "Extended KV cache to N blocks" line), so every figure here
    is the reservation's, and the line says so: "KV cache reserved:" where
    it says "KV cache size" otherwise (five characters more)."""
    if not extensible:
        return summary(size, capacity)
    owner = size.parallelism.owner()
    line = summary(size, None).removesuffix(owner)
    if capacity is None:
        return f"{line}; KV cache reserved, committed after warm-up{owner}"
    return (
        f"{line}; KV cache reserved: {capacity.tokens_with:,} tokens with "
        f"extraction, {capacity.tokens_without:,} without{owner}"
    )


def hidden_state_cache_size(
    vllm_config: VllmConfig,
    layer_name: str,
    num_aux_layers: int,
    dtype: torch.dtype,
    kv_cache_config: KVCacheConfig,
    kv_cache_specs: dict[str, Any] | None = None,
) -> HiddenStateCacheSize:
    """The hidden-state layer's page, block size and pool as vLLM laid them
    out; what a page must hold, from what the speculator writes; for a group
    of its own, a ``max_model_len`` request's blocks by vLLM's admission
    arithmetic and, given ``kv_cache_specs`` where the bill warning names
    pool width and ``split_kv_cache_groups`` could be on, the target's
    capacity with it on, by vLLM's layout of the same specs."""
    name = layer_name
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    held = [g for g in groups if name in g.layer_names]
    placed = [t for t in tensors if name in t.layers]
    if len(held) != 1 or len(placed) != 1:
        raise ValueError(
            f"the hidden-state layer {name} is in {len(held)} KV-cache "
            f"groups and {len(placed)} KV-cache tensors, not one of each"
        )
    (group,), (tensor,) = held, placed
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.kv_cache_specs[name]
    num_blocks = kv_cache_config.num_blocks_of(tensor)
    if tensor.size % num_blocks:
        raise ValueError(
            f"the KV cache pool of {tensor.size} bytes is not {num_blocks} equal blocks"
        )
    own_group = group.layer_names == [name]
    request_blocks = None
    if own_group:
        pages = [_request_pages(vllm_config, g) for g in groups]
        request_blocks = (pages[groups.index(group)], sum(pages))
    # Groups overlay one allocation per pool (device, HiSparse's host).
    pools = {t.host_resident: t.size for t in tensors}
    size = HiddenStateCacheSize(
        num_aux_layers=num_aux_layers,
        hidden_size=vllm_config.model_config.get_hidden_size(),
        dtype_bytes=dtype.itemsize,
        block_size=spec.block_size,
        page_bytes=spec.page_size_bytes,
        num_blocks=num_blocks,
        pool_block_bytes=tensor.size // num_blocks,
        kv_cache_bytes=sum(pools.values()),
        own_group=own_group,
        request_blocks=request_blocks,
        parallelism=Parallelism(
            vllm_config.parallel_config.tensor_parallel_size,
            vllm_config.parallel_config.pipeline_parallel_size,
            vllm_config.parallel_config.data_parallel_size,
        ),
    )
    # Laid out only for the warning that names it, where the key is off
    # (split groups have one layer each) and allowed.
    if (
        kv_cache_specs is None
        or not (size.bill_more_than_doubles and size.pool_width_bytes)
        or vllm_config.parallel_config.pipeline_parallel_size > 1
        or kv_cache_groups.why_unsplit(groups) is not None
    ):
        return size
    memory, _ = _budget(vllm_config, kv_cache_config)
    capacity = kv_cache_groups.split_capacity(vllm_config, [kv_cache_specs], [memory])
    return dataclasses.replace(size, split_capacity=capacity)


def kv_capacity(
    vllm_config: VllmConfig,
    layer_name: str,
    kv_cache_config: KVCacheConfig,
    kv_cache_specs: dict[str, Any],
) -> KVCapacity:
    """The target's KV capacity by vLLM's own ``get_kv_cache_capacity``:
    with extraction, on ``kv_cache_config``; with no speculative config, on
    the layout vLLM's own ``get_kv_cache_configs`` makes of
    ``kv_cache_specs`` without the hidden-state layer and without the Mamba
    groups' speculative blocks, on the same budget."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    with_it = get_kv_cache_capacity(vllm_config, kv_cache_config)
    # Its own model config, so that vLLM's auto-fit of max_model_len (-1)
    # cannot touch the engine's.
    without = copy.copy(vllm_config)
    without.speculative_config = None
    without.model_config = copy.copy(vllm_config.model_config)
    without.model_config.original_max_model_len = vllm_config.model_config.max_model_len
    specs = {
        name: _without_speculative_blocks(spec)
        for name, spec in kv_cache_specs.items()
        if name != layer_name
    }
    memory, budget = _budget(vllm_config, kv_cache_config)
    (layout,) = kv_cache_groups.vllm_layout(without, [specs], [memory])
    extras = tuple(
        (i, _request_pages(vllm_config, g) - _request_pages(without, plain))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if (plain := _without_speculative_blocks(g)) is not g
    )
    return KVCapacity(*with_it, *get_kv_cache_capacity(without, layout), budget, extras)


def _request_pages(vllm_config: VllmConfig, group: Any) -> int:
    """The pages (so blocks of the pool) a ``max_model_len`` request takes
    in ``group``, as vLLM's admission and capacity count them
    (``get_max_concurrency_for_kv_cache_config``)."""
    spec = group.kv_cache_spec
    return -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)


def _without_speculative_blocks(item: Any) -> Any:
    """A KV-cache spec (or group) as vLLM builds it with no speculative
    tokens: a Mamba spec without its speculative blocks; anything else as
    it is (the same object)."""
    spec = getattr(item, "kv_cache_spec", item)
    if not getattr(spec, "num_speculative_blocks", 0):
        return item
    plain = dataclasses.replace(spec, num_speculative_blocks=0)
    return plain if item is spec else dataclasses.replace(item, kv_cache_spec=plain)


def _budget(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[int, str]:
    """The KV budget an engine without extraction would get, and its label:
    the one given (``kv_cache_memory_bytes``, or ``num_gpu_blocks_override``,
    which vLLM's own functions apply), else the bytes allocated here (vLLM
    profiled it; without extraction it would profile its own)."""
    cache = vllm_config.cache_config
    (pool,) = {t.size for t in kv_cache_config.kv_cache_tensors if not t.host_resident}
    allocated = pool // kv_cache_config.num_blocks * kv_cache_config.num_blocks
    if cache.num_gpu_blocks_override is not None:
        return (
            allocated,
            f"{cache.num_gpu_blocks_override} blocks (num_gpu_blocks_override)",
        )
    if cache.kv_cache_memory_bytes:
        given = cache.kv_cache_memory_bytes
        return given, f"{given} bytes (kv_cache_memory_bytes)"
    return allocated, f"{allocated} bytes (allocated here)"


def _why(error: Exception) -> str:
    """Our own refusals say why; anything else also says what it was."""
    if isinstance(error, ValueError):
        return str(error)
    return f"{type(error).__name__}: {error}"
