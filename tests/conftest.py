"""Shared fixtures. `cuda`-marked tests skip where torch sees no CUDA device;
`slow`-marked ones unless pytest is given `--slow`. Where
``CG_EXTRACT_EXPECT_VLLM`` names a version (``make test``'s run on vLLM
0.33.0), the session stops unless it imports that vLLM, and says at its end
which it ran (engine processes check it too: vllm_on_cpu/site/sitecustomize.py).
"""

import os

import pytest
import torch

EXPECT_VLLM = "CG_EXTRACT_EXPECT_VLLM"
# Tests marked mrv2_process run in a child session on Model Runner V2.
pytest_plugins = ["vllm_on_cpu.mrv2_process"]


def pytest_configure(config):
    expected = os.environ.get(EXPECT_VLLM)
    if expected:
        import vllm

        if vllm.__version__ != expected:
            raise pytest.UsageError(
                f"{EXPECT_VLLM}={expected} but this session imports vllm "
                f"{vllm.__version__} from {vllm.__file__}"
            )


def pytest_terminal_summary(terminalreporter):
    expected = os.environ.get(EXPECT_VLLM)
    if expected:
        import vllm

        terminalreporter.write_line(
            f"{EXPECT_VLLM}={expected}: this session ran vllm {vllm.__version__} "
            f"from {os.path.dirname(vllm.__file__)}; its engine processes "
            "check the same at import"
        )


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (run once and recorded in "
        "docs/testing.md, not in CI)",
    )


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA device")
    if not config.getoption("--slow"):
        skips["slow"] = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def environ_kept():
    """Each test gives back the environment it started with. vLLM writes
    ``os.environ`` as it builds a config in this process (the CPU platform's
    thread and allocator settings; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for
    the external launcher), and ``perf/sweep.py``'s ``main`` sets
    ``VLLM_LOGGING_LEVEL``. Kept, they reach every later test and each
    process it spawns: an engine of vLLM's tests then runs in the test's own
    process, where ``load_hidden_states`` waits forever (issue 62's CI hang)."""
    saved = dict(os.environ)
    yield
    for name in os.environ.keys() - saved.keys():
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama config.json: all vLLM needs with load_format='dummy'."""
    from vllm_on_cpu.harness import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"))


class OurLog(list):
    """Our loggers' INFO and louder messages, in order; ``debug`` their
    DEBUG ones."""

    def __init__(self) -> None:
        super().__init__()
        self.debug: list[str] = []


@pytest.fixture
def cg_extract_log():
    """Messages our ``vllm.cg_extract.*`` loggers emit during the test
    (DEBUG in ``.debug``), each checked to read like vLLM's own start-up
    lines when the test ends (``assert_reads_like_vllms``).

    Recorded by a filter on each of our module loggers, set to DEBUG for the
    test (vLLM's handler still prints INFO and up): whenever vLLM
    (re)configures logging it stops its tree propagating to the root and
    clears the handlers of loggers below it, so neither pytest's ``caplog``
    nor a handler of ours would see every record; filters stay.
    """
    import logging

    import cg_extract.cache_backend
    import cg_extract.kv_cache_report
    import cg_extract.plugin
    import cg_extract.speculator  # noqa: F401  (their module loggers exist)
    from tests.torch_alone.test_cache_size import assert_reads_like_vllms

    messages = OurLog()
    records: list[logging.LogRecord] = []

    def record(rec: logging.LogRecord) -> bool:
        records.append(rec)
        kept = messages if rec.levelno > logging.DEBUG else messages.debug
        kept.append(rec.getMessage())
        return True

    ours = {
        logging.getLogger(name)
        for name in logging.root.manager.loggerDict
        if name.startswith("vllm.cg_extract.")
    }
    levels = {logger: logger.level for logger in ours}
    for logger in ours:
        logger.addFilter(record)
        logger.setLevel(logging.DEBUG)
    try:
        yield messages
    finally:
        for logger in ours:
            logger.removeFilter(record)
            logger.setLevel(levels[logger])
    for rec in records:
        assert_reads_like_vllms(rec.levelname, rec.getMessage())
