"""The hidden-state KV-cache write, in torch alone.

vLLM's cache-only layer stores token ``t``'s aux hidden states (``L`` layers of
``H`` values) at ``kv_cache[slot // block_size, :, slot % block_size]`` of a
``[num_blocks, L, block_size, H]`` cache, and sends the padding slot -1 to
block 0, the null block no request owns. These functions write exactly those
bytes; they need no vLLM, so the GPU check and the ``kernel`` sweep run them on
a machine without it.
"""

from __future__ import annotations

import torch


def slot_coordinates(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each slot; padding (-1) maps to block 0, offset 0."""
    slots = slot_mapping.clamp_min(0)
    return slots // block_size, slots % block_size


def write_stacked(
    hidden_states: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``[n, L, H]`` into the cache: vLLM's ``basic_cache``."""
    blocks, offsets = slot_coordinates(slot_mapping, kv_cache.shape[2])
    kv_cache[blocks, :, offsets] = hidden_states


def write_per_layer(
    aux_hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each ``[n, H]`` aux hidden state straight into its cache row.

    Same bytes as :func:`write_stacked` on ``torch.stack(aux, dim=1)``, without
    the stacked copy: every hidden-state byte is read once and written once.
    """
    blocks, offsets = slot_coordinates(slot_mapping, kv_cache.shape[2])
    for layer, hidden in enumerate(aux_hidden_states):
        kv_cache[blocks, layer, offsets] = hidden


def payload_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype) -> int:
    """Bytes of hidden state one step stores."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return num_tokens * num_layers * hidden_size * itemsize
