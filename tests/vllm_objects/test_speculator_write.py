"""Every path of our speculator (eager, copy-in graph, zero-copy graph) writes
through the one op, once, and leaves the null block alone, with the real vLLM
config, cache-only layer and KV cache, graphs on the emulated backend."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import torch
from vllm.config.compilation import CUDAGraphMode

from cg_extract import target_buffers
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from perf.measure import count_step, graph_steps_kept
from vllm_on_cpu.harness import (
    attach_target_graph_outputs,
    build_vllm_config,
    emulated_graph_keys,
    load_speculator,
    make_step_inputs,
)

SIZES = [1, 2, 4, 8, 16, 24, 32]
OP = "cg_extract.write_hidden_states.default"


@pytest.fixture(scope="module")
def speculators(model_dir):
    """vLLM's own class, and ours with copy-in and zero-copy graphs."""
    target_buffers.clear()
    keys = emulated_graph_keys(SIZES)
    reference = load_speculator(
        upstream_speculator_class(), build_vllm_config(model_dir), num_blocks=16
    )
    ours = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **keys),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(ours, SIZES)
    with graph_steps_kept():
        ours.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
        ours.speculator.capture()
    target_buffers.clear()
    assert ours.speculator.cudagraph_stats()["zero_copy_sizes"] == SIZES
    return reference, ours, target


# (real tokens, padding rows from the target, target replayed a FULL graph)
STEPS = {
    "eager": (40, 3, False),  # above the largest size
    "copy_in": (13, 2, False),  # 15 pads to 16: one more padded row
    "zero_copy": (10, 6, True),  # the target's graph of 16, 6 rows padding
}


@pytest.mark.parametrize("path", list(STEPS))
def test_each_path_writes_once_and_never_block_0(speculators, path):
    reference, ours, target = speculators
    num_tokens, num_padding, target_replayed = STEPS[path]
    for loaded in (reference, ours):
        loaded.kv_cache.zero_()
    before = dict(ours.speculator.counts)
    ref_in = make_step_inputs(
        reference, num_tokens, torch.Generator().manual_seed(9), num_padding=num_padding
    )
    reference.speculator.propose(**ref_in.kwargs)
    our_in = make_step_inputs(
        ours,
        num_tokens,
        torch.Generator().manual_seed(9),
        num_padding=num_padding,
        target=target if target_replayed else None,
    )
    count = count_step(lambda: ours.speculator.propose(**our_in.kwargs))
    assert ours.speculator.counts[path] == before[path] + 1
    writes = [op.name for op in [*count.dispatched, *count.replayed]]
    assert not [name for name in writes if "index_put" in name]
    assert writes.count(OP) == 1
    if path != "eager":
        assert [op.name for op in count.replayed] == [OP], "the graph holds the op only"
    assert reference.kv_cache[0].any(), "vLLM's class writes its padding to block 0"
    assert not ours.kv_cache[0].any(), "ours writes padding nowhere"
    assert torch.equal(reference.kv_cache[1:], ours.kv_cache[1:])
