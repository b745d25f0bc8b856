"""The NVML sampler against the real pynvml, on this GPU (the fake's tests:
tests/torch_alone/test_nvml.py)."""

from __future__ import annotations

import math
import os
import time

import pynvml
import pytest
import torch

from perf.nvml import NvmlSampler, nvml_index


@pytest.mark.cuda
def test_real_nvml_on_this_gpu():
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    index = nvml_index(
        torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    with NvmlSampler(pynvml, index=index, interval_s=0.01) as sampler:
        assert sampler.available, sampler.reason
        with sampler.segment("matmul"):
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                x = (x @ x).clamp_(-1, 1)
                torch.cuda.synchronize()
        summary = sampler.summary("matmul", steps=1)
    assert 0 <= summary["gpu_util_pct"] <= 100
    assert summary["gpu_mem_used_mib"] > 0
    assert summary["power_w"] > 0 or math.isnan(summary["power_w"])
    assert summary["sm_clock_mhz"] > 0
    energy = summary["energy_mj_per_step"]
    assert energy >= 0 or math.isnan(energy)
