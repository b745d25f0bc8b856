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
    HiddenStateCacheSize,
    KVCapacity,
    MambaExtra,
    PageSetter,
    Parallelism,
    WidestGroup,
)

# The figures of the two lines, as the e2e tests and users read them.
SUMMARY = re.compile(
    r"hidden-state cache billed (?:up to )?(?P<bill>\d+) bytes \([\d.]+ MiB\), "
    r"(?P<share>[\d.]+)% of the (?P<kv_cache>\d+)-byte KV cache(?P<owner>[^;]*)"
    r"(?:; a (?P<max_model_len>\d+)-token request's: (?P<request_blocks>\d+) of "
    r"its (?P<all_blocks>\d+) blocks \((?P<request_share>[\d.]+)%\))?; holds "
    r"(?:up to )?(?P<tokens>\d+) tokens \((?P<blocks>\d+) blocks of "
    r"(?P<block_size>\d+)\); each \d+-token block billed (?P<block_bill>\d+) "
    r"bytes for (?P<states>\d+) bytes of states \((?P<ratio>[\d.]+)x; [^)]*\); "
    r"waste (?:up to )?(?P<waste>\d+) bytes: page padding (?P<padding>\d+) "
    r"\((?P<page>\d+)-byte pages\), pool width (?P<pool_width>\d+) "
)
CAPACITY = re.compile(
    r"the target's KV capacity, (?P<whose>[^:]*): (?P<with>\d+) tokens with "
    r"extraction, (?P<with_concurrency>[\d.]+) requests of "
    r"(?P<max_model_len>\d+) tokens at once; (?P<without>\d+) tokens with no "
    r"speculative config, (?P<without_concurrency>[\d.]+) at once, by vLLM's "
    r"layout of the target's KV-cache specs alone (?P<budget>[^:]*): extraction "
    r"costs (?P<cost>-?[\d.]+)% of it(?:; of it, Mamba group\(s\) "
    r"(?P<mamba_groups>[\d, ]+) hold [^:]*: (?P<mamba_blocks>\d+) block\(s\) of "
    r"(?P<mamba_block>\d+) bytes, (?P<mamba_bytes>\d+) bytes a request)?$"
)
WARNING = "vLLM bills the hidden-state cache"


def figures(pattern: re.Pattern, line: str) -> dict[str, int | str | None]:
    """The named figures of ``line``: ints where they are, percentages and
    concurrencies as printed (strings), texts as they are."""
    got = pattern.search(line)
    assert got, line
    return {k: int(v) if v and v.isdigit() else v for k, v in got.groupdict().items()}


parallelisms = st.builds(
    Parallelism, st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)
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
        num_groups=draw(st.integers(2, 6)) if own else draw(st.integers(1, 6)),
        request_blocks=request,
        max_model_len=draw(st.integers(1, 10**6)) if own else None,
        parallelism=draw(parallelisms),
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
    assert size.tokens == size.block_size * size.num_blocks
    assert 0 < size.share <= 1
    assert size.share == size.bill_bytes / size.kv_cache_bytes


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_the_summary_prints_the_figures_exactly(size):
    line = size.summary()
    got = figures(SUMMARY, line)
    per_block = size.pool_block_bytes if size.own_group else size.page_bytes
    states = size.per_token_bytes * size.block_size
    assert {k: got[k] for k in ("bill", "kv_cache", "tokens", "blocks")} == {
        "bill": per_block * size.num_blocks,
        "kv_cache": size.kv_cache_bytes,
        "tokens": size.block_size * size.num_blocks,
        "blocks": size.num_blocks,
    }
    assert (got["block_size"], got["block_bill"], got["states"]) == (
        size.block_size,
        per_block,
        states,
    )
    assert got["waste"] == (per_block - states) * size.num_blocks
    assert got["padding"] == (size.page_bytes - states) * size.num_blocks
    assert got["pool_width"] == (per_block - size.page_bytes) * size.num_blocks
    assert got["page"] == size.page_bytes
    assert (
        got["share"] == f"{100 * per_block * size.num_blocks / size.kv_cache_bytes:.1f}"
    )
    assert got["ratio"] == f"{per_block / states:.2f}"
    # A group of its own draws on the pool the others draw on: its figures
    # are what it would have in every block, and a request's share is said.
    assert ("up to" in line) == size.own_group
    if size.own_group:
        mine, every = size.request_blocks
        assert (got["request_blocks"], got["all_blocks"]) == (mine, every)
        assert got["max_model_len"] == size.max_model_len
        assert got["request_share"] == f"{100 * mine / every:.1f}"
    else:
        assert got["request_blocks"] is None
    assert got["owner"] == size.parallelism.kv_cache_owner()


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_warns_exactly_when_the_bill_more_than_doubles_the_states(size):
    states = size.bill_bytes - size.waste_bytes
    assert size.bill_more_than_doubles == (size.bill_bytes > 2 * states)
    assert size.bill_more_than_doubles == (size.waste_bytes > states)


def one_size(**changes) -> HiddenStateCacheSize:
    """A group of its own: 1-token blocks of 3072 bytes of states (3 aux
    layers x 256 x 4 bytes) in 16000-byte pages set by a Mamba group of
    67-token blocks, drawn from a pool of 16000-byte blocks."""
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
        num_groups=2,
        other_block_sizes=(67,),
        page_setter=PageSetter(
            index=0, spec="MambaSpec", num_layers=1, block_size=67, page_bytes=16000
        ),
        widest_group=WidestGroup(
            index=0, spec="MambaSpec", num_layers=1, page_bytes=16000
        ),
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


def test_the_warning_names_the_page_padding_and_its_way_out():
    size = one_size()
    assert size.bill_more_than_doubles
    warning = size.bill_warning()
    assert warning.startswith(f"extract_hidden_states: {WARNING} 5.21x its states")
    assert "each 1-token block 16000 bytes for 3072 bytes of states" in warning
    assert "Page padding, 12928 bytes a block: the page is the one group 0 " in warning
    assert "(MambaSpec, 1 layer(s), 67-token blocks, 16000-byte pages)" in warning
    # 16000 // 3072 = 5 tokens would fit; 1 is the largest divisor of 67.
    assert "a page would fit 5 tokens" in warning
    assert "divide the other groups' (67), and 1 is the largest" in warning
    assert "--block-size" in warning and "eagle_aux_hidden_state_layer_ids" in warning
    assert "Pool width" not in warning and "#56822" not in warning
    # vLLM padded the page with no other group's page to blame.
    generic = one_size(page_setter=None).bill_warning()
    assert "vLLM padded the page itself" in generic and "group 0" not in generic


def test_the_warning_names_the_pool_width_and_its_way_out():
    """GPT-OSS's layout: 8-token blocks of 24576 bytes of states in
    32768-byte pages, from a pool of 65536-byte blocks (2 layers wide)."""
    size = one_size(
        block_size=8,
        page_bytes=32768,
        pool_block_bytes=65536,
        kv_cache_bytes=655360,
        other_block_sizes=(32,),
        page_setter=PageSetter(0, "SlidingWindowSpec", 2, 32, 32768),
        widest_group=WidestGroup(0, "SlidingWindowSpec", 2, 32768),
    )
    warning = size.bill_warning()
    assert f"{WARNING} 2.67x its states: each 8-token block 65536 bytes" in warning
    assert "Page padding, 8192 bytes a block" in warning
    assert (
        "Pool width, 32768 bytes a block: the hidden-state layer has a KV-cache "
        "group of its own" in warning
    )
    assert "(group 0: SlidingWindowSpec, 2 layer(s) x 32768 bytes)" in warning
    assert "each 32768-byte page takes a 65536-byte block" in warning
    assert "vllm-project/vllm#56774" in warning and "vllm-project/vllm#56822" in warning
    assert "split_kv_cache_groups" not in warning  # no split capacity given
    # Where the key could be on, the way out is the key and its capacity.
    keyed = dataclasses.replace(size, split_capacity=(5041, 9.846)).bill_warning()
    assert (
        '"split_kv_cache_groups": true (the hidden-state group billed at its own '
        "width: 5,041 tokens, 9.85x; docs/design.md#splitting-the-kv-cache-groups)"
        in keyed
    )
    assert "#56822" not in keyed
    # Page padding alone: the key is not named, whatever the capacity.
    padded = dataclasses.replace(one_size(), split_capacity=(5041, 9.846))
    assert "split_kv_cache_groups" not in padded.bill_warning()
    # Pool width alone: no page padding said.
    alone = one_size(
        block_size=8, page_bytes=24576, pool_block_bytes=65536, kv_cache_bytes=655360
    ).bill_warning()
    assert "Page padding" not in alone and "--block-size" not in alone
    assert "Pool width, 40960 bytes a block" in alone


@pytest.mark.parametrize(
    ("sizes", "owner", "whose"),
    [
        ((1, 1, 1), "", "the engine's, as vLLM logs it"),
        (
            (2, 1, 1),
            ", one on each of 2 TP ranks",
            "the engine's, as vLLM logs it, every one of 2 TP ranks holding the "
            "same blocks",
        ),
        (
            (1, 3, 1),
            " of pipeline stage 3 of 3, the last, which holds the hidden-state layer",
            "pipeline stage 3 of 3's, the last, which holds the hidden-state layer "
            "(vLLM's own log gives the first stage's)",
        ),
        (
            (1, 1, 2),
            ", DP rank 0's, each of 2 DP ranks having its own",
            "the engine's, as vLLM logs it, of DP rank 0's engine, each of 2 DP "
            "ranks having its own",
        ),
        (
            (2, 2, 2),
            " of pipeline stage 2 of 2, the last, which holds the hidden-state "
            "layer, one on each of 2 TP ranks, DP rank 0's, each of 2 DP ranks "
            "having its own",
            "pipeline stage 2 of 2's, the last, which holds the hidden-state layer "
            "(vLLM's own log gives the first stage's), every one of 2 TP ranks "
            "holding the same blocks, of DP rank 0's engine, each of 2 DP ranks "
            "having its own",
        ),
    ],
)
def test_the_lines_say_whose_kv_cache_they_speak_of(sizes, owner, whose):
    parallelism = Parallelism(*sizes)
    line = one_size(parallelism=parallelism).summary()
    assert f"of the 160000-byte KV cache{owner}; " in line
    capacity = one_capacity(parallelism=parallelism).summary()
    assert figures(CAPACITY, capacity)["whose"] == whose


def one_capacity(**changes) -> KVCapacity:
    fields = dict(
        max_model_len=512,
        tokens_with=3120,
        concurrency_with=3120 / 512,
        tokens_without=13107,
        concurrency_without=13107 / 512,
        budget="on the same 33554432-byte budget (kv_cache_memory_bytes)",
        pool_block_bytes=65536,
    )
    return KVCapacity(**{**fields, **changes})


@settings(max_examples=200, deadline=None)
@given(
    without=st.integers(1, 10**7),
    lost=st.floats(0, 1),
    max_model_len=st.integers(1, 10**6),
    extras=st.lists(st.integers(0, 4), max_size=5),
    pool_block=st.integers(1, 2**24),
    parallelism=parallelisms,
)
def test_the_capacity_line_prints_the_figures_exactly(
    without, lost, max_model_len, extras, pool_block, parallelism
):
    tokens_with = int(without * (1 - lost))
    capacity = one_capacity(
        max_model_len=max_model_len,
        tokens_with=tokens_with,
        concurrency_with=tokens_with / max_model_len,
        tokens_without=without,
        concurrency_without=without / max_model_len,
        pool_block_bytes=pool_block,
        mamba_extras=tuple(MambaExtra(i, n) for i, n in enumerate(extras)),
        parallelism=parallelism,
    )
    got = figures(CAPACITY, capacity.summary())
    assert (got["with"], got["without"], got["max_model_len"]) == (
        tokens_with,
        without,
        max_model_len,
    )
    assert got["with_concurrency"] == f"{tokens_with / max_model_len:.2f}"
    assert got["without_concurrency"] == f"{without / max_model_len:.2f}"
    assert got["cost"] == f"{100 * (without - tokens_with) / without:.1f}"
    assert got["budget"] == "on the same 33554432-byte budget (kv_cache_memory_bytes)"
    if any(extras):
        assert str(got["mamba_groups"]) == ", ".join(
            str(i) for i, n in enumerate(extras) if n
        )
        assert got["mamba_blocks"] == sum(extras)
        assert (got["mamba_block"], got["mamba_bytes"]) == (
            pool_block,
            sum(extras) * pool_block,
        )
    else:
        assert got["mamba_groups"] is None


def test_the_mamba_groups_extra_pages_are_named_with_their_bytes():
    """Qwen3-Next's layout: three Mamba groups, each 1 page more a request
    for the speculative token, each page a whole 81920-byte pool block."""
    extras = tuple(MambaExtra(i, 1) for i in range(3)) + (MambaExtra(3, 0),)
    line = one_capacity(pool_block_bytes=81920, mamba_extras=extras).summary()
    assert line.endswith(
        "; of it, Mamba group(s) 0, 1, 2 hold 1 more page(s) each a request for "
        "the speculative token: 3 block(s) of 81920 bytes, 245760 bytes a request"
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
        (
            {"request_blocks": (3, 2), "max_model_len": 8},
            "must be some of the request's",
        ),
        ({"request_blocks": (1, 2)}, "max_model_len must be a positive int, got None"),
    ],
)
def test_inconsistent_figures_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        one_size(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokens_without": 0}, "tokens_without is 0"),
        ({"tokens_with": -1}, "tokens_with must be a non-negative int, got -1"),
        ({"max_model_len": 0}, "max_model_len must be a positive int, got 0"),
    ],
)
def test_inconsistent_capacities_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        one_capacity(**changes)
