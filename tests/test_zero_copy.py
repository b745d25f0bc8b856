"""Fused write and zero-copy replay against vLLM's own eager class, with the
real vLLM config, cache-only layer and KV cache, on the emulated backend."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import torch
from vllm.config.compilation import CUDAGraphMode

import cg_extract.speculator as speculator_module
from cg_extract import target_buffers
from cg_extract.cudagraph_manager import StaticMemoryViolation
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from cg_extract.testing import (
    attach_target_graph_outputs,
    build_vllm_config,
    load_speculator,
    make_step_inputs,
)
from cg_extract.write_graphs import WriteGraphs

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
GRAPH_KEYS = dict(
    cudagraph=True, cudagraph_backend="emulated", cudagraph_capture_sizes=SIZES
)
TARGET_ROWS = 64  # the target's own largest capture size


@pytest.fixture(autouse=True)
def no_published_buffers():
    target_buffers.clear()
    yield
    target_buffers.clear()


def zero_copy_speculator(model_dir, dtype="float32", rows=TARGET_ROWS):
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, dtype=dtype, **GRAPH_KEYS),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, rows)
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
    assert ours.speculator.cudagraph_stats()["zero_copy_replays"] == 1


def test_emulator_catches_a_zero_copy_replay_of_a_stale_buffer(model_dir, monkeypatch):
    """With the address check broken, a replay over fresh tensors would read
    the target's buffers (stale data): the emulator refuses it."""
    ours, _ = zero_copy_speculator(model_dir)
    monkeypatch.setattr(
        WriteGraphs, "_reads_in_place", lambda self, given, padded: True
    )
    fresh = make_step_inputs(ours, 16, torch.Generator().manual_seed(1))
    with pytest.raises(StaticMemoryViolation, match="external tensor at 0x"):
        ours.speculator.propose(**fresh.kwargs)


def test_no_zero_copy_without_published_buffers(model_dir):
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=16,
    )
    attach_target_graph_outputs(loaded, TARGET_ROWS)
    target_buffers.clear()  # the target captured no FULL graphs
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    loaded.speculator.capture()
    stats = loaded.speculator.cudagraph_stats()
    assert stats["zero_copy_sizes"] == [] and stats["captured_sizes"] == SIZES


def test_zero_copy_sizes_stop_at_the_target_buffers(model_dir):
    ours, _ = zero_copy_speculator(model_dir, rows=24)
    assert ours.speculator.cudagraph_stats()["zero_copy_sizes"] == [1, 2, 4, 8, 16, 24]


def test_every_path_runs_the_connector_hooks(model_dir, monkeypatch):
    """Every path's step goes through dummy_attention, whose decorator runs the
    connector's wait_for_layer_load and save_kv_layer. (A real replay skips
    that Python: hence graph mode admits only connectors whose per-forward
    hooks do nothing. The emulator re-runs it, so it is seen here.)"""
    calls = []
    original = speculator_module.dummy_attention
    monkeypatch.setattr(
        speculator_module,
        "dummy_attention",
        lambda name, x: calls.append(name) or original(name, x),
    )
    ours, target = zero_copy_speculator(model_dir)
    gen = torch.Generator().manual_seed(2)
    calls.clear()
    for n, tgt in ((16, target), (5, None), (80, None)):
        ours.speculator.propose(**make_step_inputs(ours, n, gen, target=tgt).kwargs)
    assert calls == [ours.layer_name] * 3
    stats = ours.speculator.cudagraph_stats()
    assert (
        stats["zero_copy_replays"],
        stats["copy_in_replays"],
        stats["eager_steps"],
    ) == (1, 1, 1)
