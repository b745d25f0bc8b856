"""The ``LLM.generate`` scenarios, run by one engine of one way, in its process.

``python -m tests.vllm_engine.generate_scenarios WAY MODEL_DIR STORAGE OUT_JSON`` (in the
environment of :func:`vllm_on_cpu.engine.engine_env`) starts ``LLM`` with its
engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; TP workers are
still processes of their own), runs the scenarios in turn, waits for
the connector's files, and writes to ``OUT_JSON``, per scenario, each
request's prompt, generated tokens, finish reason, prefix-cache hits and saved
file, with the evidence that the scenario did what it is named for (chunks,
hits, preemptions, the abort) and the speculator's ``cudagraph_stats()``
before and after it. ``tests/vllm_engine/test_e2e_generate.py`` compares the ways.

Prompts are fixed token ids (seeded), so every way runs the same requests in
the same order and the engine schedules them identically.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_on_cpu.engine import (
    ALL_WAYS,
    MAX_NUM_BATCHED_TOKENS,
    TARGET_GRAPH_WAYS,
    EngineRun,
    engine_env,
    engine_kwargs,
    install_pp_stand_ins,
    lock_is_free,
)
from vllm_on_cpu.hidden_states_connector import (
    CPUHiddenStatesConnector,
    kv_transfer_config,
)

PREFIX = 96  # three blocks
FLUSH_STEPS = 50


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def saves_outputs(sampling: SamplingParams) -> bool:
    extra = (sampling.extra_args or {}).get("kv_transfer_params", {})
    return bool(extra.get("include_output_tokens"))


def params(max_tokens: int, with_outputs: bool = True):
    """Greedy, a fixed length; ``with_outputs`` saves the generated tokens'
    hidden states too (``include_output_tokens``: all but the last token).
    The scenarios save them: decode steps are small, so their rows are the
    ones graphs write, and the comparison must see them."""
    extra = {"kv_transfer_params": {"include_output_tokens": True}}
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args=extra if with_outputs else None,
    )


class Run:
    """One engine, the scenarios run on it, and what they left behind."""

    def __init__(self, llm, storage: Path):
        self.llm = llm
        self.storage = storage
        # Each data-parallel rank its own prompts (rank 0's at DP=1 too).
        self.dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        self.rng = random.Random(18 + self.dp_rank)
        self.preemptions = 0
        # vLLM counts preemptions only for its stats logger; count them at
        # the scheduler's one place that preempts.
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def counted(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    def stats(self) -> list[Any]:
        return self.llm.collective_rpc("speculator_stats")

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[dict[str, Any]]:
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            sampling,
            use_tqdm=False,
        )
        return [
            {
                "prompt": list(o.prompt_token_ids),
                "output": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason,
                "cached": o.num_cached_tokens or 0,
                "path": (o.kv_transfer_params or {}).get("hidden_states_path"),
                "kv_transfer_params": o.kv_transfer_params,
                "with_outputs": saves_outputs(sampling),
            }
            for o in outputs
        ]

    def run_scenarios(
        self,
        names: list[str],
        collect: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> dict[str, Any]:
        """Each scenario in turn: its requests (once ``collect``, by default
        :meth:`flush`, has their saves), its evidence, the speculator's stats
        before and after it."""
        results = {}
        for name in names:
            before = self.stats()
            requests, evidence = SCENARIOS[name](self)
            (collect or self.flush)(requests)
            results[name] = {
                "requests": requests,
                "evidence": evidence,
                "stats_before": before,
                "stats_after": self.stats(),
                "sends_still_counted": self.sends_still_counted(),
            }
        return results

    def sends_still_counted(self) -> list[str]:
        """The requests whose finished sends vLLM's executor still counts
        (``KVOutputAggregator``) after up to :data:`FLUSH_STEPS` more steps:
        none, once each worker that reports a request has reported it."""
        engine_core = self.llm.llm_engine.engine_core.engine_core
        aggregator = engine_core.model_executor.kv_output_aggregator
        for _ in range(FLUSH_STEPS):
            if aggregator is None or not aggregator._send_remaining_count:
                break
            self.llm.llm_engine.step()
        return sorted(aggregator._send_remaining_count) if aggregator else []

    def flush(self, requests: list[dict[str, Any]]) -> None:
        """Step until every request's file is written and unlocked: the
        scheduler hands a finished request's save to the worker one step
        later, and generate() has returned by then."""
        for _ in range(FLUSH_STEPS):
            if all(
                r["path"] and Path(r["path"]).exists() and lock_is_free(r["path"])
                for r in requests
            ):
                return
            self.llm.llm_engine.step()
        missing = [r["path"] for r in requests if not Path(r["path"] or "").exists()]
        raise RuntimeError(f"no saved file after {FLUSH_STEPS} steps: {missing}")


# --------------------------------------------------------------------------
# The scenarios: each returns its requests and the evidence of what it shows.


def chunked_prefill(run: Run):
    """Prompts longer than a step's token budget prefill over several steps
    (of 64 tokens: eager), then decode once together (a graph)."""
    lengths = [150, 300, 97]
    requests = run.generate([tokens(run.rng, n) for n in lengths], params(2))
    return requests, {"max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS}


def decode(run: Run):
    """Several decode steps; with data parallelism, 4 more per rank, so that
    a rank runs dummy steps while the next still decodes."""
    lengths = [10, 40, 70, 33]
    prompts = [tokens(run.rng, n) for n in lengths]
    max_tokens = 12 + 4 * run.dp_rank
    return run.generate(prompts, params(max_tokens)), {"max_tokens": max_tokens}


def prefix_cache_hits(run: Run):
    """A first request fills the cache; later ones share its first blocks,
    whose hidden states they then save without recomputing them."""
    prefix = tokens(run.rng, PREFIX)
    first = run.generate([prefix + tokens(run.rng, 20)], params(2))
    rest = run.generate([prefix + tokens(run.rng, n) for n in (5, 37, 64)], params(2))
    return first + rest, {"shared_prefix": PREFIX}


def preemption(run: Run):
    """More requests than the KV cache holds as they grow: the scheduler
    preempts some and recomputes them later."""
    before = run.preemptions
    prompts = [tokens(run.rng, 100) for _ in range(8)]
    requests = run.generate(prompts, params(40))
    return requests, {"preemptions": run.preemptions - before}


def aborted_mid_flight(run: Run):
    """One request aborted while decoding, through the engine that
    ``generate`` drives (generate itself cannot abort); the others finish."""
    engine = run.llm.llm_engine
    names = ["abort-0", "abort-1", "abort-2"]
    prompts = {
        name: tokens(run.rng, n) for name, n in zip(names, (50, 60, 70), strict=True)
    }
    ids = {
        name: engine.add_request(name, {"prompt_token_ids": prompt}, params(30))
        for name, prompt in prompts.items()
    }
    victim, generated, finished, aborted_after = names[1], {}, {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
        if aborted_after is None and len(generated.get(victim, [])) >= 5:
            aborted_after = len(generated[victim])
            engine.abort_request([victim])
    requests = []
    for name in names:
        out = finished.get(name)
        requests.append(
            {
                "name": name,
                "prompt": prompts[name],
                "output": generated.get(name, []),
                "finish_reason": out.outputs[0].finish_reason if out else "abort",
                "cached": (out.num_cached_tokens or 0) if out else 0,
                "path": str(run.storage / f"{ids[name]}.safetensors"),
                "with_outputs": True,
            }
        )
    return requests, {"aborted": victim, "aborted_after_tokens": aborted_after}


def many_prompt_lengths(run: Run):
    """Lengths around every capture size and block size, in one call."""
    lengths = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 129]
    requests = run.generate([tokens(run.rng, n) for n in lengths], params(2))
    return requests, {"lengths": lengths}


def short_prefill_then_decode(run: Run):
    """Short prompts prefilled in one step that fits a graph but is no uniform
    decode (the target's PIECEWISE graphs, our copy-in), then decode steps
    (the target's FULL graphs, our zero-copy)."""
    lengths = [3, 9, 5]
    requests = run.generate([tokens(run.rng, n) for n in lengths], params(6))
    return requests, {"lengths": lengths, "max_tokens": 6}


def client_prompts(run: Run):
    """The prompts ``tests/vllm_engine/test_e2e_server.py`` sends through the server, one
    token each, as the users' client asks: the in-process reference."""
    return run.generate(server_prompts(), params(1, with_outputs=False)), {}


def server_prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [tokens(rng, n) for n in (1, 5, 16, 31, 33, 64, 100, 200)]


def short_client_prompts(run: Run):
    """Short prompts, sent together after the others by the server tests.
    They total the largest capture size, so every step they make replays a
    graph however the server batches them (which depends on timing)."""
    return run.generate(short_prompts(), params(1, with_outputs=False)), {}


def short_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [tokens(rng, n) for n in (1, 2, 3, 3, 4, 5, 6, 8)]


# What the server tests' client sends, one wave after the other, each all at
# once: prompts of many lengths, then short ones that always fit a graph.
CLIENT_WAVES = {"client_prompts": server_prompts, "short_client_prompts": short_prompts}


SCENARIOS: dict[str, Callable[[Run], tuple[list[dict[str, Any]], dict]]] = {
    f.__name__: f
    for f in (
        chunked_prefill,
        decode,
        prefix_cache_hits,
        preemption,
        aborted_mid_flight,
        many_prompt_lengths,
        client_prompts,
        short_client_prompts,
        short_prefill_then_decode,
    )
}
# What tests/vllm_engine/test_e2e_generate.py runs: all but the server tests' references.
GENERATE_SCENARIOS = list(SCENARIOS)[:6]
# The target-graphs way's (tests/vllm_engine/test_e2e_target_graphs.py): decode steps
# under every mode, and small mixed steps for FULL_AND_PIECEWISE.
TARGET_SCENARIOS = ["decode", "short_prefill_then_decode"]


CONNECTORS = ("example", "fp8", "mooncake")


def transfer_config(args: argparse.Namespace) -> dict[str, Any]:
    """``kv_transfer_config`` for the CPU-saving connector ``--connector``
    names (hs-connectors is imported only when asked for)."""
    if args.connector == "mooncake":
        from tests.vllm_engine import cpu_mooncake_hidden_states_connector as mooncake

        return mooncake.kv_transfer_config(args.mooncake_master)
    connector = CPUHiddenStatesConnector
    if args.connector == "fp8":
        from tests.vllm_engine.cpu_fp8_hidden_states_connector import (
            CPUFP8HiddenStatesConnector,
        )

        connector = CPUFP8HiddenStatesConnector
    return kv_transfer_config(args.storage, connector)


@dataclass
class ScenarioRun:
    """This script run as ``name`` (one engine of ``way``) under ``workdir``."""

    engine: EngineRun
    out: Path
    storage: Path

    def results(self) -> dict[str, Any]:
        return json.loads(self.out.read_text())


def scenario_run(
    name: str, way: str, model_dir: Path, workdir: Path, *options: str, **env: str
) -> ScenarioRun:
    """``env`` adds to the engine's environment (the target way's mode)."""
    out, storage = workdir / f"{name}.json", workdir / name
    args = ["-m", __name__, way, str(model_dir), str(storage), str(out), *options]
    env = engine_env(way, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    return ScenarioRun(EngineRun(args, env, workdir / f"{name}.log"), out, storage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("way", choices=ALL_WAYS)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("storage", type=Path, help="where the connector saves")
    parser.add_argument("out", type=Path, help="the JSON written")
    parser.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, default=GENERATE_SCENARIOS
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument(
        "--caches", type=Path, help="torch.save each rank's hidden-state cache here"
    )
    parser.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="example",
        help="vLLM's ExampleHiddenStatesConnector or one of hs-connectors'",
    )
    parser.add_argument(
        "--mooncake-master", help="host:port of the Mooncake store's master"
    )
    args = parser.parse_args(argv)
    if args.way in TARGET_GRAPH_WAYS:
        from vllm_on_cpu import target_graphs

        target_graphs.enable()  # before the config is built
    install_pp_stand_ins()
    llm = LLM(
        **engine_kwargs(
            args.way,
            args.model_dir,
            args.storage,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            load_format=args.load_format,
            kv_transfer_config=transfer_config(args),
        )
    )
    collect = None
    if args.connector == "mooncake":
        from tests.vllm_engine.cpu_mooncake_hidden_states_connector import fetch_samples

        def collect(requests):
            fetch_samples(llm, requests, args.mooncake_master, args.storage)

    results = Run(llm, args.storage).run_scenarios(args.scenarios, collect)
    args.out.write_text(json.dumps(results, indent=1))
    if args.caches:
        torch.save(llm.collective_rpc("hidden_state_cache"), args.caches)


if __name__ == "__main__":
    main()
