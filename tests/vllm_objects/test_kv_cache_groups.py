"""The ``split_kv_cache_groups`` key (:mod:`cg_extract.kv_cache_groups`) with
vLLM's own config build and KV-cache layout functions.

Kimi-K3 (vllm-project/vllm#56774) is laid out from its config alone: vLLM
builds no Kimi model on a CPU, so each layer's spec is written here as Kimi's
layers write it, with the model's own state calculators. What the engine
core says of the key for each family of the project (the split, why none, the
refusal hint) is in test_cache_size_vllm.py, with those families' layouts.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)

from cg_extract import kv_cache_groups
from cg_extract.config import (
    ADDITIONAL_CONFIG,
    ADDITIONAL_CONFIG_KEY,
    SPECULATIVE_CONFIG,
)
from cg_extract.kv_cache_groups import KEY, vllm_layout
from tests.model_families import write_family_dir
from tests.vllm_objects.test_cache_size_vllm import BUDGET, engine_core_layout, said
from tests.vllm_objects.test_pipeline_parallel import MRV2, PP
from vllm_on_cpu.engine import AUX_LAYER_IDS
from vllm_on_cpu.harness import (
    KVLayout,
    build_vllm_config,
    resolve_layout,
    speculative_config,
)

try:  # vLLM 0.33: platforms may supply a KV-cache config builder
    from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder
except ImportError:  # vLLM 0.32
    DefaultKVCacheConfigBuilder = None

ON_0_33 = pytest.mark.skipif(
    DefaultKVCacheConfigBuilder is None,
    reason="vLLM 0.32 has no KV-cache config builders nor SupportsKVCacheGrouping",
)


def tokens(layout: KVLayout) -> int:
    return get_kv_cache_capacity(layout.vllm_config, layout.kv_cache_config)[0]


def hidden_bill(layout: KVLayout) -> float:
    """The pool's bytes a hidden-state block is billed (its tensor's stride:
    groups alias one pool), over the states the block holds."""
    config = layout.kv_cache_config
    (group,) = [
        g
        for g in config.kv_cache_groups
        if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)
    ]
    (tensor,) = [t for t in config.kv_cache_tensors if group.layer_names == t.layers]
    spec = group.kv_cache_spec
    states = spec.block_size * spec.num_kv_heads * spec.head_size
    return tensor.size / config.num_blocks / (states * get_dtype_size(spec.dtype))


def hidden_state_spec(vllm_config) -> dict:
    """The hidden-state layer's spec, as vLLM's ``CacheOnlyAttentionLayer``
    (model_executor/models/extract_hidden_states.py) builds it."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    draft = vllm_config.speculative_config.draft_model_config.hf_config
    name = f"model.cache_only_layers.{model.get_total_num_hidden_layers()}"
    return {
        name: HiddenStateCacheSpec(
            block_size=cache.block_size,
            num_kv_heads=len(draft.eagle_aux_hidden_state_layer_ids),
            head_size=model.get_hidden_size(),
            dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model),
        )
    }


# --------------------------------------------------------------------------
# Kimi-K3: the layout

K3_BUDGET = 256 * 2**20


def kimi_k3(tmp_path, extraction: bool, split: bool = False) -> KVLayout:
    """The tiny Kimi-K3's config and specs, and vLLM's layout of them on
    ``K3_BUDGET``, as the engine core makes it."""
    spec = speculative_config(AUX_LAYER_IDS, **({KEY: True} if split else {}))
    vllm_config = EngineArgs(
        model=str(write_family_dir(tmp_path / "kimi_k3", "kimi_k3")),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        attention_backend="CPU_MLA",
        enable_prefix_caching=False,
        mamba_cache_mode="none",
        max_model_len=4096,
        kv_cache_memory_bytes=K3_BUDGET,
        speculative_config=spec if extraction else None,
    ).create_engine_config()
    specs = kimi_k3_specs(vllm_config)
    resolve_layout(vllm_config, specs)
    (config,) = vllm_layout(vllm_config, [specs], [K3_BUDGET])
    return KVLayout(vllm_config, specs, config, None)


def kimi_k3_specs(vllm_config) -> dict:
    """Each layer's spec as Kimi's write theirs (models/kimi_k3/nvidia: the
    delta attention through ``MambaBase.get_kv_cache_spec``, the latent
    attention's own), after the block size vLLM's hybrid alignment gives.

    That alignment is the hybrid step of the platform's
    ``update_block_size_for_backend``, which finds the backend in a built
    model's layers: called here with the backend the config chose. It makes
    MLA blocks multiples of 128 tokens, as on a GPU; that method would then
    refuse 128 for CPU_MLA (16 only)."""
    from vllm.models.kimi_k3 import KimiLinearForCausalLM

    backend = vllm_config.attention_config.backend.get_class()
    current_platform._align_hybrid_block_size(vllm_config, backend)
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf = model.hf_config
    linear = MambaSpec(
        shapes=KimiLinearForCausalLM.get_mamba_state_shape_from_config(vllm_config),
        dtypes=KimiLinearForCausalLM.get_mamba_state_dtype_from_config(vllm_config),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,  # its GatedDeltaNet base's
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=vllm_config.num_speculative_tokens,
    )
    latent = MLAAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
        dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model),
        cache_dtype_str=cache.cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
    )
    specs = {
        f"model.layers.{i}.self_attn": linear if hf.is_kda_layer(i) else latent
        for i in range(hf.num_hidden_layers)
    }
    if vllm_config.speculative_config is not None:
        specs |= hidden_state_spec(vllm_config)
    return specs


def test_kimi_k3s_hidden_states_are_billed_a_page_a_block_with_the_key(tmp_path):
    """Without the key the hidden-state group, beside groups of 8 layers, is
    billed 8 pages a block: 12x its states, a third of the capacity without
    extraction. With it, one page (1.5x: a page of 128 latent rows would
    hold 96 tokens of states; the block is 64, the largest divisor of 128)."""
    target = kimi_k3(tmp_path, extraction=False)
    default = kimi_k3(tmp_path, extraction=True)
    split = kimi_k3(tmp_path, extraction=True, split=True)
    assert tokens(target) == 26_565
    assert max(len(g.layer_names) for g in default.kv_cache_config.kv_cache_groups) == 8
    assert (tokens(default), hidden_bill(default)) == (9_115, 12.0)
    assert all(len(g.layer_names) == 1 for g in split.kv_cache_config.kv_cache_groups)
    assert hidden_bill(split) <= 1.6
    assert tokens(split) >= 20_000


# --------------------------------------------------------------------------
# The key as given


def build_with_key(model_dir, where: str, value, **spec_extra):
    if where == SPECULATIVE_CONFIG:
        return build_vllm_config(model_dir, **{KEY: value}, **spec_extra)
    additional = {"additional_config": {ADDITIONAL_CONFIG_KEY: {KEY: value}}}
    return build_vllm_config(model_dir, engine_args=additional, **spec_extra)


@pytest.mark.parametrize("value", ["yes", 1])
@pytest.mark.parametrize("where", [SPECULATIVE_CONFIG, ADDITIONAL_CONFIG])
def test_a_value_other_than_true_or_false_is_refused_where_given(
    model_dir, where, value
):
    message = f"{where} key '{KEY}' must be true or false, got {value!r}"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build_with_key(model_dir, where, value)


def test_different_values_in_both_places_are_refused(model_dir):
    with pytest.raises(ValueError, match=rf"\['{KEY}'\] given in both the speculative"):
        build_with_key(model_dir, ADDITIONAL_CONFIG, False, **{KEY: True})


@pytest.mark.parametrize("where", [SPECULATIVE_CONFIG, ADDITIONAL_CONFIG])
def test_the_key_needs_no_cudagraph(model_dir, where):
    assert kv_cache_groups.asked(build_with_key(model_dir, where, True))


# --------------------------------------------------------------------------
# Refused where the groups are not vLLM's default ones on one stage


@MRV2
def test_pipeline_parallel_is_refused(model_dir):
    with pytest.raises(
        ValueError, match=f"^{KEY} needs pipeline_parallel_size 1, got 2"
    ):
        build_vllm_config(model_dir, engine_args=PP, **{KEY: True})


if DefaultKVCacheConfigBuilder is not None:

    class GroupingBuilder(DefaultKVCacheConfigBuilder):
        def get_kv_cache_groups(self, vllm_config, kv_cache_spec):
            return super().get_kv_cache_groups(vllm_config, kv_cache_spec)

    class PlacingBuilder(DefaultKVCacheConfigBuilder):
        def get_kv_cache_config_from_groups(self, vllm_config, groups, num_blocks):
            return super().get_kv_cache_config_from_groups(
                vllm_config, groups, num_blocks
            )


@ON_0_33
def test_a_platform_builder_that_groups_the_layers_is_refused(model_dir, monkeypatch):
    def builder_named(name: str) -> None:
        qualname = f"{__name__}.{name}"
        monkeypatch.setattr(
            current_platform, "get_kv_cache_config_builder_cls", lambda _: qualname
        )
        return qualname

    grouping = builder_named("GroupingBuilder")
    with pytest.raises(ValueError, match=f"builder, {re.escape(grouping)}, groups"):
        build_vllm_config(model_dir, **{KEY: True})
    builder_named("PlacingBuilder")  # groups as vLLM's default builder does
    assert kv_cache_groups.asked(build_vllm_config(model_dir, **{KEY: True}))


@ON_0_33
def test_a_model_that_groups_its_own_layers_is_refused(model_dir, monkeypatch):
    from vllm.config import ModelConfig

    monkeypatch.setattr(
        ModelConfig, "supports_kv_cache_grouping", property(lambda self: True)
    )
    with pytest.raises(ValueError, match=f"^{KEY}: LlamaForCausalLM groups its own"):
        build_vllm_config(model_dir, **{KEY: True})


# --------------------------------------------------------------------------
# Where vLLM's packed grouping takes over (the families' splits, refusal
# hints and warnings: test_cache_size_vllm.py)


def test_packed_groups_are_left_to_vllm(model_dir, cg_extract_log):
    """A block-outermost layout with pages of two sizes: vLLM packs the
    groups and strides the hidden-state group's blocks by the widest
    group's, with no page padding."""
    cfg = build_vllm_config(
        model_dir, engine_args={"max_model_len": 512}, **{KEY: True}
    )
    record_kv_cache_layout(cfg.cache_config, "BLNHC")
    full = FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=4,
        head_size=64,
        dtype=cfg.model_config.dtype,
    )
    sliding = SlidingWindowSpec(
        block_size=full.block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=full.dtype,
        sliding_window=32,
    )
    specs = {f"model.layers.{i}.self_attn": (sliding, full)[i % 2] for i in range(4)}
    engine_core_layout(
        KVLayout(cfg, specs | hidden_state_spec(cfg), None, None), BUDGET
    )
    (warning,) = said(cg_extract_log)
    assert warning.endswith(
        "vLLM packed the KV-cache groups block-outermost (pages "
        "of different sizes), a grouping cg_extract does not split"
    )
