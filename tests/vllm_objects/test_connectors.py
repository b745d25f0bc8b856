"""KV connectors in graph mode get the eager layer's hooks, exactly.

The connectors are created as a GPU worker creates them
(``vllm_on_cpu.harness.worker_connector``): vLLM's
``ensure_kv_transfer_initialized`` (a one-process gloo group stands in for the
worker's distributed setup), wrapped in MRv2's ``ActiveKVConnector``, which
binds each step's metadata (built by the scheduler-side connector) before the
forward and clears it after. Test connectors come from
``kv_connector_module_path`` (tests/vllm_objects/recording_connectors.py). The reference is
vLLM's own eager speculator; graphs are emulated.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode

import cg_extract.speculator as speculator_module
from cg_extract import target_buffers
from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from tests.vllm_objects import recording_connectors
from tests.vllm_objects.recording_connectors import CALLS, HookFailed, HookInGraphWork
from vllm_on_cpu.harness import (
    attach_target_graph_outputs,
    build_vllm_config,
    emulated_graph_keys,
    load_speculator,
    make_step_inputs,
    single_process_group,
    worker_connector,
)

MODULE = "tests.vllm_objects.recording_connectors"
SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
GRAPH_KEYS = emulated_graph_keys(SIZES)
HOOKS = ("wait_for_layer_load", "save_kv_layer")
# One step as the runner drives it: bind (pre_forward), the draft layer's
# hooks (propose), then post_forward's calls.
STEP = [
    "bind_connector_metadata",
    *HOOKS,
    "start_load_kv",
    "wait_for_save",
    "clear_connector_metadata",
]


def recording(name: str = "recording", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"name": name, **extra},
    }


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def hidden_states_subclass(path) -> dict[str, Any]:
    return {
        "kv_connector": "RecordingHiddenStatesConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


@pytest.fixture(scope="module")
def distributed(model_dir):
    with single_process_group(build_vllm_config(model_dir)):
        yield


@pytest.fixture(autouse=True)
def flag_graph_work(monkeypatch):
    """Mark every capture (warm-up included) and replay of the write graphs,
    so that a hook run inside one raises."""

    def flagged(method):
        def run(*args, **kwargs):
            recording_connectors.in_graph_work = True
            try:
                return method(*args, **kwargs)
            finally:
                recording_connectors.in_graph_work = False

        return run

    monkeypatch.setattr(CudaGraphManager, "capture", flagged(CudaGraphManager.capture))
    monkeypatch.setattr(CudaGraphManager, "replay", flagged(CudaGraphManager.replay))
    target_buffers.clear()
    CALLS.clear()
    yield
    target_buffers.clear()
    CALLS.clear()


def graph_speculator(model_dir, kv, dtype="float32", capture=True):
    """Ours with zero-copy and copy-in graphs, as after the target's capture."""
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(
            model_dir, dtype=dtype, engine_args={"kv_transfer_config": kv}, **GRAPH_KEYS
        ),
        num_blocks=16,
    )
    target = attach_target_graph_outputs(loaded, SIZES)
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
    if capture:
        loaded.speculator.capture()
    return loaded, target


def random_step(gen, loaded, target, seed):
    """A zero-copy, copy-in or eager step (about a third each)."""
    kind = int(torch.randint(0, 3, (), generator=gen))
    if kind == 0:  # the target replayed a FULL graph: n is one of its sizes
        n = SIZES[int(torch.randint(0, len(SIZES), (), generator=gen))]
    elif kind == 1:
        n = int(torch.randint(1, 65, (), generator=gen))
    else:
        n = int(torch.randint(65, 120, (), generator=gen))
    inputs = make_step_inputs(
        loaded,
        n,
        torch.Generator().manual_seed(seed),
        num_padding=int(torch.randint(0, 3, (), generator=gen)) if kind == 1 else 0,
        target=target if kind == 0 else None,
    )
    return n, inputs


def calls_of_step(connectors, loaded, inputs) -> list:
    CALLS.clear()
    connectors.step(loaded, inputs)
    calls = list(CALLS)
    CALLS.clear()
    return calls


def paths(loaded) -> dict[str, int]:
    stats = loaded.speculator.cudagraph_stats()
    return {
        k: stats[k] for k in ("zero_copy_replays", "copy_in_replays", "eager_steps")
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_mode_hooks_equal_vllms_eager_layer(distributed, model_dir, dtype):
    """Same calls, order, layer, KV cache tensor, slot mappings, padding mask
    and copied-out rows as vLLM's eager class, over hundreds of steps."""
    kv = recording()
    reference = load_speculator(
        upstream_speculator_class(),
        build_vllm_config(
            model_dir, dtype=dtype, engine_args={"kv_transfer_config": kv}
        ),
        num_blocks=16,
    )
    graphed, target = graph_speculator(model_dir, kv, dtype)
    gen = torch.Generator().manual_seed(5)
    with worker_connector(graphed) as connectors:
        for seed in range(300):
            n, ours_in = random_step(gen, graphed, target, seed)
            ref_in = make_step_inputs(
                reference,
                n,
                torch.Generator().manual_seed(seed),
                num_padding=len(ours_in.kwargs["input_batch"].is_padding) - n,
            )
            expected = calls_of_step(connectors, reference, ref_in)
            got = calls_of_step(connectors, graphed, ours_in)
            assert [c.method for c in expected] == STEP
            assert [c.method for c in got] == STEP, f"step {seed}: {paths(graphed)}"
            for want, have in zip(expected, got, strict=True):
                assert want.same_as(have), f"step {seed}, {have.method}, n={n}"
            save = got[STEP.index("save_kv_layer")]
            assert save.layer_name == graphed.layer_name
            assert save.kv_cache is graphed.kv_cache
            assert len(save.rows) == n and save.rows.dtype == graphed.kv_cache.dtype
            assert torch.equal(
                reference.kv_cache[1:].view(torch.uint8),
                graphed.kv_cache[1:].view(torch.uint8),
            )
    assert min(paths(graphed).values()) > 60, paths(graphed)


def test_copied_out_rows_are_the_steps_hidden_states(distributed, model_dir):
    """What the offloading hook collects after a replay is the step's own aux
    hidden states (the comparison above could pass on two equal wrongs)."""
    graphed, target = graph_speculator(model_dir, recording())
    with worker_connector(graphed) as connectors:
        for n, tgt in ((16, target), (5, None), (80, None)):
            inputs = make_step_inputs(
                graphed, n, torch.Generator().manual_seed(n), target=tgt
            )
            (save,) = [
                c
                for c in calls_of_step(connectors, graphed, inputs)
                if c.method == "save_kv_layer"
            ]
            assert torch.equal(
                save.rows, torch.stack(inputs.aux_hidden_states, dim=1)[:n]
            )
    assert paths(graphed) == {
        "zero_copy_replays": 1,
        "copy_in_replays": 1,
        "eager_steps": 1,
    }


@pytest.mark.parametrize(
    "kind",
    ["hidden_states", "module_path", "hidden_states_subclass", "multi", "nested_multi"],
)
def test_any_connector_starts_in_graph_mode(distributed, model_dir, tmp_path, kind):
    hidden_states = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    kv = {
        "hidden_states": hidden_states,
        "module_path": recording(),
        "hidden_states_subclass": hidden_states_subclass(tmp_path),
        "multi": multi(hidden_states, recording()),
        "nested_multi": multi(
            multi(recording("inner"), hidden_states_subclass(tmp_path)),
            recording("outer"),
        ),
    }[kind]
    graphed, target = graph_speculator(model_dir, kv)
    assert graphed.speculator.cudagraph_stats()["zero_copy_sizes"] == SIZES
    expected_names = {
        "hidden_states": [],  # vLLM's own: records nothing, must run unharmed
        "module_path": ["recording"],
        "hidden_states_subclass": ["hidden_states"],
        "multi": ["recording"],
        "nested_multi": ["inner", "hidden_states", "outer"],
    }[kind]
    with worker_connector(graphed) as connectors:
        for n, tgt in ((16, target), (5, None)):
            inputs = make_step_inputs(
                graphed, n, torch.Generator().manual_seed(n), target=tgt
            )
            hooks = [
                (c.connector, c.method)
                for c in calls_of_step(connectors, graphed, inputs)
                if c.method in HOOKS
            ]
            # MultiConnector waits on every child, then saves to every child.
            assert hooks == [(name, HOOKS[0]) for name in expected_names] + [
                (name, HOOKS[1]) for name in expected_names
            ]
    assert paths(graphed) == {
        "zero_copy_replays": 1,
        "copy_in_replays": 1,
        "eager_steps": 0,
    }


@pytest.mark.parametrize("hook", HOOKS)
def test_a_raising_hook_reaches_the_caller(distributed, model_dir, hook):
    kv = recording(raise_in=hook)
    reference = load_speculator(
        upstream_speculator_class(),
        build_vllm_config(model_dir, engine_args={"kv_transfer_config": kv}),
        num_blocks=16,
    )
    graphed, target = graph_speculator(model_dir, kv)
    message = f"recording.{hook} failed"
    with worker_connector(graphed) as connectors:
        with pytest.raises(HookFailed, match=message):
            connectors.step(
                reference,
                make_step_inputs(reference, 5, torch.Generator().manual_seed(0)),
            )
        for n, tgt in ((16, target), (5, None), (80, None)):
            inputs = make_step_inputs(
                graphed, n, torch.Generator().manual_seed(n), target=tgt
            )
            with pytest.raises(HookFailed, match=message):
                connectors.step(graphed, inputs)
    assert paths(graphed) == {
        "zero_copy_replays": 1,
        "copy_in_replays": 1,
        "eager_steps": 1,
    }


def capture_with_metadata_bound(model_dir, monkeypatch=None, graph_write=None):
    """Capture while the connector has metadata (at a real capture it usually
    has none, which would hide a hook inside the graph), then step."""
    loaded, target = graph_speculator(model_dir, recording(), capture=False)
    spec = loaded.speculator
    with worker_connector(loaded) as connectors:
        if graph_write is not None:
            # Graphs are built at capture, from their manager's step.
            monkeypatch.setattr(spec.cudagraph_manager, "write", graph_write(spec))
        connectors.bind()
        assert connectors.worker.kv_connector.has_connector_metadata()
        spec.capture()
        assert [c.method for c in CALLS] == ["bind_connector_metadata"]
        connectors.worker.post_forward(set())
        for n, tgt in ((16, target), (5, None)):
            inputs = make_step_inputs(
                loaded, n, torch.Generator().manual_seed(n), target=tgt
            )
            assert [c.method for c in calls_of_step(connectors, loaded, inputs)] == STEP
    return loaded


def test_no_hook_runs_during_capture_or_inside_a_replay(distributed, model_dir):
    loaded = capture_with_metadata_bound(model_dir)
    assert paths(loaded)["zero_copy_replays"] == paths(loaded)["copy_in_replays"] == 1


def test_a_hook_inside_the_graph_is_caught(distributed, model_dir, monkeypatch):
    """The check above fails for a graph that runs the hooks in its step."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionMetadata,
    )

    def write_then_hooks(spec):
        def step(aux, slots):
            spec._write(aux, slots)
            with set_forward_context(
                {spec.layer_name: CacheOnlyAttentionMetadata(slots)},
                spec.vllm_config,
                slot_mapping={spec.layer_name: slots},
                is_padding=slots < 0,
            ):
                spec._run_connector_hooks()

        return step

    with pytest.raises(HookInGraphWork, match="ran during a graph capture or replay"):
        capture_with_metadata_bound(model_dir, monkeypatch, write_then_hooks)


def test_without_a_kv_transfer_group_graph_steps_do_nothing_more(
    model_dir, monkeypatch
):
    """No forward context is built and no hook path is entered after a
    replay; eager steps keep vLLM's forward context."""
    entered = []
    for name in ("set_forward_context", "dummy_attention"):
        original = getattr(speculator_module, name)
        monkeypatch.setattr(
            speculator_module,
            name,
            lambda *a, _name=name, _original=original, **k: (
                entered.append(_name) or _original(*a, **k)
            ),
        )
    graphed, target = graph_speculator(model_dir, None)
    for n, tgt in ((16, target), (5, None)):
        graphed.speculator.propose(
            **make_step_inputs(
                graphed, n, torch.Generator().manual_seed(n), target=tgt
            ).kwargs
        )
    assert entered == []
    graphed.speculator.propose(
        **make_step_inputs(graphed, 80, torch.Generator().manual_seed(0)).kwargs
    )
    assert entered == ["set_forward_context", "dummy_attention"]


def test_a_connector_that_needs_piecewise_keeps_the_copy_in_graphs(
    distributed, model_dir
):
    """vLLM's own check sees the requirement through nested MultiConnectors
    and runs the target PIECEWISE, so there are no FULL target graphs and no
    zero-copy ones. The requirement is about layerwise work inside the
    target's forward; our hooks run on the host after the replay, so the
    copy-in graphs stay and every hook still runs, in eager order."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    child = {**recording(), "kv_connector": "PiecewiseRecordingConnector"}
    cfg = build_vllm_config(
        model_dir,
        engine_args={"kv_transfer_config": multi(multi(recording("plain"), child))},
        **GRAPH_KEYS,
    )
    ktc = cfg.kv_transfer_config
    assert KVConnectorFactory.get_connector_class(ktc).requires_piecewise_for_cudagraph(
        ktc.kv_connector_extra_config
    )
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg, num_blocks=16)
    target = attach_target_graph_outputs(loaded, SIZES)
    # What the plugin publishes for a PIECEWISE target: no FULL sizes.
    target_buffers.publish(loaded.kv_cache.device, target, [])
    loaded.speculator.init_cudagraph_manager(CUDAGraphMode.PIECEWISE)
    loaded.speculator.capture()
    assert loaded.speculator.graphs.zero_copy_sizes == []
    with worker_connector(loaded) as connectors:
        for n in (5, 16):
            inputs = make_step_inputs(loaded, n, torch.Generator().manual_seed(n))
            hooks = [
                c.method
                for c in calls_of_step(connectors, loaded, inputs)
                if c.method in HOOKS
            ]
            assert hooks == [HOOKS[0], HOOKS[0], HOOKS[1], HOOKS[1]]
    assert paths(loaded) == {
        "zero_copy_replays": 0,
        "copy_in_replays": 2,
        "eager_steps": 0,
    }
