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
everything else about them is the CPU backend's. Besides the tiny Llama, the
hybrid and MLA families (:mod:`tests.model_families`) resolve through their own
groups (mamba groups, attention blocks sized to the mamba page, MLA), each
layer's stand-in reporting what the CUDA backend it gets in vLLM 0.33 reports.
"""

from __future__ import annotations

import copy
import inspect

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    extract_from_kv_cache,
)
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport

from cg_extract.cache_backend import ExtractCacheMetadataBuilder
from cg_extract.plugin import upstream_speculator_class
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from tests.model_families import family_config, family_engine_args, write_family_dir
from vllm_on_cpu.harness import (
    LoadedSpeculator,
    _cpu_safe_model_loading,
    build_vllm_config,
    emulated_graph_keys,
    get_kv_cache_configs,
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
# Per family and GPU: each target layer's KV-cache spec -> the support level
# the metadata builder of the CUDA backend that layer gets reports in vLLM
# 0.33 (files under vllm/ of the 0.33.0 wheel).
FAMILY_TARGETS = {
    # Hopper. Gated delta net layers: GDNAttentionMetadataBuilder,
    # v1/attention/backends/gdn_attn.py:136, UNIFORM_BATCH. Gated attention:
    # FlashAttention 3, v1/attention/backends/flash_attn.py:619, ALWAYS.
    "qwen3_next": (
        "qwen3_next",
        {
            "MambaSpec": AttentionCGSupport.UNIFORM_BATCH,
            "FullAttentionSpec": AttentionCGSupport.ALWAYS,
        },
    ),
    # Hopper: FLASH_ATTN_MLA leads the SM90 MLA list (platforms/cuda.py:150);
    # FlashAttnMLAMetadataBuilder, v1/attention/backends/mla/flashattn_mla.py
    # :127, UNIFORM_BATCH.
    "deepseek_v2_sm90": (
        "deepseek_v2",
        {"MLAAttentionSpec": AttentionCGSupport.UNIFORM_BATCH},
    ),
    # Blackwell: FLASHINFER_MLA leads the SM100 list (platforms/cuda.py:123);
    # FlashInferMLAMetadataBuilder, v1/attention/backends/mla/flashinfer_mla.py
    # :140, ALWAYS.
    "deepseek_v2_sm100": (
        "deepseek_v2",
        {"MLAAttentionSpec": AttentionCGSupport.ALWAYS},
    ),
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


def with_expert_parallel_group(cfg) -> None:
    """A world of one (``single_process_parallel_state``) with the expert
    parallel group a MoE model's layers ask for: vLLM makes that group only
    when the config it initialises under is a MoE one, and the Llama's came
    first."""
    from vllm.distributed import parallel_state

    single_process_parallel_state()
    if cfg.model_config.is_moe and parallel_state._EP is None:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)


class Runner:
    """What MRv2's ``initialize_kv_cache`` has when it resolves the mode: the
    attention groups of the target and the draft, built by vLLM."""

    def __init__(
        self,
        speculator_cls: type,
        model_dir,
        support: AttentionCGSupport | dict[str, AttentionCGSupport],
        dtype: str = "float32",
        engine_args: dict | None = None,
    ):
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backends,
        )
        from vllm.model_executor.layers.attention_layer_base import (
            AttentionLayerBase,
        )
        from vllm.model_executor.model_loader import get_model
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            record_kv_cache_layout,
            resolve_kv_cache_layout,
        )
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend

        cfg = build_vllm_config(
            model_dir,
            dtype=dtype,
            engine_args=engine_args,
            **emulated_graph_keys(SIZES),
        )
        self.vllm_config = cfg
        with set_current_vllm_config(cfg), _cpu_safe_model_loading(CPU):
            with_expert_parallel_group(cfg)
            target = get_model(vllm_config=cfg)
            self.speculator = speculator_cls(cfg, CPU)
            self.speculator.load_model(target)
            # The engine core's block size for these backends (vLLM 0.33
            # sets it here only; 0.32's CPU platform already had).
            current_platform.update_block_size_for_backend(cfg)
            forward_context = cfg.compilation_config.static_forward_context
            # The layers with a KV cache (MoE layers are in the context too).
            attn_layers = get_layers_from_vllm_config(cfg, AttentionLayerBase)
            self.target_layers = set(attn_layers) - set(
                self.speculator.draft_attn_layer_names
            )
            for name in self.target_layers:
                layer = attn_layers[name]
                if isinstance(support, dict):  # by the layer's kind
                    level = support[type(layer.get_kv_cache_spec(cfg)).__name__]
                else:
                    level = support
                stand_in = with_cg_support(layer.get_attn_backend(), level)
                if hasattr(layer, "attn_backend"):
                    layer.attn_backend = stand_in
                else:  # mamba layers name their backend by their type
                    layer.get_attn_backend = lambda stand_in=stand_in: stand_in
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
        resolve = compilation.resolve_cudagraph_mode_and_sizes
        # vLLM 0.32, 0.33 resolve for either runner; 0.34 has MRv2 alone.
        mrv2 = {"use_v2_model_runner": True}
        if "use_v2_model_runner" not in inspect.signature(resolve).parameters:
            mrv2 = {}
        try:
            return resolve(
                cg_support.min_cg_support,
                cg_support.min_cg_attn_backend,
                self.vllm_config.uniform_decode_query_len,
                **mrv2,
                kv_cache_config=self.kv_cache_config,
                max_num_reqs=self.vllm_config.scheduler_config.max_num_seqs,
                piecewise_capture_available=True,
            )
        except ValueError as e:
            return f"refused: {e}"


# The KV-cache groups get_kv_cache_configs makes here of each family's tiny
# config, the draft layer's included: three mamba groups, the attention
# group sized to their page and the hidden-state group beside them; MLA with
# the draft layer in one group (both are MLA-type specs).
FAMILY_GROUPS = {
    "qwen3_next": ["MambaSpec"] * 3 + ["FullAttentionSpec", "HiddenStateCacheSpec"],
    "deepseek_v2": ["UniformTypeKVCacheSpecs"],
}

SPECULATORS = (
    ("ours", ExtractHiddenStatesSpeculator),
    ("vllm", upstream_speculator_class()),
)


@pytest.fixture(scope="module")
def runners(model_dir, tmp_path_factory):
    built = {
        (name, kind): Runner(cls, model_dir, support)
        for name, support in TARGET_SUPPORT.items()
        for kind, cls in SPECULATORS
    }
    for name, (family, support) in FAMILY_TARGETS.items():
        family_dir = write_family_dir(tmp_path_factory.mktemp(name), family)
        dtype = family_config(family)["torch_dtype"]
        # The family's pinned kernels (DeepSeek-V2: the reference CPU_MLA,
        # which loads float32 weights on every CPU; AMX_MLA would not).
        pinned = family_engine_args(family)
        for kind, cls in SPECULATORS:
            built[name, kind] = Runner(cls, family_dir, support, dtype, pinned)
    return built


def weakest(support) -> AttentionCGSupport:
    levels = support.values() if isinstance(support, dict) else [support]
    return min(levels, key=lambda level: level.value)


def mode_table(ours: Runner, theirs: Runner) -> dict:
    """requested -> (target alone, vLLM's speculator, ours), each resolved by
    vLLM over that runner's groups (a refusal as its message)."""
    return {
        requested: (
            ours.resolve(requested, ours.target_alone()),
            theirs.resolve(requested, theirs.cg_support),
            ours.resolve(requested, ours.cg_support),
        )
        for requested in REQUESTED
    }


def print_table(title: str, table: dict) -> None:
    print(f"\n{title}: requested | target alone | vLLM's speculator | ours")
    for requested, row in table.items():
        cells = (requested, *row)
        print("  " + " | ".join(getattr(x, "name", str(x)) for x in cells))


TARGETS = {
    **TARGET_SUPPORT,
    **{name: support for name, (_, support) in FAMILY_TARGETS.items()},
}


@pytest.mark.parametrize("target", TARGETS)
def test_our_draft_layer_resolves_as_the_target_alone(runners, target):
    ours, theirs = runners[target, "ours"], runners[target, "vllm"]
    assert type(ours.draft_builder()) is ExtractCacheMetadataBuilder
    assert type(theirs.draft_builder()) is CacheOnlyAttentionMetadataBuilder
    assert ours.cg_support == ours.target_alone()
    assert ours.cg_support.min_cg_support is weakest(TARGETS[target])
    assert theirs.cg_support.min_cg_support is AttentionCGSupport.NEVER

    table = mode_table(ours, theirs)
    print_table(f"{target} target", table)
    for requested, (alone, upstream, got) in table.items():
        assert got == alone, requested
        # vLLM's own speculator keeps no FULL graph in any requested mode.
        assert isinstance(upstream, str) or not upstream.has_full_cudagraphs()
    resolved = {requested: got for requested, (_, _, got) in table.items()}
    # The FULL decode graphs survive, which is the point.
    assert resolved[CUDAGraphMode.FULL_AND_PIECEWISE] == (
        CUDAGraphMode.FULL_AND_PIECEWISE
    )
    assert resolved[CUDAGraphMode.FULL_DECODE_ONLY] == CUDAGraphMode.FULL_DECODE_ONLY
    assert resolved[CUDAGraphMode.PIECEWISE] == CUDAGraphMode.PIECEWISE
    if weakest(TARGETS[target]) is AttentionCGSupport.ALWAYS:
        assert resolved[CUDAGraphMode.FULL] == CUDAGraphMode.FULL


@pytest.mark.parametrize("target", FAMILY_TARGETS)
def test_each_family_resolves_from_its_own_groups(runners, target):
    """vLLM built the family's own KV-cache groups and attention groups, and
    each target layer's builder reports its stand-in's level."""
    family, support = FAMILY_TARGETS[target]
    runner = runners[target, "ours"]
    specs = [
        type(g.kv_cache_spec).__name__ for g in runner.kv_cache_config.kv_cache_groups
    ]
    print(f"\n{target}: KV-cache groups {specs}")
    assert specs == FAMILY_GROUPS[family]
    seen = set()
    for groups in runner.attn_groups:
        for group in groups:
            layers = set(group.layer_names)
            if layers == runner.speculator.draft_attn_layer_names:
                continue
            assert layers <= runner.target_layers
            kinds = {
                type(runner.forward_context[n].get_kv_cache_spec(runner.vllm_config))
                for n in layers
            }
            (kind,) = {k.__name__ for k in kinds}
            builder = group.get_metadata_builder(0)
            level = builder.get_cudagraph_support(
                runner.vllm_config, group.kv_cache_spec
            )
            assert level is support[kind], (target, kind)
            seen.add(kind)
    assert seen == set(support)


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


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("requested", REQUESTED)
def test_we_capture_under_the_resolved_mode(runners, target, requested):
    """The mode vLLM resolved goes to ``init_cudagraph_manager``, as the runner
    hands it; the copy-in graphs capture under each (the zero-copy ones need
    the target's FULL graphs, which a CPU cannot capture) and a replay writes
    the step's hidden states where the connector reads them, and nothing
    else, into a cache shaped as vLLM shapes the draft's group."""
    runner = runners[target, "ours"]
    mode = runner.resolve(requested, runner.cg_support)
    assert isinstance(mode, CUDAGraphMode) and mode != CUDAGraphMode.NONE
    spec = runner.speculator
    layer = runner.forward_context[spec.layer_name]
    cfg = runner.vllm_config
    layer.kv_cache = torch.zeros(
        16,
        layer.num_heads,
        draft_block_size(runner),
        layer.head_size,
        dtype=layer.kv_cache_torch_dtype,
    )
    with set_current_vllm_config(cfg):
        spec.init_cudagraph_manager(mode)
        spec.capture()
        assert spec.cudagraph_stats()["captured_sizes"] == SIZES
        layer.kv_cache.zero_()  # what capture's warm-up wrote is not the step's
        loaded = LoadedSpeculator(spec, cfg, layer.kv_cache, spec.layer_name)
        before = spec.cudagraph_stats()["copy_in_replays"]
        n = 3
        inputs = make_step_inputs(loaded, n, torch.Generator().manual_seed(n))
        spec.propose(**inputs.kwargs)
        assert spec.cudagraph_stats()["copy_in_replays"] == before + 1
    stacked = torch.stack(inputs.aux_hidden_states, dim=1)[:n]
    assert torch.equal(extract_from_kv_cache(layer.kv_cache, inputs.slots, n), stacked)
    assert layer.kv_cache.count_nonzero() == stacked.count_nonzero()


def draft_block_size(runner: Runner) -> int:
    """The block size of the KV-cache group vLLM put the draft layer in: the
    attention groups' (MLA: 16) or its own (beside mamba groups), which is
    not always ``cache_config.block_size``."""
    (group,) = [
        g
        for g in runner.kv_cache_config.kv_cache_groups
        if runner.speculator.layer_name in g.layer_names
    ]
    return group.kv_cache_spec.block_size


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
