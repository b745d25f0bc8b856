"""vLLM 0.34.0's pre-commit hooks on upstream/'s series (upstream/precommit.py),
each tool from the package registry at the version its hook pins, in a tool
environment of its own under $CG_EXTRACT_CACHE. No vLLM import: the hooks
read vLLM's source distribution."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "upstream"))
import precommit  # noqa: E402

# The hooks that select a file of the series: ruff and typos from their
# repositories' pins, the rest vLLM's local hooks (mypy through its own
# tools/pre_commit/mypy.py). The others select none of its files.
SELECTING = {
    "ruff-check",
    "ruff-format",
    "typos",
    "mypy",
    "check-buildkite-step-keys",  # 0002 adds to a job's dependencies
    "check-test-tethering",
    "check-spdx-header",
    "check-root-lazy-imports",
    "check-filenames",
    "update-dockerfile-graph",
    "check-forbidden-imports",
    "check-torch-cuda-call",
    "validate-config",
    "check-dockerignore-tracked",
    "check-boolean-context-manager",
    "check-trust-remote-code",
    "suggestion",
}

# A planted file for each kind of finding: no SPDX header, an unused import
# (ruff check), a line ruff format rewrites, a misspelling (typos), an
# attribute mypy knows is missing, and a test file no Buildkite job collects.
PLANTED = {
    "tests/v1/spec_decode/test_planted_findings.py": (
        "import os\nimport sys\n\n\ndef test_planted():\n"
        "    # recieve\n    x=os.no_such_function()\n    assert x\n"
    ),
    "tests/planted_untethered/test_planted_untethered.py": (
        "# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n\n\n"
        "def test_planted():\n    pass\n"
    ),
}


def test_vllms_hooks_pass_on_the_series():
    outcomes, files, _ = precommit.check()
    failed = {o.hook: o.output for o in outcomes if o.returncode}
    assert failed == {}
    assert {o.hook for o in outcomes} == SELECTING
    # Every Python file of the series went through ruff, typos and mypy.
    by_hook = {o.hook: o.files for o in outcomes}
    python = [f for f in files if f.endswith(".py")]
    assert len(python) >= 5
    for hook in ("ruff-check", "ruff-format", "mypy"):
        assert by_hook[hook] == python, hook
    assert by_hook["typos"] == files


def test_planted_findings_fail_their_hooks():
    tree, files = precommit.series_tree(precommit.VERSION)
    for path, text in PLANTED.items():
        (tree / path).parent.mkdir(exist_ok=True)
        (tree / path).write_text(text)
    env = precommit.tool_env(precommit.config_of(tree))
    outcomes = precommit.run_hooks(
        tree, sorted(files + list(PLANTED)), env, precommit.VERSION
    )
    failed = {o.hook: o.output for o in outcomes if o.returncode}
    assert set(failed) == {
        "ruff-check",
        "ruff-format",
        "typos",
        "mypy",
        "check-spdx-header",
        "check-test-tethering",
    }, failed
    assert "F401" in failed["ruff-check"]
    assert "recieve" in failed["typos"]
    assert 'Module has no attribute "no_such_function"' in failed["mypy"]
    assert "test_planted_untethered.py" in failed["check-test-tethering"]
    assert "test_planted_findings.py" in failed["check-spdx-header"]
