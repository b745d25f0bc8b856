"""The hidden-state cache's size, as the log reports it once the KV cache exists.

Pure arithmetic, no torch and no vLLM: the speculator reads the figures from
vLLM's own ``KVCacheConfig`` (:meth:`cg_extract.speculator.
ExtractHiddenStatesSpeculator.report_cache_size`) and hands them here.

Why users need it: vLLM sizes the hidden-state group's pages beside the
target's groups (one page size for every group, block sizes that divide each
other, one pool of blocks all groups draw on), and a user who extracts sees
the result only as a KV cache smaller than expected or an engine that will
not start (vllm-project/vllm#53243, #56774). The states themselves take
``num_aux_layers x hidden_size x dtype bytes`` a token; anything a page holds
beyond that, times its blocks, is page padding.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class PageSetter:
    """The KV-cache group whose page every group's pages are padded to."""

    index: int
    spec: str  # its KVCacheSpec class name
    num_layers: int
    block_size: int
    page_bytes: int  # its own page, before any padding


@dataclass(frozen=True)
class HiddenStateCacheSize:
    """The hidden-state layer's share of a KV cache of ``num_blocks`` blocks.

    ``page_bytes`` is the layer's page as vLLM lays it out (padding included),
    ``pool_block_bytes`` one block of the pool its blocks are drawn from,
    ``kv_cache_bytes`` every pool together. ``own_group``: the layer is its
    group's only one, so each block the group holds is a whole pool block;
    otherwise it shares its group's block table, and each block carries one of
    its pages beside the other layers'.
    """

    num_aux_layers: int
    hidden_size: int
    dtype_bytes: int
    block_size: int
    page_bytes: int
    num_blocks: int
    pool_block_bytes: int
    kv_cache_bytes: int
    own_group: bool
    num_groups: int
    other_block_sizes: tuple[int, ...] = ()
    page_setter: PageSetter | None = None

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
            "num_groups",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.page_bytes < self.states_page_bytes:
            raise ValueError(
                f"page_bytes {self.page_bytes} is less than the "
                f"{self.states_page_bytes} bytes of states a page holds "
                f"({self._per_page_formula()}): the spec read does not "
                "describe the hidden-state cache"
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

    # ------------------------------------------------------------------
    # The figures

    @property
    def per_token_bytes(self) -> int:
        return self.num_aux_layers * self.hidden_size * self.dtype_bytes

    @property
    def states_page_bytes(self) -> int:
        """What a page must hold: ``block_size`` tokens of states."""
        return self.per_token_bytes * self.block_size

    @property
    def bytes(self) -> int:
        """Its pages: one in each block of the KV cache."""
        return self.page_bytes * self.num_blocks

    @property
    def padding_bytes(self) -> int:
        return (self.page_bytes - self.states_page_bytes) * self.num_blocks

    @property
    def share(self) -> float:
        return self.bytes / self.kv_cache_bytes

    @property
    def tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def padding_more_than_doubles(self) -> bool:
        """Padding larger than the states themselves: the cache is more than
        twice what it stores."""
        return self.page_bytes > 2 * self.states_page_bytes

    @property
    def wider_pool_blocks(self) -> bool:
        """Each block its own group holds costs a whole pool block, wider
        than its page (vllm-project/vllm#56774's charge)."""
        return self.own_group and self.pool_block_bytes > self.page_bytes

    # ------------------------------------------------------------------
    # What the log says

    def _per_page_formula(self) -> str:
        return (
            f"{self.num_aux_layers} aux layers x {self.hidden_size} hidden x "
            f"{self.dtype_bytes} bytes x {self.block_size} tokens"
        )

    def summary(self) -> str:
        """The INFO line, every figure exact in bytes. A group of its own
        draws its blocks from the pool the other groups draw on, so its
        bytes, tokens and padding are what it would have in every block:
        "up to"."""
        up_to = "up to " if self.own_group else ""
        if not self.own_group:
            table = "its pages share a block table with the target's layers"
        else:
            table = (
                "its own block table, drawing on one pool of blocks with "
                f"{self.num_groups - 1} other KV-cache group(s)"
            )
            if self.wider_pool_blocks:
                table += (
                    f": each block it holds takes a whole "
                    f"{self.pool_block_bytes}-byte block of that pool"
                )
        return (
            f"extract_hidden_states: hidden-state cache {up_to}{self.bytes} bytes "
            f"({self.bytes / MiB:.1f} MiB), {100 * self.share:.1f}% of the "
            f"{self.kv_cache_bytes}-byte KV cache; holds {up_to}{self.tokens} "
            f"tokens ({self.num_blocks} blocks of {self.block_size}); page "
            f"padding {up_to}{self.padding_bytes} bytes: {self.page_bytes}-byte "
            f"pages for {self.states_page_bytes} bytes of states "
            f"({self._per_page_formula()}); {table}"
        )

    def padding_warning(self) -> str:
        """The WARNING, for when padding more than doubles the cache: what
        set the page and what a user can change."""
        head = (
            f"extract_hidden_states: page padding more than doubles the "
            f"hidden-state cache ({self.padding_bytes} of its {self.bytes} "
            f"bytes): each {self.page_bytes}-byte page holds "
            f"{self.states_page_bytes} bytes of states "
            f"({self._per_page_formula()})."
        )
        setter = self.page_setter
        if setter is None:
            return (
                f"{head} vLLM padded the page itself (the layer's KV-cache spec "
                f"gives {self.page_bytes} bytes); another number of aux "
                "hidden-state layers (eagle_aux_hidden_state_layer_ids) or "
                "another block size (--block-size) changes it."
            )
        fits = self.page_bytes // self.per_token_bytes
        cause = (
            f"{head} The page is the one group {setter.index} "
            f"({setter.spec}, {setter.num_layers} layer(s), "
            f"{setter.block_size}-token blocks, {setter.page_bytes}-byte pages) "
            "sets for every KV-cache group"
        )
        if self.other_block_sizes and fits > self.block_size:
            cause += (
                f"; a page would fit {fits} tokens, but the hidden-state "
                f"group's block size must divide the other groups' "
                f"({', '.join(map(str, self.other_block_sizes))}), and "
                f"{self.block_size} is the largest that does"
            )
        return (
            f"{cause}. To shrink it: a block size for the other groups with a "
            f"divisor near {fits} (--block-size; a Mamba group's is "
            "mamba_block_size), another number of aux hidden-state layers "
            f"(now {self.num_aux_layers}, {self.per_token_bytes} bytes a "
            f"token), or a smaller page in group {setter.index} (its cache "
            "dtype: --kv-cache-dtype, mamba_ssm_cache_dtype)."
        )
