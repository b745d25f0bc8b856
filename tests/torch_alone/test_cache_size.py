"""The hidden-state cache's size line (cg_extract.cache_size): its arithmetic,
the figures it prints, the padding warning's threshold and bad input. Pure
Python; the same class read from vLLM's real KVCacheConfig is
test_cache_size_vllm.py's, and the line in vLLM's real engine the e2e tests'."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract.cache_size import HiddenStateCacheSize, PageSetter

# The figures of a summary line, as the e2e tests and users read them.
SUMMARY = re.compile(
    r"hidden-state cache (?:up to )?(?P<bytes>\d+) bytes \([\d.]+ MiB\), "
    r"(?P<share>[\d.]+)% of the (?P<kv_cache>\d+)-byte KV cache; holds "
    r"(?:up to )?(?P<tokens>\d+) tokens \((?P<blocks>\d+) blocks of "
    r"(?P<block_size>\d+)\); page padding (?:up to )?(?P<padding>\d+) bytes: "
    r"(?P<page>\d+)-byte pages for (?P<states>\d+) bytes of states"
)


@st.composite
def cache_sizes(draw) -> HiddenStateCacheSize:
    """Any consistent size: a page at least what its block's states need, a
    pool block at least a page, a KV cache at least the pool."""
    aux = draw(st.integers(1, 8))
    hidden = draw(st.integers(1, 8192))
    dtype_bytes = draw(st.sampled_from([1, 2, 4]))
    block = draw(st.integers(1, 1024))
    states = aux * hidden * dtype_bytes * block
    page = states + draw(st.integers(0, 3 * states))
    pool_block = page + draw(st.integers(0, 4 * page))
    num_blocks = draw(st.integers(1, 10**5))
    own = draw(st.booleans())
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
    )


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_the_figures_add_up(size):
    """Pages are the states plus their padding, block by block; the tokens
    are every block's; the share is of the whole KV cache."""
    aux_bytes = size.num_aux_layers * size.hidden_size * size.dtype_bytes
    states = aux_bytes * size.block_size * size.num_blocks
    assert size.bytes == size.page_bytes * size.num_blocks
    assert size.bytes == states + size.padding_bytes
    assert size.padding_bytes >= 0
    assert size.tokens == size.block_size * size.num_blocks
    assert 0 < size.share <= 1
    assert size.share == size.bytes / size.kv_cache_bytes


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_the_summary_prints_the_figures_exactly(size):
    line = size.summary()
    got = SUMMARY.search(line)
    assert got, line
    figures = {k: v for k, v in got.groupdict().items() if k != "share"}
    assert {k: int(v) for k, v in figures.items()} == {
        "bytes": size.bytes,
        "kv_cache": size.kv_cache_bytes,
        "tokens": size.tokens,
        "blocks": size.num_blocks,
        "block_size": size.block_size,
        "padding": size.padding_bytes,
        "page": size.page_bytes,
        "states": size.states_page_bytes,
    }
    assert got["share"] == f"{100 * size.bytes / size.kv_cache_bytes:.1f}"
    # A group of its own draws on the pool the others draw on: its figures
    # are what it would have in every block, and a pool block wider than its
    # page is said to be what each of its blocks costs.
    assert ("up to" in line) == size.own_group
    wider = f"takes a whole {size.pool_block_bytes}-byte block"
    assert (wider in line) == (
        size.own_group and size.pool_block_bytes > size.page_bytes
    )


@settings(max_examples=200, deadline=None)
@given(size=cache_sizes())
def test_warns_exactly_when_padding_more_than_doubles_the_cache(size):
    states = size.bytes - size.padding_bytes
    assert size.padding_more_than_doubles == (size.bytes > 2 * states)
    assert size.padding_more_than_doubles == (size.padding_bytes > states)


@pytest.mark.parametrize(
    ("padding", "warns"), [(0, False), (3071, False), (3072, False), (3073, True)]
)
def test_the_threshold_is_strictly_more_than_double(padding, warns):
    """3 aux layers x 256 x 4 bytes x 1 token = 3072 bytes of states a page:
    a page of twice that is double, not more."""
    size = one_size(page_bytes=3072 + padding, pool_block_bytes=8192)
    assert size.padding_more_than_doubles is warns


def one_size(**changes) -> HiddenStateCacheSize:
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
    )
    return HiddenStateCacheSize(**{**fields, **changes})


def test_the_warning_names_the_group_that_set_the_page_and_the_way_out():
    size = one_size()
    assert size.padding_more_than_doubles
    warning = size.padding_warning()
    assert "(129280 of its 160000 bytes)" in warning
    assert "group 0 (MambaSpec, 1 layer(s), 67-token blocks, 16000-byte pages)" in (
        warning
    )
    # 16000 // 3072 = 5 tokens would fit; 1 is the largest divisor of 67.
    assert "a page would fit 5 tokens" in warning
    assert "divide the other groups' (67), and 1 is the largest" in warning
    assert "--block-size" in warning and "aux hidden-state layers" in warning
    # vLLM padded the page with no other group's page to blame.
    generic = one_size(page_setter=None).padding_warning()
    assert "vLLM padded the page itself" in generic and "group 0" not in generic


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"page_bytes": 3071, "pool_block_bytes": 3071}, "page_bytes 3071 is less"),
        ({"page_bytes": 16001}, "page_bytes 16001 is more than a block"),
        ({"kv_cache_bytes": 159999}, "do not fit in kv_cache_bytes 159999"),
        ({"num_blocks": 0}, "num_blocks must be a positive int, got 0"),
        ({"dtype_bytes": True}, "dtype_bytes must be a positive int, got True"),
        ({"hidden_size": 256.0}, "hidden_size must be a positive int, got 256.0"),
    ],
)
def test_inconsistent_figures_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        one_size(**changes)
