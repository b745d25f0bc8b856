"""What extraction costs in KV cache, read from vLLM's layout.

The adapter between vLLM's ``KVCacheConfig`` (as the runner got it) and the
arithmetic of :mod:`cg_extract.cache_size`: the hidden-state layer's group,
spec, pool and blocks, the group that sets its page, the widest group, the
blocks a request takes; and the target's capacity with extraction and, by
vLLM's own layout functions on the same specs less the hidden-state layer
and the Mamba groups' speculative blocks, without it. Nothing here is
recomputed from vLLM's grouping rules. The speculator logs the result
(``ExtractHiddenStatesSpeculator.report_cache_size``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs

from cg_extract import kv_cache_groups
from cg_extract.cache_size import (
    HiddenStateCacheSize,
    KVCapacity,
    MambaExtra,
    PageSetter,
    Parallelism,
    WidestGroup,
)


def hidden_state_cache_size(
    vllm_config: VllmConfig,
    layer_name: str,
    num_aux_layers: int,
    dtype: torch.dtype,
    kv_cache_config: KVCacheConfig,
    kv_cache_specs: dict[str, Any] | None = None,
) -> HiddenStateCacheSize:
    """The hidden-state layer's pages, block size and pool, read from
    ``kv_cache_config`` as vLLM laid it out; what a page must hold, from what
    the speculator writes (``num_aux_layers`` states of ``dtype``); for a
    group of its own, the blocks a request of ``max_model_len`` tokens takes,
    by vLLM's admission arithmetic (each group's ``max_memory_usage_bytes``
    in pages). Given ``kv_cache_specs`` (the runner's), where the bill
    warning names pool width and ``split_kv_cache_groups`` could be on, the
    target's capacity with it on, by vLLM's layout of the same specs."""
    name = layer_name
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    held = [(i, g) for i, g in enumerate(groups) if name in g.layer_names]
    placed = [t for t in tensors if name in t.layers]
    if len(held) != 1 or len(placed) != 1:
        raise ValueError(
            f"the hidden-state layer {name} is in {len(held)} KV-cache "
            f"groups and {len(placed)} KV-cache tensors, not one of each"
        )
    ((index, group),), (tensor,) = held, placed
    spec = _layer_spec(group, name)
    num_blocks = kv_cache_config.num_blocks_of(tensor)
    if tensor.size % num_blocks:
        raise ValueError(
            f"the KV cache pool of {tensor.size} bytes is not {num_blocks} equal blocks"
        )
    # Groups overlay one allocation per pool (device, HiSparse's host).
    pools = {t.host_resident: t.size for t in tensors}
    others = [(i, g) for i, g in enumerate(groups) if i != index]
    own_group = group.layer_names == [name]
    request_blocks = None
    if own_group:
        pages = [_request_pages(vllm_config, g) for g in groups]
        request_blocks = (pages[index], sum(pages))
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
        num_groups=len(groups),
        other_block_sizes=tuple(
            sorted({g.kv_cache_spec.block_size for _, g in others})
        ),
        page_setter=_page_setter(spec, others) if own_group else None,
        widest_group=_widest_group(others) if own_group else None,
        request_blocks=request_blocks,
        max_model_len=vllm_config.model_config.max_model_len,
        parallelism=_parallelism(vllm_config),
    )
    # Laid out only for the warning that names it: pool width is a cause.
    warned_of_width = size.bill_more_than_doubles and size.pool_width_bytes > 0
    if kv_cache_specs is None or not warned_of_width:
        return size
    if not _could_split(vllm_config, kv_cache_config):
        return size
    memory, _ = _budget(vllm_config, kv_cache_config)
    split_capacity = kv_cache_groups.split_capacity(
        vllm_config, [kv_cache_specs], [memory]
    )
    return dataclasses.replace(size, split_capacity=split_capacity)


def _could_split(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """``split_kv_cache_groups`` is off, allowed, and would split groups."""
    return (
        not kv_cache_groups.asked(vllm_config)
        and vllm_config.parallel_config.pipeline_parallel_size == 1
        and kv_cache_groups.why_unsplit(kv_cache_config.kv_cache_groups) is None
    )


def kv_capacity(
    vllm_config: VllmConfig,
    layer_name: str,
    kv_cache_config: KVCacheConfig,
    kv_cache_specs: dict[str, Any],
) -> KVCapacity:
    """The target's KV capacity by vLLM's own ``get_kv_cache_capacity``:
    with extraction, on ``kv_cache_config``; with no speculative config,
    on the layout vLLM's own ``get_kv_cache_configs`` makes of
    ``kv_cache_specs`` without the hidden-state layer and without the
    Mamba groups' speculative blocks, on the same budget."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    tokens_with, concurrency_with = get_kv_cache_capacity(vllm_config, kv_cache_config)
    without = _without_speculation(vllm_config)
    specs = {
        name: _without_speculative_blocks(spec)
        for name, spec in kv_cache_specs.items()
        if name != layer_name
    }
    memory, budget = _budget(vllm_config, kv_cache_config)
    (layout,) = kv_cache_groups.vllm_layout(without, [specs], [memory])
    tokens_without, concurrency_without = get_kv_cache_capacity(without, layout)
    extras = tuple(
        MambaExtra(i, _request_pages(vllm_config, g) - _request_pages(without, plain))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if (plain := _without_speculative_blocks(g)) is not g
    )
    return KVCapacity(
        max_model_len=vllm_config.model_config.max_model_len,
        tokens_with=tokens_with,
        concurrency_with=concurrency_with,
        tokens_without=tokens_without,
        concurrency_without=concurrency_without,
        budget=budget,
        pool_block_bytes=_device_pool_block(kv_cache_config),
        mamba_extras=extras,
        parallelism=_parallelism(vllm_config),
    )


def _page_setter(spec: Any, others: list[tuple[int, Any]]) -> PageSetter | None:
    """The group whose own page the hidden-state layer's padded page is: of
    the other groups with that page, the one whose unpadded page is largest.
    None when vLLM did not pad the page to another group's."""
    if getattr(spec, "page_size_padded", None) is None:
        return None
    page = spec.page_size_bytes
    candidates = [
        PageSetter(
            index=i,
            spec=type(g.kv_cache_spec).__name__,
            num_layers=len(g.layer_names),
            block_size=g.kv_cache_spec.block_size,
            page_bytes=getattr(
                g.kv_cache_spec, "real_page_size_bytes", g.kv_cache_spec.page_size_bytes
            ),
        )
        for i, g in others
        if g.kv_cache_spec.page_size_bytes == page
    ]
    return max(candidates, key=lambda s: s.page_bytes, default=None)


def _layer_spec(group: Any, name: str) -> Any:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[name]
    return spec


def _widest_group(others: list[tuple[int, Any]]) -> WidestGroup | None:
    """Of the other groups, the one whose layers' pages side by side are
    widest: a block of the pool is that wide."""

    def width(group: Any) -> int:
        return sum(_layer_spec(group, n).page_size_bytes for n in group.layer_names)

    if not others:
        return None
    index, group = max(others, key=lambda ig: width(ig[1]))
    return WidestGroup(
        index=index,
        spec=type(group.kv_cache_spec).__name__,
        num_layers=len(group.layer_names),
        page_bytes=group.kv_cache_spec.page_size_bytes,
    )


def _request_pages(vllm_config: VllmConfig, group: Any) -> int:
    """The pages (so blocks of the pool) a request of ``max_model_len``
    tokens takes in ``group``: what vLLM's admission and capacity count for
    it (``get_max_concurrency_for_kv_cache_config``)."""
    spec = group.kv_cache_spec
    return -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)


def _parallelism(vllm_config: VllmConfig) -> Parallelism:
    parallel = vllm_config.parallel_config
    return Parallelism(
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        data_parallel_size=parallel.data_parallel_size,
    )


def _without_speculation(vllm_config: VllmConfig) -> VllmConfig:
    """``vllm_config`` as the same target without a speculative config: a
    shallow copy, with its own model config so that vLLM's auto-fit of
    ``max_model_len`` (``-1``) cannot touch the engine's."""
    without = copy.copy(vllm_config)
    without.speculative_config = None
    without.model_config = copy.copy(vllm_config.model_config)
    without.model_config.original_max_model_len = vllm_config.model_config.max_model_len
    return without


def _without_speculative_blocks(item: Any) -> Any:
    """A KV-cache spec (or group) as vLLM builds it with no speculative
    tokens: a Mamba spec without its speculative blocks; anything else as
    it is (the same object)."""
    spec = getattr(item, "kv_cache_spec", item)
    if not getattr(spec, "num_speculative_blocks", 0):
        return item
    plain = dataclasses.replace(spec, num_speculative_blocks=0)
    return plain if item is spec else dataclasses.replace(item, kv_cache_spec=plain)


def _device_pool_block(kv_cache_config: KVCacheConfig) -> int:
    (size,) = {t.size for t in kv_cache_config.kv_cache_tensors if not t.host_resident}
    return size // kv_cache_config.num_blocks


def _budget(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[int, str]:
    """The KV budget an engine without extraction would get, and its label:
    the one given (``kv_cache_memory_bytes``, or ``num_gpu_blocks_override``,
    which vLLM's own functions apply), else the bytes allocated here."""
    cache = vllm_config.cache_config
    allocated = _device_pool_block(kv_cache_config) * kv_cache_config.num_blocks
    if cache.num_gpu_blocks_override is not None:
        blocks = cache.num_gpu_blocks_override
        return allocated, f"in the same {blocks} blocks (num_gpu_blocks_override)"
    if cache.kv_cache_memory_bytes:
        given = cache.kv_cache_memory_bytes
        return given, f"on the same {given}-byte budget (kv_cache_memory_bytes)"
    return allocated, (
        f"on the {allocated} bytes allocated here (vLLM profiled the budget, "
        "and without extraction would profile its own)"
    )
