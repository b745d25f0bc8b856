"""What extraction costs in KV cache (cg_extract.cache_size): the bill's
arithmetic, the figures the two lines print, the warning's threshold and
causes, whose KV cache a parallel engine's lines speak of, and bad input.
Pure Python; the same classes read from vLLM's real KV-cache configs are
test_cache_size_vllm.py's, and the lines in vLLM's real engine the families
suite's."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract.cache_size import (
    DOCS,
    GiB,
    HiddenStateCacheSize,
    KVCapacity,
    MiB,
    Parallelism,
    breakdown,
    summary,
)

# Our log lines: how they open (the engine tests find ours by it), and how
# long they may be after vLLM's prefix at each level: as short as vLLM's own.
OUR_LINES = ("extract_hidden_states", "cg_extract", "split_kv_cache_groups")
LIMITS = {"INFO": 200, "WARNING": 300}


def assert_reads_like_vllms(level: str, message: str) -> None:
    assert message.startswith(OUR_LINES), message
    assert len(message) <= LIMITS.get(level, len(message)), (level, message)


# The INFO line's figures, as the e2e tests and users read them.
SUMMARY = re.compile(
    r"extract_hidden_states: hidden-state cache (?P<bill>[\d,]+\.\d\d (?:MiB|GiB)), "
    r"(?P<ratio>[\d.]+)x its states(?:; KV cache size (?P<with>[\d,]+) tokens with "
    r"extraction, (?P<without>[\d,]+) without)?(?P<owner>.*)$"
)
# The DEBUG line's: every figure, in bytes.
DETAIL = re.compile(
    r"extract_hidden_states: hidden-state cache billed (?P<bill>\d+) of "
    r"(?P<kv_cache>\d+) bytes: (?P<blocks>\d+) blocks of (?P<block_size>\d+) "
    r"tokens, each billed (?P<block_bill>\d+) \((?P<billed_as>[^)]*)\) for "
    r"(?P<states>\d+) of states \((?P<aux>\d+) x (?P<hidden>\d+) x "
    r"(?P<dtype_bytes>\d+) bytes a token\); page padding (?P<padding>\d+) "
    r"\((?P<page>\d+)-byte pages\), pool width (?P<pool_width>\d+) "
    r"\((?P<pool_block>\d+)-byte pool blocks\)(?:; a request's blocks: "
    r"(?P<request_blocks>\d+) of (?P<all_blocks>\d+))?(?:; capacity (?P<with>\d+) "
    r"tokens \((?P<with_concurrency>[\d.]+)x\) with extraction, (?P<without>\d+) "
    r"\((?P<without_concurrency>[\d.]+)x\) without, (?P<budget>[^;]*); Mamba "
    r"groups' speculative pages a request: (?P<mamba>\{[^}]*\}))?$"
)
WARNING = "vLLM bills the hidden-state cache"


def figures(pattern: re.Pattern, line: str) -> dict[str, int | str | None]:
    """The named figures of ``line``: ints where they are (vLLM's thousands
    commas read), the rest as printed."""
    got = pattern.search(line)
    assert got, line
    return {
        k: int(v.replace(",", "")) if v and v.replace(",", "").isdigit() else v
        for k, v in got.groupdict().items()
    }


def in_mib_or_gib(nbytes: int) -> str:
    return f"{nbytes / MiB:.2f} MiB" if nbytes < GiB else f"{nbytes / GiB:,.2f} GiB"


parallelisms = st.builds(
    Parallelism, st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)
)


@st.composite
def cache_sizes(draw) -> HiddenStateCacheSize:
    """Any consistent size: a page at least what its block's states need, a
    pool block at least a page, a KV cache at least the pool; a group of its
    own with its share of a request's blocks."""
    aux = draw(st.integers(1, 8))
    hidden = draw(st.integers(1, 8192))
    dtype_bytes = draw(st.sampled_from([1, 2, 4]))
    block = draw(st.integers(1, 1024))
    states = aux * hidden * dtype_bytes * block
    page = states + draw(st.integers(0, 3 * states))
    pool_block = page + draw(st.integers(0, 4 * page))
    num_blocks = draw(st.integers(1, 10**5))
    own = draw(st.booleans())
    request = None
    if own:
        every = draw(st.integers(1, 10**4))
        request = (draw(st.integers(1, every)), every)
    split = draw(st.none() | st.tuples(st.integers(0, 10**7), st.floats(0, 10**4)))
    return HiddenStateCacheSize(
        num_aux_layers=aux,
        hidden_size=hidden,
        dtype_bytes=dtype_bytes,
        block_size=block,
        page_bytes=page,
        num_blocks=num_blocks,
        pool_block_bytes=pool_block,
        kv_cache_bytes=pool_block * num_blocks + draw(st.integers(0, 10**6)),
        own_group=own,
        request_blocks=request,
        split_capacity=split if own else None,
        parallelism=draw(parallelisms),
    )


@st.composite
def capacities(draw) -> KVCapacity:
    """The target's capacity, with no more tokens with extraction than
    without (a KV cache of up to 10 million tokens)."""
    without = draw(st.integers(1, 10**7))
    tokens_with = draw(st.integers(0, without))
    max_model_len = draw(st.integers(1, 10**6))
    extras = draw(st.lists(st.integers(0, 4), max_size=5))
    return KVCapacity(
        tokens_with=tokens_with,
        concurrency_with=tokens_with / max_model_len,
        tokens_without=without,
        concurrency_without=without / max_model_len,
        budget="33554432 bytes (kv_cache_memory_bytes)",
        mamba_extra_pages=tuple(enumerate(extras)),
    )


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_the_bill_is_the_states_and_their_waste(size):
    """What each block costs: its page in a shared block table, a whole pool
    block in a group of its own; beyond the states, page padding and (own
    group only) the pool block's width beyond the page."""
    states = size.num_aux_layers * size.hidden_size * size.dtype_bytes
    states *= size.block_size
    per_block = size.pool_block_bytes if size.own_group else size.page_bytes
    assert size.bill_bytes == per_block * size.num_blocks
    assert size.bill_bytes == states * size.num_blocks + size.waste_bytes
    assert size.waste_bytes == size.padding_bytes + size.pool_width_bytes
    assert size.padding_bytes == (size.page_bytes - states) * size.num_blocks >= 0
    width = size.pool_block_bytes - size.page_bytes if size.own_group else 0
    assert size.pool_width_bytes == width * size.num_blocks
    assert size.bill_ratio == per_block / states


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes(), capacity=st.none() | capacities())
def test_the_info_line_is_short_and_prints_the_figures(size, capacity):
    """The bill in MiB (GiB from 1 GiB), its multiple of the states, the
    tokens with and without extraction as vLLM prints its own (1,024), whose
    KV cache: within 200 characters."""
    line = summary(size, capacity)
    assert_reads_like_vllms("INFO", line)
    got = figures(SUMMARY, line)
    per_block = size.pool_block_bytes if size.own_group else size.page_bytes
    states = size.num_aux_layers * size.hidden_size * size.dtype_bytes
    assert got["bill"] == in_mib_or_gib(per_block * size.num_blocks)
    assert got["ratio"] == f"{per_block / (states * size.block_size):.2f}"
    if capacity is None:
        assert got["with"] is None and got["without"] is None
    else:
        assert (got["with"], got["without"]) == (
            capacity.tokens_with,
            capacity.tokens_without,
        )
    assert got["owner"] == size.parallelism.owner()


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes(), capacity=st.none() | capacities())
def test_the_debug_line_prints_every_figure_exactly(size, capacity):
    got = figures(DETAIL, breakdown(size, capacity))
    per_block = size.pool_block_bytes if size.own_group else size.page_bytes
    states = size.num_aux_layers * size.hidden_size * size.dtype_bytes
    states *= size.block_size
    assert (got["bill"], got["kv_cache"], got["blocks"], got["block_size"]) == (
        per_block * size.num_blocks,
        size.kv_cache_bytes,
        size.num_blocks,
        size.block_size,
    )
    assert (got["aux"], got["hidden"], got["dtype_bytes"]) == (
        size.num_aux_layers,
        size.hidden_size,
        size.dtype_bytes,
    )
    assert (got["block_bill"], got["states"], got["page"], got["pool_block"]) == (
        per_block,
        states,
        size.page_bytes,
        size.pool_block_bytes,
    )
    assert got["padding"] == (size.page_bytes - states) * size.num_blocks
    assert got["pool_width"] == (per_block - size.page_bytes) * size.num_blocks
    # A group of its own draws on the pool the others draw on: a request's
    # share of its blocks is said.
    assert got["billed_as"] == (
        "its own group's pool block" if size.own_group else "its page"
    )
    assert (got["request_blocks"], got["all_blocks"]) == (
        size.request_blocks or (None, None)
    )
    if capacity is None:
        assert got["with"] is None
        return
    assert (got["with"], got["without"]) == (
        capacity.tokens_with,
        capacity.tokens_without,
    )
    assert got["with_concurrency"] == f"{capacity.concurrency_with:.2f}"
    assert got["without_concurrency"] == f"{capacity.concurrency_without:.2f}"
    assert got["budget"] == capacity.budget
    assert got["mamba"] == str(dict(capacity.mamba_extra_pages))


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_warns_exactly_when_the_bill_more_than_doubles_the_states(size):
    states = size.bill_bytes - size.waste_bytes
    assert size.bill_more_than_doubles == (size.bill_bytes > 2 * states)
    assert size.bill_more_than_doubles == (size.waste_bytes > states)


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_the_warning_is_short_and_names_each_cause(size):
    """Each cause that applies with its bytes a block; the key and its
    capacity where the pool is the wider cause and the key could be on; the
    docs anchor for causes and remedies: within 300 characters."""
    warning = size.bill_warning()
    assert_reads_like_vllms("WARNING", warning)
    padding = size.padding_bytes // size.num_blocks
    width = size.pool_width_bytes // size.num_blocks
    assert (f"page padding {padding:,} bytes a block" in warning) == (padding > 0)
    assert (f"pool width {width:,} bytes a block" in warning) == (width > 0)
    keyed = width > 0 and size.split_capacity is not None
    assert ('"split_kv_cache_groups": true gives' in warning) == keyed
    if keyed:
        tokens, concurrency = size.split_capacity
        assert f"gives {tokens:,} tokens ({concurrency:.2f}x)" in warning
    assert warning.endswith(f"; see {DOCS}")


def one_size(**changes) -> HiddenStateCacheSize:
    """A group of its own: 1-token blocks of 3072 bytes of states (3 aux
    layers x 256 x 4 bytes) in 16000-byte pages (a Mamba group's), drawn
    from a pool of 16000-byte blocks."""
    fields = dict(
        num_aux_layers=3,
        hidden_size=256,
        dtype_bytes=4,
        block_size=1,
        page_bytes=16000,
        num_blocks=10,
        pool_block_bytes=16000,
        kv_cache_bytes=160000,
        own_group=True,
    )
    return HiddenStateCacheSize(**{**fields, **changes})


@pytest.mark.parametrize(
    ("page", "pool_block", "warns"),
    [
        (6144, 6144, False),  # page padding alone: twice the states
        (6145, 6145, True),
        (3072, 6144, False),  # pool width alone: twice
        (3072, 6145, True),
        (4096, 8192, True),  # both: GPT-OSS's 2.67x
    ],
)
def test_the_threshold_is_the_bill_strictly_more_than_double(page, pool_block, warns):
    """3072 bytes of states a block: the bill (the pool block, for a group of
    its own) at twice that is double, not more; in a shared block table the
    page alone is billed, however wide the pool."""
    own = one_size(page_bytes=page, pool_block_bytes=pool_block, kv_cache_bytes=10**6)
    assert own.bill_more_than_doubles is warns
    shared = one_size(
        page_bytes=page,
        pool_block_bytes=pool_block,
        kv_cache_bytes=10**6,
        own_group=False,
    )
    assert shared.bill_more_than_doubles is (page > 6144)


def test_gpt_osss_warning():
    """GPT-OSS's layout: 8-token blocks of 24576 bytes of states in
    32768-byte pages, from a pool of 65536-byte blocks (2 layers wide); with
    and without the capacity split_kv_cache_groups would give."""
    size = one_size(
        block_size=8, page_bytes=32768, pool_block_bytes=65536, kv_cache_bytes=655360
    )
    assert size.bill_warning() == (
        f"extract_hidden_states: {WARNING} 2.67x its states (page padding 8,192 "
        f"bytes a block, pool width 32,768 bytes a block); see {DOCS}"
    )
    keyed = dataclasses.replace(size, split_capacity=(5041, 9.846))
    assert keyed.bill_warning() == (
        f"extract_hidden_states: {WARNING} 2.67x its states (page padding 8,192 "
        'bytes a block, pool width 32,768 bytes a block); "split_kv_cache_groups": '
        f"true gives 5,041 tokens (9.85x); see {DOCS}"
    )


@pytest.mark.parametrize(
    ("sizes", "owner"),
    [
        ((1, 1, 1), ""),
        ((2, 1, 1), " (each of 2 TP ranks)"),
        ((1, 3, 1), " (last of 3 PP stages)"),
        ((1, 1, 2), " (DP rank 0 of 2)"),
        ((2, 2, 2), " (last of 2 PP stages, each of 2 TP ranks, DP rank 0 of 2)"),
    ],
)
def test_the_line_says_whose_kv_cache_it_speaks_of(sizes, owner):
    line = summary(one_size(parallelism=Parallelism(*sizes)), None)
    assert line == (
        f"extract_hidden_states: hidden-state cache 0.15 MiB, 5.21x its states{owner}"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"page_bytes": 3071, "pool_block_bytes": 3071}, "page_bytes 3071 is less"),
        ({"page_bytes": 16001}, "page_bytes 16001 is more than a block"),
        ({"kv_cache_bytes": 159999}, "do not fit in kv_cache_bytes 159999"),
        ({"num_blocks": 0}, "num_blocks must be a positive int, got 0"),
        ({"dtype_bytes": True}, "dtype_bytes must be a positive int, got True"),
        ({"hidden_size": 256.0}, "hidden_size must be a positive int, got 256.0"),
        ({"request_blocks": (3, 2)}, "must be some of the request's"),
        ({"request_blocks": (0, 2)}, "must be some of the request's"),
    ],
)
def test_inconsistent_figures_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        one_size(**changes)


def one_capacity(**changes) -> KVCapacity:
    fields = dict(
        tokens_with=3120,
        concurrency_with=3120 / 512,
        tokens_without=13107,
        concurrency_without=13107 / 512,
        budget="33554432 bytes (kv_cache_memory_bytes)",
    )
    return KVCapacity(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokens_without": 0}, "tokens_without must be a positive int, got 0"),
        ({"tokens_with": -1}, "tokens_with must be a non-negative int, got -1"),
    ],
)
def test_inconsistent_capacities_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        one_capacity(**changes)
