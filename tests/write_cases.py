"""Inputs for the hidden-state write op and the cache they must leave, shared
by its CPU, interpreted-Triton and CUDA tests. Torch only (hypothesis only
for :func:`any_write_case`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ("separate", "stacked", "strided")


@dataclass
class WriteCase:
    aux: list[torch.Tensor]  # L tensors of [n, H], laid out as `layout` says
    slots: torch.Tensor  # [n]; -1 at the padded rows
    initial: torch.Tensor  # the cache before the write: random, so that any
    # stray write shows

    def fresh_cache(self) -> torch.Tensor:
        return self.initial.clone()

    def owned_rows(self) -> torch.Tensor:
        return (self.slots >= 0).nonzero().flatten()

    def expected(self) -> torch.Tensor:
        """The cache after the write, element by element in Python: owned rows
        stored, everything else (block 0 included) as it was."""
        cache = self.fresh_cache()
        block_size = cache.shape[2]
        for row in self.owned_rows().tolist():
            slot = int(self.slots[row])
            for layer, hidden in enumerate(self.aux):
                cache[slot // block_size, layer, slot % block_size] = hidden[row]
        return cache

    def to(self, device: str) -> WriteCase:
        """The same case on ``device``, with the same strides."""

        def move(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            return out.copy_(t)

        return WriteCase(
            [move(a) for a in self.aux], self.slots.to(device), self.initial.to(device)
        )


def write_case(
    gen: torch.Generator,
    num_tokens: int,
    num_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
    layout: str,
    padding: list[int],
    block_size: int = 16,
    slot_dtype: torch.dtype = torch.int64,
    null_block: bool = False,
    any_bits: bool = False,
) -> WriteCase:
    """``layout``: ``separate`` contiguous tensors (the target's persistent
    buffers), ``stacked`` views ``buf[:, l]`` of one ``[n, L, H]`` buffer (the
    copy-in static buffer), ``strided`` every other row and column of a
    larger buffer. Real slots are unique and may fall anywhere, block 0
    included unless ``null_block`` keeps it for padding, as vLLM does; the
    rows in ``padding`` get slot -1. ``any_bits``: hidden values and cache
    are random bit patterns (NaNs with any payload, infinities, subnormals),
    so that only a copy that never looks at the values keeps them."""
    n, L, H = num_tokens, num_layers, hidden_size
    num_blocks = -(-n // block_size) + 2
    first = block_size if null_block else 0
    slots = torch.randperm(num_blocks * block_size - first, generator=gen)[:n] + first
    slots[padding] = -1
    values = _random(gen, (n, L, H), dtype, any_bits)
    if layout == "separate":
        aux = [values[:, layer].clone() for layer in range(L)]
    elif layout == "stacked":
        aux = [values[:, layer] for layer in range(L)]
    elif layout == "strided":
        aux = []
        for layer in range(L):
            big = torch.zeros(2 * n, 2 * H, dtype=dtype)
            big[::2, ::2] = values[:, layer]
            aux.append(big[::2, ::2])
    else:
        raise ValueError(f"layout {layout!r}; expected one of {LAYOUTS}")
    initial = _random(gen, (num_blocks, L, block_size, H), dtype, any_bits)
    return WriteCase(aux, slots.to(slot_dtype), initial)


def _random(gen: torch.Generator, shape, dtype: torch.dtype, any_bits: bool):
    if not any_bits:
        return torch.randn(shape, generator=gen).to(dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen)
    return raw.to(torch.uint8).view(dtype)


def run_op(case: WriteCase) -> torch.Tensor:
    """The cache after ``write_hidden_states`` on the case, on its device."""
    from cg_extract.write_op import write_hidden_states

    cache = case.fresh_cache()
    write_hidden_states(case.aux, cache, case.slots)
    return cache


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads, signed zeros), on any
    devices and with any strides."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.cpu().contiguous().view(torch.uint8),
            b.cpu().contiguous().view(torch.uint8),
        )
    )


def any_write_case(max_tokens: int, max_layers: int, max_hidden: int):
    """A hypothesis strategy: any size, layout, dtype, block size, slot dtype
    and padding pattern (padding anywhere, not only in the tail)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw) -> WriteCase:
        num_tokens = draw(st.integers(0, max_tokens))
        padding = draw(st.sets(st.integers(0, max(num_tokens - 1, 0))))
        return write_case(
            torch.Generator().manual_seed(draw(st.integers(0, 2**31))),
            num_tokens=num_tokens,
            num_layers=draw(st.integers(1, max_layers)),
            hidden_size=draw(st.integers(1, max_hidden)),
            dtype=draw(st.sampled_from(DTYPES)),
            layout=draw(st.sampled_from(LAYOUTS)),
            padding=sorted(p for p in padding if p < num_tokens),
            block_size=draw(st.sampled_from([1, 3, 16])),
            slot_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
            any_bits=draw(st.booleans()),
        )

    return cases()
