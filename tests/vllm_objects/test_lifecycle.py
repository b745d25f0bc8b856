"""Graph mode through the life of an MRv2 worker, on the emulated backend.

vLLM's own lifecycle functions run here: ``profile_cudagraph_memory`` (with
its ``_init_minimal_kv_cache_for_profiling`` and ``_teardown_profiling_state``)
and elastic EP's ``_release_cuda_graphs``, on a stand-in for the runner that
does, for the speculator, what ``GPUModelRunner`` does. What needs a CUDA
device is faked, and said so where it is (``without_cuda``).
"""

import gc
import os
import subprocess
import sys
import weakref
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor
from vllm.platforms import current_platform
from vllm.v1.worker.gpu.cudagraph_utils import (
    CudaGraphManager,
    ModelCudaGraphManager,
    profile_cudagraph_memory,
)
from vllm.v1.worker.gpu.input_batch import InputBuffers

from cg_extract import plugin, target_buffers
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from cg_extract.vllm_graphs import SpeculatorGraphs, decode_query_kwargs
from vllm_on_cpu.harness import (
    TargetGraphOutputs,
    _SlotMappingsOnly,
    build_vllm_config,
    emulated_graph_keys,
    kv_cache_config_of,
    load_speculator,
    make_step_inputs,
    propose_same_step,
    resolve_layout,
    single_process_parallel_state,
)

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
GRAPH_KEYS = emulated_graph_keys(SIZES)
NUM_BLOCKS = 16  # the real KV cache's; the profiler's minimal one is larger here


def load_ours(model_dir, num_blocks: int):
    """Our speculator with emulated graphs, loaded as the worker loads it."""
    return load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **GRAPH_KEYS),
        num_blocks=num_blocks,
    )


# FULL_DECODE_ONLY over SIZES with 2-token decodes: round_up(size, 2).
TARGET_FULL_SIZES = [2, 4, 8, 16, 24, 32, 48, 64]


class FakePool:
    """What ``graph_pool_handle()`` returns on a CUDA platform."""


def _target_capture_without_cuda(self, create_forward_fn, progress_bar_desc):
    """Fake of vLLM's ``CudaGraphManager.capture`` for the target: no CUDA
    graphs here, and no target model. It walks the FULL descriptors as the
    real one does (only ``_max_full_descs_to_capture`` of them while
    profiling) and allocates the persistent aux buffers as
    ``store_capture_output`` does, at the first, largest, one."""
    descs = self._capture_descs.get(CUDAGraphMode.FULL, [])
    if self._max_full_descs_to_capture is not None:
        descs = descs[: self._max_full_descs_to_capture]
    model_config = self.vllm_config.model_config
    spec = self.vllm_config.speculative_config.draft_model_config.hf_config
    for desc in descs:
        if not self.aux_hidden_states:
            self.aux_hidden_states = [
                torch.zeros(
                    desc.num_tokens,
                    model_config.get_hidden_size(),
                    dtype=model_config.dtype,
                )
                for _ in spec.eagle_aux_hidden_state_layer_ids
            ]
        self.graphs[desc] = None
    self._graphs_captured = True


@pytest.fixture
def without_cuda(monkeypatch):
    """Fakes, for CUDA only: the CPU-only torch raises on
    ``torch.accelerator.synchronize`` / ``empty_cache`` (nothing to wait for
    or free here), the CPU platform has no graph pools, and the target's
    capture is :func:`_target_capture_without_cuda`."""
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    platform = type(current_platform)
    monkeypatch.setattr(
        platform, "graph_pool_handle", lambda self: FakePool(), raising=False
    )
    monkeypatch.setattr(platform, "_global_graph_pool", None)
    monkeypatch.setattr(CudaGraphManager, "capture", _target_capture_without_cuda)
    plugin.register()  # the capture hook that publishes the target's buffers
    target_buffers.clear()
    yield
    target_buffers.clear()


def target_compilation(cfg, mode, max_num_seqs=None):
    """What ``resolve_cudagraph_mode_and_sizes`` leaves on a GPU for the
    target (the CPU platform turns graphs off)."""
    cc = cfg.compilation_config
    cc.cudagraph_mode = mode
    cc.cudagraph_capture_sizes = list(SIZES)
    cc.max_cudagraph_capture_size = max(SIZES)
    if max_num_seqs is not None:
        cfg.scheduler_config.max_num_seqs = max_num_seqs
    if hasattr(cfg, "_split_cudagraph_capture_sizes"):
        # vLLM 0.34's graph managers plan from the split sizes, which vLLM
        # derives from the list as it does for a GPU given the list.
        query_lens = cfg.get_decode_cudagraph_query_lens(cfg.uniform_decode_query_len)
        cfg._split_cudagraph_capture_sizes(True, query_lens)


class StandInWorker(SimpleNamespace):
    """The worker an elastic EP executor holds (by weak reference)."""


class StandInRunner:
    """What ``GPUModelRunner`` (vllm/v1/worker/gpu/model_runner.py) holds and
    does for the speculator, for vLLM's lifecycle functions to run on: its
    ``initialize_kv_cache`` lines that build the target's graph manager, call
    ``set_attn`` and ``init_cudagraph_manager`` and bind the KV cache, and
    its ``capture_model`` lines that capture the target, then the speculator.
    No target model (its graphs need CUDA); the block tables are a stand-in
    for ``BlockTables`` (pinned memory) holding its persistent slot rows."""

    def __init__(self, loaded, mode):
        spec = loaded.speculator
        self.loaded = loaded
        self.speculator = spec
        self.mode = mode
        self.vllm_config = loaded.vllm_config
        self.compilation_config = self.vllm_config.compilation_config
        self.cache_config = self.vllm_config.cache_config
        self.max_num_reqs = self.vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device("cpu")
        self.cudagraph_manager = None
        self.model = torch.nn.Module()
        self.model_state = SimpleNamespace(supports_mm_inputs=False)
        self.lora_config = None
        self.kv_caches = []
        self.attn_groups = []
        self.input_buffers = InputBuffers(
            spec.max_num_reqs, spec.max_num_tokens, self.device
        )
        self.captures = []  # weak references to what each capture made

    @property
    def layer(self):
        return self.compilation_config.static_forward_context[self.loaded.layer_name]

    def get_kv_cache_spec(self):
        return {self.loaded.layer_name: self.layer.get_kv_cache_spec(self.vllm_config)}

    def get_model(self):
        return self.model

    def needs_cudagraph_capture(self):  # vLLM 0.33's profiler asks
        return self.cudagraph_manager is not None and (
            self.cudagraph_manager.needs_capture()
        )

    def maybe_remove_all_loras(self, lora_config):
        assert lora_config is None

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
        self.kv_cache_config = kv_cache_config
        self.block_tables = _SlotMappingsOnly(
            torch.full(
                (len(kv_cache_config.kv_cache_groups), self.speculator.max_num_tokens),
                -1,
                dtype=torch.int64,
            )
        )
        self.cudagraph_manager = ModelCudaGraphManager(
            self.vllm_config,
            self.device,
            self.mode,
            **decode_query_kwargs(self.vllm_config),
        )
        self.speculator.set_attn(
            self.model_state,
            kv_cache_config,
            self.block_tables,
            self.input_buffers,
            self.attn_groups,
        )
        self.speculator.init_cudagraph_manager(self.mode)
        layer = self.layer
        layer.kv_cache = torch.zeros(
            kv_cache_config.num_blocks,
            layer.num_heads,
            self.cache_config.block_size,
            layer.head_size,
            dtype=layer.kv_cache_torch_dtype,
        )
        self.kv_caches = [layer.kv_cache]
        if not is_profiling:
            self.loaded.kv_cache = layer.kv_cache

    def capture_model(self, profile_only=False):
        # What the target's capture does to the runner's persistent inputs
        # (prepare_inputs_to_capture: get_dummy_slot_mappings, is_padding).
        self.block_tables.slot_mappings.fill_(-1)
        self.input_buffers.is_padding.fill_(True)
        self.cudagraph_manager.capture(
            self.model,
            self.model_state,
            self.input_buffers,
            None,
            self.block_tables,
            self.attn_groups,
            self.kv_cache_config,
            use_aux_hidden_state_outputs=True,
        )
        self.speculator.capture()
        spec, target = self.speculator, self.cudagraph_manager
        self.captures.append(
            {
                "speculator graphs (vLLM's CudaGraphManager)": spec.cudagraph_manager,
                "WriteGraphs": spec.graphs,
                "static hidden-state buffer": spec.graphs.hidden_states,
                "target graph manager": target,
                "target aux buffer": target.aux_hidden_states[0],
                "KV cache": self.layer.kv_cache,
            }
        )
        self.captures[-1] = {k: weakref.ref(v) for k, v in self.captures[-1].items()}
        return 0

    def real_kv_cache_config(self):
        """As the engine core sizes the KV cache (here: NUM_BLOCKS blocks)."""
        return kv_cache_config_of(
            self.vllm_config, self.get_kv_cache_spec(), NUM_BLOCKS
        )

    def target_outputs(self) -> TargetGraphOutputs:
        return TargetGraphOutputs(
            self.cudagraph_manager.aux_hidden_states,
            TARGET_FULL_SIZES,
            self.block_tables.slot_mappings,
            self.input_buffers,
        )


def same_cache(reference, ours):
    # Block 0 is the null block: graph padding writes stale rows there.
    return torch.equal(
        reference.kv_cache[1:].view(torch.uint8), ours.kv_cache[1:].view(torch.uint8)
    )


def run_steps(reference, ours, target, num_steps, seed):
    """Random steps on both: half as after a FULL replay of the target (one of
    its sizes, inputs in its buffers), half with fresh tensors (any size).
    Returns the paths our speculator took."""
    gen = torch.Generator().manual_seed(seed)
    before = Counter(ours.speculator.counts)
    expected = Counter()
    for step in range(num_steps):
        target_replayed = bool(torch.randint(0, 2, (), generator=gen))
        if target_replayed:
            sizes = TARGET_FULL_SIZES
            n = sizes[int(torch.randint(0, len(sizes), (), generator=gen))]
            expected["zero_copy"] += 1
        else:
            n = int(torch.randint(1, 100, (), generator=gen))
            expected["copy_in" if n <= max(SIZES) else "eager"] += 1
        step_seed = seed * 100_000 + step
        ref_in = make_step_inputs(
            reference, n, torch.Generator().manual_seed(step_seed)
        )
        our_in = make_step_inputs(
            ours,
            n,
            torch.Generator().manual_seed(step_seed),
            target=target if target_replayed else None,
        )
        assert torch.equal(
            reference.speculator.propose(**ref_in.kwargs),
            ours.speculator.propose(**our_in.kwargs),
        )
        assert same_cache(reference, ours), f"step {step}: n={n}, {target_replayed=}"
    taken = Counter(ours.speculator.counts)
    taken.subtract(before)
    assert +taken == expected
    assert min(expected.values()) > 50
    return expected


def test_profiling_teardown_real_init_steps_elastic_release_recapture_steps(
    model_dir, without_cuda, monkeypatch
):
    reference = load_speculator(
        upstream_speculator_class(), build_vllm_config(model_dir), num_blocks=NUM_BLOCKS
    )
    ours = load_ours(model_dir, num_blocks=NUM_BLOCKS)
    cfg, spec = ours.vllm_config, ours.speculator
    target_compilation(cfg, CUDAGraphMode.FULL_DECODE_ONLY)
    runner = StandInRunner(ours, CUDAGraphMode.FULL_DECODE_ONLY)
    resolve_layout(cfg, runner.get_kv_cache_spec())
    with set_current_vllm_config(cfg):
        # 1. Memory profiling (gpu_worker.determine_available_memory), vLLM's
        # own function: minimal KV cache, capture_model, teardown.
        profiling_captures = []
        original = SpeculatorGraphs.capture

        def spy(self, *args, **kwargs):
            graphs = original(self, *args, **kwargs)
            target = runner.cudagraph_manager.captured_token_counts()
            profiling_captures.append(
                (target, graphs.captured_sizes, graphs.zero_copy_sizes)
            )
            return graphs

        monkeypatch.setattr(SpeculatorGraphs, "capture", spy)
        assert profile_cudagraph_memory(runner) == 0  # nothing measurable here
        monkeypatch.setattr(SpeculatorGraphs, "capture", original)
        # The target captured only its two largest FULL graphs; ours were
        # captured, and so measured, in full, zero-copy at all planned sizes.
        assert profiling_captures == [([48, 64], SIZES, TARGET_FULL_SIZES)]
        (profiling,) = runner.captures
        gc.collect()
        alive = [name for name, ref in profiling.items() if ref() is not None]
        assert alive == [], f"still referenced after the profiler's teardown: {alive}"
        assert spec.cudagraph_manager is None and spec.graphs is None
        assert target_buffers.get("cpu") is None

        # 2. The real KV cache (gpu_worker.initialize_from_config) and capture
        # (compile_or_warm_up_model -> capture_model).
        runner.initialize_kv_cache(runner.real_kv_cache_config())
        assert ours.kv_cache.shape == reference.kv_cache.shape
        runner.capture_model()
        assert runner.cudagraph_manager.captured_token_counts() == TARGET_FULL_SIZES
        stats = spec.cudagraph_stats()
        assert stats["captured_sizes"] == SIZES
        assert stats["zero_copy_sizes"] == TARGET_FULL_SIZES
        run_steps(reference, ours, runner.target_outputs(), 1000, seed=1)

        # 3. Elastic EP scaling: vLLM's _release_cuda_graphs on its executor
        # over a stand-in worker, then warm_and_capture's capture_model.
        shell = spec.cudagraph_manager
        released = runner.captures[-1]
        worker = StandInWorker(model_runner=runner, vllm_config=cfg)
        ElasticEPScalingExecutor(worker)._release_cuda_graphs()
        gc.collect()
        assert spec.cudagraph_manager is shell and spec.graphs is None
        assert released["WriteGraphs"]() is None
        assert released["static hidden-state buffer"]() is None
        # Between release and recapture, steps run eagerly and stay correct.
        eager_before = spec.counts["eager"]
        for seed in range(3):
            n = 8 + seed
            ref_in = make_step_inputs(reference, n, torch.Generator().manual_seed(seed))
            our_in = make_step_inputs(ours, n, torch.Generator().manual_seed(seed))
            reference.speculator.propose(**ref_in.kwargs)
            spec.propose(**our_in.kwargs)
            assert same_cache(reference, ours)
        assert spec.counts["eager"] == eager_before + 3
        runner.capture_model()
        assert spec.cudagraph_stats()["zero_copy_sizes"] == TARGET_FULL_SIZES
        run_steps(reference, ours, runner.target_outputs(), 1000, seed=2)


class AllocationLog(TorchDispatchMode):
    """Every storage an op creates (factory ops, out-of-place results)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, int] = {}  # data_ptr -> nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    self.storages[storage.data_ptr()] = storage.nbytes()
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def test_init_allocates_nothing_and_capture_allocates_the_static_buffers(model_dir):
    """vLLM measures what ``capture_model`` allocates (and reserves it while
    profiling); ``init_cudagraph_manager`` runs in no measured window. With
    capture sizes up to max_num_batched_tokens the static buffers are large."""
    sizes = [1, 8, 512, 2048]
    loaded = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(
            model_dir,
            max_num_batched_tokens=2048,
            cudagraph=True,
            cudagraph_backend="emulated",
            cudagraph_capture_sizes=sizes,
        ),
    )
    spec = loaded.speculator
    with AllocationLog() as at_init:
        spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert isinstance(spec.cudagraph_manager, SpeculatorGraphs)
    assert at_init.storages == {}
    with set_current_vllm_config(loaded.vllm_config), AllocationLog() as at_capture:
        spec.capture()
    graphs = spec.graphs
    layers, hidden = 3, loaded.kv_cache.shape[-1]
    expected = 2048 * (layers * hidden * 4 + 8)  # fp32 states, int64 slots
    assert graphs.static_bytes == expected
    static = {b.untyped_storage().data_ptr() for b in graphs.copy_in.buffers.values()}
    assert len(static) == 2 and static <= set(at_capture.storages)
    assert at_capture.nbytes >= expected + graphs.graph_memory_bytes


def test_reinit_drops_the_graphs_of_the_earlier_kv_cache(model_dir):
    loaded = load_ours(model_dir, num_blocks=4)
    spec = loaded.speculator
    spec.init_cudagraph_manager(CUDAGraphMode.FULL)
    spec.capture()
    old_graphs, old_cache = weakref.ref(spec.graphs), weakref.ref(loaded.kv_cache)
    # A new KV cache, as the runner binds one after the profiler's.
    layer = loaded.vllm_config.compilation_config.static_forward_context[
        loaded.layer_name
    ]
    layer.kv_cache = loaded.kv_cache = torch.zeros_like(loaded.kv_cache)
    spec.init_cudagraph_manager(CUDAGraphMode.FULL)
    gc.collect()
    assert old_graphs() is None and old_cache() is None
    assert spec.graphs is None
    spec.capture()
    assert spec.cudagraph_stats()["captured_sizes"] == SIZES
    # Re-init without graphs drops them too.
    spec.init_cudagraph_manager(CUDAGraphMode.NONE)
    assert spec.cudagraph_manager is None and spec.graphs is None


def test_dropping_the_manager_frees_its_graphs_before_any_collection(model_dir):
    """vLLM's profiler drops our manager with ``setattr(speculator, name,
    None)`` (cudagraph_utils.py) and collects garbage only later, after its
    KV cache is gone: nothing of ours may wait for that collection. With the
    collector off, the graphs, their static buffers and the manager go at
    the ``setattr``."""
    loaded = load_ours(model_dir, num_blocks=4)
    spec = loaded.speculator
    spec.init_cudagraph_manager(CUDAGraphMode.FULL)
    spec.capture()
    graphs = spec.graphs
    held = {
        "manager": spec.cudagraph_manager,
        "WriteGraphs": graphs,
        "a copy-in graph": graphs.copy_in._graphs[SIZES[-1]],
        "static hidden-state buffer": graphs.hidden_states,
        "static slot buffer": graphs.slot_mapping,
    }
    refs = {name: weakref.ref(each) for name, each in held.items()}
    del graphs, held
    gc.collect()
    gc.disable()
    try:
        spec.cudagraph_manager = None  # what the profiler's setattr does
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert alive == [], f"kept alive until a collection: {alive}"


def test_a_second_capture_needs_a_release(model_dir):
    loaded = load_ours(model_dir, num_blocks=4)
    spec = loaded.speculator
    spec.init_cudagraph_manager(CUDAGraphMode.FULL)
    # vLLM's meaning of needs_capture(), which no 0.32/0.33 caller asks of a
    # speculator's manager yet: graphs are owed until captured, and again
    # after a release.
    assert spec.cudagraph_manager.needs_capture()
    spec.capture()
    assert not spec.cudagraph_manager.needs_capture()
    with pytest.raises(RuntimeError, match="already captured; release_graphs"):
        spec.capture()
    spec.cudagraph_manager.release_graphs()
    assert spec.cudagraph_manager.needs_capture()
    spec.capture()
    assert spec.cudagraph_stats()["captured_sizes"] == SIZES


@pytest.mark.parametrize(
    "mode, max_num_seqs, full_sizes",
    [
        # Uniform 2-token decodes: round_up(size, 2), the default mode.
        (CUDAGraphMode.FULL_AND_PIECEWISE, 128, [2, 4, 8, 16, 24, 32, 48, 64]),
        # ... bounded by max_num_seqs decodes of 2 tokens.
        (CUDAGraphMode.FULL_AND_PIECEWISE, 8, [2, 4, 8, 16]),
        (CUDAGraphMode.FULL_DECODE_ONLY, 12, [2, 4, 8, 16, 24]),
        # FULL for mixed batches too: every capture size.
        (CUDAGraphMode.FULL, 8, SIZES),
    ],
)
def test_zero_copy_sizes_are_the_targets_planned_full_sizes(
    model_dir, without_cuda, mode, max_num_seqs, full_sizes
):
    """vLLM's own planner (ModelCudaGraphManager) decides the target's FULL
    sizes; ours get exactly those, whatever our copy-in sizes."""
    loaded = load_ours(model_dir, num_blocks=4)
    cfg, spec = loaded.vllm_config, loaded.speculator
    target_compilation(cfg, mode, max_num_seqs)
    runner = StandInRunner(loaded, mode)
    resolve_layout(cfg, runner.get_kv_cache_spec())
    with set_current_vllm_config(cfg):
        runner.initialize_kv_cache(runner.real_kv_cache_config())
        target = runner.cudagraph_manager
        # What the plugin's hook does after the target's capture (tested with
        # the hook itself in tests/vllm_objects/test_plugin.py and in the lifecycle walk).
        target.aux_hidden_states = [
            torch.zeros(max(full_sizes), loaded.kv_cache.shape[-1]) for _ in range(3)
        ]
        target_buffers.publish("cpu", target, plugin.planned_full_sizes(target))
        spec.capture()
    stats = spec.cudagraph_stats()
    assert stats["zero_copy_sizes"] == full_sizes and stats["captured_sizes"] == SIZES


def test_info_lines_show_under_vllms_default_logging(model_dir):
    """A plain ``python -c``: vLLM configures only its ``vllm`` logger tree,
    so our INFO lines must sit under it to be printed."""
    code = f"""
from pathlib import Path
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from vllm_on_cpu.harness import build_vllm_config, emulated_graph_keys, load_speculator
model = Path({str(model_dir)!r})
keys = emulated_graph_keys([1, 2])
eager = load_speculator(ExtractHiddenStatesSpeculator, build_vllm_config(model, **keys))
eager.speculator.init_cudagraph_manager(CUDAGraphMode.NONE)
graphs = load_speculator(ExtractHiddenStatesSpeculator, build_vllm_config(model, **keys))
graphs.speculator.init_cudagraph_manager(CUDAGraphMode.FULL)
with set_current_vllm_config(graphs.vllm_config):
    graphs.speculator.capture()
"""
    root = Path(__file__).resolve().parents[2]
    # Ahead of the session's path (vLLM 0.34's: the Triton stand-in's).
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    printed = out.stdout + out.stderr
    assert (
        "INFO" in printed
        and "extract_hidden_states runs eagerly: the runner's cudagraph_mode is NONE"
        in printed
    ), printed
    # Two copy-in graphs, sizes 1 and 2; no target published buffers here.
    assert (
        "extract_hidden_states: captured 2 emulated graphs for 1-2 tokens "
        "(no zero-copy) in " in printed
    ), printed


# Micro-batching (DBO, ``ubatch_size`` > 1), per release, under Model Runner
# V2. vLLM 0.32 and 0.33 refuse it with speculative decoding when the config
# is built (without VLLM_USE_V2_MODEL_RUNNER=1 they run the V1 runner, which
# never builds our speculator); the plugin adds no check of its own. vLLM
# 0.34 allows it, and every ``DraftModelSpeculator``
# under ``use_ubatching`` rebuilds the step's metadata from the runner's block
# tables; ours does the same, eagerly, and says why.
A2A = {"all2all_backend": "deepep_low_latency"}  # vLLM's DBO check wants one
DP2 = {"data_parallel_size": 2}
VLLMS_SPEC = "vLLM: dual batch overlap with speculative decoding"
VLLMS_A2A = "vLLM: Microbatching currently only supports the deepep_low_latency"
VLLMS_HYBRID = "vLLM: dual batch overlap with hybrid models"


@pytest.mark.mrv2_process
@pytest.mark.parametrize(
    "model, engine_args, as_on_a_gpu, before_034, on_034",
    [
        # The CPU platform turns enable_dbo off when it builds the config.
        ("llama", {"enable_dbo": True, **DP2, **A2A}, {}, "whole", "whole"),
        # A GPU keeps it: set after the build, as a worker gets it there.
        # 0.32 and 0.33 refuse it at a GPU's build (as VLLMS_SPEC, below).
        ("llama", {**DP2, **A2A}, {"enable_dbo": True}, "unreachable", "rebuilds"),
        ("llama", A2A, {"enable_dbo": True}, "whole", "rebuilds"),
        ("llama", {"ubatch_size": 2, **DP2}, {}, VLLMS_SPEC, VLLMS_A2A),
        ("llama", {"ubatch_size": 2, **A2A}, {}, VLLMS_SPEC, "rebuilds"),
        ("llama", {"ubatch_size": 2, **DP2, **A2A}, {}, VLLMS_SPEC, "rebuilds"),
        ("llama", {"ubatch_size": 1, **DP2, **A2A}, {}, "whole", "whole"),
        ("qwen3_next", {"ubatch_size": 2, **A2A}, {}, VLLMS_SPEC, VLLMS_HYBRID),
    ],
    ids=[
        "dbo-dp2-cpu",
        "dbo-dp2",
        "dbo-dp1",
        "ubatch2-default-all2all",
        "ubatch2-dp1",
        "ubatch2-dp2",
        "ubatch1-dp2",
        "ubatch2-hybrid",
    ],
)
def test_micro_batching_per_release(
    model_dir,
    tmp_path,
    monkeypatch,
    model,
    engine_args,
    as_on_a_gpu,
    before_034,
    on_034,
):
    """Which configs vLLM refuses (its message unchanged), which run whole
    batches, and which reach the rebuild path (0.34): graphs off, the
    reason logged."""
    from cg_extract import vllm_graphs
    from tests.model_families import family_engine_args, write_family_dir
    from tests.torch_alone.test_cache_size import assert_reads_like_vllms
    from vllm_on_cpu.harness import vllm_release

    expected = on_034 if vllm_release() == "0.34.0" else before_034
    if expected == "unreachable":
        pytest.skip("vLLM refuses it when a GPU builds the config")
    # This process's world of one, set up before a config with DP (vLLM would
    # otherwise wait for the other rank), whether or not a test ran before.
    with set_current_vllm_config(build_vllm_config(model_dir)):
        single_process_parallel_state()
    if model != "llama":
        model_dir = write_family_dir(tmp_path, model)
        engine_args = {**family_engine_args(model), **engine_args}
    if expected.startswith("vLLM: "):
        with pytest.raises(ValueError) as refused:
            build_vllm_config(model_dir, engine_args=engine_args, **GRAPH_KEYS)
        assert expected.removeprefix("vLLM: ") in str(refused.value)
        assert "cg_extract" not in str(refused.value)
        return
    cfg = build_vllm_config(model_dir, engine_args=engine_args, **GRAPH_KEYS)
    assert getattr(cfg, "use_v2_model_runner", True)  # 0.34 has MRv2 alone
    for name, value in as_on_a_gpu.items():
        setattr(cfg.parallel_config, name, value)
    logged = []
    monkeypatch.setattr(
        vllm_graphs, "info_once", lambda _, msg, *a: logged.append(msg % a)
    )
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg)
    spec = loaded.speculator
    rebuilds = expected == "rebuilds"
    assert spec._rebuilds_metadata is rebuilds
    with set_current_vllm_config(loaded.vllm_config):
        spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert (spec.cudagraph_manager is None) is rebuilds
    eager = [line for line in logged if "micro-batching" in line]
    assert len(eager) == rebuilds, logged
    for line in eager:
        assert line.startswith("extract_hidden_states runs eagerly: micro-batching (")
        assert_reads_like_vllms("INFO", line)


def test_a_micro_batched_step_writes_vllms_bytes(model_dir, monkeypatch):
    """vLLM 0.34, micro-batching with data parallelism: the runner hands
    ``propose`` no metadata and no slot mappings (``execute_model`` under
    ``ubatch_state``), and our speculator rebuilds them from the runner's
    block tables as vLLM's does (``_build_drafter_attn_metadata``), writing
    its bytes, eagerly with graphs asked for."""
    import numpy as np
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffers
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_states import init_model_state

    from vllm_on_cpu.harness import vllm_release

    if vllm_release() != "0.34.0":
        pytest.skip("0.32, 0.33 refuse micro-batching with extraction (test above)")
    # What vLLM's CPU worker sets at import (vllm/v1/worker/cpu/shm.py).
    monkeypatch.setattr(buffer_utils, "UvaBuffer", cpu_buffers.UvaBuffer)
    with set_current_vllm_config(build_vllm_config(model_dir)):
        single_process_parallel_state()
    cfg = build_vllm_config(
        model_dir, engine_args={"ubatch_size": 2, **DP2, **A2A}, **GRAPH_KEYS
    )
    num_blocks, query_lens, context_lens = 32, [5, 1, 7, 3], [20, 3, 0, 40]
    gen = torch.Generator().manual_seed(0)
    first_blocks = 1 + torch.randperm(num_blocks - 1, generator=gen)
    # Each request's blocks, as the scheduler gave them (none is block 0).
    blocks, start = [], 0
    for length in np.add(query_lens, context_lens):
        count = -(-int(length) // cfg.cache_config.block_size)
        blocks.append(first_blocks[start : start + count].tolist())
        start += count
    num_tokens = sum(query_lens)
    aux = [torch.randn(num_tokens, 256, generator=gen) for _ in range(3)]
    last_sampled = torch.randint(0, 1000, (128, 1), generator=gen)

    def micro_batched_step(cls):
        """Load ``cls``, ``set_attn`` as the runner's ``initialize_kv_cache``
        does, the step's block tables and slots as its ``prepare_attn``
        computes them, then ``propose`` as under ``ubatch_state``."""
        loaded = load_speculator(cls, cfg, num_blocks=num_blocks)
        spec, vllm_config = loaded.speculator, loaded.vllm_config
        layer = vllm_config.compilation_config.static_forward_context[loaded.layer_name]
        specs = {loaded.layer_name: layer.get_kv_cache_spec(vllm_config)}
        block_size = vllm_config.cache_config.block_size
        max_blocks = -(-vllm_config.model_config.max_model_len // block_size)
        with set_current_vllm_config(vllm_config):
            block_tables = BlockTables(
                [block_size],
                spec.max_num_reqs,
                spec.max_num_tokens,
                [max_blocks],
                spec.device,
            )
            buffers = InputBuffers(spec.max_num_reqs, spec.max_num_tokens, spec.device)
            spec.set_attn(
                init_model_state(vllm_config, torch.nn.Module(), None, spec.device),
                kv_cache_config_of(vllm_config, specs, num_blocks),
                block_tables,
                buffers,
                [],
            )
            spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
            spec.capture()
        batch = InputBatch.make_dummy(
            len(query_lens), num_tokens, buffers, is_padding=False
        )
        starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        batch.query_start_loc_np[:] = starts
        batch.query_start_loc.copy_(torch.from_numpy(starts))
        batch.positions.copy_(
            torch.cat(
                [
                    torch.arange(c, c + q)
                    for c, q in zip(context_lens, query_lens, strict=True)
                ]
            )
        )
        for req, ids in enumerate(blocks):
            block_tables.append_block_ids(req, (ids,), overwrite=True)
        block_tables.apply_staged_writes()
        block_tables.gather_block_tables(
            batch.idx_mapping, batch.num_reqs_after_padding
        )
        slots = block_tables.compute_slot_mappings(
            batch.idx_mapping, batch.query_start_loc, batch.positions, num_tokens
        )[0].clone()
        draft = spec.propose(
            input_batch=batch,
            attn_metadata=None,
            slot_mappings=None,
            last_hidden_states=torch.empty(0),
            aux_hidden_states=aux,
            num_sampled=torch.ones(len(query_lens), dtype=torch.int32),
            num_rejected=torch.zeros(len(query_lens), dtype=torch.int32),
            last_sampled=last_sampled,
            next_prefill_tokens=torch.zeros(1, spec.max_num_reqs),
            temperature=torch.zeros(spec.max_num_reqs),
            seeds=torch.zeros(spec.max_num_reqs, dtype=torch.int64),
        )
        return loaded, draft, slots

    theirs, their_draft, slots = micro_batched_step(upstream_speculator_class())
    ours, our_draft, our_slots = micro_batched_step(ExtractHiddenStatesSpeculator)
    assert torch.equal(our_draft, their_draft) and torch.equal(our_slots, slots)
    assert torch.equal(ours.kv_cache, theirs.kv_cache)
    # Each token's states sit in its own request's block, at its position.
    block_size = theirs.block_size
    wanted = torch.tensor(
        [
            ids[pos // block_size] * block_size + pos % block_size
            for ids, c, q in zip(blocks, context_lens, query_lens, strict=True)
            for pos in range(c, c + q)
        ]
    )
    assert torch.equal(slots, wanted)
    stored = ours.kv_cache[wanted // block_size, :, wanted % block_size]
    assert torch.equal(stored, torch.stack(aux, dim=1))
    assert ours.speculator.cudagraph_manager is None
    assert ours.speculator.counts == {"zero_copy": 0, "copy_in": 0, "eager": 1}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_through_vllms_capture_path(model_dir):
    """On a GPU: capture inside ``graph_capture``, each graph inside
    ``capture_pool`` on vLLM's stream, into the global pool; replays write
    upstream's bytes; release and recapture work; dropping the manager, as the
    profiler does, frees the static buffers."""
    keys = dict(cudagraph=True, cudagraph_backend="cuda", cudagraph_capture_sizes=SIZES)
    reference = load_speculator(
        upstream_speculator_class(),
        build_vllm_config(model_dir),
        device="cuda",
        num_blocks=NUM_BLOCKS,
    )
    ours = load_speculator(
        ExtractHiddenStatesSpeculator,
        build_vllm_config(model_dir, **keys),
        device="cuda",
        num_blocks=NUM_BLOCKS,
    )
    spec = ours.speculator

    def steps(seed):
        gen = torch.Generator().manual_seed(seed)
        for step in range(300):
            n = int(torch.randint(1, 100, (), generator=gen))
            (ref, _), (got, _) = propose_same_step([reference, ours], n, seed + step)
            assert torch.equal(ref, got)
            assert same_cache(reference, ours), f"step {step}, {n} tokens"

    with set_current_vllm_config(ours.vllm_config):
        spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
        spec.capture()
        assert spec.cudagraph_manager.pool is current_platform.get_global_graph_pool()
        assert spec.graphs.static_bytes > 0
        steps(0)
        replays = spec.cudagraph_stats()["copy_in_replays"]
        assert replays > 100
        spec.cudagraph_manager.release_graphs()
        spec.capture()
        steps(1000)
        assert spec.cudagraph_stats()["copy_in_replays"] > 2 * replays - 50
        static = weakref.ref(spec.graphs.hidden_states)
        spec.cudagraph_manager = None  # profile_cudagraph_memory's teardown
        gc.collect()
        assert static() is None
