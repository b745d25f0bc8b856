"""What every sweep engine shares: parameters, the mode registry, runners.

An engine builds one :class:`Runner` per mode. A runner owns its own KV cache
and runs one step of that mode; the sweep times steps, counts the ops one step
dispatches, and compares the cache each runner wrote with the reference
runner's (``upstream``). Adding a mode is adding one :class:`Mode` to an
engine's ``MODES``: nothing in the sweep names modes except the speedup
references.

This module and :mod:`perf.kernel_engine` import no vLLM, so the ``kernel``
engine runs on a GPU machine that has none.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from cg_extract import cache_write
from vllm_on_cpu.harness import DTYPES

REFERENCE_MODE = "upstream"
# Our dtype names (vllm_on_cpu.harness.DTYPES) as vLLM spells them.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Engines by name, imported lazily. Each module exports MODES (the names, in
# the order they run) and, except `vllm`, ENGINE (its Engine subclass).
ENGINE_MODULES = {
    "speculator": "perf.speculator_engine",
    "kernel": "perf.kernel_engine",
    "vllm": "perf.vllm_engine",
}

# vLLM's cache block size never exceeds this; the memory estimate rounds every
# cache up by two such blocks rather than asking vLLM for its block size.
MAX_BLOCK_SIZE = 256


def engine_module(name: str):
    return importlib.import_module(ENGINE_MODULES[name])


def engine_modes(name: str) -> list[str]:
    return list(engine_module(name).MODES)


def default_modes(name: str) -> list[str]:
    return [m for m, mode in engine_module(name).MODES.items() if mode.default]


class ModeUnavailable(Exception):
    """This machine cannot run the mode; the message says why."""


@dataclass(frozen=True)
class Params:
    """What a sweep's engines are built for: the target's shape and the device."""

    device: torch.device
    hidden_size: int
    aux_layers: tuple[int, ...]
    dtype: str  # a key of vllm_on_cpu.harness.DTYPES
    capture_sizes: tuple[int, ...]
    max_tokens: int  # the largest token count the sweep runs
    block_size: int = 16  # the kernel engine's; the speculator engine uses vLLM's

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_layers(self) -> int:
        return len(self.aux_layers)


class Runner(ABC):
    """One mode of one engine, with its own KV cache.

    What a step dispatches, what its graph replays and the size it pads to are
    measured around :meth:`step` (:func:`perf.measure.count_step`), so a
    runner declares none of them.
    """

    kv_cache: torch.Tensor

    @abstractmethod
    def step(self, inputs: Any) -> torch.Tensor:
        """Run one step on ``inputs``; returns the draft tokens."""

    def receive(self, inputs: Any) -> Any:
        """The step's inputs as this mode gets them, prepared before timing.

        The same values for every mode; a mode that models a target which
        replayed a FULL graph places them in that target's persistent
        buffers, whose filling is the target's work, not the step's.
        """
        return inputs

    def reset_cache(self) -> None:
        self.kv_cache.zero_()

    def graph_summary(self) -> dict[str, Any] | None:
        """Capture time and graph memory of this mode's graphs (the sweep's
        ``.meta.json``); None for a mode without graphs."""
        return None


@dataclass(frozen=True)
class Mode:
    summary: str  # one line for --help
    # engine -> runner, raising ModeUnavailable; None for the vllm engine,
    # whose modes are engine configurations rather than runners
    build: Callable[[Any], Runner] | None = None
    # Run when --modes names none; False: only when named.
    default: bool = True


class Engine(ABC):
    """Builds runners for the selected modes and the inputs of each step."""

    name: str
    MODES: dict[str, Mode]

    def __init__(self, params: Params, graph_backend: str = "cuda"):
        self.params = params
        self.device = params.device
        # "emulated" only for tests that check the graph path's bytes on CPU.
        self.graph_backend = graph_backend
        self.block_size = params.block_size  # the speculator engine's is vLLM's
        self.runners: dict[str, Runner] = {}
        self.skipped: dict[str, str] = {}
        self.reference: Runner | None = None

    @abstractmethod
    def make_inputs(self, num_tokens: int, generator: torch.Generator) -> Any:
        """One step's inputs, shared by every runner."""

    def build(self, modes: Iterable[str]) -> None:
        """Build the reference and every mode this machine can run; record
        the reason for each one it cannot."""
        modes = list(modes)
        self.reference = self.MODES[REFERENCE_MODE].build(self)
        for name in modes:
            if name == REFERENCE_MODE:
                self.runners[name] = self.reference
                continue
            try:
                self.runners[name] = self.MODES[name].build(self)
            except ModeUnavailable as why:
                self.skipped[name] = str(why)

    def graph_summaries(self) -> dict[str, Any]:
        """Each graph mode's :meth:`Runner.graph_summary`."""
        summaries = {m: r.graph_summary() for m, r in self.runners.items()}
        return {m: s for m, s in summaries.items() if s is not None}

    def require_cuda_graphs(self) -> None:
        """Real graphs need CUDA; the emulated backend (tests only) runs anywhere."""
        if self.graph_backend == "cuda" and self.device.type != "cuda":
            raise ModeUnavailable(
                f"real CUDA graphs need a CUDA device; this run is on "
                f"{self.device.type} (an emulated replay is not a graph timing)"
            )

    def num_blocks(self) -> int:
        """Enough blocks for every token of the largest step, plus the null block."""
        return -(-self.params.max_tokens // self.block_size) + 1

    def payload_bytes(self, num_tokens: int) -> int:
        """Hidden-state bytes one step stores: the floor reads and writes them once."""
        p = self.params
        return cache_write.payload_bytes(
            num_tokens, p.num_layers, p.hidden_size, p.torch_dtype
        )


def estimate_bytes(params: Params, num_runners: int) -> int:
    """Memory the engine will allocate, before allocating any of it.

    Each runner holds a KV cache of ``max_tokens`` slots (plus block
    rounding) and a ``[max_tokens, L, H]`` staging buffer; the inputs add the
    aux hidden states and the upstream arithmetic's stacked temporary.
    """
    row = params.num_layers * params.hidden_size * params.torch_dtype.itemsize
    cache = (params.max_tokens + 2 * MAX_BLOCK_SIZE) * row
    staging = params.max_tokens * row
    inputs = 2 * params.max_tokens * row
    return num_runners * (cache + staging) + inputs


def caches_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality outside block 0, the null block where vLLM's
    write sends padding (ours writes padding nowhere)."""
    return torch.equal(*(t[1:].contiguous().view(torch.uint8) for t in (a, b)))
