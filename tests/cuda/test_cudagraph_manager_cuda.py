"""CudaGraphManager on a real device: the caller's pool shared, one pool for
all sizes, capture accounting and release. The rig and the replay check are
tests/torch_alone/test_cudagraph_manager.py's, whose backend-parametrized
tests run on both backends."""

from __future__ import annotations

import pytest
import torch

from cg_extract.cudagraph_manager import CudaGraphManager
from tests.torch_alone.test_cudagraph_manager import (
    F32,
    HAS_CUDA,
    SIZES,
    build_rig,
    replay_and_compare,
)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_shares_the_callers_pool():
    pool = torch.cuda.graph_pool_handle()
    rig = build_rig("cuda", pool=pool)
    assert rig.manager.pool is pool
    assert rig.manager.captured_sizes == list(SIZES)
    replay_and_compare(rig, 3, seed=0)
    rig.manager.release()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_makes_one_pool_for_all_sizes():
    manager = CudaGraphManager(SIZES, "cuda", backend="cuda")
    assert manager.pool is None
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    manager.capture(lambda n: dst[:n].copy_(src[:n] * 2))
    assert manager.pool is not None
    manager.release()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_accounting_and_release():
    torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # left cached
    rig = build_rig("cuda")
    manager = rig.manager
    # The cached block each capture's empty_cache frees is not counted.
    assert 0 < manager.graph_memory_bytes < 64 * 2**20
    assert manager.capture_time_s > 0
    assert manager.captured_sizes == list(SIZES)
    manager.release()
    assert manager.captured_sizes == []
    assert manager.padded_size(1) is None
