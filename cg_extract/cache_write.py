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

    On a CPU reading the slots is free (no device to wait for), so padding is
    dropped on the host; the Triton kernel masks it instead. Up to
    :data:`COPY_UP_TO` tokens each owned token's rows take one copy
    (:func:`copy_rows`), above that each layer one scatter
    (:func:`scatter_layers`).
    """
    if slot_mapping.shape[0] <= COPY_UP_TO:
        copy_rows(aux_hidden_states, kv_cache, slot_mapping.tolist())
        return
    if int(slot_mapping.min()) < 0:
        owned = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping = slot_mapping[owned]
        aux_hidden_states = [hidden[owned] for hidden in aux_hidden_states]
    scatter_layers(aux_hidden_states, kv_cache, slot_mapping)


# The crossover perf/write_op_cost.py measured on a 2-core AMD EPYC (family 26
# model 2), bf16, hidden 1024 x 3 layers and 4096 x 4, with warm caches and
# with every cache evicted before each call (docs/measurements.md, "The write op's
# fixed cost"): the copies cost least up to 4 tokens in all four.
COPY_UP_TO = 4


def copy_rows(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slots: list[int],
) -> None:
    """One copy per owned slot (``slots``: the slot mapping as a list) of its
    ``[L, H]`` cache rows: no index tensors, the least fixed cost; any cache
    strides."""
    owned = [(token, slot) for token, slot in enumerate(slots) if slot >= 0]
    if not owned:
        return
    _, num_layers, block_size, hidden_size = kv_cache.shape
    # [n, L, H]: each token's layers side by side, as its cache rows lie.
    rows = torch.cat(list(aux_hidden_states), 1).view(
        len(slots), num_layers, hidden_size
    )
    for token, slot in owned:
        kv_cache[slot // block_size, :, slot % block_size] = rows[token]


def scatter_layers(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Every slot >= 0: one scatter per layer, straight from its aux hidden
    state (no stacked copy of the payload); any cache strides."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping.remainder(block_size)
    kv_cache, aux_hidden_states = _as_words(kv_cache, aux_hidden_states)
    for layer_cache, hidden in zip(kv_cache.unbind(1), aux_hidden_states, strict=True):
        layer_cache.index_put_((blocks, offsets), hidden)


# Wider element types a row of hidden values can be viewed as, widest first.
# CPU scatters copy element by element, so moving a 2 KiB bf16 row as 128
# complex128 words instead of 1024 bf16 values is what makes the write fast;
# a copy never looks at the bits, so any bit pattern (NaNs included) survives.
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32))


def _as_words(
    kv_cache: torch.Tensor, aux_hidden_states: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """The cache and the aux hidden states viewed as the widest words that
    tile every row of all of them (same bytes, fewer elements); as they are
    when none does (e.g. an odd row stride or width)."""
    tensors = [kv_cache, *aux_hidden_states]
    itemsize = kv_cache.element_size()
    for size, word in _WORDS:
        if size <= itemsize:
            break
        if any(t.data_ptr() % size for t in tensors):
            continue
        try:
            return kv_cache.view(word), [h.view(word) for h in aux_hidden_states]
        except RuntimeError:  # a stride, width or offset the word does not tile
            continue
    return kv_cache, aux_hidden_states


def check_write_args(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ``ValueError`` naming the argument unless the three agree:
    ``L`` aux hidden states of ``[n, H]``, a ``[num_blocks, L, block_size, H]``
    cache of their dtype and device, ``n`` int32 or int64 slots on it.

    Every step runs this, so the passing case is a few comparisons; the
    messages are built only on failure.
    """
    shape = kv_cache.shape
    dtype, device = kv_cache.dtype, kv_cache.device
    want = (slot_mapping.shape[0], shape[-1]) if slot_mapping.dim() == 1 else None
    if (
        len(shape) == 4
        and want is not None
        and len(aux_hidden_states) == shape[1]
        and slot_mapping.dtype in _SLOT_DTYPES
        and slot_mapping.device == device
    ):
        # A loop, not all() over a generator: this is the per-step cost.
        for hidden in aux_hidden_states:
            if (
                hidden.shape != want
                or hidden.dtype is not dtype
                or hidden.device != device
            ):
                break
        else:
            return
    if len(shape) != 4:
        raise ValueError(
            f"kv_cache has shape {list(shape)}; expected "
            "[num_blocks, num_layers, block_size, hidden_size]"
        )
    if want is None or slot_mapping.dtype not in _SLOT_DTYPES:
        raise ValueError(
            f"slot_mapping is {slot_mapping.dtype} of shape "
            f"{list(slot_mapping.shape)}; expected one int32 or int64 slot per token"
        )
    if len(aux_hidden_states) != shape[1]:
        raise ValueError(
            f"{len(aux_hidden_states)} aux hidden states for a cache of "
            f"{shape[1]} layers (kv_cache shape {list(shape)})"
        )
    for layer, hidden in enumerate(aux_hidden_states):
        if hidden.shape != want or hidden.dtype != dtype or hidden.device != device:
            raise ValueError(
                f"aux hidden state {layer} is {hidden.dtype} {list(hidden.shape)} "
                f"on {hidden.device}; expected {dtype} {list(want)} on {device} "
                "(one row per slot, the cache's hidden size, dtype and device)"
            )
    raise ValueError(f"slot_mapping is on {slot_mapping.device}, kv_cache on {device}")


_SLOT_DTYPES = (torch.int32, torch.int64)


def payload_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype) -> int:
    """Bytes of hidden state one step stores."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return num_tokens * num_layers * hidden_size * itemsize
