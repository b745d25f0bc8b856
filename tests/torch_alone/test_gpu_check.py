"""``perf/gpu_check.sh`` rehearsed on this CPU as the GPU check's machine would
run it: ``python3`` first on ``PATH`` (this interpreter's), no vLLM
(``tests/torch_alone/no_vllm_site``), torch without CUDA. Every step that needs no CUDA
must pass and the script must end with its own "no CUDA" status; a test file
that imports vLLM unguarded must turn that into "could not start". The CUDA
steps' verdict branches run with a STAND-IN for their results
(``tests/torch_alone/gpu_check_stand_in.py``). Every run leaves at most the 8 files a GPU
machine returns: ``summary.txt`` and one archive of the logs. And the Triton
compiles the check pays for stay few."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_VLLM_SITE = HERE / "no_vllm_site"
PASSED, FAILED, NOT_STARTED, NO_CUDA = 0, 1, 2, 3
RETURNED_FILES = 8  # what a GPU machine run brings back, at most
STAND_IN = HERE / "gpu_check_stand_in.py"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a rehearsal for machines without CUDA"
)


def run_check(repo: Path, out: Path, **extra_env: str) -> subprocess.CompletedProcess:
    """As its machine runs it: this interpreter is ``python3`` on ``PATH``,
    and no ``python`` of it is (the machine documents only ``python3``)."""
    bin_dir = out.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    ours = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p != ours]
    env = {k: v for k, v in os.environ.items() if k not in ("PY", "TRITON_INTERPRET")}
    env["PATH"] = os.pathsep.join([str(bin_dir), *path])
    env["PYTHONPATH"] = str(NO_VLLM_SITE)
    env.update(extra_env)
    return subprocess.run(
        [str(repo / "perf" / "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_rehearsal_runs_every_step_that_needs_no_cuda(tmp_path):
    done = run_check(ROOT, tmp_path / "out")
    log = done.stdout + done.stderr
    out = tmp_path / "out"
    env = read_archived(out, "env.log")
    assert "vllm importable: False" in env, log  # the rehearsal hid it
    assert "cuda available: False" in env, log
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("env: "), log
    assert summary[1].startswith("collect: exit 0, "), log
    assert "error" not in summary[1], log
    assert summary[-1].startswith("gpu_check: no CUDA here: "), log
    assert done.stdout.splitlines()[-1] == summary[-1]
    assert done.returncode == NO_CUDA, log
    assert archived(out) == {"env.log", "collect.log"}  # the CUDA steps did not start


def archived(out: Path) -> set[str]:
    """What the run left: ``summary.txt`` and the archive, no more than a
    GPU machine returns; the names in the archive."""
    left = sorted(p.name for p in out.iterdir())
    assert left == ["gpu_check.tar.gz", "summary.txt"], left
    assert len(left) <= RETURNED_FILES
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        return {Path(name).name for name in archive.getnames() if name != "."}


def read_archived(out: Path, name: str) -> str:
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        return archive.extractfile(f"./{name}").read().decode()


A_GPU_RUNS_FILES = {"env.log", "collect.log", "pytest.log", "junit.xml", "sweep.log",
                    "kernel.csv", "kernel.png", "kernel.meta.json"}  # fmt: skip
# Where vLLM imports, the split step's too (the stand-in's: no plot).
SPLIT_FILES = {"split.log", "split.csv"}


@pytest.mark.parametrize(
    ("outcome", "status", "verdict"),
    [
        (
            "pass",
            PASSED,
            "passed: the cuda tests (2 run), the kernel sweep and the "
            "split_kv_cache_groups measurement",
        ),
        ("failed", FAILED, "a CUDA step failed: cuda tests (pytest.log)"),
        ("skipped", FAILED, "a CUDA step failed: every cuda test skipped (pytest.log)"),
        (
            "not_exact",
            FAILED,
            "a CUDA step failed: kernel sweep rows with bit_exact False",
        ),
    ],
)
def test_the_cuda_steps_verdicts_with_stand_in_results(
    tmp_path, outcome, status, verdict
):
    """The branches a GPU run takes, the CUDA steps' results written by a
    STAND-IN (no GPU runs): a pass, a failed test, every cuda test skipped
    (pytest's exit 0 is no pass then), a row that is not bit-exact. The
    split step's two outcomes: the pass runs where vLLM imports (this
    interpreter's, not hidden), so the step runs (its stand-in's rows); the
    others as the GPU machine, without vLLM, where it says it was not run
    and the verdict is the other steps'."""
    out = tmp_path / "out"
    vllm = outcome == "pass"
    done = run_check(
        ROOT,
        out,
        GPU_CHECK_STAND_IN=str(STAND_IN),
        GPU_CHECK_STAND_IN_OUTCOME=outcome,
        **({"PYTHONPATH": ""} if vllm else {}),
    )
    log = done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert any(line.startswith("STAND-IN: no GPU ran") for line in summary), log
    assert summary[-1] == f"gpu_check: {verdict} [STAND-IN results: no GPU ran]", log
    assert done.returncode == status, log
    split = [line for line in summary if line.startswith("split: ")]
    if vllm:
        assert split[0].startswith("split: exit 0, "), log
        assert archived(out) == A_GPU_RUNS_FILES | SPLIT_FILES
    else:
        assert split == [
            "split: not run: vLLM is not importable here (env.log), and the "
            "split_kv_cache_groups measurement runs vLLM's engine (its CPU "
            "figures: docs/measurements.md)"
        ], log
        assert archived(out) == A_GPU_RUNS_FILES


def test_an_unguarded_vllm_import_makes_the_rehearsal_fail(tmp_path):
    repo = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("cg_extract", "compat", "perf", "tests", "vllm_on_cpu"):
        shutil.copytree(ROOT / part, repo / part, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", repo)
    # In a level's folder, as a new test would be: the check collects tests/ whole.
    (repo / "tests" / "vllm_objects" / "test_unguarded.py").write_text(
        "import vllm\n\n\ndef test_nothing():\n    assert vllm\n"
    )
    done = run_check(repo, tmp_path / "out")
    log = done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith("gpu_check: could not start: tests/ does not collect"), log
    assert "tests/vllm_objects/test_unguarded.py" in last, log
    assert done.returncode == NOT_STARTED, log


def test_the_measured_kernel_is_among_the_dozen_the_kernel_tests_compile():
    """What the check's Triton compiles cost (``tests/torch_alone/kernel_keys.py``): every
    case of the kernel's CUDA tests is one compile, no more, and every mode of
    the sweep launches one kernel, which those tests compile too."""
    pytest.importorskip("triton")
    from tests.cuda.test_write_kernel_cuda import CUDA_CASES
    from tests.torch_alone import kernel_keys

    tested = kernel_keys.KernelKeys()
    kernel_keys.kernel_test_launches(tested)
    assert len(tested.compiles) == len(CUDA_CASES) == 12
    measured = kernel_keys.KernelKeys()
    with kernel_keys.recording(measured):
        kernel_keys.sweep_launches(
            ["--sizes", "1", "3", "600", "--capture-sizes", "1", "4"]
        )
    assert len(measured.compiles) == 1
    assert measured.compiles.keys() <= tested.compiles.keys()
