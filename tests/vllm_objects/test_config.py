"""ExtractGraphConfig parsing and the split of a user's speculative config."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cg_extract.config import (
    ADDITIONAL_CONFIG,
    ADDITIONAL_CONFIG_KEY,
    KEYS,
    ExtractGraphConfig,
    merge_our_keys,
    split_speculative_config,
)

VLLM_KEYS = {"method", "num_speculative_tokens", "draft_model_config", "model"}


def test_defaults():
    cfg = ExtractGraphConfig.from_dict({})
    assert cfg == ExtractGraphConfig(False, None, "auto")
    assert KEYS == (
        "cudagraph",
        "cudagraph_capture_sizes",
        "cudagraph_backend",
        "split_kv_cache_groups",
    )


def test_round_trip_through_dict():
    cfg = ExtractGraphConfig.from_dict(
        {
            "cudagraph": True,
            "cudagraph_capture_sizes": [8, 1, 4],
            "cudagraph_backend": "emulated",
        }
    )
    assert cfg.cudagraph_capture_sizes == (8, 1, 4)
    assert ExtractGraphConfig.from_dict(cfg.to_dict()) == cfg


def test_from_vllm_config_reads_additional_config():
    class Cfg:
        additional_config = {ADDITIONAL_CONFIG_KEY: {"cudagraph": True}}

    assert ExtractGraphConfig.from_vllm_config(Cfg()).cudagraph is True

    class Bare:
        additional_config = {}

    assert ExtractGraphConfig.from_vllm_config(Bare()) == ExtractGraphConfig()


@pytest.mark.parametrize("value", ["true", 1, 0, None, [True]])
def test_cudagraph_must_be_bool(value):
    with pytest.raises(
        ValueError,
        match=r"'cudagraph' must be true or false.*"
        + repr(value).replace("[", r"\[").replace("]", r"\]"),
    ):
        ExtractGraphConfig.from_dict({"cudagraph": value})


@pytest.mark.parametrize(
    "sizes, fragment",
    [
        ([], "non-empty list"),
        (8, "non-empty list"),
        ([0, 4], r"positive integers, got \[0\]"),
        ([-2], r"positive integers, got \[-2\]"),
        ([1.5, 4], r"positive integers, got \[1.5\]"),
        (["8"], r"positive integers, got \['8'\]"),
        ([True, 4], r"positive integers, got \[True\]"),
        ([4, 8, 4], r"duplicate sizes \[4\]"),
    ],
)
def test_bad_capture_sizes(sizes, fragment):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes.*" + fragment):
        ExtractGraphConfig.from_dict({"cudagraph_capture_sizes": sizes})


def test_unknown_backend_names_value_and_choices():
    with pytest.raises(
        ValueError, match=r"'cudagraph_backend'.*\['auto', 'cuda', 'emulated'\].*'tpu'"
    ):
        ExtractGraphConfig.from_dict({"cudagraph_backend": "tpu"})


@given(st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, unique=True))
def test_any_unique_positive_sizes_accepted(sizes):
    assert ExtractGraphConfig.from_dict(
        {"cudagraph_capture_sizes": sizes}
    ).cudagraph_capture_sizes == tuple(sizes)


def test_split_moves_only_our_keys():
    spec = {
        "method": "extract_hidden_states",
        "cudagraph": True,
        "cudagraph-backend": "emulated",
    }
    theirs, ours = split_speculative_config(spec, VLLM_KEYS)
    assert theirs == {"method": "extract_hidden_states"}
    assert ours == {"cudagraph": True, "cudagraph_backend": "emulated"}
    assert "cudagraph" in spec, "the caller's dict is not modified"


@pytest.mark.parametrize(
    "key, guess",
    [
        ("cudagraphs", "cudagraph"),
        ("cuda_graph", "cudagraph"),
        ("CudaGraph", "cudagraph"),
        ("cudagraph_capture_size", "cudagraph_capture_sizes"),
        ("cuda_graph_backend", "cudagraph_backend"),
        ("cudagraph_sizes", "cudagraph_capture_sizes"),
        ("capture_sizes", "cudagraph_capture_sizes"),
        ("capture-sizes", "cudagraph_capture_sizes"),
        ("cg_backend", "cudagraph_backend"),
        ("graph_backend", "cudagraph_backend"),
        ("enable_cudagraph", "cudagraph"),
        ("use_cuda_graph", "cudagraph"),
        ("cudagrpah", "cudagraph"),
        ("backend", "cudagraph_backend"),  # half its words: just enough
    ],
)
def test_near_misses_of_our_keys_are_named(key, guess):
    with pytest.raises(
        ValueError,
        match=f"unknown speculative config key '{key}'; did you mean '{guess}'",
    ):
        split_speculative_config(
            {"method": "extract_hidden_states", key: True}, VLLM_KEYS
        )


@pytest.mark.parametrize("key", ["banana", "sizes", "max_sizes", "enable"])
def test_unrelated_unknown_keys_are_left_for_vllm(key):
    theirs, ours = split_speculative_config({"method": "x", key: 1}, VLLM_KEYS)
    assert theirs == {"method": "x", key: 1} and ours == {}


def test_vllms_own_keys_are_never_guessed_as_ours():
    from vllm.config import SpeculativeConfig

    fields = set(SpeculativeConfig.__dataclass_fields__)
    spec = {key: None for key in fields}
    theirs, ours = split_speculative_config(spec, fields)
    assert theirs == spec and ours == {}


def test_keys_given_in_additional_config_are_named_so():
    with pytest.raises(
        ValueError,
        match=r"^additional_config\['cg_extract'\] key 'cudagraph' must be true",
    ):
        merge_our_keys({}, {"cudagraph": "yes"})
    with pytest.raises(
        ValueError,
        match=r"^unknown additional_config\['cg_extract'\] key 'capture_sizes'; "
        r"did you mean 'cudagraph_capture_sizes'\?",
    ):
        merge_our_keys({}, {"capture_sizes": [8]})
    with pytest.raises(
        ValueError, match=r"must be a dict of cg_extract keys.*got True"
    ):
        merge_our_keys({}, True)


def test_merge_takes_keys_from_both_places_and_says_where():
    cfg, sources = merge_our_keys(
        {"cudagraph": True}, {"cudagraph_backend": "emulated", "cudagraph": True}
    )
    assert cfg == ExtractGraphConfig(True, None, "emulated")
    assert sources == {
        "cudagraph": "speculative config",
        "cudagraph_backend": ADDITIONAL_CONFIG,
    }
    assert merge_our_keys({"cudagraph_capture_sizes": [1, 2]}, None)[0] == (
        ExtractGraphConfig(False, (1, 2), "auto")
    )


def test_a_key_given_twice_with_different_values_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"\['cudagraph_capture_sizes'\] given in both the speculative config "
        r"\(\{'cudagraph_capture_sizes': \[1, 2\]\}\) and "
        r"additional_config\['cg_extract'\] \(\{'cudagraph_capture_sizes': \[1, 4\]\}\)",
    ):
        merge_our_keys(
            {"cudagraph_capture_sizes": [1, 2], "cudagraph": True},
            {"cudagraph_capture_sizes": [1, 4], "cudagraph": True},
        )
    # The same value in both (a list and a tuple compare as the same sizes).
    cfg, _ = merge_our_keys(
        {"cudagraph_capture_sizes": [1, 2]}, {"cudagraph_capture_sizes": (1, 2)}
    )
    assert cfg.cudagraph_capture_sizes == (1, 2)
