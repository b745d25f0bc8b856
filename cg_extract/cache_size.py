"""What extraction costs in KV cache: the arithmetic vLLM's ``KVCacheConfig``
does not do, and the lines that say it.

Pure Python, no torch and no vLLM: :mod:`cg_extract.kv_cache_report` reads
the figures from vLLM's layout and logs these lines once the KV cache exists.

vLLM lays the hidden-state layer out beside the target's KV-cache groups, and
a user sees the result only as a smaller KV cache or an engine that will not
start (vllm-project/vllm#53243, #56774). The states take ``num_aux_layers x
hidden_size x dtype bytes`` a token; vLLM bills the layer a page in each
block where it shares the target's block table, and a whole block of the
pool for each of its blocks where it has a group of its own. The bill beyond
the states is page padding (a page wider than its block's states) and pool
width (a pool block wider than the page); the docs section ``DOCS`` names
says where each comes from and what changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB, GiB = 2**20, 2**30
DOCS = "docs/design.md#what-extraction-costs-in-kv-cache"
SPLIT_DOCS = "docs/design.md#splitting-the-kv-cache-groups"


@dataclass(frozen=True)
class Parallelism:
    """Whose KV cache the logging worker sees (``cg_extract.speaks``): only
    the last pipeline stage holds the hidden-state layer, every TP rank holds
    the same blocks, and each DP rank has its own."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def owner(self) -> str:
        tp, pp, dp = (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
        )
        parts = [
            f"last of {pp} PP stages" if pp > 1 else "",
            f"each of {tp} TP ranks" if tp > 1 else "",
            f"DP rank 0 of {dp}" if dp > 1 else "",
        ]
        parts = [part for part in parts if part]
        return f" ({', '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class HiddenStateCacheSize:
    """What vLLM bills the hidden-state layer in a KV cache of ``num_blocks``
    blocks: ``page_bytes`` its page as laid out (padding included),
    ``pool_block_bytes`` a block of the pool its blocks come from,
    ``kv_cache_bytes`` every pool together. ``own_group``: the layer is its
    group's only one, so each of its blocks is a whole pool block;
    ``request_blocks`` then the blocks a ``max_model_len`` request takes in
    it and in every group (vLLM's admission arithmetic). ``split_capacity``:
    the target's (tokens, concurrency) with ``split_kv_cache_groups`` on,
    where that key is off and could be on."""

    num_aux_layers: int
    hidden_size: int
    dtype_bytes: int
    block_size: int
    page_bytes: int
    num_blocks: int
    pool_block_bytes: int
    kv_cache_bytes: int
    own_group: bool
    request_blocks: tuple[int, int] | None = None
    split_capacity: tuple[int, float] | None = None
    parallelism: Parallelism = Parallelism()

    def __post_init__(self) -> None:
        for name in (
            "num_aux_layers",
            "hidden_size",
            "dtype_bytes",
            "block_size",
            "page_bytes",
            "num_blocks",
            "pool_block_bytes",
            "kv_cache_bytes",
        ):
            _check_int(name, getattr(self, name), least=1)
        if self.page_bytes < self.states_page_bytes:
            raise ValueError(
                f"page_bytes {self.page_bytes} is less than the "
                f"{self.states_page_bytes} bytes of states a page holds: the "
                "spec read does not describe the hidden-state cache"
            )
        if self.page_bytes > self.pool_block_bytes:
            raise ValueError(
                f"page_bytes {self.page_bytes} is more than a block of the "
                f"pool, pool_block_bytes {self.pool_block_bytes}"
            )
        if self.pool_block_bytes * self.num_blocks > self.kv_cache_bytes:
            raise ValueError(
                f"{self.num_blocks} blocks of {self.pool_block_bytes} bytes do "
                f"not fit in kv_cache_bytes {self.kv_cache_bytes}"
            )
        if self.request_blocks is not None:
            mine, every = self.request_blocks
            if not (0 < mine <= every):
                raise ValueError(
                    f"request_blocks {self.request_blocks}: the hidden-state "
                    "group's blocks must be some of the request's"
                )

    @property
    def states_page_bytes(self) -> int:
        """What a page must hold: ``block_size`` tokens of states."""
        return (
            self.num_aux_layers * self.hidden_size * self.dtype_bytes * self.block_size
        )

    @property
    def billed_block_bytes(self) -> int:
        """Each of its blocks: its page in a shared block table, a whole pool
        block in a group of its own."""
        return self.pool_block_bytes if self.own_group else self.page_bytes

    @property
    def bill_bytes(self) -> int:
        """Each of its blocks, in every block it can hold (all of them)."""
        return self.billed_block_bytes * self.num_blocks

    @property
    def padding_bytes(self) -> int:
        return (self.page_bytes - self.states_page_bytes) * self.num_blocks

    @property
    def pool_width_bytes(self) -> int:
        """In a shared table the rest of a block is the target's, not waste."""
        return (self.billed_block_bytes - self.page_bytes) * self.num_blocks

    @property
    def waste_bytes(self) -> int:
        return self.padding_bytes + self.pool_width_bytes

    @property
    def bill_ratio(self) -> float:
        return self.billed_block_bytes / self.states_page_bytes

    @property
    def bill_more_than_doubles(self) -> bool:
        """The warning's threshold."""
        return self.billed_block_bytes > 2 * self.states_page_bytes

    def bill_warning(self) -> str:
        """Each cause that applies with its bytes a block, the key that
        removes the pool width where it could be on, and where the causes
        and remedies are told."""
        causes = [
            f"{what} {nbytes // self.num_blocks:,} bytes a block"
            for what, nbytes in (
                ("page padding", self.padding_bytes),
                ("pool width", self.pool_width_bytes),
            )
            if nbytes
        ]
        key = ""
        if self.pool_width_bytes and self.split_capacity is not None:
            key = f"; {split_hint(*self.split_capacity)}"
        return (
            f"extract_hidden_states: vLLM bills the hidden-state cache "
            f"{self.bill_ratio:.2f}x its states ({', '.join(causes)}){key}; "
            f"see {DOCS}"
        )


@dataclass(frozen=True)
class KVCapacity:
    """The target's capacity (tokens, requests of ``max_model_len`` at once)
    with extraction and with no speculative config, both by vLLM's own
    ``get_kv_cache_capacity``, on ``budget``. ``mamba_extra_pages``: each
    Mamba group's pages a request holds for the speculative token."""

    tokens_with: int
    concurrency_with: float
    tokens_without: int
    concurrency_without: float
    budget: str
    mamba_extra_pages: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _check_int("tokens_with", self.tokens_with, least=0)
        _check_int("tokens_without", self.tokens_without, least=1)


def summary(size: HiddenStateCacheSize, capacity: KVCapacity | None) -> str:
    """The INFO line: the bill, its multiple of the states, the target's
    tokens with and without extraction, whose KV cache."""
    line = (
        f"extract_hidden_states: hidden-state cache {_mib_or_gib(size.bill_bytes)}, "
        f"{size.bill_ratio:.2f}x its states"
    )
    if capacity is not None:
        line += (
            f"; KV cache size {capacity.tokens_with:,} tokens with extraction, "
            f"{capacity.tokens_without:,} without"
        )
    return line + size.parallelism.owner()


def breakdown(size: HiddenStateCacheSize, capacity: KVCapacity | None) -> str:
    """The DEBUG line: every figure of both, in bytes."""
    where = "its own group's pool block" if size.own_group else "its page"
    line = (
        f"extract_hidden_states: hidden-state cache billed {size.bill_bytes} of "
        f"{size.kv_cache_bytes} bytes: {size.num_blocks} blocks of "
        f"{size.block_size} tokens, each billed {size.billed_block_bytes} "
        f"({where}) for {size.states_page_bytes} of states ({size.num_aux_layers} "
        f"x {size.hidden_size} x {size.dtype_bytes} bytes a token); page padding "
        f"{size.padding_bytes} ({size.page_bytes}-byte pages), pool width "
        f"{size.pool_width_bytes} ({size.pool_block_bytes}-byte pool blocks)"
    )
    if size.request_blocks is not None:
        line += "; a request's blocks: {} of {}".format(*size.request_blocks)
    if capacity is not None:
        c = capacity
        line += (
            f"; capacity {c.tokens_with} tokens ({c.concurrency_with:.2f}x) with "
            f"extraction, {c.tokens_without} ({c.concurrency_without:.2f}x) "
            f"without, {c.budget}; Mamba groups' speculative pages a request: "
            f"{dict(c.mamba_extra_pages)}"
        )
    return line


def split_hint(tokens: int, concurrency: float) -> str:
    """The way out of pool width: the key, and the target's capacity with it."""
    return f'"split_kv_cache_groups": true gives {tokens:,} tokens ({concurrency:.2f}x)'


def _mib_or_gib(nbytes: int) -> str:
    if nbytes < GiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / GiB:,.2f} GiB"


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "positive" if least else "non-negative"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")
