"""The hidden-state KV-cache write, in torch alone.

vLLM's cache-only layer stores token ``t``'s aux hidden states (``L`` layers of
``H`` values) at ``kv_cache[slot // block_size, :, slot % block_size]`` of a
``[num_blocks, L, block_size, H]`` cache, and sends the padding slot -1 to
block 0, the null block no request owns (:func:`write_stacked`, its
``basic_cache``). Our write (:func:`write_owned_slots`, the CPU body of
:mod:`cg_extract.write_op`) stores the same bytes in every slot a token owns
and nothing at all for a negative slot. None of this needs vLLM, so the GPU
check and the ``kernel`` sweep run it on a machine without it.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each ``[n, H]`` aux hidden state straight into its cache row.

    Same bytes as :func:`write_stacked` on ``torch.stack(aux, dim=1)``, without
    the stacked copy. Our write before :mod:`cg_extract.write_op`, kept as the
    sweep's reference for what one op costs against ``3 + 2L`` small ones.
    """
    blocks, offsets = slot_coordinates(slot_mapping, kv_cache.shape[2])
    for layer, hidden in enumerate(aux_hidden_states):
        kv_cache[blocks, layer, offsets] = hidden


def write_owned_slots(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row ``t`` of aux layer ``l`` to ``kv_cache[slot // bs, l, slot % bs]``
    for every ``slot = slot_mapping[t] >= 0``; a negative slot writes nothing.

    On a CPU reading the slots is free (no device to wait for), so padding
    is dropped before the scatter; the Triton kernel masks it instead.
    """
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        owned = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping = slot_mapping[owned]
        aux_hidden_states = [hidden[owned] for hidden in aux_hidden_states]
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping.remainder(block_size)
    for layer, hidden in enumerate(aux_hidden_states):
        kv_cache.select(1, layer).index_put_((blocks, offsets), hidden)


def check_write_args(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ``ValueError`` naming the argument unless the three agree:
    ``L`` aux hidden states of ``[n, H]``, a ``[num_blocks, L, block_size, H]``
    cache of their dtype and device, ``n`` integer slots."""
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache has shape {list(kv_cache.shape)}; expected "
            "[num_blocks, num_layers, block_size, hidden_size]"
        )
    _, num_layers, _, hidden_size = kv_cache.shape
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping is {slot_mapping.dtype} of shape "
            f"{list(slot_mapping.shape)}; expected one int32 or int64 slot per token"
        )
    if len(aux_hidden_states) != num_layers:
        raise ValueError(
            f"{len(aux_hidden_states)} aux hidden states for a cache of "
            f"{num_layers} layers (kv_cache shape {list(kv_cache.shape)})"
        )
    want = (len(slot_mapping), hidden_size)
    for layer, hidden in enumerate(aux_hidden_states):
        if (
            hidden.shape != want
            or hidden.dtype != kv_cache.dtype
            or hidden.device != kv_cache.device
        ):
            raise ValueError(
                f"aux hidden state {layer} is {hidden.dtype} {list(hidden.shape)} "
                f"on {hidden.device}; expected {kv_cache.dtype} {list(want)} on "
                f"{kv_cache.device} (one row per slot, the cache's hidden size, "
                "dtype and device)"
            )
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device}, kv_cache on {kv_cache.device}"
        )


def payload_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype) -> int:
    """Bytes of hidden state one step stores."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return num_tokens * num_layers * hidden_size * itemsize
