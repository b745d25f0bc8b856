"""The ``speculator`` engine: the real ``propose`` of the real speculators.

Each mode is a speculator built the way the MRv2 runner builds one: from a
``VllmConfig`` (a Llama ``config.json`` with ``load_format="dummy"``), with
vLLM's cache-only draft model loaded and a real KV cache bound to its layer
(:mod:`vllm_on_cpu.harness`). ``upstream`` is vLLM's own class, ``eager`` and
``graph`` are ours with ``cudagraph`` false and true, ``per_layer`` ours
eager with the write before the op (one scatter per aux layer).

vLLM is imported inside functions only, so that ``--help`` and input checks
stay fast and the module can be imported where vLLM is absent.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from perf.engines import VLLM_DTYPES, Engine, Mode, ModeUnavailable, Params, Runner

MAX_NUM_SEQS = 128
HEAD_DIM = 64  # vllm_on_cpu.harness.write_model_dir's; hidden size must be a multiple


class SpeculatorRunner(Runner):
    """``cls`` built and loaded; ours (``our_keys``) then get their graphs
    as the runner sets them up, after ``target_sizes``' FULL graphs of the
    target, if any, have published their buffers."""

    def __init__(
        self, engine: SpeculatorEngine, cls: type, target_sizes=(), **our_keys
    ):
        from vllm_on_cpu.harness import attach_target_graph_outputs, load_speculator

        cfg = engine.vllm_config(**our_keys)
        blocks = engine.num_blocks()  # every config has the engine's block size
        self.loaded = load_speculator(cls, cfg, engine.device, num_blocks=blocks)
        self.kv_cache = self.loaded.kv_cache
        self.target = None
        if target_sizes:
            self.target = attach_target_graph_outputs(self.loaded, list(target_sizes))
        if our_keys:
            _init_graphs_as_the_runner_does(self)

    @property
    def speculator(self):
        return self.loaded.speculator

    def step(self, inputs: Any) -> torch.Tensor:
        return self.speculator.propose(**inputs.kwargs)


def upstream_runner(engine: SpeculatorEngine) -> SpeculatorRunner:
    from cg_extract.plugin import upstream_speculator_class

    return SpeculatorRunner(engine, upstream_speculator_class())


def eager_runner(engine: SpeculatorEngine) -> SpeculatorRunner:
    from cg_extract.speculator import ExtractHiddenStatesSpeculator

    return SpeculatorRunner(engine, ExtractHiddenStatesSpeculator, cudagraph=False)


def per_layer_runner(engine: SpeculatorEngine) -> SpeculatorRunner:
    """Ours eager, its one write op swapped for the write before it: the
    reference that prices the op's dispatch in the same run."""
    from cg_extract.cache_write import write_per_layer
    from cg_extract.speculator import ExtractHiddenStatesSpeculator

    class PerLayerWrite(ExtractHiddenStatesSpeculator):
        write_cache = staticmethod(write_per_layer)

    return SpeculatorRunner(engine, PerLayerWrite, cudagraph=False)


class GraphRunner(SpeculatorRunner):
    """Ours with ``cudagraph`` true.

    ``in_place``: the runner's persistent buffers are attached as ``set_attn``
    and the plugin's capture hook attach them on a GPU worker, and every step
    arrives as views of them (:func:`vllm_on_cpu.harness.as_target_outputs`),
    as after a FULL graph replay of the target: captured sizes replay with no
    copy. Otherwise every step copies its inputs in.
    """

    def __init__(self, engine: SpeculatorEngine, in_place: bool):
        from cg_extract.speculator import ExtractHiddenStatesSpeculator

        engine.require_cuda_graphs()
        # in place: a target with FULL graphs at our sizes, all replay with no copy
        super().__init__(
            engine,
            ExtractHiddenStatesSpeculator,
            engine.params.capture_sizes if in_place else (),
            cudagraph=True,
            cudagraph_backend=engine.graph_backend,
            cudagraph_capture_sizes=list(engine.params.capture_sizes),
        )
        if not self.speculator.cudagraph_stats()["captured_sizes"]:
            raise ModeUnavailable("the speculator captured no graphs (see its log)")

    def graph_summary(self) -> dict:
        return self.speculator.graphs.summary()

    def receive(self, inputs: Any) -> Any:
        from vllm_on_cpu.harness import as_target_outputs

        # Above the target's largest graph the target ran eagerly: fresh tensors.
        if self.target is None or inputs.num_tokens > len(
            self.target.aux_hidden_states[0]
        ):
            return inputs
        return as_target_outputs(inputs, self.loaded, self.target)


def _init_graphs_as_the_runner_does(runner: SpeculatorRunner) -> None:
    """``init_cudagraph_manager`` with the runner's usual mode, then ``capture``
    (a no-op when graphs are off, called anyway as the runner calls it)."""
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode

    spec = runner.speculator
    spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    with set_current_vllm_config(runner.loaded.vllm_config):
        spec.capture()


class SpeculatorEngine(Engine):
    name = "speculator"
    MODES = {
        "upstream": Mode("vLLM's own eager speculator", upstream_runner),
        "eager": Mode("ours, cudagraph false", eager_runner),
        "per_layer": Mode(
            "ours, cudagraph false, the write before the op (a scatter per layer)",
            per_layer_runner,
        ),
        "graph": Mode(
            "ours, cudagraph true, inputs in the target's persistent buffers "
            "(zero-copy replay)",
            lambda engine: GraphRunner(engine, in_place=True),
        ),
        "graph_copy_in": Mode(
            "ours, cudagraph true, fresh inputs (copy-in replay)",
            lambda engine: GraphRunner(engine, in_place=False),
        ),
    }

    def __init__(self, params: Params, graph_backend: str = "cuda"):
        from cg_extract.plugin import register
        from vllm_on_cpu.harness import write_model_dir

        super().__init__(params, graph_backend)
        register()  # idempotent; our config keys need the plugin's config hook
        self._tmp = tempfile.TemporaryDirectory(prefix="cg_extract_sweep_")
        self.model_dir = write_model_dir(
            Path(self._tmp.name) / "model",
            hidden_size=params.hidden_size,
            num_layers=max(params.aux_layers) + 1,
            dtype=VLLM_DTYPES[params.dtype],
        )
        self.block_size = self.vllm_config().cache_config.block_size

    def vllm_config(self, **our_keys: Any):
        from vllm_on_cpu.harness import build_vllm_config

        p = self.params
        max_tokens = max(p.max_tokens, max(p.capture_sizes))
        return build_vllm_config(
            self.model_dir,
            aux_layer_ids=list(p.aux_layers),
            dtype=VLLM_DTYPES[p.dtype],
            max_num_batched_tokens=max_tokens,
            max_num_seqs=min(MAX_NUM_SEQS, max_tokens),  # vLLM: seqs <= tokens
            **our_keys,
        )

    def make_inputs(self, num_tokens: int, generator: torch.Generator):
        from vllm_on_cpu.harness import make_step_inputs

        return make_step_inputs(self.reference.loaded, num_tokens, generator)


ENGINE = SpeculatorEngine
MODES = SpeculatorEngine.MODES
