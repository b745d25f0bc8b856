"""The hidden-state cache's size, read from vLLM's real KV-cache config.

Our speculator (real vLLM config, real cache-only layer and its own
``HiddenStateCacheSpec``) beside target layers' specs, grouped and sized by
vLLM's own ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups``, as
the engine core does; the speculator reads the result
(``report_cache_size``, which the plugin calls once the runner's real KV
cache exists; that call, in vLLM's real engine, is the e2e tests'). A
planted Mamba group of 67-token blocks makes vLLM give the hidden-state
group 1-token blocks in 16000-byte pages: padding more than doubles it.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch
from vllm.config import set_current_vllm_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from cg_extract.speculator import ExtractHiddenStatesSpeculator
from tests.torch_alone.test_cache_size import SUMMARY
from vllm_on_cpu.harness import build_vllm_config, kv_cache_config_of, load_speculator

NUM_BLOCKS = 10
AUX, HIDDEN, FP32 = 3, 256, 4  # build_vllm_config's aux layers; the tiny Llama
FLOAT32 = torch.float32
WARNING = "page padding more than doubles the hidden-state cache"


@pytest.fixture(scope="module")
def one_speculator(model_dir):
    return load_speculator(ExtractHiddenStatesSpeculator, build_vllm_config(model_dir))


@pytest.fixture
def loaded(one_speculator):
    """The module's speculator, as a new engine's: nothing reported yet."""
    one_speculator.speculator._cache_size_reported = False
    return one_speculator


def engine_core_config(loaded, target_specs):
    """``target_specs`` and the speculator's own layer, as vLLM lays them out
    in ``NUM_BLOCKS`` blocks; handed to the speculator as ``set_attn`` does."""
    cfg = loaded.vllm_config
    layer = cfg.compilation_config.static_forward_context[loaded.layer_name]
    with set_current_vllm_config(cfg):
        specs = {**target_specs, loaded.layer_name: layer.get_kv_cache_spec(cfg)}
        config = kv_cache_config_of(cfg, specs, NUM_BLOCKS)
    loaded.speculator.kv_cache_config = config
    return config


def mamba(block_size: int) -> dict:
    """One Mamba layer of 4 x 1000 float32 states: a 16000-byte page."""
    spec = MambaSpec(block_size=block_size, shapes=((4, 1000),), dtypes=(FLOAT32,))
    return {"model.layers.0.mixer": spec}


def summaries(log: list[str]) -> list[str]:
    return [m for m in log if "hidden-state cache" in m and WARNING not in m]


def reported(log: list[str]) -> dict[str, int]:
    (line,) = summaries(log)
    got = SUMMARY.search(line)
    assert got, line
    return {k: float(v) if k == "share" else int(v) for k, v in got.groupdict().items()}


def test_a_planted_over_padded_group_warns_naming_its_cause(loaded, cg_extract_log):
    config = engine_core_config(loaded, mamba(block_size=67))
    (hidden,) = [
        g for g in config.kv_cache_groups if loaded.layer_name in g.layer_names
    ]
    # vLLM's choice: the largest divisor of 67 that fits 16000 // 3072 = 5.
    assert hidden.kv_cache_spec.block_size == 1
    loaded.speculator.report_cache_size()
    states = AUX * HIDDEN * FP32 * 1
    assert reported(cg_extract_log) == {
        "bytes": 16000 * NUM_BLOCKS,
        "share": 100.0,  # a group of its own: every block, at most
        "kv_cache": 16000 * NUM_BLOCKS,
        "tokens": NUM_BLOCKS,
        "blocks": NUM_BLOCKS,
        "block_size": 1,
        "padding": (16000 - states) * NUM_BLOCKS,
        "page": 16000,
        "states": states,
    }
    (warning,) = [m for m in cg_extract_log if WARNING in m]
    assert "group 0 (MambaSpec, 1 layer(s), 67-token blocks, 16000-byte pages)" in (
        warning
    )
    assert "a page would fit 5 tokens" in warning
    assert "divide the other groups' (67), and 1 is the largest" in warning


def test_a_page_padded_less_than_double_does_not_warn(loaded, cg_extract_log):
    """16-token Mamba blocks: the hidden-state group gets 4 (the largest
    divisor of 16 fitting 5), 12288 bytes of states in a 16000-byte page."""
    engine_core_config(loaded, mamba(block_size=16))
    loaded.speculator.report_cache_size()
    got = reported(cg_extract_log)
    assert (got["block_size"], got["page"], got["states"]) == (4, 16000, 12288)
    assert got["padding"] == (16000 - 12288) * NUM_BLOCKS
    assert not [m for m in cg_extract_log if WARNING in m]


def attention(cfg, num_layers: int) -> dict:
    """The tiny Llama's full-attention layers (4 KV heads of 64)."""
    spec = FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=4,
        head_size=64,
        dtype=FLOAT32,
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def test_a_layer_in_the_targets_group_costs_its_page_of_each_block(
    loaded, cg_extract_log
):
    cfg = loaded.vllm_config
    config = engine_core_config(loaded, attention(cfg, num_layers=4))
    assert len(config.kv_cache_groups) == 1
    block = cfg.cache_config.block_size
    states = AUX * HIDDEN * FP32 * block
    pool_block = 4 * (2 * 4 * 64 * FP32 * block) + states  # K and V, 4 layers
    loaded.speculator.report_cache_size()
    assert reported(cg_extract_log) == {
        "bytes": states * NUM_BLOCKS,
        "share": round(100 * states / pool_block, 1),
        "kv_cache": pool_block * NUM_BLOCKS,
        "tokens": block * NUM_BLOCKS,
        "blocks": NUM_BLOCKS,
        "block_size": block,
        "padding": 0,
        "page": states,
        "states": states,
    }
    assert "share a block table with the target's layers" in cg_extract_log[0]


def test_once_per_engine_and_only_on_dp_rank_0(loaded, cg_extract_log, monkeypatch):
    engine_core_config(loaded, mamba(block_size=67))
    loaded.speculator.report_cache_size()
    loaded.speculator.report_cache_size()  # a second KV cache (elastic EP)
    assert len(summaries(cg_extract_log)) == 1
    assert len([m for m in cg_extract_log if WARNING in m]) == 1
    # DP rank 1 of a dense model: vLLM made it a world of its own, rank 0 of
    # DP 1, and only data_parallel_index says which rank it is.
    loaded.speculator._cache_size_reported = False
    parallel = loaded.vllm_config.parallel_config
    monkeypatch.setattr(parallel, "data_parallel_index", 1)
    assert parallel.data_parallel_rank == 0 and parallel.data_parallel_size == 1
    before = len(cg_extract_log)
    loaded.speculator.report_cache_size()
    assert cg_extract_log[before:] == []


def test_a_config_that_does_not_describe_the_cache_is_reported_not_raised(
    loaded, cg_extract_log
):
    """A KV-cache config whose hidden-state pages cannot hold what the
    speculator writes (here: the layer's spec planted with half the hidden
    size) is a report that cannot be made, never an engine that fails."""
    cfg = loaded.vllm_config
    layer = cfg.compilation_config.static_forward_context[loaded.layer_name]
    small = layer.get_kv_cache_spec(cfg).__class__(
        block_size=16, num_kv_heads=AUX, head_size=HIDDEN // 2, dtype=FLOAT32
    )
    with set_current_vllm_config(cfg):
        config = kv_cache_config_of(cfg, {loaded.layer_name: small}, NUM_BLOCKS)
    loaded.speculator.kv_cache_config = config
    loaded.speculator.report_cache_size()
    (message,) = cg_extract_log
    assert message.startswith("extract_hidden_states: cache size not reported:")
    assert "page_bytes 24576 is less than the 49152 bytes of states" in message


def test_a_config_without_the_layer_is_reported_not_raised(loaded, cg_extract_log):
    """A KV-cache config that holds no hidden-state layer (one of another
    stage's layers, say) names what it lacks."""
    cfg = loaded.vllm_config
    with set_current_vllm_config(cfg):
        config = kv_cache_config_of(cfg, attention(cfg, num_layers=2), NUM_BLOCKS)
    loaded.speculator.kv_cache_config = config
    loaded.speculator.report_cache_size()
    (message,) = cg_extract_log
    assert message == (
        "extract_hidden_states: cache size not reported: the hidden-state "
        f"layer {loaded.layer_name} is in 0 KV-cache groups and 0 KV-cache "
        "tensors, not one of each"
    )
