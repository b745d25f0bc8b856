"""TEST FIXTURE, a pytest plugin: the series' CUDA-only unit tests run on a
CPU, on a FAKE of ``torch.cuda``'s graph API.

    pytest -p vllm_on_cpu.graph_unit_stand_in tests/v1/spec_decode/...

0002's unit tests (vLLM's ``test_extract_hidden_states_cudagraph.py``) skip
what needs capture or replay without CUDA (``skipif(..., reason="requires
CUDA")``), as vLLM's GPU tests do. Loaded from outside vLLM's tree
(``upstream/vllm_tests.py``, whose run also collects vLLM's existing tests
of what the series touches), this plugin runs those same test bodies here:
it drops that skip from every collected test that carries it (in that run,
0002's only: ``tests/vllm_engine/test_upstream_series.py`` checks which
tests it ran, by name) and, around each such test only, puts in place
:mod:`vllm_on_cpu.cuda_graph`'s fake graph API (a capture records the
region's ops, a replay runs them again on the captured tensors), the host
calls a CUDA capture makes that a CPU lacks, and the host as vLLM's CPU
worker sets it up (unpinned buffers), which 0002's tests build on.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

REASON = "requires CUDA"
_ON_FAKE = pytest.StashKey[bool]()


def _requires_cuda(mark: pytest.Mark) -> bool:
    return mark.name == "skipif" and mark.kwargs.get("reason") == REASON


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(map(_requires_cuda, item.own_markers)):
            item.own_markers[:] = [m for m in item.own_markers if not _requires_cuda(m)]
            item.stash[_ON_FAKE] = True
            # In a JUnit report: which tests ran here that skip without CUDA.
            item.user_properties.append(("cpu_stand_in_for", REASON))


@contextlib.contextmanager
def fake_cuda_graphs():
    """:mod:`vllm_on_cpu.cuda_graph`'s graph API and the host calls a CUDA
    capture makes that a CPU lacks, in place until the block ends; yields the
    ``MonkeyPatch`` that holds them."""
    from vllm.forward_context import DPMetadata
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffer_utils
    from vllm.v1.worker.gpu import buffer_utils, cudagraph_utils

    from vllm_on_cpu import cuda_graph

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "CUDAGraph", cuda_graph.CUDAGraph)
        m.setattr(torch.cuda, "graph", cuda_graph.graph)
        m.setattr(torch.cpu, "graph_pool_handle", cuda_graph.graph_pool_handle, False)
        # What a capture on CUDA syncs, streams and frees: a CPU's ops are
        # done when they return, and it has no stream to capture on.
        m.setattr(
            cudagraph_utils,
            "graph_capture",
            lambda device, stream=None: contextlib.nullcontext(
                types.SimpleNamespace(stream=stream)
            ),
        )
        m.setattr(cudagraph_utils, "current_stream", lambda: None)
        m.setattr(torch.accelerator, "synchronize", lambda *args: None)
        m.setattr(torch.accelerator, "empty_cache", lambda: None)
        # vLLM's DP token counts are host tensors on a GPU: no graph holds
        # their reads (cuda_graph.host_work says why it must be told).
        make = staticmethod(cuda_graph.host_work(DPMetadata.make))
        m.setattr(DPMetadata, "make", make)
        # The host as vLLM's CPU worker sets it up (v1/worker/cpu/shm.py):
        # unpinned host buffers; and the graph pool this run makes, dropped
        # after it.
        m.setattr(buffer_utils, "UvaBuffer", cpu_buffer_utils.UvaBuffer)
        m.setattr(type(current_platform), "_global_graph_pool", None)
        yield m


@pytest.fixture(autouse=True)
def _fake_cuda_graphs(request: pytest.FixtureRequest):
    if not request.node.stash.get(_ON_FAKE, False):
        yield
        return
    with fake_cuda_graphs():
        yield
