"""The hidden-state write as one Triton kernel: the CUDA body of
:mod:`cg_extract.write_op`.

One program per (token, chunk of ``BLOCK_H`` hidden values) stores that
chunk of every aux layer; the layers are a tuple of pointers, unrolled at
compile time, so all ``L`` of them go in one launch whatever their memory
(separate persistent buffers, views of one stacked buffer, any row stride).
Slots may be a strided view too (a column of a wider tensor), as the torch
body allows.
A token whose slot is negative (vLLM's padding) loads its slot and nothing
else: no aux read, no cache write, block 0 included. Slots are not bounds
checked, as in vLLM's own cache kernels.

Uses nothing newer than Triton 3.6 (tuple arguments, ``tl.static_range``).
With ``TRITON_INTERPRET=1`` set before this module is imported, the same
kernel runs on CPU tensors (the tests do that in a process of their own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Hidden values per program: whole rows up to this width (a power of two,
# at least 16 lanes so tiny sizes compile like real ones).
MIN_BLOCK_H, MAX_BLOCK_H = 16, 1024


# Triton compiles one variant per pattern of its int arguments (== 1, a
# multiple of 16); the slot stride is read once per program, where knowing it
# buys nothing, so it gets none (a strided slot view costs no extra compile).
@triton.jit(do_not_specialize=["slot_stride"])
def _write_kernel(
    aux_ptrs,  # tuple of L pointers to [n, H] rows
    aux_row_strides,  # tuple of L ints
    aux_col_strides,  # tuple of L ints
    cache_ptr,  # [num_blocks, L, block_size, H]
    slot_ptr,  # [n], any stride
    slot_stride,
    block_size,
    stride_block,
    stride_layer,
    stride_offset,
    stride_col,
    hidden_size,
    BLOCK_H: tl.constexpr,
):
    # Every offset is int64: a stride fits int32 whenever the tensor's strides
    # do, but a stride times an index need not (a cache with its layer axis
    # outside the block axis puts layer 2 past 2**31 elements at 1 GiB a layer).
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row * slot_stride).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    # A negative slot masks every lane: nothing is read or written.
    mask = cols < tl.where(slot >= 0, hidden_size, 0)
    dst = (
        cache_ptr
        + (slot // block_size) * stride_block
        + (slot % block_size) * stride_offset
        + cols * stride_col
    )
    for layer in tl.static_range(len(aux_ptrs)):
        src = aux_ptrs[layer] + row * aux_row_strides[layer]
        values = tl.load(src + cols * aux_col_strides[layer], mask=mask)
        tl.store(dst + tl.full((), layer, tl.int64) * stride_layer, values, mask=mask)


def write_owned_slots(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the kernel: same contract as
    :func:`cg_extract.cache_write.write_owned_slots`."""
    if slot_mapping.shape[0] == 0:
        return
    grid, args, constexprs = launch_args(aux_hidden_states, kv_cache, slot_mapping)
    _write_kernel[grid](*args, **constexprs)


def launch_args(
    aux_hidden_states: Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[tuple[int, int], tuple, dict[str, int]]:
    """Grid, arguments and constexprs of the launch for these tensors (what
    Triton specialises on: ``tests/torch_alone/kernel_keys.py`` counts them)."""
    hidden_size = kv_cache.shape[3]
    block_h = min(max(triton.next_power_of_2(hidden_size), MIN_BLOCK_H), MAX_BLOCK_H)
    grid = (slot_mapping.shape[0], triton.cdiv(hidden_size, block_h))
    args = (
        tuple(aux_hidden_states),
        tuple(h.stride(0) for h in aux_hidden_states),
        tuple(h.stride(1) for h in aux_hidden_states),
        kv_cache,
        slot_mapping,
        slot_mapping.stride(0),
        kv_cache.shape[2],
        *kv_cache.stride(),
        hidden_size,
    )
    return grid, args, {"BLOCK_H": block_h}
