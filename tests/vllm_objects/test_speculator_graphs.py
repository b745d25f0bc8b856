"""Graph mode on the emulated backend against eager, with the real vLLM config,
the real ExtractHiddenStatesModel and a real KV cache."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.dp_utils import DPSyncState

from cg_extract.config import ExtractGraphConfig
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from cg_extract.target_buffers import TargetGraphs
from cg_extract.vllm_graphs import (
    ABOVE_ROWS,
    EAGER,
    NO_ZERO_COPY,
    capture_line,
    graph_backend,
    zero_copy_refusal,
)
from tests.torch_alone.test_cache_size import assert_reads_like_vllms
from vllm_on_cpu.harness import (
    build_vllm_config,
    emulated_graph_keys,
    load_speculator,
    make_step_inputs,
    propose_same_step,
)

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
GRAPH_KEYS = emulated_graph_keys(SIZES)


def graph_speculator(cfg, mode=CUDAGraphMode.FULL_AND_PIECEWISE, capture=True):
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg, num_blocks=16)
    loaded.speculator.init_cudagraph_manager(mode)
    if capture:
        loaded.speculator.capture()
    return loaded


def step_both(reference, graphed, num_tokens, seed, num_padding=0):
    """Run one identical step on both; return both draft-token tensors."""
    results = propose_same_step([reference, graphed], num_tokens, seed, num_padding)
    return [tokens for tokens, _ in results]


def record_replays(graphed, monkeypatch):
    """The padded sizes the copy-in graphs replay, in order."""
    replayed = []
    graphs = graphed.speculator.graphs.copy_in
    original = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda n: replayed.append(n) or original(n))
    return replayed


def counts(loaded):
    """(captured sizes, graph replays, eager fallbacks) so far."""
    stats = loaded.speculator.cudagraph_stats()
    return stats["captured_sizes"], stats["replays"], stats["eager_fallbacks"]


def assert_same_cache(reference, graphed, context=""):
    # Block 0 is the null block: vLLM's class writes padding there, ours nothing.
    ref, got = reference.kv_cache[1:], graphed.kv_cache[1:]
    assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8)), (
        f"KV caches differ {context}"
    )
    assert not graphed.kv_cache[0].any(), f"block 0 written {context}"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def configs(request, model_dir):
    return build_vllm_config(model_dir, dtype=request.param), build_vllm_config(
        model_dir, dtype=request.param, **GRAPH_KEYS
    )


def test_graph_mode_matches_eager_over_thousands_of_steps(configs):
    eager_cfg, graph_cfg = configs
    reference = load_speculator(upstream_speculator_class(), eager_cfg, num_blocks=16)
    graphed = graph_speculator(graph_cfg)
    graphed_kv_bytes = graphed.kv_cache.element_size()
    assert graphed_kv_bytes == (
        4 if eager_cfg.model_config.dtype == torch.float32 else 2
    )
    gen = torch.Generator().manual_seed(0)
    expected_replays = expected_eager = 0
    for seed in range(2000):
        n = int(
            torch.randint(1, 100, (), generator=gen)
        )  # up to 99 > 64, the largest size
        pad = int(torch.randint(0, 3, (), generator=gen)) if n < 60 else 0
        ref_tokens, graph_tokens = step_both(
            reference, graphed, n, seed, num_padding=pad
        )
        assert torch.equal(ref_tokens, graph_tokens)
        assert_same_cache(reference, graphed, f"at step {seed}, {n}+{pad} tokens")
        if n + pad <= max(SIZES):
            expected_replays += 1
        else:
            expected_eager += 1
    assert counts(graphed) == (SIZES, expected_replays, expected_eager)
    assert graphed.speculator.cudagraph_stats()["copy_in_replays"] == expected_replays
    assert expected_replays > 1000 and expected_eager > 300


@pytest.fixture(scope="module")
def three_ways(configs):
    """vLLM's own speculator, ours eager and ours with graphs, one engine dtype."""
    eager_cfg, graph_cfg = configs
    return (
        load_speculator(upstream_speculator_class(), eager_cfg, num_blocks=16),
        load_speculator(ExtractHiddenStatesSpeculator, eager_cfg, num_blocks=16),
        graph_speculator(graph_cfg),
    )


AUX_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_aux_states_of_other_dtypes_are_stored_as_vllm_converts_them(three_ways):
    """A model whose layers emit another dtype than the engine's (or several):
    vLLM's speculator stores the values converted to the model's dtype, and
    so does ours, eagerly and through the copy-in graphs, byte for byte."""
    reference, eager, graphed = three_ways

    # The speculators stay out of hypothesis's arguments (it prints those).
    @settings(max_examples=60, deadline=None)
    @given(
        num_tokens=st.integers(1, 80),
        num_padding=st.integers(0, 2),
        aux_dtypes=st.lists(st.sampled_from(AUX_DTYPES), min_size=3, max_size=3),
        seed=st.integers(0, 2**16),
    )
    def check(num_tokens, num_padding, aux_dtypes, seed):
        replays = graphed.speculator.counts["copy_in"]
        propose_same_step(
            list(three_ways), num_tokens, seed, num_padding, aux_dtypes=aux_dtypes
        )
        what = f"{num_tokens}+{num_padding} tokens, aux {aux_dtypes}"
        assert_same_cache(reference, eager, f"eager, {what}")
        assert_same_cache(reference, graphed, f"graphs, {what}")
        fits = num_tokens + num_padding <= max(SIZES)
        assert graphed.speculator.counts["copy_in"] == replays + fits

    check()


def test_skipped_copy_in_is_caught(model_dir, monkeypatch):
    """The comparison above fails when the slots are not copied in."""
    reference = load_speculator(
        upstream_speculator_class(), build_vllm_config(model_dir), num_blocks=16
    )
    graphed = graph_speculator(build_vllm_config(model_dir, **GRAPH_KEYS))
    # The copy-in writes the slots into a buffer the graphs do not read.
    graphs = graphed.speculator.graphs
    monkeypatch.setattr(graphs, "slot_mapping", graphs.slot_mapping.clone())
    with pytest.raises(AssertionError, match="KV caches differ"):
        for seed in range(20):
            step_both(reference, graphed, 5 + seed, seed)
            assert_same_cache(reference, graphed)


def test_eager_before_capture_and_above_the_largest_size(model_dir):
    graphed = graph_speculator(
        build_vllm_config(model_dir, **GRAPH_KEYS), capture=False
    )
    gen = torch.Generator().manual_seed(1)
    # The runner's dummy and profile runs come before capture.
    inputs = make_step_inputs(graphed, 8, gen)
    graphed.speculator.propose(**inputs.kwargs, dummy_run=True, is_profile=True)
    assert counts(graphed) == ([], 0, 1)
    graphed.speculator.capture()
    graphed.speculator.propose(**make_step_inputs(graphed, 65, gen).kwargs)
    graphed.speculator.propose(**make_step_inputs(graphed, 64, gen).kwargs)
    assert graphed.speculator.cudagraph_stats()["replays"] == 1
    assert graphed.speculator.cudagraph_stats()["eager_fallbacks"] == 2


def test_skip_attn_dummy_run_neither_replays_nor_writes(model_dir):
    graphed = graph_speculator(build_vllm_config(model_dir, **GRAPH_KEYS))
    graphed.kv_cache.zero_()
    inputs = make_step_inputs(graphed, 8, torch.Generator().manual_seed(2))
    graphed.speculator.propose(
        **inputs.kwargs, dummy_run=True, skip_attn_for_dummy_run=True
    )
    assert not graphed.kv_cache.any()
    assert graphed.speculator.cudagraph_stats()["replays"] == 0


def test_padding_pads_to_the_smallest_captured_size(model_dir, monkeypatch):
    graphed = graph_speculator(build_vllm_config(model_dir, **GRAPH_KEYS))
    replayed = record_replays(graphed, monkeypatch)
    for n in (1, 3, 17, 33, 64):
        graphed.speculator.propose(
            **make_step_inputs(graphed, n, torch.Generator().manual_seed(n)).kwargs
        )
    assert replayed == [1, 4, 24, 48, 64]
    # The padded tail of the static slot buffer holds the padding slot.
    assert graphed.speculator.graphs.slot_mapping[64 - 1].item() != -1
    graphed.speculator.propose(
        **make_step_inputs(graphed, 33, torch.Generator().manual_seed(0)).kwargs
    )
    assert (graphed.speculator.graphs.slot_mapping[33:48] == -1).all()


def test_data_parallel_steps_use_this_ranks_count(model_dir, monkeypatch):
    graphed = graph_speculator(build_vllm_config(model_dir, **GRAPH_KEYS))
    replayed = record_replays(graphed, monkeypatch)

    def dp(*counts, eager):
        # By name: vLLM 0.34 added max_query_len before eager.
        fields = {"uniform_token_count": None, "max_query_len": None}
        return DPSyncState(
            num_tokens_across_dp=torch.tensor(counts, dtype=torch.int32),
            eager=eager,
            num_reqs=max(counts),
            **{k: v for k, v in fields.items() if k in DPSyncState.__annotations__},
        )

    gen = torch.Generator().manual_seed(0)
    # The ranks agreed to run eagerly (another is in a long prefill): each
    # entry is a rank's real count; 5 tokens fit this rank's graph of 8.
    inputs = make_step_inputs(graphed, 5, gen)
    graphed.speculator.propose(**inputs.kwargs, dp_sync_state=dp(5, 100, eager=True))
    graphed.speculator.propose(**inputs.kwargs, dp_sync_state=dp(5, 20, eager=True))
    # They agreed on a graph: vLLM padded every rank to it, this one included.
    inputs = make_step_inputs(graphed, 24, gen)
    graphed.speculator.propose(**inputs.kwargs, dp_sync_state=dp(24, 24, eager=False))
    assert replayed == [8, 8, 24]
    assert counts(graphed)[1:] == (3, 0)


NO_GRAPHS = [  # (mode, keys, the reason's words): every reason there is
    (CUDAGraphMode.NONE, GRAPH_KEYS, "cudagraph_mode is NONE"),
    (
        CUDAGraphMode.FULL,
        {**GRAPH_KEYS, "cudagraph": False},
        "'cudagraph' is false",
    ),
    # Never given: the line says how to switch graphs on, and does not
    # claim a value the user never wrote.
    (CUDAGraphMode.FULL, {}, 'add "cudagraph": true'),
    (
        CUDAGraphMode.FULL,
        {**GRAPH_KEYS, "enforce_eager": True},
        "sets enforce_eager",
    ),
    (
        CUDAGraphMode.FULL,
        {**GRAPH_KEYS, "cudagraph_backend": "auto"},
        "backend 'auto' found no CUDA device",
    ),
]


@pytest.mark.parametrize("mode, keys, reason", NO_GRAPHS)
def test_no_graphs_and_why(model_dir, mode, keys, reason):
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator, build_vllm_config(model_dir, **keys)
    )
    spec = loaded.speculator
    backend, why = graph_backend(
        loaded.vllm_config, spec.graph_config, mode, spec.device
    )
    assert backend is None and reason in why
    if "cudagraph" not in keys:
        assert "'cudagraph' is false" not in why
    loaded.speculator.init_cudagraph_manager(mode)
    assert loaded.speculator.cudagraph_manager is None
    loaded.speculator.capture()  # a no-op, as the runner calls it regardless
    loaded.speculator.propose(
        **make_step_inputs(loaded, 4, torch.Generator().manual_seed(0)).kwargs
    )
    assert counts(loaded) == ([], 0, 0)
    assert loaded.speculator.cudagraph_stats()["eager_steps"] == 1


def test_graph_keys_without_cudagraph_are_not_called_a_choice(model_dir):
    """A config that reaches the worker with some of our keys but not
    'cudagraph' (built without EngineArgs, which the worker re-checks):
    graphs are off by default, not "'cudagraph' is false"."""
    cfg = build_vllm_config(model_dir)
    cfg.additional_config = {
        **(cfg.additional_config or {}),
        "cg_extract": {"cudagraph_backend": "emulated"},
    }
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg)
    spec = loaded.speculator
    backend, why = graph_backend(
        loaded.vllm_config, spec.graph_config, CUDAGraphMode.FULL, spec.device
    )
    assert backend is None and 'add "cudagraph": true' in why
    assert "'cudagraph' is false" not in why


def test_our_info_lines_fit_their_limit(model_dir):
    """Every INFO line the graphs' planning and capture log, with the longest
    reason of each kind and numbers beyond any engine's, fits 200 characters
    and starts with ``extract_hidden_states`` (how a reader finds ours)."""
    eager = []
    for mode, keys, words in NO_GRAPHS:
        cfg = build_vllm_config(model_dir, **keys)
        graph_config = ExtractGraphConfig.from_vllm_config(cfg)
        device = torch.device("privateuseone:15")  # torch's longest device name
        backend, why = graph_backend(cfg, graph_config, mode, device)
        assert backend is None and words in why
        eager.append(EAGER % why)

    cache = torch.zeros(2, 3, 4, 8)  # [blocks, layers, block size, hidden]
    fits = [torch.zeros(16, 8) for _ in range(3)]
    long_dtypes = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.bfloat16]
    other = [torch.zeros(16, 8, dtype=dtype) for dtype in long_dtypes]
    block_tables = SimpleNamespace(slot_mappings=torch.zeros(1, 16))
    refusals = [
        zero_copy_refusal(target, tables, cache, num_layers=3)
        for target, tables in [
            (None, block_tables),
            (TargetGraphs(fits, (16,)), None),
            (TargetGraphs(fits[:2], (16,)), block_tables),
            (TargetGraphs(other, (16,)), block_tables),
        ]
    ]
    assert len({*refusals} - {None}) == 4, refusals
    assert zero_copy_refusal(TargetGraphs(fits, (16,)), block_tables, cache, 3) is None
    no_zero_copy = [NO_ZERO_COPY % why for why in refusals]
    above = ABOVE_ROWS % ("1,048,576", "4,096", "1,048,577-16,777,216")

    sizes = list(range(1, 2**20 + 1))
    captured = capture_line(
        SimpleNamespace(
            captured_sizes=sizes,
            zero_copy_sizes=sizes[7:],
            copy_in=SimpleNamespace(backend="emulated"),
            capture_time_s=123456.789,
            static_bytes=2**50,
            graph_memory_bytes=2**50 + 2**19,
        )
    )
    assert captured == (
        "extract_hidden_states: captured 1,048,576 emulated graphs for "
        "1-1,048,576 tokens (1,048,569 zero-copy for 8-1,048,576) in 123,456.79 s, "
        "1,073,741,824.00 MiB static buffers, 1,073,741,824.50 MiB graphs"
    )
    for line in [*eager, *no_zero_copy, above, captured]:
        assert_reads_like_vllms("INFO", line)
        assert line.startswith("extract_hidden_states"), line


@pytest.mark.parametrize(
    "mode",
    [
        CUDAGraphMode.FULL,
        CUDAGraphMode.FULL_DECODE_ONLY,
        CUDAGraphMode.FULL_AND_PIECEWISE,
        # The copy-in graphs need no FULL target graph.
        CUDAGraphMode.PIECEWISE,
    ],
)
def test_every_mode_with_graphs_captures(model_dir, mode):
    graphed = graph_speculator(build_vllm_config(model_dir, **GRAPH_KEYS), mode=mode)
    assert graphed.speculator.cudagraph_stats()["captured_sizes"] == SIZES


def test_default_sizes_follow_the_target(model_dir):
    cfg = build_vllm_config(
        model_dir, max_num_seqs=16, cudagraph=True, cudagraph_backend="emulated"
    )
    graphed = graph_speculator(cfg, capture=False)
    # vLLM's default for 16 requests, 2 tokens each (one speculative token).
    assert graphed.speculator.cudagraph_manager.capture_sizes.sizes == (
        1,
        2,
        4,
        8,
        16,
        24,
        32,
        40,
        48,
        56,
        64,
    )
