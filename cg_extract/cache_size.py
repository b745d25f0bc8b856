"""What extraction costs in KV cache, as the log reports it once the KV cache
exists.

Pure arithmetic, no torch and no vLLM: the speculator reads the figures from
vLLM's own ``KVCacheConfig`` and computes the capacities with vLLM's own
functions (:meth:`cg_extract.speculator.ExtractHiddenStatesSpeculator.
report_cache_size`), and hands them here.

Why users need it: vLLM lays the hidden-state layer out beside the target's
KV-cache groups (one page size for every group, block sizes that divide each
other, one pool of blocks all groups draw on), and a user who extracts sees
the result only as a KV cache smaller than expected or an engine that will
not start (vllm-project/vllm#53243, #56774). The states themselves take
``num_aux_layers x hidden_size x dtype bytes`` a token. What vLLM bills for
them is a page in each block where the layer shares the target's block
table, and a whole block of the pool for each of its blocks where it has a
group of its own; the difference is waste, from page padding (a page wider
than its block's states) and pool width (a pool block wider than the page).
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
class WidestGroup:
    """The KV-cache group whose pages, side by side, make a block of the pool."""

    index: int
    spec: str
    num_layers: int
    page_bytes: int


@dataclass(frozen=True)
class Parallelism:
    """Whose KV cache the worker that logs sees: ``vllm_config.parallel_config``'s
    sizes. Only the last pipeline stage holds the hidden-state layer, and the
    rank that speaks for the speculator logs (``cg_extract.speaks``)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def kv_cache_owner(self) -> str:
        """After "KV cache": whose it is, empty for a single worker."""
        tp, pp, dp = (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
        )
        parts = []
        if pp > 1:
            parts.append(
                f" of pipeline stage {pp} of {pp}, the last, which holds the "
                "hidden-state layer"
            )
        if tp > 1:
            parts.append(f", one on each of {tp} TP ranks")
        if dp > 1:
            parts.append(f", DP rank 0's, each of {dp} DP ranks having its own")
        return "".join(parts)

    def capacity_owner(self) -> str:
        """Whose capacity the capacity line gives."""
        tp, pp, dp = (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
        )
        if pp > 1:
            whose = (
                f"pipeline stage {pp} of {pp}'s, the last, which holds the "
                "hidden-state layer (vLLM's own log gives the first stage's)"
            )
        else:
            whose = "the engine's, as vLLM logs it"
        if tp > 1:
            whose += f", every one of {tp} TP ranks holding the same blocks"
        if dp > 1:
            whose += f", of DP rank 0's engine, each of {dp} DP ranks having its own"
        return whose


@dataclass(frozen=True)
class HiddenStateCacheSize:
    """What vLLM bills the hidden-state layer in a KV cache of ``num_blocks``
    blocks.

    ``page_bytes`` is the layer's page as vLLM lays it out (padding included),
    ``pool_block_bytes`` one block of the pool its blocks are drawn from,
    ``kv_cache_bytes`` every pool together. ``own_group``: the layer is its
    group's only one, so each block the group holds is a whole pool block;
    otherwise it shares its group's block table, and each block carries one of
    its pages beside the other layers'. ``request_blocks``: for a group of its
    own, the blocks a request of ``max_model_len`` tokens takes in it and in
    all groups together (vLLM's admission arithmetic).
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
    widest_group: WidestGroup | None = None
    request_blocks: tuple[int, int] | None = None
    max_model_len: int | None = None
    parallelism: Parallelism = Parallelism()
    # The target's capacity (tokens, requests at once) were the groups split
    # (split_kv_cache_groups), where that key is off and could be on.
    split_capacity: tuple[int, float] | None = None

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
            _positive_int(name, getattr(self, name))
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
        if self.request_blocks is not None:
            mine, every = self.request_blocks
            _positive_int("max_model_len", self.max_model_len)
            if not (0 < mine <= every):
                raise ValueError(
                    f"request_blocks {self.request_blocks}: the hidden-state "
                    "group's blocks must be some of the request's"
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
    def billed_block_bytes(self) -> int:
        """What each of its blocks costs: its page in a shared block table, a
        whole pool block in a group of its own."""
        return self.pool_block_bytes if self.own_group else self.page_bytes

    @property
    def bill_bytes(self) -> int:
        """What vLLM charges it: each of its blocks, in every block it can
        hold (all of them)."""
        return self.billed_block_bytes * self.num_blocks

    @property
    def states_bytes(self) -> int:
        return self.states_page_bytes * self.num_blocks

    @property
    def waste_bytes(self) -> int:
        """The bill beyond the states: page padding plus pool width."""
        return self.bill_bytes - self.states_bytes

    @property
    def padding_bytes(self) -> int:
        """Its pages beyond the states they hold."""
        return (self.page_bytes - self.states_page_bytes) * self.num_blocks

    @property
    def pool_width_bytes(self) -> int:
        """Pool blocks beyond the page each of its blocks uses (a group of its
        own only: in a shared table the rest of a block is the target's)."""
        if not self.own_group:
            return 0
        return (self.pool_block_bytes - self.page_bytes) * self.num_blocks

    @property
    def share(self) -> float:
        return self.bill_bytes / self.kv_cache_bytes

    @property
    def bill_ratio(self) -> float:
        """The bill over the states: 1 when nothing is wasted."""
        return self.billed_block_bytes / self.states_page_bytes

    @property
    def tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def bill_more_than_doubles(self) -> bool:
        """vLLM bills more than twice the states (the warning's threshold)."""
        return self.billed_block_bytes > 2 * self.states_page_bytes

    @property
    def request_share(self) -> float | None:
        if self.request_blocks is None:
            return None
        mine, every = self.request_blocks
        return mine / every

    # ------------------------------------------------------------------
    # What the log says

    def _per_page_formula(self) -> str:
        return (
            f"{self.num_aux_layers} aux layers x {self.hidden_size} hidden x "
            f"{self.dtype_bytes} bytes x {self.block_size} tokens"
        )

    def summary(self) -> str:
        """The INFO line, every figure exact in bytes. A group of its own
        draws its blocks from the pool the other groups draw on, so its bill,
        tokens and waste are what it would have in every block: "up to"."""
        up_to = "up to " if self.own_group else ""
        if self.own_group:
            where = (
                "its own KV-cache group draws whole "
                f"{self.pool_block_bytes}-byte blocks from the pool "
                f"{self.num_groups - 1} other KV-cache group(s) draw on"
            )
        else:
            where = "its pages share a block table with the target's layers"
        request = ""
        if self.request_blocks is not None:
            mine, every = self.request_blocks
            request = (
                f"; a {self.max_model_len}-token request's: {mine} of its "
                f"{every} blocks ({100 * mine / every:.1f}%)"
            )
        return (
            f"extract_hidden_states: hidden-state cache billed {up_to}"
            f"{self.bill_bytes} bytes ({self.bill_bytes / MiB:.1f} MiB), "
            f"{100 * self.share:.1f}% of the {self.kv_cache_bytes}-byte KV cache"
            f"{self.parallelism.kv_cache_owner()}{request}; holds {up_to}"
            f"{self.tokens} tokens ({self.num_blocks} blocks of "
            f"{self.block_size}); each {self.block_size}-token block billed "
            f"{self.billed_block_bytes} bytes for {self.states_page_bytes} bytes "
            f"of states ({self.bill_ratio:.2f}x; {self._per_page_formula()}); "
            f"waste {up_to}{self.waste_bytes} bytes: page padding "
            f"{self.padding_bytes} ({self.page_bytes}-byte pages), pool width "
            f"{self.pool_width_bytes} ({where})"
        )

    def bill_warning(self) -> str:
        """The WARNING, for a bill more than twice the states: each cause
        with its bytes, and what a user can change."""
        per_block = self.billed_block_bytes
        text = (
            f"extract_hidden_states: vLLM bills the hidden-state cache "
            f"{self.bill_ratio:.2f}x its states: each {self.block_size}-token "
            f"block {per_block} bytes for {self.states_page_bytes} bytes of "
            f"states ({self._per_page_formula()})."
        )
        padding = self.page_bytes - self.states_page_bytes
        if padding:
            text += f" Page padding, {padding} bytes a block: {self._padding_cause()}."
        width = self.pool_width_bytes // self.num_blocks
        if width:
            text += f" Pool width, {width} bytes a block: {self._width_cause()}."
        return f"{text} {self._ways_out(padding > 0, width > 0)}"

    def _padding_cause(self) -> str:
        setter = self.page_setter
        if setter is None:
            return (
                f"vLLM padded the page itself (the layer's KV-cache spec gives "
                f"{self.page_bytes} bytes)"
            )
        cause = (
            f"the page is the one group {setter.index} ({setter.spec}, "
            f"{setter.num_layers} layer(s), {setter.block_size}-token blocks, "
            f"{setter.page_bytes}-byte pages) sets for every KV-cache group"
        )
        fits = self.page_bytes // self.per_token_bytes
        if self.other_block_sizes and fits > self.block_size:
            cause += (
                f"; a page would fit {fits} tokens, but the hidden-state "
                f"group's block size must divide the other groups' "
                f"({', '.join(map(str, self.other_block_sizes))}), and "
                f"{self.block_size} is the largest that does"
            )
        return cause

    def _width_cause(self) -> str:
        widest = self.widest_group
        group = (
            f" (group {widest.index}: {widest.spec}, {widest.num_layers} "
            f"layer(s) x {widest.page_bytes} bytes)"
            if widest is not None
            else ""
        )
        return (
            "the hidden-state layer has a KV-cache group of its own, and vLLM "
            "draws every group's blocks from one pool whose blocks are as wide "
            f"as its widest group{group}, so each {self.page_bytes}-byte page "
            f"takes a {self.pool_block_bytes}-byte block "
            "(vllm-project/vllm#56774)"
        )

    def _ways_out(self, padding: bool, width: bool) -> str:
        ways = []
        if padding:
            fits = self.page_bytes // self.per_token_bytes
            setter = self.page_setter
            ways.append(
                f"a block size for the other groups with a divisor near {fits} "
                "(--block-size; a Mamba group's is mamba_block_size) or another "
                "number of aux hidden-state layers (eagle_aux_hidden_state_"
                f"layer_ids, now {self.num_aux_layers}, {self.per_token_bytes} "
                "bytes a token) shrinks the padding"
                + (
                    f", and so does a smaller page in group {setter.index} (its "
                    "cache dtype: --kv-cache-dtype, mamba_ssm_cache_dtype)"
                    if setter is not None
                    else ""
                )
            )
        if width and self.split_capacity is not None:
            ways.append(split_hint(*self.split_capacity))
        elif width:
            ways.append(
                "the pool width goes with a vLLM that bills the group at its own "
                "width (vllm-project/vllm#56822)"
            )
        return "To change it: " + "; ".join(ways) + "."


def split_hint(tokens: int, concurrency: float) -> str:
    """The way out of pool width: the key, and the target's capacity with it."""
    return (
        '"split_kv_cache_groups": true (the hidden-state group billed at its own '
        f"width: {tokens:,} tokens, {concurrency:.2f}x; "
        "docs/design.md#splitting-the-kv-cache-groups)"
    )


@dataclass(frozen=True)
class MambaExtra:
    """A Mamba group's pages a request holds for the speculative token: its
    spec's pages with the speculative block less those without it."""

    index: int
    pages: int


@dataclass(frozen=True)
class KVCapacity:
    """The target's KV capacity with extraction and with no speculative config
    at all, both from vLLM's own capacity arithmetic (``get_kv_cache_capacity``):
    tokens of ``max_model_len`` requests at once, and those requests."""

    max_model_len: int
    tokens_with: int
    concurrency_with: float
    tokens_without: int
    concurrency_without: float
    budget: str  # what "the same budget" is
    pool_block_bytes: int
    mamba_extras: tuple[MambaExtra, ...] = ()
    parallelism: Parallelism = Parallelism()

    def __post_init__(self) -> None:
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("pool_block_bytes", self.pool_block_bytes)
        for name in ("tokens_with", "tokens_without"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.tokens_without == 0:
            raise ValueError("tokens_without is 0: no capacity to compare with")

    @property
    def cost(self) -> float:
        """The share of the capacity without extraction that extraction takes."""
        return 1 - self.tokens_with / self.tokens_without

    @property
    def mamba_extra_pages(self) -> int:
        return sum(extra.pages for extra in self.mamba_extras)

    @property
    def mamba_extra_bytes(self) -> int:
        """Each page a group holds is a whole block of the pool."""
        return self.mamba_extra_pages * self.pool_block_bytes

    def summary(self) -> str:
        line = (
            f"extract_hidden_states: the target's KV capacity, "
            f"{self.parallelism.capacity_owner()}: {self.tokens_with} tokens "
            f"with extraction, {self.concurrency_with:.2f} requests of "
            f"{self.max_model_len} tokens at once; {self.tokens_without} tokens "
            f"with no speculative config, {self.concurrency_without:.2f} at once, "
            f"by vLLM's layout of the target's KV-cache specs alone {self.budget}: "
            f"extraction costs {100 * self.cost:.1f}% of it"
        )
        extras = [e for e in self.mamba_extras if e.pages]
        if extras:
            groups = ", ".join(str(e.index) for e in extras)
            each = {e.pages for e in extras}
            pages = f"{each.pop()} more page(s) each" if len(each) == 1 else "pages"
            line += (
                f"; of it, Mamba group(s) {groups} hold {pages} a request for "
                f"the speculative token: {self.mamba_extra_pages} block(s) of "
                f"{self.pool_block_bytes} bytes, {self.mamba_extra_bytes} bytes "
                "a request"
            )
        return line


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
