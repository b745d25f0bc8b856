"""TEST FIXTURE, a pytest plugin: tests marked ``mrv2_process`` run in one
pytest process of their own where vLLM resolves Model Runner V2 on this CPU.

Extraction across pipeline stages is refused on vLLM's V1 runner, which is
what a plain CPU process gets (no usable Triton). MRv2 needs the Triton
stand-in in place before ``vllm`` is first imported
(:func:`vllm_on_cpu.engine.cpu_env`), too late in a session that imported it
already. So the first marked test runs every marked test of the session in a
child ``pytest`` started with that environment; each marked test here then
reports the child's outcome for it (failures with the child's traceback).
The child's own fixtures and plugins are the session's; vLLM's config and
objects are real, only the runner it resolves differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MARK = "mrv2_process"
# In the child: where it writes each test's outcome.
CHILD_REPORT = "VLLM_ON_CPU_MRV2_REPORT"
_CHILD = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARK}: run in a child pytest whose vLLM resolves Model Runner V2 "
        "on this CPU (vllm_on_cpu/mrv2_process.py)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    # A child, or a session already started with that environment (vLLM
    # 0.34's, which needs the stand-in for any config): run them here.
    if os.environ.get(CHILD_REPORT) or _started_with_the_stand_in():
        return
    marked = [item for item in items if item.get_closest_marker(MARK)]
    state = {"nodeids": [item.nodeid for item in marked], "outcomes": None}
    config.stash[_CHILD] = state
    for item in marked:
        item.runtest = _reported_by_child(item, state)


def _started_with_the_stand_in() -> bool:
    from triton.backends import backends

    return os.environ.get("TRITON_INTERPRET") == "1" and "cpu" in backends


def _reported_by_child(item: pytest.Item, state: dict):
    def runtest() -> None:
        if state["outcomes"] is None:
            state["outcomes"] = _run_child(item.config, state["nodeids"])
        outcome = state["outcomes"].get(item.nodeid)
        if outcome is None:
            pytest.fail(
                f"the MRv2 child ran no {item.nodeid}:\n{state['outcomes']['']}",
                pytrace=False,
            )
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"])
        if outcome["outcome"] != "passed":
            pytest.fail(f"in the MRv2 child:\n{outcome['text']}", pytrace=False)

    return runtest


def _run_child(config: pytest.Config, nodeids: list[str]) -> dict:
    from vllm_on_cpu.engine import cpu_env

    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "outcomes.json"
        env = {**os.environ, **cpu_env(), CHILD_REPORT: str(report)}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
            cwd=config.rootpath,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        outcomes = json.loads(report.read_text()) if report.exists() else {}
    outcomes[""] = (proc.stdout + proc.stderr)[-6000:]  # for a test it never ran
    return outcomes


# In the child: each test's outcome, its first failing phase's if any.

_outcomes: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get(CHILD_REPORT):
        return
    seen = _outcomes.get(report.nodeid)
    if seen is None or (seen["outcome"] == "passed" and not report.passed):
        text = report.longreprtext
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        _outcomes[report.nodeid] = {"outcome": report.outcome, "text": text}


def pytest_sessionfinish() -> None:
    path = os.environ.get(CHILD_REPORT)
    if path:
        Path(path).write_text(json.dumps(_outcomes))
