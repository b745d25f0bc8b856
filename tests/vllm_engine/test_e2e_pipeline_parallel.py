"""Extraction across pipeline stages and across two vLLM nodes, byte-identical
to one stage.

With pipeline parallelism only the last stage builds the speculator and holds
the hidden-state layer; the aux hidden states of the earlier stages' layers
reach it in the intermediate tensors (:mod:`cg_extract.pipeline_parallel`).
The tiny Llama's four layers split two and two, and its aux layers are 1, 2
and 3: layer 1's states come from the first stage, layer 2's from the
boundary (the second stage's first layer reads what the first stage sent),
layer 3's from the second stage.

One module fixture starts, at once, a one-stage reference (vLLM's own
speculator) and three engines at ``pipeline_parallel_size=2``: vLLM's own
speculator, with STAND-INS for what vLLM 0.32/0.33 refuse (the plugin's two
pipeline changes alone, :data:`vllm_on_cpu.engine.PP_STAND_INS`); ours
eagerly; ours with the target's own graphs (``FULL_AND_PIECEWISE``, the fake
graph API of :mod:`vllm_on_cpu.target_graphs`). And two vLLM nodes as vLLM
runs pipeline parallelism across machines (``--nnodes 2``): node 0's OpenAI
server with the first stage, a headless node 1 with the second, ours with
(emulated) graphs, driven by the users' client. Every engine across stages
keeps async scheduling on, as a GPU does (a STAND-IN on a CPU, see
:func:`vllm_on_cpu.engine.pipeline_env`).
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from tests.model_families import write_family_dir
from tests.openai_server import free_port, request, serve
from tests.vllm_engine.generate_scenarios import (
    CLIENT_WAVES,
    TARGET_SCENARIOS,
    scenario_run,
)
from tests.vllm_engine.real_engine import (
    UPSTREAM,
    assert_same_request,
    assert_same_saves,
    cache_size_lines,
    require_cpu_engine,
    run_engines,
)
from tests.vllm_engine.users_client import fetch_all
from vllm_on_cpu import step_log
from vllm_on_cpu.engine import (
    EngineRun,
    cli_args,
    engine_env,
    engine_kwargs,
    load_saved,
    pipeline_env,
    stop,
)

pytestmark = pytest.mark.e2e

PP = 2
WAYS = ("vllm", "eager", "target")
OURS = "cg_extract.speculator.ExtractHiddenStatesSpeculator"
CAPTURE_LINE = "extract_hidden_states: captured "


@contextlib.contextmanager
def two_nodes(model_dir, workdir):
    """Node 1 headless (``vllm serve --headless``, through
    :mod:`vllm_on_cpu.cli`), node 0 the OpenAI server; yields node 0's URL."""
    kwargs = engine_kwargs(
        "graphs", model_dir, workdir / "served", pipeline_parallel_size=PP
    )
    env = engine_env("graphs", VLLM_SERVER_DEV_MODE="1", **pipeline_env("graphs"))
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1"]
    nodes += ["--master-port", str(free_port())]
    node1 = EngineRun(
        ["-m", "vllm_on_cpu.cli", "serve", *cli_args(kwargs), *nodes]
        + ["--node-rank", "1", "--headless"],
        env,
        workdir / "node1.log",
    ).start()
    try:
        with serve(
            kwargs, env, workdir / "node0.log", extra_args=(*nodes, "--node-rank", "0")
        ) as base_url:
            yield base_url
    finally:
        stop(node1)


def staged_runs(model_dir, workdir, pp, ways, *reference_scenarios, **env):
    """A one-stage reference (vLLM's speculator, ``TARGET_SCENARIOS`` and
    ``reference_scenarios``) and each way across ``pp`` stages (``env``
    added to theirs), not started;
    the target way's last stage logs its steps under ``workdir / "steps"``."""
    reference = scenario_run(
        "pp1_vllm",
        "vllm",
        model_dir,
        workdir,
        "--scenarios",
        *TARGET_SCENARIOS,
        *reference_scenarios,
    )
    staged = {
        way: scenario_run(
            f"pp{pp}_{way}",
            way,
            model_dir,
            workdir,
            "--scenarios",
            *TARGET_SCENARIOS,
            "--pipeline-parallel-size",
            str(pp),
            **pipeline_env(way),
            **env,
            **({step_log.STEP_LOG: str(workdir / "steps")} if way == "target" else {}),
        )
        for way in ways
    }
    return reference, staged


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_pp")
    reference, staged = staged_runs(model_dir, workdir, PP, WAYS, *CLIENT_WAVES)
    engines = [reference.engine, *(r.engine for r in staged.values())]
    # The engines run while the two nodes start: both keep the cores busy.
    with ThreadPoolExecutor(1) as pool:
        ran = pool.submit(run_engines, engines, 600)
        with two_nodes(model_dir, workdir) as base_url:
            served = {
                wave: asyncio.run(fetch_all(base_url, str(model_dir), prompts()))
                for wave, prompts in CLIENT_WAVES.items()
            }
            _, rpc = request(
                f"{base_url}/collective_rpc", {"method": "speculator_stats"}
            )
        ran.result()
    return {
        "reference": reference.results(),
        "staged": {way: run.results() for way, run in staged.items()},
        "served": served,
        "served_stats": rpc["results"],
        "workdir": workdir,
        "pp": PP,
    }


def assert_one_stage_bytes(runs, way, scenario):
    want = runs["reference"][scenario]["requests"]
    got = runs["staged"][way][scenario]["requests"]
    assert len(got) == len(want) > 0
    for i, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        assert ours["prompt"] == theirs["prompt"]
        assert_same_request(
            ours, theirs, load_saved(theirs["path"]), f"{way}, {scenario}, request {i}"
        )


def assert_graphs_replayed_on_the_last_stage(runs):
    """From the last stage's step log: the target replayed FULL graphs, ours
    replayed zero-copy after them and copy-in on the small mixed steps, and
    every step took the path due (:func:`step_log.zero_copy_violations`)."""
    pp = runs["pp"]
    (name, steps), *others = step_log.read(runs["workdir"] / "steps").items()
    assert not others and name == f"dp0_tp{pp - 1}", name
    after = runs["staged"]["target"][TARGET_SCENARIOS[-1]]["stats_after"][-1]
    assert after["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    paths = [path for step in steps for path in step["paths"]]
    assert paths.count("zero_copy") > 0, paths
    assert paths.count("copy_in") > 0, paths
    assert sum(step["target"] == "FULL" for step in steps) > 0
    full_sizes = after["target_graphs"]["full_sizes"]
    assert step_log.zero_copy_violations(steps, full_sizes, "FULL_AND_PIECEWISE") == []


def assert_only_the_last_stage_holds_the_speculator(runs, way):
    *firsts, last = runs["staged"][way][TARGET_SCENARIOS[-1]]["stats_after"]
    assert len(firsts) == runs["pp"] - 1 and set(firsts) == {None}
    assert last["class"] == (
        f"{UPSTREAM}.ExtractHiddenStatesSpeculator" if way == "vllm" else OURS
    )


@pytest.mark.parametrize("scenario", TARGET_SCENARIOS)
@pytest.mark.parametrize("way", WAYS)
def test_each_way_across_stages_saves_the_one_stage_bytes(runs, way, scenario):
    assert_one_stage_bytes(runs, way, scenario)


@pytest.mark.parametrize("way", WAYS)
def test_only_the_last_stage_holds_the_speculator(runs, way):
    assert_only_the_last_stage_holds_the_speculator(runs, way)


def test_the_targets_graphs_and_ours_replayed_on_the_last_stage(runs):
    assert_graphs_replayed_on_the_last_stage(runs)


@pytest.mark.parametrize("way", ["eager", "target"])
def test_the_last_stage_logs_our_lines_once(runs, way):
    """The stage that holds the speculator logs the hidden-state cache's size
    and (with graphs) the capture, once: vLLM's first rank holds no
    speculator, and the memory profiler's capture is not logged."""
    log = runs["workdir"] / f"pp{PP}_{way}.log"
    (line,) = cache_size_lines(log)
    assert f"Worker_PP{PP - 1}" in line, line
    assert f"KV cache of pipeline stage {PP} of {PP}, the last," in line, line
    captures = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if CAPTURE_LINE in line
    ]
    assert len(captures) == (way == "target"), captures
    assert all(f"Worker_PP{PP - 1}" in line for line in captures), captures


@pytest.mark.parametrize("wave", CLIENT_WAVES)
def test_two_nodes_serve_the_one_node_bytes(runs, wave):
    prompts = CLIENT_WAVES[wave]()
    want = runs["reference"][wave]["requests"]
    got = runs["served"][wave]
    assert len(got) == len(want) == len(prompts)
    for i, ((_, saved), theirs) in enumerate(zip(got, want, strict=True)):
        assert saved["token_ids"].tolist() == prompts[i] == theirs["prompt"]
        assert_same_saves(saved, load_saved(theirs["path"]), f"{wave}, prompt {i}")


def test_the_headless_node_ran_our_graphs(runs):
    """Node 1 holds the last stage: the plugin loaded there, captured, and
    replayed (read through node 0's ``/collective_rpc``, which reaches every
    worker of both nodes)."""
    first, last = runs["served_stats"]
    assert first is None
    assert last["class"] == OURS
    assert last["stats"]["copy_in_replays"] > 0
    node1 = (runs["workdir"] / "node1.log").read_text(errors="replace").splitlines()
    (capture,) = [line for line in node1 if CAPTURE_LINE in line]
    assert f"Worker_PP{PP - 1}" in capture, capture
    node0 = (runs["workdir"] / "node0.log").read_text(errors="replace")
    assert CAPTURE_LINE not in node0


# --------------------------------------------------------------------------
# Run once, not in CI (``pytest --slow``; docs/testing.md has the figures):
# a second family, and three stages, whose middle one relays the aux states
# of the first stage's layers (PPHandler.relay_aux_hidden_states).

SLOW_CASES = {"qwen3, 2 stages": ("qwen3", 2), "llama, 3 stages": ("llama", 3)}
# The Llama's layers across three stages, so that aux layer 1's states come
# from the first stage and the middle one must relay them (vLLM's default,
# 1, 2, 1, would capture 1 and 2 on the middle stage).
PARTITIONS = {3: "2,1,1"}
SLOW_WAYS = ("vllm", "eager", "graphs", "target")


@pytest.fixture(scope="module", params=SLOW_CASES)
def slow_runs(request, model_dir, tmp_path_factory):
    require_cpu_engine()
    family, pp = SLOW_CASES[request.param]
    workdir = tmp_path_factory.mktemp(f"e2e_{family}_pp{pp}")
    if family != "llama":
        model_dir = write_family_dir(workdir / "model", family)
    partition = {"VLLM_PP_LAYER_PARTITION": PARTITIONS[pp]} if pp in PARTITIONS else {}
    reference, staged = staged_runs(model_dir, workdir, pp, SLOW_WAYS, **partition)
    run_engines([reference.engine, *(r.engine for r in staged.values())], 1200)
    return {
        "reference": reference.results(),
        "staged": {way: run.results() for way, run in staged.items()},
        "workdir": workdir,
        "pp": pp,
    }


@pytest.mark.slow
@pytest.mark.parametrize("way", SLOW_WAYS)
def test_more_stages_and_families_save_the_one_stage_bytes(slow_runs, way):
    for scenario in TARGET_SCENARIOS:
        assert_one_stage_bytes(slow_runs, way, scenario)
    assert_only_the_last_stage_holds_the_speculator(slow_runs, way)


@pytest.mark.slow
def test_more_stages_and_families_replay_on_the_last_stage(slow_runs):
    assert_graphs_replayed_on_the_last_stage(slow_runs)
    *_, last = slow_runs["staged"]["graphs"][TARGET_SCENARIOS[-1]]["stats_after"]
    assert last["stats"]["copy_in_replays"] > 0
