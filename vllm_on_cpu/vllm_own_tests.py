"""vLLM's own tests, from the installed release's source distribution, run
twice at once: with cg_extract's plugin loaded at session start and without
any (:mod:`vllm_on_cpu.plugin_loaded`); every test whose outcome differs.

    python -m vllm_on_cpu.vllm_own_tests [--registered] TEST_PATH_OR_ID...

vLLM's unit tests seldom build ``EngineArgs``, the only thing that loads
plugins in a test process, so in a plain run they test vLLM without us;
forced in, the plugin's rebinding of vLLM's names is what they meet. The
tests run from a folder holding the release's ``tests/`` (symlinks) and
``pyproject.toml`` but no ``vllm/``, so the installed vLLM is the one
imported (it has the compiled ops; the source distribution's has none),
offline (``HF_HUB_OFFLINE=1``, the hub models of :data:`MODELS` given as
local config folders). Outcomes are compared by kind (passed, failed,
error, skipped): messages carry addresses and timings.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from compat import vllm_release
from upstream.apply_series import link_tests
from upstream.vllm_tests import OFFLINE_MODELS
from vllm_on_cpu.plugin_loaded import HEADER

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "vllm_on_cpu" / "site"
# ``ModelConfig()``'s default model, which vLLM's KV-cache layout tests build
# (offline they fail before reaching the layout we wrap); its hub config.
MODELS = {
    **OFFLINE_MODELS,
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
# Each run's state: "off", and what the run with the plugin requires.
WITHOUT = "off"


@dataclass
class Run:
    outcomes: dict[str, str]  # node id -> passed | failed | error | skipped
    messages: dict[str, str]  # node id -> its first failure/skip message
    seconds_by_file: dict[str, float]  # test time (junit's), for the CI budget
    state: str  # what vLLM's classes showed (plugin_loaded's summary line)
    seconds: float
    returncode: int


@dataclass
class Comparison:
    version: str
    tests: list[str]
    without: Run
    with_plugin: Run

    def differences(self) -> dict[str, tuple[str, str]]:
        """Test id -> (outcome without, outcome with), where they differ
        (a test one run lacks counts as ``missing``)."""
        a, b = self.without.outcomes, self.with_plugin.outcomes
        return {
            test: (a.get(test, "missing"), b.get(test, "missing"))
            for test in sorted(a.keys() | b.keys())
            if a.get(test) != b.get(test)
        }


def counts(run: Run) -> dict[str, int]:
    found: dict[str, int] = {}
    for outcome in run.outcomes.values():
        found[outcome] = found.get(outcome, 0) + 1
    return dict(sorted(found.items()))


def tree(version: str, into: Path) -> Path:
    """``into`` made a folder to run ``version``'s tests from (its
    ``tests/``, without its ``vllm/``: the installed one is imported)."""
    link_tests(vllm_release.sdist(version), into)
    return into


def tests_calling(version: str, test_file: str, names: set[str]) -> list[str]:
    """The tests of ``version``'s ``test_file`` whose body calls one of
    ``names`` (a function, or a method of that name), as node ids: a large
    file's tests of one function, without the rest."""
    tree_ = ast.parse((vllm_release.sdist(version) / test_file).read_text())
    return [
        f"{test_file}::{node.name}"
        for node in tree_.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
        and any(
            isinstance(call, ast.Call)
            and getattr(call.func, "id", getattr(call.func, "attr", None)) in names
            for call in ast.walk(node)
        )
    ]


def environment(folder: Path, models: Path) -> dict[str, str]:
    """The process environment of a run from ``folder``: the rig's Triton
    stand-in (0.34 refuses an x86 CPU without it, and MRv2 needs it), its
    offline models, no runner or plugin choice inherited."""
    redirect = {}
    for name, config in MODELS.items():
        redirect[name] = str(models / name.replace("/", "--"))
        Path(redirect[name]).mkdir(parents=True)
        (Path(redirect[name]) / "config.json").write_text(json.dumps(config))
    (models / "redirect.json").write_text(json.dumps(redirect))
    env = {
        **os.environ,
        # vLLM's `tests` package before ours (ROOT has one too).
        "PYTHONPATH": os.pathsep.join(map(str, (folder, ROOT, SITE))),
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",  # two runs on two cores
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "VLLM_MODEL_REDIRECT_PATH": str(models / "redirect.json"),
    }
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_PLUGINS"):
        env.pop(name, None)  # the tests choose the runner; plugin_loaded sets it
    return env


def junit_outcomes(
    path: Path,
) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """Outcome and message by node id (``file::Class::name``; xunit1's
    ``file`` attribute: a class name alone does not say where a module ends)."""
    outcomes, messages, seconds = {}, {}, {}
    for case in ElementTree.parse(path).iter("testcase"):
        file = case.get("file") or ""
        module = file.removesuffix(".py").replace("/", ".")
        owner = case.get("classname", "").removeprefix(module).lstrip(".")
        test = "::".join(filter(None, (file, owner, case.get("name"))))
        ends = [c for c in case if c.tag in ("failure", "error", "skipped")]
        # A test that fails and errors in teardown is one case with both.
        kinds = sorted({"failed" if c.tag == "failure" else c.tag for c in ends})
        outcomes[test] = "+".join(kinds) or "passed"
        if ends:
            messages[test] = ends[0].get("message") or ""
        seconds[file] = seconds.get(file, 0.0) + float(case.get("time") or 0)
    return outcomes, messages, seconds


def run(
    folder: Path,
    tests: list[str],
    state: str,
    env: dict[str, str],
    timeout: float | None = None,
) -> Run:
    """pytest on ``tests`` from ``folder`` with the plugin in ``state``
    (:data:`vllm_on_cpu.plugin_loaded.STATES`)."""
    junit = folder / f"{state}.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    command += ["-p", "vllm_on_cpu.plugin_loaded", f"--cg-extract={state}"]
    # A folder with a module that fails to import (CUDA-only, torchvision)
    # still runs the rest; the module counts as an error, in both runs.
    command += ["--continue-on-collection-errors"]
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1", *tests]
    start = time.monotonic()
    proc = subprocess.run(
        command, cwd=folder, env=env, text=True, capture_output=True, timeout=timeout
    )
    seconds = time.monotonic() - start
    found = re.search(rf"^{HEADER}(.*) \(vllm ", proc.stdout, re.M)
    # 0: all passed, 1: some failed; anything else stopped the session.
    if proc.returncode not in (0, 1) or found is None or not junit.is_file():
        raise RuntimeError(
            f"pytest --cg-extract={state} {' '.join(tests)} exited "
            f"{proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return Run(*junit_outcomes(junit), found.group(1), seconds, proc.returncode)


def compare(
    tests: list[str],
    version: str | None = None,
    with_plugin: str = "installed",
    timeout: float | None = None,
) -> Comparison:
    """:func:`run` without the plugin and with it (``with_plugin``: the
    state required, ``installed`` or ``registered``), both at once, in the
    installed vLLM's release's test tree (``version`` checks it)."""
    import vllm

    installed = vllm.__version__.split("+")[0]
    if version not in (None, installed):
        raise ValueError(f"asked for vLLM {version}'s tests; {installed} is installed")
    with tempfile.TemporaryDirectory(prefix="vllm_own_tests_") as scratch:
        folder = tree(installed, Path(scratch))
        env = environment(folder, Path(scratch) / "models")
        with ThreadPoolExecutor(2) as pool:
            without, loaded = (
                pool.submit(run, folder, tests, state, env, timeout)
                for state in (WITHOUT, with_plugin)
            )
            return Comparison(installed, tests, without.result(), loaded.result())


def report(comparison: Comparison) -> str:
    lines = [f"vLLM {comparison.version}: {' '.join(comparison.tests)}"]
    for name, got in (
        ("without", comparison.without),
        ("with", comparison.with_plugin),
    ):
        lines.append(
            f"  {name:7} cg_extract ({got.state}): {counts(got)} in {got.seconds:.0f} s"
        )
    for test, (a, b) in comparison.differences().items():
        message = comparison.with_plugin.messages.get(test, "")[:200]
        lines.append(f"  DIFFERS {test}: {a} without, {b} with {message}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="+", help="paths or ids under tests/")
    parser.add_argument(
        "--registered",
        action="store_true",
        help="accept the plugin stepped aside (a release it is not ported to)",
    )
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    args = parser.parse_args(argv)
    done = compare(
        args.tests, with_plugin="registered" if args.registered else "installed"
    )
    print(report(done))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "version": done.version,
                    "tests": done.tests,
                    "without": vars(done.without),
                    "with": vars(done.with_plugin),
                },
                indent=1,
            )
        )
    return 1 if done.differences() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
