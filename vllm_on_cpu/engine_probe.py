"""What a running engine's worker reports, through ``collective_rpc``.

Mixed into the worker with vLLM's own ``worker_extension_cls`` engine
argument (``--worker-extension-cls``) on a GPU, and a base of
:class:`vllm_on_cpu.worker.SpeculatorGraphsCPUWorker` on a CPU, so that
the sweep and the tests read the same values from the same runner: the
graph mode the runner resolved, and the speculator's class, graphs and
replays.
"""

from __future__ import annotations

from typing import Any

EXTENSION = f"{__name__}.EngineProbe"


class EngineProbe:
    """Methods for a vLLM worker (``self.model_runner`` is MRv2's runner)."""

    def cudagraph_mode(self) -> str:
        """The mode the runner resolved and built its graph manager with (on
        a CPU the platform forces NONE)."""
        manager = getattr(self.model_runner, "cudagraph_manager", None)
        mode = getattr(manager, "cudagraph_mode", None)
        return mode.name if mode is not None else "NONE"

    def speculator_stats(self) -> dict[str, Any] | None:
        """Our ``cudagraph_stats()`` (None for vLLM's class), the class's name,
        and the CUDA graph support the draft layer's metadata builder reports
        in the runner's own attention groups, the value MRv2 resolves its
        graph mode from; None without a speculator."""
        runner = self.model_runner
        speculator = runner.speculator
        if speculator is None:
            return None
        stats = getattr(speculator, "cudagraph_stats", None)
        (draft,) = [
            group
            for groups in runner.attn_groups
            for group in groups
            if set(group.layer_names) == speculator.draft_attn_layer_names
        ]
        support = draft.get_metadata_builder(0).get_cudagraph_support(
            self.vllm_config, draft.kv_cache_spec
        )
        return {
            "class": f"{type(speculator).__module__}.{type(speculator).__name__}",
            "stats": stats() if stats is not None else None,
            "draft_cg_support": support.name,
            "cudagraph_mode": self.cudagraph_mode(),
            "vllm_graphs": vllm_graphs(speculator),
        }


def vllm_graphs(speculator: Any) -> dict[str, dict[str, Any]]:
    """The speculator's vLLM ``CudaGraphManager`` attributes (how vLLM's
    own speculators hold their graphs): each one's mode and captured token
    counts."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    return {
        name: {
            "mode": manager.cudagraph_mode.name,
            "captured": sorted({desc.num_tokens for desc in manager.graphs}),
        }
        for name, manager in vars(speculator).items()
        if isinstance(manager, CudaGraphManager)
    }
