"""The runner's CUDA graph mode, as vLLM itself resolves it with our speculator.

Nothing here hands a mode to the speculator: each case loads a real target
(vLLM's Llama, dummy weights) and a real speculator under one config, takes
the KV-cache specs from their layers, resolves the KV cache layout and builds
the KV-cache config as the engine core does, and builds the attention groups
with MRv2's ``init_attn_backend``. The mode is then vLLM's own
``get_attn_cg_support`` and ``resolve_cudagraph_mode_and_sizes`` over those
groups, with the compilation config a GPU gets (``VLLM_COMPILE``, splitting
ops from vLLM's ``set_splitting_ops_for_v1``).

The one stand-in: CUDA attention backends cannot exist on a CPU, so the
target's layers get a subclass of their CPU backend whose builder reports the
support level of FlashAttention (``UNIFORM_BATCH``) or of a backend with
``ALWAYS`` (FlashInfer's level with its TRT-LLM kernels, Triton attention);
everything else about them is the CPU backend's.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport

from cg_extract.cache_backend import ExtractCacheMetadataBuilder
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from perf.harness import (
    LoadedSpeculator,
    _cpu_safe_model_loading,
    build_vllm_config,
    emulated_graph_keys,
    make_step_inputs,
    single_process_parallel_state,
)

CPU = torch.device("cpu")
SIZES = [1, 2, 4, 8, 16]
REQUESTED = [
    CUDAGraphMode.FULL_AND_PIECEWISE,
    CUDAGraphMode.FULL_DECODE_ONLY,
    CUDAGraphMode.FULL,
    CUDAGraphMode.PIECEWISE,
]
TARGET_SUPPORT = {
    "flash_attn": AttentionCGSupport.UNIFORM_BATCH,
    "always": AttentionCGSupport.ALWAYS,
}


def with_cg_support(backend: type, support: AttentionCGSupport) -> type:
    """``backend`` whose builder reports ``support``: the stand-in for a CUDA
    attention backend."""
    builder = type(
        f"{support.name}Builder",
        (backend.get_builder_cls(),),
        {"_cudagraph_support": support},
    )
    return type(
        f"{support.name}{backend.__name__}",
        (backend,),
        {"get_builder_cls": staticmethod(lambda: builder)},
    )


class Runner:
    """What MRv2's ``initialize_kv_cache`` has when it resolves the mode: the
    attention groups of the target and the draft, built by vLLM."""

    def __init__(self, speculator_cls: type, model_dir, support: AttentionCGSupport):
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backends,
        )
        from vllm.model_executor.model_loader import get_model
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            record_kv_cache_layout,
            resolve_kv_cache_layout,
        )
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend

        cfg = build_vllm_config(model_dir, **emulated_graph_keys(SIZES))
        self.vllm_config = cfg
        with set_current_vllm_config(cfg), _cpu_safe_model_loading(CPU):
            single_process_parallel_state()
            target = get_model(vllm_config=cfg)
            self.speculator = speculator_cls(cfg, CPU)
            self.speculator.load_model(target)
            forward_context = cfg.compilation_config.static_forward_context
            self.target_layers = set(forward_context) - set(
                self.speculator.draft_attn_layer_names
            )
            for name in self.target_layers:
                layer = forward_context[name]
                layer.attn_backend = with_cg_support(layer.attn_backend, support)
            # The engine core's part: one layout for every backend, then the
            # KV-cache config from the layers' specs.
            specs = get_kv_cache_spec(cfg)
            layouts = get_supported_kv_cache_layouts(get_current_attn_backends(cfg))
            layout = resolve_kv_cache_layout(
                cfg, [[x.name for x in layouts]], list(specs.values())
            )
            record_kv_cache_layout(cfg.cache_config, layout.name)
            (self.kv_cache_config,) = get_kv_cache_configs(cfg, [specs], [2**26])
            self.attn_groups, self.cg_support, _ = init_attn_backend(
                self.kv_cache_config,
                cfg,
                CPU,
                draft_layer_names=self.speculator.draft_attn_layer_names,
            )
        self.forward_context = forward_context

    def draft_builder(self):
        (group,) = [
            g
            for groups in self.attn_groups
            for g in groups
            if set(g.layer_names) == self.speculator.draft_attn_layer_names
        ]
        return group.get_metadata_builder(0)

    def target_alone(self):
        """vLLM's weakest support over the target's layers only: what the
        runner would see without a draft layer."""
        from vllm.v1.worker.gpu.attn_utils import get_attn_cg_support

        return get_attn_cg_support(
            self.attn_groups, self.vllm_config, checked_layer_names=self.target_layers
        )

    def resolve(self, requested: CUDAGraphMode, cg_support) -> CUDAGraphMode | str:
        """``resolve_cudagraph_mode_and_sizes`` as ``initialize_kv_cache`` calls
        it, on the compilation config a GPU has for ``requested``; a refusal
        is returned as its message."""
        compilation = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=requested
        )
        compilation.set_splitting_ops_for_v1(
            all2all_backend=self.vllm_config.parallel_config.all2all_backend
        )
        try:
            return compilation.resolve_cudagraph_mode_and_sizes(
                cg_support.min_cg_support,
                cg_support.min_cg_attn_backend,
                self.vllm_config.uniform_decode_query_len,
                use_v2_model_runner=True,
                kv_cache_config=self.kv_cache_config,
                max_num_reqs=self.vllm_config.scheduler_config.max_num_seqs,
                piecewise_capture_available=True,
            )
        except ValueError as e:
            return f"refused: {e}"


@pytest.fixture(scope="module")
def runners(model_dir):
    return {
        (name, kind): Runner(cls, model_dir, support)
        for name, support in TARGET_SUPPORT.items()
        for kind, cls in (
            ("ours", ExtractHiddenStatesSpeculator),
            ("vllm", upstream_speculator_class()),
        )
    }


@pytest.mark.parametrize("target", TARGET_SUPPORT)
def test_our_draft_layer_resolves_as_the_target_alone(runners, target):
    ours, theirs = runners[target, "ours"], runners[target, "vllm"]
    assert type(ours.draft_builder()) is ExtractCacheMetadataBuilder
    assert type(theirs.draft_builder()) is CacheOnlyAttentionMetadataBuilder
    assert ours.cg_support == ours.target_alone()
    assert ours.cg_support.min_cg_support is TARGET_SUPPORT[target]
    assert theirs.cg_support.min_cg_support is AttentionCGSupport.NEVER

    rows = []
    for requested in REQUESTED:
        alone = ours.resolve(requested, ours.target_alone())
        got = ours.resolve(requested, ours.cg_support)
        upstream = theirs.resolve(requested, theirs.cg_support)
        rows.append((requested, alone, got, upstream))
        assert got == alone, requested
        # vLLM's own speculator keeps no FULL graph in any requested mode.
        assert isinstance(upstream, str) or not upstream.has_full_cudagraphs()
    print(f"\n{target} target: requested, target alone, ours, vLLM's speculator")
    for row in rows:
        print("  " + " | ".join(getattr(x, "name", str(x)) for x in row))
    resolved = {requested: got for requested, _, got, _ in rows}
    # The FULL decode graphs survive, which is the point.
    assert resolved[CUDAGraphMode.FULL_AND_PIECEWISE] == (
        CUDAGraphMode.FULL_AND_PIECEWISE
    )
    assert resolved[CUDAGraphMode.FULL_DECODE_ONLY] == CUDAGraphMode.FULL_DECODE_ONLY
    assert resolved[CUDAGraphMode.PIECEWISE] == CUDAGraphMode.PIECEWISE
    if TARGET_SUPPORT[target] is AttentionCGSupport.ALWAYS:
        assert resolved[CUDAGraphMode.FULL] == CUDAGraphMode.FULL


def test_vllms_own_speculator_degrades_the_mode(runners):
    """The defect this fixes, shown on vLLM's class: FULL_AND_PIECEWISE falls
    to PIECEWISE and FULL is refused."""
    theirs = runners["flash_attn", "vllm"]
    assert (
        theirs.resolve(CUDAGraphMode.FULL_AND_PIECEWISE, theirs.cg_support)
        == CUDAGraphMode.PIECEWISE
    )
    refused = theirs.resolve(CUDAGraphMode.FULL, theirs.cg_support)
    assert isinstance(refused, str) and "CacheOnlyAttentionBackend" in refused


@pytest.mark.parametrize("target", TARGET_SUPPORT)
@pytest.mark.parametrize("requested", REQUESTED)
def test_we_capture_under_the_resolved_mode(runners, target, requested):
    """The mode vLLM resolved goes to ``init_cudagraph_manager``, as the runner
    hands it; the copy-in graphs capture under each (the zero-copy ones need
    the target's FULL graphs, which a CPU cannot capture) and replay."""
    runner = runners[target, "ours"]
    mode = runner.resolve(requested, runner.cg_support)
    assert isinstance(mode, CUDAGraphMode) and mode != CUDAGraphMode.NONE
    spec = runner.speculator
    layer = runner.forward_context[spec.layer_name]
    cfg = runner.vllm_config
    layer.kv_cache = torch.zeros(
        16,
        layer.num_heads,
        cfg.cache_config.block_size,
        layer.head_size,
        dtype=layer.kv_cache_torch_dtype,
    )
    with set_current_vllm_config(cfg):
        spec.init_cudagraph_manager(mode)
        spec.capture()
        assert spec.cudagraph_stats()["captured_sizes"] == SIZES
        loaded = LoadedSpeculator(spec, cfg, layer.kv_cache, spec.layer_name)
        before = spec.cudagraph_stats()["copy_in_replays"]
        spec.propose(**make_step_inputs(loaded, 3, torch.Generator()).kwargs)
        assert spec.cudagraph_stats()["copy_in_replays"] == before + 1


def test_the_layer_backend_is_ours_only(runners):
    """vLLM's shared classes are untouched: a fresh cache-only layer (MRv1's
    proposer builds the same model) still gets vLLM's backend."""
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionBackend,
        CacheOnlyAttentionLayer,
    )

    assert CacheOnlyAttentionBackend.get_builder_cls() is (
        CacheOnlyAttentionMetadataBuilder
    )
    cfg = copy.deepcopy(runners["flash_attn", "vllm"].vllm_config)
    cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(cfg):
        layer = CacheOnlyAttentionLayer(2, 64, prefix="fresh")
    assert layer.get_attn_backend() is CacheOnlyAttentionBackend


def test_a_backend_chosen_by_someone_else_is_kept_and_named(runners, cg_extract_log):
    """Should a newer vLLM or another plugin give the layer its own backend,
    we keep it (and whatever support it reports) and say so."""
    from cg_extract.cache_backend import ExtractCacheBackend, report_graph_support

    runner = runners["flash_attn", "ours"]
    layer = runner.forward_context[runner.speculator.layer_name]
    assert layer.attn_backend is ExtractCacheBackend
    other = with_cg_support(ExtractCacheBackend, AttentionCGSupport.NEVER)
    layer.attn_backend = other
    try:
        report_graph_support(layer)
        assert layer.attn_backend is other
    finally:
        layer.attn_backend = ExtractCacheBackend
    assert any(other.__name__ in m and "may lower" in m for m in cg_extract_log)


def test_a_layer_of_another_class_is_refused(runners):
    """Only vLLM's cache-only layer gets our backend: a target attention
    layer handed in by mistake is refused, its backend untouched."""
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionLayer,
    )

    from cg_extract.cache_backend import report_graph_support

    runner = runners["flash_attn", "ours"]
    (name, layer) = next(
        (name, layer)
        for name, layer in runner.forward_context.items()
        if name != runner.speculator.layer_name
    )
    assert not isinstance(layer, CacheOnlyAttentionLayer)
    backend = layer.attn_backend
    with pytest.raises(TypeError, match=f"got {type(layer).__name__}"):
        report_graph_support(layer)
    assert layer.attn_backend is backend, name
