"""The write op's Triton kernel on a real GPU: against its torch body and the
element-by-element reference, and inside a real CUDA graph. Every test is
``cuda``-marked; ``perf/gpu_check.sh`` runs them on a machine without vLLM
(this file imports none, nor hypothesis)."""

from __future__ import annotations

import pytest
import torch

from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.write_op import write_hidden_states
from tests.write_cases import DTYPES, LAYOUTS, run_op, same_bytes, write_case

CUDA_CASES = [
    (dtype, hidden_size, num_layers, layout)
    for dtype in DTYPES
    for hidden_size in (1, 100, 1024, 4096, 5000)
    for num_layers, layout in zip((1, 4, 8), LAYOUTS, strict=True)
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, hidden_size, num_layers, layout", CUDA_CASES, ids=str)
def test_kernel_on_cuda_matches_the_torch_body(dtype, hidden_size, num_layers, layout):
    case = write_case(
        torch.Generator().manual_seed(hidden_size),
        num_tokens=300,
        num_layers=num_layers,
        hidden_size=hidden_size,
        dtype=dtype,
        layout=layout,
        padding=[0, 5, *range(290, 300)],
        slot_dtype=torch.int32 if hidden_size == 100 else torch.int64,
        null_block=True,
    )
    got = run_op(case.to("cuda"))
    torch.cuda.synchronize()
    assert same_bytes(got, run_op(case))
    assert same_bytes(got, case.expected())


@pytest.mark.cuda
def test_kernel_in_a_real_cuda_graph():
    """Captured once over static inputs, replayed over new values and new
    padding: each replay equals the torch body, block 0 and padding untouched."""
    case = write_case(
        torch.Generator().manual_seed(0), 64, 4, 1000, torch.bfloat16, "stacked", []
    ).to("cuda")
    aux = [a.clone() for a in case.aux]
    slots = case.slots.clone()
    cache = case.fresh_cache()
    manager = CudaGraphManager([16, 64], "cuda", "cuda")
    manager.capture(
        lambda n: write_hidden_states([a[:n] for a in aux], cache, slots[:n]),
        progress=False,
    )
    for seed in range(20):
        new = write_case(
            torch.Generator().manual_seed(seed),
            64, 4, 1000, torch.bfloat16, "stacked", padding=list(range(seed, 64, 7)),
        )  # fmt: skip
        for static, values in zip(aux, new.aux, strict=True):
            static.copy_(values)
        slots.copy_(new.slots)
        cache.copy_(new.initial)
        manager.replay(64)
        torch.cuda.synchronize()
        assert same_bytes(cache, new.expected()), f"replay {seed}"


@pytest.mark.cuda
def test_kernel_on_cuda_reads_strided_slots():
    """A slot view with stride 2 (a column of a wider tensor) through the op."""
    case = write_case(
        torch.Generator().manual_seed(2), 40, 3, 512, torch.bfloat16, "separate", [7]
    ).to("cuda")
    strided = torch.stack([case.slots, case.slots.flip(0)], dim=1)[:, 0]
    assert strided.stride(0) == 2
    got = case.fresh_cache()
    write_hidden_states(case.aux, got, strided)
    torch.cuda.synchronize()
    assert same_bytes(got, case.expected())
