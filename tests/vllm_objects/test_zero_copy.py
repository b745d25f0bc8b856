"""Fused write and zero-copy replay against vLLM's own eager class, with the
real vLLM config, cache-only layer and KV cache, on the emulated backend."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import torch
from vllm.config.compilation import CUDAGraphMode

from cg_extract import target_buffers
from cg_extract.emulated_graph import StaticMemoryViolation
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from cg_extract.write_graphs import WriteGraphs
from vllm_on_cpu.harness import (
    attach_target_graph_outputs,
    build_vllm_config,
    emulated_graph_keys,
    load_speculator,
    make_step_inputs,
)

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
GRAPH_KEYS = emulated_graph_keys(SIZES)


@pytest.fixture(autouse=True)
def no_published_buffers():
    target_buffers.clear()
    yield
    target_buffers.clear()


def zero_copy_speculator(model_dir, dtype="float32", full_sizes=SIZES):
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, dtype=dtype, **GRAPH_KEYS),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, full_sizes)
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    return loaded, target


def same_cache(reference, ours):
    """Equal outside the null block 0, which ours never writes."""
    return not ours.kv_cache[0].any() and torch.equal(
        reference.kv_cache[1:].view(torch.uint8), ours.kv_cache[1:].view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_paths_match_upstream_over_thousands_of_steps(model_dir, dtype):
    reference = load_speculator(
        upstream_speculator_class(),
        build_vllm_config(model_dir, dtype=dtype),
        num_blocks=16,
    )
    ours, target = zero_copy_speculator(model_dir, dtype)
    assert ours.speculator.cudagraph_stats()["zero_copy_sizes"] == SIZES
    gen = torch.Generator().manual_seed(11)
    expected = {"zero_copy_replays": 0, "copy_in_replays": 0, "eager_steps": 0}
    for seed in range(1500):
        target_replayed = bool(torch.randint(0, 2, (), generator=gen))
        if target_replayed:  # a target FULL graph: n is one of its sizes
            n = SIZES[int(torch.randint(0, len(SIZES), (), generator=gen))]
            expected["zero_copy_replays"] += 1
        else:  # the target ran eagerly or piecewise: fresh tensors
            n = int(torch.randint(1, 100, (), generator=gen))
            expected["copy_in_replays" if n <= max(SIZES) else "eager_steps"] += 1
        ref_in = make_step_inputs(reference, n, torch.Generator().manual_seed(seed))
        our_in = make_step_inputs(
            ours,
            n,
            torch.Generator().manual_seed(seed),
            target=target if target_replayed else None,
        )
        assert torch.equal(
            reference.speculator.propose(**ref_in.kwargs),
            ours.speculator.propose(**our_in.kwargs),
        )
        assert same_cache(reference, ours), (
            f"step {seed}: n={n}, target_replayed={target_replayed}"
        )
    stats = ours.speculator.cudagraph_stats()
    assert {k: stats[k] for k in expected} == expected
    assert min(expected.values()) > 100


def test_other_views_take_the_copy_in_path(model_dir):
    ours, target = zero_copy_speculator(model_dir)
    gen = torch.Generator().manual_seed(0)
    inputs = make_step_inputs(ours, 16, gen, target=target)
    aux = inputs.kwargs["aux_hidden_states"]
    # Same values, but not at the captured addresses: one layer is a copy.
    inputs.kwargs["aux_hidden_states"] = [aux[0].clone(), *aux[1:]]
    ours.speculator.propose(**inputs.kwargs)
    # A view of the right buffer with another stride (every other row).
    strided = [buf[: 2 * 16 : 2] for buf in target.aux_hidden_states]
    ours.speculator.propose(**{**inputs.kwargs, "aux_hidden_states": strided})
    # The right buffers, but a size with no graph: 3 tokens pad to 4.
    ours.speculator.propose(**make_step_inputs(ours, 3, gen, target=target).kwargs)
    stats = ours.speculator.cudagraph_stats()
    assert (stats["zero_copy_replays"], stats["copy_in_replays"]) == (0, 3)
    ours.speculator.propose(**make_step_inputs(ours, 16, gen, target=target).kwargs)
    stats = ours.speculator.cudagraph_stats()
    assert stats["zero_copy_replays"] == 1
    assert stats["replays"] == 4, "every replay counts, zero-copy ones too"


def test_emulator_catches_a_zero_copy_replay_of_a_stale_buffer(model_dir, monkeypatch):
    """With the address check broken, a replay over fresh tensors would read
    the target's buffers (stale data): the emulator refuses it."""
    ours, _ = zero_copy_speculator(model_dir)
    monkeypatch.setattr(WriteGraphs, "_reads_in_place", lambda self, given: True)
    fresh = make_step_inputs(ours, 16, torch.Generator().manual_seed(1))
    with pytest.raises(StaticMemoryViolation, match="external tensor at 0x"):
        ours.speculator.propose(**fresh.kwargs)


def test_no_zero_copy_without_published_buffers(model_dir):
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=16,
    )
    attach_target_graph_outputs(loaded, SIZES)
    target_buffers.clear()  # the target captured no FULL graphs
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    stats = loaded.speculator.cudagraph_stats()
    assert stats["zero_copy_sizes"] == [] and stats["captured_sizes"] == SIZES


def test_no_zero_copy_before_the_runner_shares_its_block_tables(
    model_dir, cg_extract_log
):
    """The target published its buffers, but ``set_attn`` has not run (no
    slot row to read): copy-in graphs only, and a line says why."""
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, SIZES)  # published while alive
    del loaded.speculator.block_tables, loaded.speculator.kv_cache_config
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    stats = loaded.speculator.cudagraph_stats()
    assert stats["zero_copy_sizes"] == [] and stats["captured_sizes"] == SIZES
    assert target_buffers.get("cpu").full_sizes == tuple(target.full_sizes)
    assert (
        "extract_hidden_states: no zero-copy graphs: the runner has not shared "
        "its block tables." in cg_extract_log
    ), "\n".join(cg_extract_log)


def test_zero_copy_sizes_are_the_targets_full_sizes(model_dir):
    """The target's FULL sizes need not be ours: each gets a zero-copy graph,
    whatever our copy-in sizes; a FULL size replays with no copy, any other
    step takes the copy-in graph or runs eagerly, all writing upstream's bytes."""
    full_sizes = [2, 6, 40, 100]
    reference = load_speculator(
        upstream_speculator_class(), build_vllm_config(model_dir), num_blocks=16
    )
    ours, target = zero_copy_speculator(model_dir, full_sizes=full_sizes)
    stats = ours.speculator.cudagraph_stats()
    assert stats["zero_copy_sizes"] == full_sizes and stats["captured_sizes"] == SIZES
    steps = [  # (tokens, inputs in the target's buffers, path)
        (100, True, "zero_copy_replays"),  # above our largest copy-in size
        (100, False, "eager_steps"),
        (6, True, "zero_copy_replays"),  # not one of our sizes
        (6, False, "copy_in_replays"),  # pads to 8
        (4, True, "copy_in_replays"),  # not a FULL size of the target
        (40, True, "zero_copy_replays"),
        (101, False, "eager_steps"),
    ]
    for seed, (n, in_place, path) in enumerate(steps):
        before = ours.speculator.cudagraph_stats()[path]
        ref_in = make_step_inputs(reference, n, torch.Generator().manual_seed(seed))
        our_in = make_step_inputs(
            ours,
            n,
            torch.Generator().manual_seed(seed),
            target=target if in_place else None,
        )
        assert torch.equal(
            reference.speculator.propose(**ref_in.kwargs),
            ours.speculator.propose(**our_in.kwargs),
        )
        assert same_cache(reference, ours), f"{n} tokens, in place {in_place}"
        assert ours.speculator.cudagraph_stats()[path] == before + 1, (n, in_place)


def test_the_capture_line_counts_and_spans_both_graph_sets(model_dir, cg_extract_log):
    """One INFO line: how many graphs, the sizes they span (not the lists),
    seconds and MiB as vLLM writes its own."""
    ours, _ = zero_copy_speculator(model_dir, full_sizes=[2, 6, 40, 100])
    graphs = ours.speculator.graphs
    (line,) = [m for m in cg_extract_log if "extract_hidden_states: captured" in m]
    assert line == (
        f"extract_hidden_states: captured {len(SIZES)} emulated graphs for "
        f"1-64 tokens (4 zero-copy for 2-100) in {graphs.capture_time_s:.2f} s, "
        f"{graphs.static_bytes / 2**20:.2f} MiB static buffers, "
        f"{graphs.graph_memory_bytes / 2**20:.2f} MiB graphs"
    )
    # Static buffers: 64 rows of every aux hidden state, and 64 slots.
    num_blocks, num_layers, block_size, hidden = ours.kv_cache.shape
    assert graphs.static_bytes == 64 * num_layers * hidden * 4 + 64 * 8
    assert len(line) <= 200


def test_full_sizes_above_the_targets_buffer_rows_take_no_zero_copy_graph(
    model_dir, cg_extract_log
):
    """Should a FULL size of the target exceed its buffers' rows (vLLM sizes
    them for its largest), that size gets no zero-copy graph, and a line
    says which sizes and why; the others keep theirs."""
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, [2, 6, 40, 48, 100, 120])
    target.aux_hidden_states[:] = [a[:48] for a in target.aux_hidden_states]
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    assert loaded.speculator.cudagraph_stats()["zero_copy_sizes"] == [2, 6, 40, 48]
    assert (
        "extract_hidden_states: no zero-copy graphs above the target's 48 buffer "
        "rows: 2 of its FULL sizes, 100-120." in cg_extract_log
    )


def test_target_buffers_of_another_dtype_fall_back_to_copy_in(
    model_dir, cg_extract_log
):
    """A target whose layers emit another dtype than the cache's (bf16 into
    an fp32 cache) has persistent aux buffers of that dtype (vLLM's
    ``empty_like`` of the layers' outputs): the speculator captures copy-in
    graphs only, says why, and steps handed views of those buffers, as after
    the target's FULL replay, still write upstream's bytes (never reaching
    the write op's dtype refusal)."""
    reference = load_speculator(
        upstream_speculator_class(), build_vllm_config(model_dir), num_blocks=16
    )
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, SIZES)
    assert loaded.kv_cache.dtype == torch.float32
    target.aux_hidden_states[:] = [
        a.to(torch.bfloat16) for a in target.aux_hidden_states
    ]
    assert target_buffers.get("cpu").aux_hidden_states[0].dtype == torch.bfloat16
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    stats = loaded.speculator.cudagraph_stats()
    assert stats["zero_copy_sizes"] == [] and stats["captured_sizes"] == SIZES
    assert (
        "extract_hidden_states: no zero-copy graphs: the target's aux hidden "
        "states are torch.bfloat16, the hidden-state cache torch.float32; they "
        "are converted and copied in." in cg_extract_log
    )
    emitted = [torch.bfloat16] * len(target.aux_hidden_states)
    # Steps the target replayed (views of its buffers), then one above its
    # sizes and ours (it ran eagerly: fresh tensors; ours runs eagerly too).
    for seed, n in enumerate((16, 3, 64, 100)):
        ref_in = make_step_inputs(
            reference, n, torch.Generator().manual_seed(seed), aux_dtypes=emitted
        )
        replayed = n <= max(SIZES)
        our_in = make_step_inputs(
            loaded,
            n,
            torch.Generator().manual_seed(seed),
            target=target if replayed else None,
            aux_dtypes=emitted,
        )
        aux = our_in.kwargs["aux_hidden_states"]
        in_place = aux[0].data_ptr() == target.aux_hidden_states[0].data_ptr()
        assert in_place == replayed and aux[0].dtype == torch.bfloat16
        reference.speculator.propose(**ref_in.kwargs)
        loaded.speculator.propose(**our_in.kwargs)
        assert same_cache(reference, loaded)
    stats = loaded.speculator.cudagraph_stats()
    assert stats["copy_in_replays"] == 3 and stats["eager_steps"] == 1


def test_release_graphs_empties_the_graphs_a_caller_still_holds(model_dir):
    """Elastic EP's release (``release_graphs()``): whoever still holds the
    write graphs (a stats reader) holds no graph and no view of the target's
    buffers any more."""
    ours, _ = zero_copy_speculator(model_dir)
    held = ours.speculator.graphs
    assert held.captured_sizes == SIZES and held.zero_copy_sizes == SIZES
    ours.speculator.cudagraph_manager.release_graphs()
    assert ours.speculator.graphs is None
    assert held.captured_sizes == [] and held.zero_copy_sizes == []
