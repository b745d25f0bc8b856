"""Our eager speculator against vLLM's own class, with the real cache-only
model, a real KV cache and the connector's own reader."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    extract_from_kv_cache,
)

from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from vllm_on_cpu.harness import (
    build_vllm_config,
    load_speculator,
    make_step_inputs,
    propose_same_step,
    vllm_release,
)


@pytest.fixture(scope="module")
def pair(model_dir):
    cfg = build_vllm_config(model_dir, aux_layer_ids=[0, 2, 3])
    return load_speculator(upstream_speculator_class(), cfg), load_speculator(
        ExtractHiddenStatesSpeculator, cfg
    )


def test_eager_matches_upstream_over_random_batches(pair):
    upstream, ours = pair
    gen = torch.Generator().manual_seed(1234)
    for seed in range(300):
        n = int(torch.randint(1, 1000, (), generator=gen))
        pad = int(torch.randint(0, 8, (), generator=gen))
        (up_tokens, _), (our_tokens, inputs) = propose_same_step(
            list(pair), n, seed, num_padding=pad
        )
        assert torch.equal(up_tokens, our_tokens)
        # Upstream sends padding to the null block 0; ours writes it nowhere.
        assert torch.equal(upstream.kv_cache[1:], ours.kv_cache[1:]), (
            f"caches differ at seed {seed}, n={n}"
        )
        assert not ours.kv_cache[0].any(), f"block 0 written at seed {seed}"
        # The connector reads back exactly what the target produced.
        stacked = torch.stack(inputs.aux_hidden_states, dim=1)[:n]
        assert torch.equal(
            extract_from_kv_cache(ours.kv_cache, inputs.slots, n), stacked
        )


def test_a_slot_row_longer_than_the_step_is_read_to_its_tokens(pair):
    """As vLLM's own class does, the layer's slot row is read for the step's
    tokens only (the aux rows'): entries past them belong to no token."""
    _, ours = pair
    n = 12
    inputs = make_step_inputs(ours, n, torch.Generator().manual_seed(8))
    slot_mappings = inputs.kwargs["slot_mappings"]
    (name,) = slot_mappings
    beyond = torch.full((5,), int(inputs.slots.max()) + 1, dtype=inputs.slots.dtype)
    slot_mappings[name] = torch.cat([slot_mappings[name], beyond])
    ours.kv_cache.zero_()
    ours.speculator.propose(**inputs.kwargs)
    stacked = torch.stack(inputs.aux_hidden_states, dim=1)[:n]
    assert torch.equal(extract_from_kv_cache(ours.kv_cache, inputs.slots, n), stacked)
    assert ours.kv_cache.count_nonzero() == stacked.count_nonzero()


def test_a_hidden_state_cache_of_another_dtype_is_refused(model_dir):
    """--kv-cache-dtype bfloat16 with a float32 model. vLLM 0.32 gives the
    cache-only layer a bf16 cache; we store hidden states unconverted, so we
    refuse at load, naming both dtypes. vLLM 0.33 and 0.34 refuse the pair
    themselves when the config is built
    (``VllmConfig._reject_mismatched_float_kv_cache``)."""
    engine_args = {"kv_cache_dtype": "bfloat16"}
    if vllm_release() in ("0.33.0", "0.34.0"):
        with pytest.raises(
            Exception,
            match='kv_cache_dtype="bfloat16" is incompatible with dtype="float32"',
        ):
            build_vllm_config(model_dir, dtype="float32", engine_args=engine_args)
        return
    assert vllm_release() == "0.32.0"
    cfg = build_vllm_config(model_dir, dtype="float32", engine_args=engine_args)
    with pytest.raises(
        ValueError,
        match="hidden-state cache is torch.bfloat16 but the model's hidden "
        "states are torch.float32",
    ):
        load_speculator(ExtractHiddenStatesSpeculator, cfg)


def test_draft_tokens_are_last_sampled_of_each_request(pair):
    _, ours = pair
    inputs = make_step_inputs(ours, 12, torch.Generator().manual_seed(7), num_reqs=5)
    tokens = ours.speculator.propose(**inputs.kwargs)
    batch = inputs.kwargs["input_batch"]
    assert tokens.shape == (5, 1)
    assert torch.equal(tokens, inputs.kwargs["last_sampled"][batch.idx_mapping, :1])


def test_padding_is_written_nowhere(pair):
    upstream, ours = pair
    for loaded in pair:
        loaded.kv_cache.zero_()
        inputs = make_step_inputs(
            loaded, 10, torch.Generator().manual_seed(3), num_padding=6
        )
        loaded.speculator.propose(**inputs.kwargs)
    touched = ours.kv_cache.flatten(1).abs().sum(1) != 0
    owned = set((inputs.slots // ours.block_size).tolist())
    assert set(touched.nonzero().flatten().tolist()) == owned, (
        "only the blocks of real tokens are written; padding not even block 0"
    )
    assert upstream.kv_cache[0].any(), "vLLM's own class sends padding to block 0"


def test_skip_attn_dummy_run_writes_nothing(pair):
    _, ours = pair
    ours.kv_cache.zero_()
    inputs = make_step_inputs(ours, 16, torch.Generator().manual_seed(5))
    tokens = ours.speculator.propose(
        **inputs.kwargs, dummy_run=True, skip_attn_for_dummy_run=True
    )
    assert tokens.shape[1] == 1
    assert not ours.kv_cache.any()


@pytest.mark.parametrize(
    "aux, message",
    [
        (None, "aux_hidden_states are required"),
        ("short", "Expected 3 auxiliary hidden states, got 2"),
    ],
)
def test_missing_aux_hidden_states(pair, aux, message):
    _, ours = pair
    inputs = make_step_inputs(ours, 4, torch.Generator().manual_seed(0))
    inputs.kwargs["aux_hidden_states"] = (
        None if aux is None else inputs.aux_hidden_states[:2]
    )
    with pytest.raises(ValueError, match=message):
        ours.speculator.propose(**inputs.kwargs)


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            {"draft_sample_method": "probabilistic"},
            "only supports draft_sample_method='greedy'",
        ),
        (
            {"disable_padded_drafter_batch": True},
            "disable_padded_drafter_batch is not supported",
        ),
    ],
)
def test_pr_validations(model_dir, keys, message):
    if "disable_padded_drafter_batch" in keys and vllm_release() == "0.34.0":
        pytest.skip("vLLM 0.34 removed disable_padded_drafter_batch")
    cfg = build_vllm_config(model_dir, **keys)
    for cls in (upstream_speculator_class(), ExtractHiddenStatesSpeculator):
        with pytest.raises(ValueError, match=message):
            load_speculator(cls, cfg)


def test_num_speculative_tokens_must_be_one(model_dir):
    cfg = build_vllm_config(model_dir, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="requires num_speculative_tokens to be 1"):
        load_speculator(ExtractHiddenStatesSpeculator, cfg)


def test_aux_layer_ids_required(model_dir):
    cfg = build_vllm_config(model_dir)
    cfg.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids = []
    with pytest.raises(
        ValueError, match="eagle_aux_hidden_state_layer_ids must be set"
    ):
        load_speculator(ExtractHiddenStatesSpeculator, cfg)


def test_eager_path_keeps_no_staging_buffer(pair):
    """vLLM's class stages every step in a [max_num_batched_tokens, L, H]
    buffer; the fused write reads the aux hidden states where they are."""
    upstream, ours = pair
    assert upstream.speculator.hidden_states.shape == (2048, 3, 256)
    assert not hasattr(ours.speculator, "hidden_states")
    assert ours.speculator.num_hidden_states == 3
    assert ours.kv_cache.shape[1] == 3
