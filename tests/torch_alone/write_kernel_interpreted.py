"""The Triton write kernel itself, run on CPU by Triton's interpreter.

Not collected with the suite: ``TRITON_INTERPRET=1`` must be set before the
kernel is defined, so ``tests/torch_alone/test_write_op.py`` runs this file with pytest in
a process of its own. Each case compares the kernel with the torch body of the
op and, on the real slots, with vLLM's ``basic_cache`` (where vLLM imports).
"""

from __future__ import annotations

import itertools
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/torch_alone/test_write_op.py with TRITON_INTERPRET=1",
        allow_module_level=True,
    )

import torch
import triton
import triton.language as tl
from hypothesis import given, settings

from cg_extract import cache_write, write_kernel
from tests.write_cases import (
    DTYPES,
    LAYOUTS,
    WriteCase,
    any_write_case,
    same_bytes,
    write_case,
)

try:
    from vllm.model_executor.models.extract_hidden_states import basic_cache
except ImportError:  # the GPU check machines have no vLLM
    basic_cache = None


def check(case: WriteCase) -> None:
    got = case.fresh_cache()
    write_kernel.write_owned_slots(case.aux, got, case.slots)
    want = case.fresh_cache()
    cache_write.write_owned_slots(case.aux, want, case.slots)
    assert same_bytes(got, want), case
    assert same_bytes(got, case.expected()), case
    if basic_cache is not None:
        vllm = case.fresh_cache()
        owned = case.owned_rows()
        basic_cache(torch.stack(case.aux, dim=1)[owned], vllm, case.slots[owned].long())
        assert same_bytes(got, vllm), case


# Every dtype with every hidden size (under, at and over a power of two and
# the kernel's 1024-wide chunk); layouts and layer counts rotate so that each
# pair of any two of the four parameters appears.
CASES = [
    (dtype, hidden_size, (1, 3, 5)[(i // 3) % 3], LAYOUTS[i % 3])
    for i, (dtype, hidden_size) in enumerate(
        itertools.product(DTYPES, [64, 100, 1024, 1030])
    )
]


@pytest.mark.parametrize("dtype, hidden_size, num_layers, layout", CASES, ids=str)
def test_kernel_matches_torch_and_vllm(dtype, hidden_size, num_layers, layout):
    """Padding in the middle and in the tail."""
    case = write_case(
        torch.Generator().manual_seed(hidden_size + num_layers),
        num_tokens=12,
        num_layers=num_layers,
        hidden_size=hidden_size,
        dtype=dtype,
        layout=layout,
        padding=[3, 10, 11],
    )
    check(case)


@settings(max_examples=25, deadline=None)
@given(case=any_write_case(max_tokens=9, max_layers=6, max_hidden=70))
def test_kernel_matches_torch_on_any_shape(case):
    check(case)


def test_all_padding_touches_nothing():
    case = write_case(
        torch.Generator().manual_seed(0),
        num_tokens=6,
        num_layers=3,
        hidden_size=40,
        dtype=torch.bfloat16,
        layout="separate",
        padding=list(range(6)),
    )
    got = case.fresh_cache()
    write_kernel.write_owned_slots(case.aux, got, case.slots)
    assert torch.equal(got, case.fresh_cache())


def test_strided_slots_are_read_by_their_stride():
    """A slot view with stride 2 (every other element of a wider tensor, each
    skipped element a live slot of another token): the kernel must read
    ``slot_mapping[t]``, not ``slot_ptr + t``."""
    case = write_case(
        torch.Generator().manual_seed(1),
        num_tokens=7,
        num_layers=2,
        hidden_size=48,
        dtype=torch.float16,
        layout="separate",
        padding=[2],
    )
    wide = torch.stack([case.slots, case.slots.flip(0)], dim=1)
    strided = wide[:, 0]
    assert strided.stride(0) == 2 and torch.equal(strided, case.slots)
    got = case.fresh_cache()
    write_kernel.write_owned_slots(case.aux, got, strided)
    assert same_bytes(got, case.expected())


@pytest.mark.parametrize("axis", ["block", "layer", "hidden"])
def test_offsets_past_int32_land_where_they_belong(axis):
    """A cache whose block axis (vLLM's layout, a big cache's far blocks),
    layer axis (a ROCm layout's) or hidden axis is outermost: one stride fits
    int32 but a stride times an index does not. Computed in
    int32 the offset wraps negative and the store lands before the cache (a
    crash of this process). The storage is over 2 GiB of virtual memory; only
    the rows written and compared are ever touched."""
    num_blocks, block_size, num_layers = 4, 16, 3
    if axis == "block":  # block 2 (slot 40) starts at 2**31 elements
        hidden_size, big = 64, 2**30
        strides = (big, block_size * hidden_size, hidden_size, 1)
        span = (num_blocks - 1) * big + num_layers * block_size * hidden_size
    elif axis == "layer":  # layer 2 starts at 2**31 elements
        hidden_size, big = 64, 2**30
        strides = (block_size * hidden_size, big, hidden_size, 1)
        span = (num_layers - 1) * big + num_blocks * block_size * hidden_size
    else:  # column 64 starts at 2**31 elements
        hidden_size, big = 128, 2**25
        strides = (block_size * num_layers, block_size, 1, big)
        span = (hidden_size - 1) * big + num_blocks * block_size * num_layers
    cache = torch.empty(span, dtype=torch.uint8).as_strided(
        (num_blocks, num_layers, block_size, hidden_size), strides
    )
    for layer in range(num_layers):
        cache[:, layer].zero_()
    gen = torch.Generator().manual_seed(5)
    aux = [
        torch.randint(1, 256, (5, hidden_size), generator=gen).to(torch.uint8)
        for _ in range(num_layers)
    ]
    slots = torch.tensor([3, 17, -1, 40, 63])
    write_kernel.write_owned_slots(aux, cache, slots)
    want = torch.zeros(cache.shape, dtype=torch.uint8)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for layer in range(num_layers):
                want[slot // block_size, layer, slot % block_size] = aux[layer][row]
    assert torch.equal(cache.contiguous(), want)


@triton.jit
def _store_as(src, dst, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(dst + cols, tl.load(src + cols).to(dst.dtype.element_ty))


def test_the_interpreter_truncates_what_it_narrows():
    """Why the op refuses aux hidden states of another dtype instead of
    converting them in the kernel (cg_extract/write_op.py, "Dtypes"): here a
    float32 value narrowed to bfloat16 in a kernel is truncated, where torch,
    as vLLM's ``copy_``, rounds to nearest even, so an in-kernel conversion
    could not be checked against vLLM's bytes on a CPU. Should this fail,
    the interpreter rounds as torch does and the choice can be revisited."""
    values = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    got = torch.empty(1024, dtype=torch.bfloat16)
    _store_as[(1,)](values, got, BLOCK=1024)
    truncated = (values.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(got.view(torch.int16), truncated)
    rounded = values.to(torch.bfloat16).view(torch.int16)
    assert (got.view(torch.int16) != rounded).any()
