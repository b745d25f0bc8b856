"""CaptureSizes and the default capture sizes, checked against vLLM itself:
the one list before vLLM 0.34, the split prefill / decode fields from 0.34."""

from __future__ import annotations

import json
import re
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract.capture_sizes import (
    DEFAULT_MAX_CAPTURE_SIZE,
    CaptureSizes,
    SplitSizes,
    decode_grid,
    default_capture_sizes,
    prefill_grid,
    split_capture_sizes,
)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "head_dim": 64,
}

size_lists = st.lists(
    st.integers(min_value=1, max_value=600), min_size=1, max_size=40, unique=True
)


def brute_force_pad(sizes: list[int], n: int) -> int | None:
    fitting = [s for s in sizes if s >= n]
    return min(fitting) if fitting else None


# --------------------------------------------------------------------------
# CaptureSizes


@settings(max_examples=200, deadline=None)
@given(sizes=size_lists)
def test_pad_matches_brute_force(sizes):
    """pad(n) is the smallest size >= n for every n, None above the largest."""
    cs = CaptureSizes(sizes)
    for n in range(-3, max(sizes) + 4):
        assert cs.pad(n) == brute_force_pad(sizes, n), n


@settings(max_examples=100, deadline=None)
@given(sizes=size_lists)
def test_pad_never_pads_more_than_needed(sizes):
    """A padded batch fits, lands on a captured size, and skips no closer size."""
    cs = CaptureSizes(sizes)
    for n in range(1, cs.max_size + 1):
        padded = cs.pad(n)
        assert padded in cs and padded >= n
        assert not any(n <= s < padded for s in sizes)
    for s in sizes:
        assert cs.pad(s) == s  # a captured size is never padded further


@settings(max_examples=100, deadline=None)
@given(sizes=size_lists, data=st.data())
def test_sizes_sorted_whatever_the_input_order(sizes, data):
    shuffled = data.draw(st.permutations(sizes))
    cs = CaptureSizes(iter(shuffled))  # any iterable, consumed once
    assert cs.sizes == tuple(sorted(sizes))
    assert isinstance(cs.sizes, tuple)
    assert cs.max_size == max(sizes)
    assert len(cs) == len(sizes)
    assert all(s in cs for s in sizes)
    assert repr(cs) == f"CaptureSizes({sorted(sizes)})"


@settings(max_examples=50, deadline=None)
@given(sizes=size_lists, data=st.data())
def test_duplicates_rejected_and_named(sizes, data):
    dup = data.draw(st.sampled_from(sizes))
    with pytest.raises(ValueError, match=rf"duplicates: \[{dup}\]"):
        CaptureSizes([*sizes, dup])


@pytest.mark.parametrize(
    "bad",
    [0, -4, 1.5, 8.0, True, False, "8", None],
    ids=repr,
)
def test_bad_size_rejected_and_named(bad):
    with pytest.raises(ValueError, match=re.escape(f"capture size {bad!r} is not")):
        CaptureSizes([1, 2, bad])


def test_empty_sizes_rejected():
    with pytest.raises(ValueError, match="empty"):
        CaptureSizes([])


# --------------------------------------------------------------------------
# The default sizes, against VllmConfig._set_cudagraph_sizes

# vLLM 0.34's split fields; earlier releases have none of them.
SPLIT_FIELDS = (
    "prefill_cudagraph_capture_token_sizes",
    "max_prefill_cudagraph_capture_tokens",
    "decode_cudagraph_capture_request_sizes",
    "max_decode_cudagraph_capture_requests",
    "max_decode_cudagraph_capture_tokens",
)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """One real VllmConfig for an extract_hidden_states target (slow to build)."""
    from vllm.engine.arg_utils import EngineArgs

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    cfg = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
            },
        },
    ).create_engine_config()
    assert cfg.uniform_decode_query_len == 2
    assert not cfg.model_config.enforce_eager
    # The interactivity mode builds another list; ours mirrors the default one.
    assert cfg.performance_mode != "interactivity"
    return Quiet(cfg)


class Quiet:
    """The config, under a repr that hypothesis can print in its reports (a
    vLLM config's repr fails there, on an InitVar field)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __repr__(self):
        return "VllmConfig(...)"


def splits(cfg) -> bool:
    return hasattr(cfg.compilation_config, SPLIT_FIELDS[0])


def configure(cfg, max_num_seqs, max_num_batched_tokens, **fields):
    """The limits, and every capture field unset but those given."""
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    compilation = cfg.compilation_config
    for name in (
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        *SPLIT_FIELDS,
    ):
        if hasattr(compilation, name):
            setattr(compilation, name, fields.get(name))


def vllm_resolves(cfg, max_num_seqs, max_num_batched_tokens, **fields):
    """The token counts vLLM's own _set_cudagraph_sizes resolves."""
    from vllm.config.compilation import CUDAGraphMode

    configure(cfg, max_num_seqs, max_num_batched_tokens, **fields)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg._set_cudagraph_sizes()
    return list(cfg.compilation_config.cudagraph_capture_sizes)


def our_default(cfg, max_num_seqs, max_num_batched_tokens, **fields):
    """The adapter's sizes for the same fields where the platform resolved
    none (as on a CPU): rebuilt from the limits and fields, release by release."""
    from cg_extract.config import ExtractGraphConfig
    from cg_extract.vllm_graphs import capture_sizes

    configure(cfg, max_num_seqs, max_num_batched_tokens, **fields)
    cfg.compilation_config.cudagraph_capture_sizes = []
    return list(capture_sizes(cfg, ExtractGraphConfig()).sizes)


@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_batched_tokens"),
    [
        (1, 8192),
        (4, 2048),
        (16, 64),
        (128, 2048),
        (256, 8192),
        (512, 8192),
        (1024, 16384),
        (3, 5),
    ],
)
def test_default_matches_vllm(vllm_config, max_num_seqs, max_num_batched_tokens):
    limits = (vllm_config.cfg, max_num_seqs, max_num_batched_tokens)
    want = vllm_resolves(*limits)
    assert want, "vLLM resolved no sizes: the comparison would be empty"
    assert our_default(*limits) == want


def split_fields():
    """0.34's split fields, each unset or given (explicit sizes, caps)."""
    sizes = st.none() | st.lists(st.integers(-2, 9000), max_size=20)
    return st.fixed_dictionaries(
        {},
        optional={
            SPLIT_FIELDS[0]: sizes,
            SPLIT_FIELDS[1]: st.integers(0, 9000),
            SPLIT_FIELDS[2]: st.none() | st.lists(st.integers(-2, 1200), max_size=20),
            SPLIT_FIELDS[3]: st.integers(0, 1200),
            SPLIT_FIELDS[4]: st.integers(1, 9000),
        },
    )


@settings(max_examples=150, deadline=None)
@given(
    max_num_seqs=st.integers(1, 1100),
    max_num_batched_tokens=st.integers(1, 20000),
    query_len=st.integers(1, 6),
    sm100=st.booleans(),
    data=st.data(),
)
def test_default_matches_vllm_any_limits(
    vllm_config, max_num_seqs, max_num_batched_tokens, query_len, sm100, data
):
    """Random limits, draft widths (q=1 takes another branch), both ceilings
    (and on SM100 0.34's wide grids), and from 0.34 random split fields."""
    import vllm.platforms

    cfg = vllm_config.cfg
    fields = data.draw(split_fields()) if splits(cfg) else {}
    limits = (cfg, max_num_seqs, max_num_batched_tokens)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(cfg), "uniform_decode_query_len", property(lambda _: query_len))
        mp.setattr(
            vllm.platforms.current_platform,
            "is_device_capability_family",
            lambda capability, device_id=0: sm100 and capability // 10 == 10,
        )
        want = outcome(vllm_resolves, *limits, **fields)
        assert outcome(our_default, *limits, **fields) == want


def outcome(resolve, *args, **fields):
    """The sizes; "refused" for explicit sizes above their own cap; [] for
    none left (vLLM turns graphs off, our CaptureSizes raises "empty")."""
    try:
        return resolve(*args, **fields)
    except ValueError as e:
        return "refused" if "above" in str(e) else [] if "empty" in str(e) else e


@settings(max_examples=60, deadline=None)
@given(
    explicit=st.lists(st.integers(1, 3000), min_size=1, max_size=30),
    max_num_batched_tokens=st.integers(1, 4096),
)
def test_explicit_list_matches_vllm(vllm_config, explicit, max_num_batched_tokens):
    """vLLM deduplicates and filters a given list (0.34 also adds the request
    counts that round it up to whole requests); so do we. The resolved list
    is then taken as it is."""
    kept = [s for s in explicit if s <= max_num_batched_tokens]
    if not kept:
        with pytest.raises(ValueError, match="empty"):
            CaptureSizes.from_vllm_inputs(explicit, max_num_batched_tokens, 8, 2)
        return
    cfg = vllm_config.cfg
    want = vllm_resolves(
        cfg, 8, max_num_batched_tokens, cudagraph_capture_sizes=explicit
    )
    if splits(cfg):
        given = SplitSizes(legacy_sizes=explicit)
        got = split_capture_sizes(max_num_batched_tokens, 8, 2, given)
    else:
        got = CaptureSizes.from_vllm_inputs(explicit, max_num_batched_tokens, 8, 2)
        got = list(got.sizes)
    assert got == want
    resolved = CaptureSizes.from_vllm_inputs(want, max_num_batched_tokens, 8, 2)
    assert list(resolved.sizes) == want


def test_default_shapes():
    """Spot values that do not depend on vLLM: strides, caps, decode sizes."""
    sizes = default_capture_sizes(8192, 512, 2)
    assert sizes[:4] == [1, 2, 4, 8]
    assert sizes[-1] == DEFAULT_MAX_CAPTURE_SIZE
    assert all(b - a == 8 for a, b in pairwise(sizes[3:]) if b < 256)
    assert all(b - a == 16 for a, b in pairwise(sizes) if a >= 256)
    # max_num_batched_tokens is captured when it fits, even off-stride
    assert default_capture_sizes(5, 3, 2) == [1, 2, 4, 5]
    assert 100 in default_capture_sizes(100, 64, 2)
    # uniform decode sizes that are off the 8-stride: 3 tokens per request
    assert {3, 6, 12, 24} <= set(default_capture_sizes(8192, 64, 3))
    # 0.34 adds the whole-request round-ups of the list: 2 x ceil(5 / 2) = 6
    assert split_capture_sizes(6, 3, 2, SplitSizes(legacy_sizes=[1, 5, 6])) == [
        1,
        2,
        5,
        6,
    ]
    # 0.34's SM100 grids, as its docstrings count them
    assert len(prefill_grid(8192)) == 54 and len(decode_grid(1024)) == 64


def test_from_vllm_inputs_explicit_list_drops_sizes_above_batch_limit():
    """A resolved list is vLLM's: nothing but the batch limit trims it."""
    for split in (None, SplitSizes()):
        cs = CaptureSizes.from_vllm_inputs(
            [16, 1, 8192, 4, 2048, 2049, 4096, 8, 2, 600, 1000],
            2048,
            4,
            2,
            False,
            split,
        )
        assert cs.sizes == (1, 2, 4, 8, 16, 600, 1000, 2048)
