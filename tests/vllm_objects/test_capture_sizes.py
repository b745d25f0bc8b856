"""CaptureSizes and the default capture list, checked against vLLM itself."""

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
    default_capture_sizes,
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
# The default list, against VllmConfig._set_cudagraph_sizes


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
    return cfg


def vllm_capture_sizes(cfg, max_num_seqs, max_num_batched_tokens, explicit=None):
    """What vLLM's own _set_cudagraph_sizes resolves for these limits."""
    from vllm.config.compilation import CUDAGraphMode

    cfg.scheduler_config.max_num_seqs = max_num_seqs
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.compilation_config.cudagraph_capture_sizes = (
        None if explicit is None else list(explicit)
    )
    cfg.compilation_config.max_cudagraph_capture_size = None
    cfg._set_cudagraph_sizes()
    return list(cfg.compilation_config.cudagraph_capture_sizes)


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
def test_default_list_matches_vllm(vllm_config, max_num_seqs, max_num_batched_tokens):
    want = vllm_capture_sizes(vllm_config, max_num_seqs, max_num_batched_tokens)
    assert want, "vLLM resolved no sizes: the comparison would be empty"
    got = default_capture_sizes(max_num_batched_tokens, max_num_seqs, 2)
    assert got == want
    from_inputs = CaptureSizes.from_vllm_inputs(
        None, max_num_batched_tokens, max_num_seqs, 2
    )
    assert list(from_inputs.sizes) == want


@settings(max_examples=150, deadline=None)
@given(
    max_num_seqs=st.integers(1, 1100),
    max_num_batched_tokens=st.integers(1, 20000),
    query_len=st.integers(1, 6),
    blackwell=st.booleans(),
)
def test_default_list_matches_vllm_any_limits(
    vllm_config, max_num_seqs, max_num_batched_tokens, query_len, blackwell
):
    """Random limits, draft widths (q=1 takes another branch) and both ceilings."""
    import vllm.platforms

    platform = vllm.platforms.current_platform
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            type(vllm_config), "uniform_decode_query_len", property(lambda _: query_len)
        )
        mp.setattr(
            platform,
            "is_device_capability_family",
            lambda capability, device_id=0: blackwell and capability // 10 == 10,
        )
        want = vllm_capture_sizes(vllm_config, max_num_seqs, max_num_batched_tokens)
    ceiling = 1024 if blackwell else DEFAULT_MAX_CAPTURE_SIZE
    got = default_capture_sizes(
        max_num_batched_tokens, max_num_seqs, query_len, ceiling
    )
    assert got == want


def test_default_list_shape():
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


def test_from_vllm_inputs_explicit_list_drops_sizes_above_batch_limit():
    cs = CaptureSizes.from_vllm_inputs(
        [16, 1, 8192, 4, 2048, 2049, 4096, 8, 2], 2048, 256, 2
    )
    assert cs.sizes == (1, 2, 4, 8, 16, 2048)


def test_from_vllm_inputs_explicit_list_ignores_default_ceiling():
    """An explicit list is the user's: nothing but the batch limit trims it."""
    cs = CaptureSizes.from_vllm_inputs([1, 600, 1000], 2048, 4, 2, max_capture_size=8)
    assert cs.sizes == (1, 600, 1000)


@settings(max_examples=60, deadline=None)
@given(
    explicit=st.lists(st.integers(1, 3000), min_size=1, max_size=30),
    max_num_batched_tokens=st.integers(1, 4096),
)
def test_from_vllm_inputs_explicit_list_matches_vllm(
    vllm_config, explicit, max_num_batched_tokens
):
    """vLLM deduplicates and filters an explicit list; so do we."""
    kept = [s for s in explicit if s <= max_num_batched_tokens]
    if not kept:
        with pytest.raises(ValueError, match="empty"):
            CaptureSizes.from_vllm_inputs(explicit, max_num_batched_tokens, 8, 2)
        return
    want = vllm_capture_sizes(vllm_config, 8, max_num_batched_tokens, explicit)
    got = CaptureSizes.from_vllm_inputs(explicit, max_num_batched_tokens, 8, 2)
    assert list(got.sizes) == want


@pytest.mark.parametrize("empty", [None, []])
def test_from_vllm_inputs_without_a_list_uses_the_default(empty):
    cs = CaptureSizes.from_vllm_inputs(empty, 8192, 512, 2, max_capture_size=1024)
    assert list(cs.sizes) == default_capture_sizes(8192, 512, 2, 1024)
    assert cs.max_size == 1024
