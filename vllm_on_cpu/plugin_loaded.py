"""TEST FIXTURE, a pytest plugin: vLLM's own tests run with cg_extract's
``register()`` forced at session start, or, for the control run, with no
general plugin at all.

    pytest -p vllm_on_cpu.plugin_loaded [--cg-extract=installed|registered|off] ...

vLLM loads general plugins only when something builds ``EngineArgs`` (or
the CLI), once per process, whatever ``VLLM_PLUGINS`` says then (notes,
"Plugins and engines in one process"); most of vLLM's unit tests never do,
so without this they cannot tell whether the plugin is there. Both runs go
through the same ``load_general_plugins()`` call at the same moment, so the
plugin is the only difference between them; ``VLLM_PLUGINS`` stays set for
engine processes the tests spawn. The session stops before collecting
anything unless the state asked for is what vLLM's classes show:

* ``installed`` (default): ``register()`` ran and put its hooks in;
* ``registered``: it ran, hooks in or stepped aside (a vLLM it does not
  test), for surveys of a release the plugin is not yet ported to;
* ``off``: nothing of cg_extract's is on vLLM's classes.

The state found is the terminal summary's ``cg_extract:`` line, which
:mod:`vllm_on_cpu.vllm_own_tests` reads.
"""

from __future__ import annotations

import os

import pytest

STATES = ("installed", "registered", "off")
HEADER = "cg_extract: "
_FOUND = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cg-extract",
        choices=STATES,
        default="installed",
        help="load cg_extract's vLLM plugin at session start and require "
        "that state (off: load no general plugin)",
    )


def state() -> str:
    """What vLLM's classes show of cg_extract: ``installed``, ``stepped
    aside`` or ``off``.

    Read off vLLM, not off cg_extract's internals, so that it holds across
    the plugin's refactors: ``register()`` always puts its config gate (a
    descriptor of ``cg_extract.plugin``) on ``EngineArgs``, stepped aside or
    not; the hooks it installs on a tested vLLM carry ``wrap_once``'s mark.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    gate = EngineArgs.__dict__.get("create_engine_config")
    if type(gate).__module__ != "cg_extract.plugin":
        return "off"
    if getattr(GPUModelRunner.initialize_kv_cache, "_cg_extract", False):
        return "installed"
    return "stepped aside"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    import vllm.plugins

    wanted = session.config.getoption("--cg-extract")
    os.environ["VLLM_PLUGINS"] = "" if wanted == "off" else "cg_extract"
    if vllm.plugins.plugins_loaded:  # loaded before us: VLLM_PLUGINS came too late
        raise pytest.UsageError("vLLM loaded its general plugins before this session")
    vllm.plugins.load_general_plugins()
    found = state()
    allowed = {"registered": ("installed", "stepped aside")}.get(wanted, (wanted,))
    if found not in allowed:
        raise pytest.UsageError(f"--cg-extract={wanted}, but vLLM shows {found}")
    session.config.stash[_FOUND] = found


def pytest_terminal_summary(terminalreporter) -> None:
    # A summary line, not a report header: -q hides headers.
    import vllm

    found = terminalreporter.config.stash.get(_FOUND, "not loaded")
    terminalreporter.write_line(f"{HEADER}{found} (vllm {vllm.__version__})")
