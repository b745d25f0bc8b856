"""perf/sweep.py's kernel engine on a CUDA device: the graph mode bit exact and
replayed within the capture range, and a whole kernel sweep. The settings are
tests/torch_alone/test_sweep.py's."""

from __future__ import annotations

import json

import pytest
import torch

from perf import sweep
from perf.kernel_engine import KernelEngine
from perf.measure import count_step, graph_steps_kept
from tests.torch_alone.test_sweep import TINY, params, read_csv


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40])
def test_kernel_graph_on_cuda(num_tokens):
    engine = KernelEngine(params("cuda", dtype="bf16"))
    with graph_steps_kept():
        engine.build(["upstream", "eager", "graph"])
    assert not engine.skipped
    inputs = engine.make_inputs(num_tokens, torch.Generator().manual_seed(3))
    for runner in engine.runners.values():
        assert sweep.bit_exact(engine, runner, inputs, runner.receive(inputs))
    graph = count_step(lambda: engine.runners["graph"].step(inputs))
    eager = count_step(lambda: engine.runners["eager"].step(inputs))
    if num_tokens <= 16:
        assert graph.replayed and graph.padded_tokens(num_tokens) >= num_tokens
        assert len(graph.dispatched) < len(eager.dispatched)
    else:
        assert not graph.replayed


@pytest.mark.cuda
def test_kernel_sweep_on_cuda(tmp_path):
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--sizes", "3", "16", "600", "--out", str(out)]
    assert sweep.main([*argv, *TINY]) == 0
    frame = read_csv(out)
    graph = frame[frame["mode"] == "graph"].set_index("num_tokens")
    assert graph["bit_exact"].all()
    assert graph.loc[3, "padded_tokens"] == 4
    assert graph.loc[600, "padded_tokens"] == 600  # beyond the capture range: eager
    assert (frame["p50_us"] > 0).all()
    launches = graph.loc[[3, 16], "launches_per_step"]
    assert ((launches > 0) & (launches < 10)).all(), launches
    captured = json.loads(out.with_suffix(".meta.json").read_text())["graphs"]
    assert captured["kernel"]["graph"]["graph_memory_bytes"] > 0
    assert captured["kernel"]["graph"]["capture_time_s"] > 0
