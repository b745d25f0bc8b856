"""The ``vllm`` engine: a whole ``LLM`` generating, with vLLM's own speculator
(``upstream``) and with ours, ``cudagraph`` false (``eager``) and true
(``graph``): the end-to-end effect of the plugin, FULL target graphs kept
included, in one command.

Every mode's engine is alive at once (each with ``--gpu-memory-utilization``
of the GPU) so that their ``generate`` calls can be interleaved like every
other engine's modes. vLLM loads the plugin in every process it starts, so
the ``upstream`` engine is built with ``VLLM_PLUGINS`` set to load none, and
every engine core is spawned (a forked one would inherit this process, where
the plugin already replaced vLLM's class). A size here is the number of prompts per ``generate`` call;
each prompt generates ``--max-tokens`` tokens with EOS ignored. Latency
columns are per generated token position: a call's wall time divided by
``--max-tokens`` (prefill included).

Model Runner V2 needs CUDA and Triton; :func:`check_can_run` stops the sweep
before anything else when either is missing. Not run on the CPU machines this
was written on: see perf/README.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from perf.engines import VLLM_DTYPES, Mode
from perf.measure import Timings, interleaved_schedule
from perf.report import add_speedups

# Mode -> our keys in the speculative config; None: the plugin not loaded.
OUR_KEYS = {
    "upstream": None,
    "eager": {"cudagraph": False},
    "graph": {"cudagraph": True},
}
MODES = {
    "upstream": Mode("upstream", "a whole LLM with vLLM's own speculator", None),
    "eager": Mode("eager", "a whole LLM with ours, cudagraph false", None),
    "graph": Mode("graph", "a whole LLM with ours, cudagraph true", None),
}


def check_can_run() -> None:
    """Exit with the reason when this machine cannot run MRv2."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "sweep: --engine vllm runs a whole vLLM engine on Model Runner V2, "
            "which needs a CUDA GPU and Triton; this machine has no CUDA device "
            "(torch.cuda.is_available() is False). Use --engine speculator (real "
            "vLLM speculators, no engine) or --engine kernel here."
        )
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError as why:
        raise SystemExit(f"sweep: --engine vllm needs vLLM: {why}") from why
    if not HAS_TRITON:
        raise SystemExit(
            "sweep: --engine vllm needs Triton with a GPU backend for Model Runner "
            "V2, and vLLM found none (vllm.triton_utils.HAS_TRITON is False)."
        )


def run(args: Any, sampler: Any, emit: Callable[[list[dict[str, Any]]], None]) -> None:
    """Emit one row per mode as each size finishes."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    llms = {mode: _make_llm(args, OUR_KEYS[mode]) for mode in args.modes_for["vllm"]}
    for size in args.sizes:
        generator = torch.Generator().manual_seed(args.seed + size)
        prompts = [
            {
                "prompt_token_ids": torch.randint(
                    0, 1000, (args.prompt_len,), generator=generator
                ).tolist()
            }
            for _ in range(size)
        ]
        size_rows = _measure(args, llms, prompts, sampler)
        add_speedups(size_rows)
        emit(size_rows)


def _make_llm(args: Any, our_keys: dict[str, Any] | None):
    from vllm import LLM

    from perf.harness import speculative_config

    with _plugins_loaded(our_keys is not None):
        return LLM(
            model=args.model,
            speculative_config=speculative_config(
                list(args.layers), **(our_keys or {})
            ),
            dtype=VLLM_DTYPES[args.dtype],
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=max(args.sizes),
            seed=args.seed,
        )


@contextlib.contextmanager
def _plugins_loaded(ours: bool) -> Iterator[None]:
    """Without ``ours``, the engine processes started inside load no plugin
    (they read ``VLLM_PLUGINS`` when they start), so they build vLLM's class."""
    saved = os.environ.get("VLLM_PLUGINS")
    if not ours:
        os.environ["VLLM_PLUGINS"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = saved


def _measure(args, llms, prompts, sampler) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    size = len(prompts)

    def generate(mode: str) -> None:
        llms[mode].generate(prompts, params, use_tqdm=False)

    for mode in llms:
        for _ in range(args.warmup):
            generate(mode)
    calls_us: dict[str, list[float]] = {mode: [] for mode in llms}
    for mode, count in interleaved_schedule(list(llms), args.iters, 1):
        with sampler.segment(("vllm", mode, size)):
            for _ in range(count):
                start = time.perf_counter()
                generate(mode)
                calls_us[mode].append((time.perf_counter() - start) * 1e6)
    rows = []
    for mode, calls in calls_us.items():
        steps = Timings(device_us=[t / args.max_tokens for t in calls])
        rows.append(
            {
                "engine": "vllm",
                "mode": mode,
                "device": "cuda",
                "num_tokens": size,
                "padded_tokens": math.nan,
                "p50_us": steps.percentile(50),
                "p90_us": steps.percentile(90),
                "p99_us": steps.percentile(99),
                "host_us": math.nan,
                "tokens_per_s": size / (steps.percentile(50) * 1e-6),
                **sampler.summary(("vllm", mode, size), len(calls) * args.max_tokens),
            }
        )
    return rows
