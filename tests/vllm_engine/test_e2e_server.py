"""The OpenAI-compatible server with the plugin and ``"cudagraph": true``,
driven by the users' client (:mod:`tests.vllm_engine.users_client`), against an
in-process ``LLM.generate`` of the same prompts with vLLM's own speculator.

The server is started as a user starts it, plus two test-only settings: our
keys name the ``emulated`` backend, and ``--worker-cls`` names
:mod:`vllm_on_cpu.worker`, which captures our graphs after the worker's
start-up as a GPU worker would (on a CPU vLLM never captures). So the
server's steps replay our graphs, and ``VLLM_SERVER_DEV_MODE``'s
``/collective_rpc`` lets the test read ``cudagraph_stats()`` back.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import asyncio

from tests.openai_server import request, serve
from tests.vllm_engine.generate_scenarios import (
    CLIENT_WAVES,
    scenario_run,
    short_prompts,
)
from tests.vllm_engine.real_engine import (
    assert_same_saves,
    require_cpu_engine,
    run_engines,
)
from tests.vllm_engine.users_client import fetch_all
from vllm_on_cpu.engine import (
    CAPTURE_SIZES,
    engine_env,
    engine_kwargs,
    load_saved,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """What the users' client got from the server, its graph stats, and the
    in-process reference's results (run while the server starts)."""
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_server")
    kwargs = engine_kwargs("graphs", model_dir, workdir / "served")
    reference = scenario_run(
        "reference", "vllm", model_dir, workdir, "--scenarios", *CLIENT_WAVES
    )
    env = engine_env("graphs", VLLM_SERVER_DEV_MODE="1")
    with serve(kwargs, env, workdir / "server.log") as base_url:
        run_engines([reference.engine], timeout=300)
        got = {
            wave: asyncio.run(fetch_all(base_url, str(model_dir), prompts()))
            for wave, prompts in CLIENT_WAVES.items()
        }
        _, rpc = request(f"{base_url}/collective_rpc", {"method": "speculator_stats"})
    results = reference.results()
    return got, rpc["results"], {w: results[w]["requests"] for w in CLIENT_WAVES}


def test_the_server_ran_our_graphs(served):
    """The first wave's batching depends on timing; the short wave's steps
    fit the largest graph however they are batched, so replays are certain."""
    _, (rank0,), _ = served
    assert rank0["class"] == "cg_extract.speculator.ExtractHiddenStatesSpeculator"
    assert rank0["stats"]["captured_sizes"] == CAPTURE_SIZES
    assert sum(map(len, short_prompts())) <= max(CAPTURE_SIZES)
    assert rank0["stats"]["copy_in_replays"] > 0


@pytest.mark.parametrize("wave", CLIENT_WAVES)
def test_the_users_client_gets_vllms_bytes(served, wave):
    got, _, reference = served
    prompts = CLIENT_WAVES[wave]()
    assert len(got[wave]) == len(reference[wave]) == len(prompts)
    for i, ((path, saved), want) in enumerate(
        zip(got[wave], reference[wave], strict=True)
    ):
        assert want["prompt"] == prompts[i]
        assert saved["token_ids"].tolist() == prompts[i]
        assert not path.with_name(path.name + ".lock").exists()  # the client's
        assert_same_saves(
            saved, load_saved(want["path"]), f"prompt {i} ({len(prompts[i])} tokens)"
        )
