"""The engine worker's step log, and the check of what our graphs did in
every step of it.

Where ``ENGINE_WORKER_STEP_LOG`` names a folder, each rank of the CPU engine
worker (:mod:`vllm_on_cpu.worker`) appends one JSON line per step it ran to
``dp<DP rank>_tp<TP rank>.jsonl`` there (:class:`StepLog`). Tests read it with
:func:`read` and the sweep's ``--engine vllm`` does on a CPU; both judge our
zero-copy path with :func:`zero_copy_violations`.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_on_cpu import cuda_graph
from vllm_on_cpu.engine_probe import target_step, vllm_graphs

# A folder: each rank appends its steps to ``dp<DP rank>_tp<TP rank>.jsonl``.
STEP_LOG = "ENGINE_WORKER_STEP_LOG"
# A step's target fields where the engine keeps no record of them.
NO_RECORD = dict.fromkeys(("target", "tokens", "padded", "prefill", "uniform_decode"))
# Our speculator's paths, as its cudagraph_stats() counts them.
PATHS = {
    "zero_copy": "zero_copy_replays",
    "copy_in": "copy_in_replays",
    "eager": "eager_steps",
}


class RankFile:
    """A record of this rank's speculator in ``<STEP_LOG>/dp<DP rank>_tp<TP
    rank><SUFFIX>``, where :data:`STEP_LOG` names a folder."""

    SUFFIX = ""

    @classmethod
    def open(cls, worker: Any) -> Any:
        """One for ``worker``'s speculator; None without a folder or a
        speculator."""
        folder = os.environ.get(STEP_LOG)
        if not folder or worker.model_runner.speculator is None:
            return None
        parallel = worker.vllm_config.parallel_config
        Path(folder).mkdir(parents=True, exist_ok=True)
        name = f"dp{parallel.data_parallel_index}_tp{worker.rank}{cls.SUFFIX}"
        return cls(Path(folder) / name, worker.model_runner)


class StepLog(RankFile):
    """One JSON line per step this rank ran:

    * ``scheduled``: request id to the tokens the scheduler gave this rank
      (empty for a DP dummy step, marked ``dummy``);
    * ``replayed``: the sizes of the speculator's graphs replayed (ours as
      our graph managers returned them, a vLLM ``CudaGraphManager``'s as the
      descriptors it ran); ``paths``: the path our speculator took in each
      ``propose`` call (``zero_copy``, ``copy_in`` or ``eager``, read from
      its ``cudagraph_stats()``; empty for vLLM's classes);
      ``dp_synced``: whether the runner handed ``propose`` a
      ``dp_sync_state`` (the DP ranks' token counts) in it, and
      ``num_tokens_across_dp`` those counts (None without);
    * what the TARGET ran, from the runner's own record of the step
      (:func:`vllm_on_cpu.engine_probe.target_step`): ``target`` (the graph
      mode: FULL, PIECEWISE or NONE), ``tokens`` and ``padded`` (its token
      count before and after padding), ``prefill`` (whether any request was
      prefilling), ``uniform_decode`` (whether every request decoded the
      runner's decode query length, the batches FULL decode graphs take);
      None where the engine keeps no such record (started without vLLM's
      ``cudagraph_metrics``) and for dummy steps;
    * ``stats``: the speculator's ``cudagraph_stats()`` after it (vLLM's
      classes: their graph managers'); ``graph_api``: the stand-in graph
      API's counts in this process (the target's graphs, and the series'
      speculator's, which it captures too).

    Written as each step ends, so a server stopped by a signal has lost
    nothing."""

    SUFFIX = ".jsonl"

    def __init__(self, path: Path, runner: Any):
        self.path = path
        self.runner = runner
        self.speculator = speculator = runner.speculator
        self.pending: deque[dict[str, Any]] = deque()
        self.replayed: list[int] = []
        self.paths: list[str] = []
        self.dp_synced: list[bool] = []
        self.num_tokens_across_dp: list[list[int] | None] = []
        self.records_target = runner.observability_config.cudagraph_metrics
        speculator.propose = self._recording_propose(speculator.propose)
        graphs = getattr(speculator, "graphs", None)
        for manager in (graphs.copy_in, graphs.zero_copy) if graphs else ():
            if manager is not None:
                manager.replay = self._recording(manager.replay)
        for name in vllm_graphs(speculator):
            manager = getattr(speculator, name)
            manager.run_fullgraph = self._recording_desc(manager.run_fullgraph)

    def _recording(self, replay):
        def recorded(num_tokens: int) -> int:
            padded = replay(num_tokens)
            self.replayed.append(padded)
            return padded

        return recorded

    def _recording_desc(self, run_fullgraph):
        def recorded(desc: Any) -> Any:
            self.replayed.append(desc.num_tokens)
            return run_fullgraph(desc)

        return recorded

    def _recording_propose(self, propose):
        stats = getattr(self.speculator, "cudagraph_stats", None)

        def recorded(*args: Any, **kwargs: Any):
            sync = kwargs.get("dp_sync_state")
            self.dp_synced.append(sync is not None)
            self.num_tokens_across_dp.append(
                None if sync is None else sync.num_tokens_across_dp.tolist()
            )
            before = stats() if stats else None
            out = propose(*args, **kwargs)
            if stats:
                after = stats()
                self.paths += [p for p, k in PATHS.items() if after[k] > before[k]]
            return out

        return recorded

    def scheduled(self, num_scheduled_tokens: dict[str, int]) -> None:
        """After the runner's ``execute_model``: the scheduler's share of
        this rank and what the target ran."""
        if num_scheduled_tokens:
            step = target_step(self.runner) if self.records_target else None
            self.pending.append(
                {"scheduled": dict(num_scheduled_tokens), **(step or NO_RECORD)}
            )

    def write(self, dummy: bool = False) -> None:
        stats = getattr(self.speculator, "cudagraph_stats", None)
        step = {"scheduled": {}, **NO_RECORD} if dummy else self.pending.popleft()
        line = {
            **step,
            "replayed": self.replayed,
            "paths": self.paths,
            "dp_synced": self.dp_synced,
            "num_tokens_across_dp": self.num_tokens_across_dp,
            "stats": stats() if stats else vllm_graphs(self.speculator),
            "graph_api": {
                "captured": cuda_graph.counts.captured,
                "replays": cuda_graph.counts.replays,
            },
        }
        if dummy:
            line["dummy"] = True
        self.replayed, self.paths, self.dp_synced = [], [], []
        self.num_tokens_across_dp = []
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")


def read(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each rank's steps (``dp0_tp0`` and so on), in the order it ran them."""
    return {
        f.stem: [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted(Path(folder).glob("*.jsonl"))
    }


def zero_copy_violations(
    steps: Sequence[dict[str, Any]], full_sizes: Sequence[int], cudagraph_mode: str
) -> list[str]:
    """Every step of our graph speculator whose path was not the one due,
    each said in a line; empty when all were. ``full_sizes`` are the token
    counts of the FULL graphs the target's runner holds, ``cudagraph_mode``
    the mode it resolved (both read from the engine, e.g. by
    :class:`vllm_on_cpu.engine_probe.EngineProbe`).

    Zero-copy reads the target's persistent buffers, which hold the step's
    aux hidden states exactly when the target replayed a FULL graph; so:

    * a uniform decode step (all its requests decoding, each its sampled
      token and its draft: the batches vLLM's FULL decode graphs take) within
      the target's FULL graphs, under a mode whose decode steps run FULL,
      must have been replayed FULL by the target and zero-copy by us;
    * any step the target replayed FULL must be zero-copy;
    * a step the target did not replay FULL must not be zero-copy: so a step
      with a prefill never, under a mode that runs mixed batches as
      PIECEWISE graphs or eagerly (FULL_AND_PIECEWISE, FULL_DECODE_ONLY).

    A request's last step decodes its one last token without a draft: a
    batch with one such request is no uniform decode, and vLLM runs it as
    a mixed one.
    """
    from vllm.config.compilation import CUDAGraphMode

    mode = CUDAGraphMode[cudagraph_mode]
    decode_full = mode.decode_mode() == CUDAGraphMode.FULL
    largest = max(full_sizes, default=0)
    wrong = []
    for i, step in enumerate(steps):
        if step["target"] is None:
            raise ValueError(
                f"step {i} of the step log has no record of the target's graph "
                "mode: the engine must run with vLLM's cudagraph_metrics=True"
            )
        if len(step["paths"]) != 1:
            wrong.append(f"step {i}: our speculator took {step['paths']}, not one path")
            continue
        (path,) = step["paths"]
        full = step["target"] == "FULL"
        kind = (
            "uniform decode"
            if step["uniform_decode"]
            else "with a prefill"
            if step["prefill"]
            else "decoding, not uniform"
        )
        what = (
            f"step {i} ({step['tokens']} tokens, {len(step['scheduled'])} "
            f"requests, {kind}; the target ran {step['target']}, ours {path})"
        )
        if decode_full and step["uniform_decode"] and step["tokens"] <= largest:
            if not full or path != "zero_copy":
                wrong.append(
                    f"{what}: a uniform decode within the target's FULL graphs "
                    f"(up to {largest} tokens) must replay zero-copy"
                )
        elif full and path != "zero_copy":
            wrong.append(f"{what}: after a FULL replay of the target, zero-copy")
        elif not full and path == "zero_copy":
            wrong.append(
                f"{what}: zero-copy only after a FULL replay of the target"
                + (" (a step with a prefill must not)" if step["prefill"] else "")
            )
    return wrong
