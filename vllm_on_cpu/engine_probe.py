"""What a running engine's worker reports, through ``collective_rpc``.

Mixed into the worker with vLLM's own ``worker_extension_cls`` engine
argument (``--worker-extension-cls``) on a GPU, and a base of
:class:`vllm_on_cpu.worker.SpeculatorGraphsCPUWorker` on a CPU, so that
the sweep and the tests read the same values from the same runner: the
graph mode the runner resolved, what the target ran each step (FULL graph,
PIECEWISE graph or eagerly), and the speculator's class, graphs and replays.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vllm_on_cpu import cuda_graph

EXTENSION = f"{__name__}.EngineProbe"
# The runtime modes vLLM's runner runs a step in (CUDAGraphMode names).
TARGET_MODES = ("FULL", "PIECEWISE", "NONE")


class EngineProbe:
    """Methods for a vLLM worker (``self.model_runner`` is MRv2's runner)."""

    def cudagraph_mode(self) -> str:
        """The mode the runner resolved and built its graph manager with (on
        a CPU the platform forces NONE)."""
        manager = getattr(self.model_runner, "cudagraph_manager", None)
        mode = getattr(manager, "cudagraph_mode", None)
        return mode.name if mode is not None else "NONE"

    def target_steps(self) -> dict[str, int]:
        """How many steps the target ran as a FULL graph, as a PIECEWISE
        graph and eagerly (``NONE``), since this was first asked (it then
        starts counting them), each read from the runner's own record of
        the step (:func:`target_step`)."""
        runner = self.model_runner
        counts = vars(runner).get("target_steps_counted")
        if counts is None:
            require_step_records(runner)
            counts = runner.target_steps_counted = dict.fromkeys(TARGET_MODES, 0)
            execute_model = runner.execute_model

            def counted(*args: Any, **kwargs: Any) -> Any:
                output = execute_model(*args, **kwargs)
                step = target_step(runner)
                if step is not None:
                    counts[step["target"]] += 1
                return output

            runner.execute_model = counted
        return dict(counts)

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
            # What the CPU stand-in graph API captured and replayed in this
            # process (the target's graphs; zero where it is not installed).
            "target_graphs": {
                "captured": cuda_graph.counts.captured,
                "replays": cuda_graph.counts.replays,
                # FULL graphs the runner's manager holds now: fewer than
                # captured where the memory profiler captured and dropped some.
                "held": len(getattr(runner.cudagraph_manager, "graphs", ())),
                # The token counts of the FULL graphs the runner holds, and
                # the capture sizes vLLM resolved.
                "full_sizes": _full_sizes(runner.cudagraph_manager),
                "capture_sizes": list(
                    self.vllm_config.compilation_config.cudagraph_capture_sizes or []
                ),
            },
            "vllm_graphs": vllm_graphs(speculator),
            "aux_dtypes": aux_dtypes_seen(speculator),
            "graph_api": graph_api(speculator, runner),
        }


def require_step_records(runner: Any) -> None:
    """The runner records each step's graph mode only with vLLM's
    ``cudagraph_metrics`` on (``--cudagraph-metrics``)."""
    if not runner.observability_config.cudagraph_metrics:
        raise ValueError(
            "the target's graph mode per step is read from vLLM's per-step "
            "CUDA graph record, which the runner keeps only with "
            "cudagraph_metrics=True (--cudagraph-metrics); start the engine "
            "with it"
        )


def target_step(runner: Any) -> dict[str, Any] | None:
    """What the target ran in the step ``runner.execute_model`` has just
    run, as the runner recorded it for ``sample_tokens`` (its
    ``execute_model_state``): the graph mode it dispatched the batch to and
    ran (``runtime_mode`` of vLLM's ``CUDAGraphStat``: "FULL", "PIECEWISE"
    or "NONE"), its token count before and after padding, whether any
    request was prefilling (the input batch's ``has_prefill``) and whether
    the batch is what vLLM's FULL decode graphs take, a uniform decode
    batch (every request at the runner's ``decode_query_len``: one sampled
    token and its drafts; as the runner asks ``dispatch``, with vLLM's own
    ``get_uniform_decode_token_count``). None for a step with no forward
    and for dummy runs, which the runner records nothing for."""
    from vllm.v1.worker.utils import get_uniform_decode_token_count

    state = getattr(runner, "execute_model_state", None)
    stat = getattr(state, "cudagraph_stats", None)
    if stat is None:
        return None
    batch = state.input_batch
    uniform = get_uniform_decode_token_count(
        batch.num_reqs,
        batch.num_tokens,
        int(batch.num_scheduled_tokens.max()),
        batch.decode_graph_eligible,
    )
    return {
        "target": stat.runtime_mode,
        "tokens": stat.num_unpadded_tokens,
        "padded": stat.num_padded_tokens,
        "prefill": bool(batch.has_prefill),
        "uniform_decode": uniform == runner.decode_query_len,
    }


def graph_api(speculator: Any, runner: Any) -> dict[str, Any]:
    """Which graph objects hold our graphs (emulated, or the fake
    ``torch.cuda.CUDAGraph``) and, for the fake's, the path their capture
    took: into the platform's global graph pool (the one the runner's own
    manager holds), on a stream vLLM's ``capture_pool`` scope gave
    ``torch.cuda.graph``; and their replays."""
    graphs = getattr(speculator, "graphs", None)
    if graphs is None:
        return {}
    held = [g for m in graphs._managers() for g in m._graphs.values()]
    fake = [g for g in held if isinstance(g, cuda_graph.CUDAGraph)]
    api = {
        "types": sorted({f"{type(g).__module__}.{type(g).__name__}" for g in held}),
        "graphs": len(held),
        "in_global_pool": 0,
        "on_vllm_stream": sum(g.capture_stream is not None for g in fake),
        "replays": sum(g.replays for g in fake),
    }
    if fake:  # a platform without the fake has no graph pool to look up
        from vllm.platforms import current_platform

        pool = current_platform.get_global_graph_pool()
        api["in_global_pool"] = sum(g.pool() is pool for g in fake)
        api["runner_pool_is_global"] = runner.cudagraph_manager.pool is pool
    return api


def _full_sizes(manager: Any) -> list[int]:
    if manager is None or not hasattr(manager, "captured_token_counts"):
        return []
    return manager.captured_token_counts()


def vllm_graphs(speculator: Any) -> dict[str, dict[str, Any]]:
    """The speculator's vLLM ``CudaGraphManager`` attributes (how vLLM's
    own speculators hold their graphs): each one's mode and captured token
    counts."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    return {
        name: {
            "mode": manager.cudagraph_mode.name,
            "captured": sorted({desc.num_tokens for desc in manager.graphs}),
            "replays": counted_replays(manager),
        }
        for name, manager in vars(speculator).items()
        if isinstance(manager, CudaGraphManager)
    }


def counted_replays(manager: Any) -> int:
    """The manager's ``run_fullgraph`` calls since this was first asked (it
    then starts counting them)."""
    if "replays_counted" not in vars(manager):
        manager.replays_counted = 0
        run_fullgraph = manager.run_fullgraph

        def counted(desc: Any) -> Any:
            manager.replays_counted += 1
            return run_fullgraph(desc)

        manager.run_fullgraph = counted
    return manager.replays_counted


def aux_dtypes_seen(speculator: Any) -> dict[str, int]:
    """How many ``propose`` calls got aux hidden states of each list of
    dtypes (``"bfloat16,bfloat16,bfloat16"``), since this was first asked
    (it then starts counting them): what the target's model code handed the
    speculator, whichever class it is."""
    if "aux_dtypes_seen" not in vars(speculator):
        seen: dict[tuple[torch.dtype, ...], int] = {}
        propose = speculator.propose
        # Where the runner's step passes it (its dummy runs name it), read
        # from the class: a wrapper (the step log's) takes *args.
        parameters = list(inspect.signature(type(speculator).propose).parameters)
        position = parameters.index("aux_hidden_states") - 1  # less self

        def counted(*args: Any, **kwargs: Any) -> Any:
            aux = (
                args[position]
                if len(args) > position
                else kwargs.get("aux_hidden_states")
            )
            if aux is not None:
                key = tuple(a.dtype for a in aux)
                seen[key] = seen.get(key, 0) + 1
            return propose(*args, **kwargs)

        speculator.aux_dtypes_seen = seen
        speculator.propose = counted
    return {
        ",".join(str(d).removeprefix("torch.") for d in key): n
        for key, n in speculator.aux_dtypes_seen.items()
    }
