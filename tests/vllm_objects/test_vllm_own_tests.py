"""vLLM's own tests of what the plugin rebinds, from the installed release's
source distribution, with the plugin's ``register()`` forced at session start
and without any plugin (issue 61): the same outcome test by test, and the
run with the plugin really had it installed (:mod:`vllm_on_cpu.vllm_own_tests`).

A plain run of vLLM's unit tests never loads the plugin (only ``EngineArgs``
does), so they cannot tell it is there; forced in, the white-box ones meet
whatever the plugin put in vLLM's modules.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from compat import vllm_release as releases
from vllm_on_cpu import vllm_own_tests
from vllm_on_cpu.harness import vllm_release

pytestmark = pytest.mark.vllm_own_tests

# What each rebinding of the plugin's is tested by in vLLM's tree, files that
# run on a CPU (each must pass tests there: checked below) in a few minutes.
COMMON = [
    # init_speculator and vLLM's speculator class (white-box: it builds
    # vLLM's class by hand and sets its attributes).
    "tests/v1/worker/test_gpu_extract_hidden_states_speculator.py",
    # The ExtractHiddenStatesModel architecture the plugin registers.
    "tests/v1/spec_decode/test_extract_hidden_states.py",
    # model_runner.get_kv_connector.
    "tests/v1/worker/test_gpu_kv_connector.py",
    # get_kv_cache_groups over MagicMock configs (CSA, SWA, compressor rings).
    "tests/v1/core/test_contiguous_kv_packing.py",
    # GPUModelRunner.initialize_kv_cache, on a runner built by hand.
    "tests/v1/worker/test_gpu_model_runner_v2.py",
    # ModelCudaGraphManager.capture under the memory profiler.
    "tests/v1/worker/test_gpu_model_runner_v2_cudagraph_profiling.py",
    # The architecture register_model rebinds, imported through the registry.
    "tests/models/test_registry.py::test_registry_imports[ExtractHiddenStatesModel]",
]
# get_kv_cache_groups and get_kv_cache_configs (split_kv_cache_groups, the
# refusal hint) are in kv_cache_utils in 0.32, in kv_cache_planning from
# 0.33: their tests there, not the files' block-hashing and the rest.
KV_CACHE_LAYOUT = {
    "0.32.0": "tests/v1/core/test_kv_cache_utils.py",
    "0.33.0": "tests/v1/core/test_kv_cache_planning.py",
    "0.34.0": "tests/v1/core/test_kv_cache_planning.py",
}
GROUPING = {"get_kv_cache_groups", "get_kv_cache_configs"}
# The speculator-method seam 0.34's port goes through.
NEW_IN = {"0.34.0": ["tests/v1/spec_decode/test_custom_speculator.py"]}


def selection(release: str) -> list[str]:
    layout = vllm_own_tests.tests_calling(release, KV_CACHE_LAYOUT[release], GROUPING)
    return [*COMMON, *layout, *NEW_IN.get(release, [])]


# The test whose failure with the plugin loaded opened issue 61.
WHITE_BOX = (
    "tests/v1/worker/test_gpu_extract_hidden_states_speculator.py::"
    "test_propose_caches_hidden_states_and_returns_sampled_tokens"
)


@pytest.fixture(scope="module")
def comparison() -> vllm_own_tests.Comparison:
    release = vllm_release()
    if release not in KV_CACHE_LAYOUT:
        pytest.skip(f"no selection of vLLM {release}'s tests")
    try:
        releases.sdist(release)
    # urllib's errors are OSErrors; RuntimeError: not listed, or a bad sha256.
    except (OSError, RuntimeError) as error:
        pytest.skip(f"vLLM {release}'s source distribution cannot be fetched: {error}")
    return vllm_own_tests.compare(selection(release), release, timeout=900)


def test_the_plugin_was_installed_in_one_run_only(comparison):
    assert comparison.with_plugin.state == "installed"
    assert comparison.without.state == "off"


def test_vllms_tests_give_the_same_outcomes_with_the_plugin(comparison):
    assert comparison.differences() == {}, vllm_own_tests.report(comparison)


def test_each_selected_file_has_tests_that_pass_here(comparison):
    """A file whose tests all skip on a CPU would compare nothing."""
    passed = {
        test.split("::")[0]
        for test, outcome in comparison.without.outcomes.items()
        if outcome == "passed"
    }
    selected = {test.split("::")[0] for test in comparison.tests}
    assert selected <= passed, vllm_own_tests.report(comparison)


def test_the_white_box_test_passes_with_the_plugin(comparison):
    assert comparison.with_plugin.outcomes[WHITE_BOX] == "passed"
