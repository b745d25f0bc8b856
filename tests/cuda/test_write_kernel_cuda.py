"""The write op's Triton kernel on a real GPU: against its torch body and the
element-by-element reference, and inside a real CUDA graph. Every test is
``cuda``-marked; ``perf/gpu_check.sh`` runs them on a machine without vLLM
(this file imports none, nor hypothesis)."""

from __future__ import annotations

import itertools

import pytest
import torch

from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.write_op import write_hidden_states
from tests.write_cases import (
    DTYPES,
    LAYOUTS,
    WriteCase,
    run_op,
    same_bytes,
    write_case,
)

# Each compile costs the GPU check about a second (tests/torch_alone/kernel_keys.py counts
# and times them), so not the full product: every pair of dtype, hidden size
# and layout (with its layer count) appears once, 12 compiles. Hidden sizes:
# 1 (an int Triton makes a constant), 100 (one partial chunk), 4096 (four
# whole chunks), 5000 (the fifth partial); bf16 at 4096 with 4 stacked layers
# is the measured shape (every mode of the sweep launches that very kernel),
# as in the graph and strided-slot tests below.
LAYERS_AND_LAYOUTS = list(zip((1, 4, 8), LAYOUTS, strict=True))
CUDA_CASES = [
    (dtype, hidden_size, *LAYERS_AND_LAYOUTS[(i + 1) % 3])
    for i, (dtype, hidden_size) in enumerate(
        itertools.product(DTYPES, (1, 100, 4096, 5000))
    )
]


def cuda_case(dtype, hidden_size, num_layers, layout) -> WriteCase:
    """One of CUDA_CASES, on CPU."""
    return write_case(
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


def graph_case(seed: int, padding: list[int]) -> WriteCase:
    return write_case(
        torch.Generator().manual_seed(seed),
        64,
        4,
        4096,
        torch.bfloat16,
        "stacked",
        padding,
    )


def strided_slots_case() -> WriteCase:
    return write_case(
        torch.Generator().manual_seed(2), 40, 4, 4096, torch.bfloat16, "separate", [7]
    )


def strided_view(slots: torch.Tensor) -> torch.Tensor:
    """The same slots as a view with stride 2 (a column of a wider tensor)."""
    return torch.stack([slots, slots.flip(0)], dim=1)[:, 0]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, hidden_size, num_layers, layout", CUDA_CASES, ids=str)
def test_kernel_on_cuda_matches_the_torch_body(dtype, hidden_size, num_layers, layout):
    case = cuda_case(dtype, hidden_size, num_layers, layout)
    got = run_op(case.to("cuda"))
    torch.cuda.synchronize()
    assert same_bytes(got, run_op(case))
    assert same_bytes(got, case.expected())


@pytest.mark.cuda
def test_kernel_in_a_real_cuda_graph():
    """Captured once over static inputs, replayed over new values and new
    padding: each replay equals the torch body, block 0 and padding untouched."""
    case = graph_case(0, []).to("cuda")
    aux = [a.clone() for a in case.aux]
    slots = case.slots.clone()
    cache = case.fresh_cache()
    manager = CudaGraphManager([16, 64], "cuda", "cuda")
    manager.capture(
        lambda n: write_hidden_states([a[:n] for a in aux], cache, slots[:n]),
        progress=False,
    )
    for seed in range(20):
        new = graph_case(seed, padding=list(range(seed, 64, 7)))
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
    case = strided_slots_case().to("cuda")
    strided = strided_view(case.slots)
    assert strided.stride(0) == 2 and torch.equal(strided, case.slots)
    got = case.fresh_cache()
    write_hidden_states(case.aux, got, strided)
    torch.cuda.synchronize()
    assert same_bytes(got, case.expected())
