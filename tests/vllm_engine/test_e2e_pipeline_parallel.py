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

Beside them, what the plugin must leave alone: vLLM's ``ExampleConnector``
saving the target's own KV at PP=2 without extraction, with the plugin and
without it; and a target whose decoder relays no aux hidden states, which
vLLM's own load-time check stops.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import asyncio
import contextlib
import subprocess
from concurrent.futures import ThreadPoolExecutor

from safetensors.torch import load_file

from tests.model_families import write_family_dir
from tests.openai_server import free_port, request, serve
from tests.torch_alone.test_cache_size import SUMMARY, figures
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
from tests.write_cases import same_bytes
from vllm_on_cpu import step_log
from vllm_on_cpu.engine import (
    EngineRun,
    cli_args,
    engine_env,
    engine_kwargs,
    load_saved,
    log_tail,
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


TARGET_KV = """
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(**{kwargs!r})
prompts = [list(range(1 + i, 41 + 7 * i)) for i in range(3)]
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
             SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
"""


def target_kv_runs(model_dir, workdir):
    """vLLM's ``ExampleConnector`` saving the target's KV of every layer at
    PP=2, no speculative config: with the plugin loaded and without."""
    runs = {}
    for name, way in [("plugin", "eager"), ("vllm", "vllm")]:
        kwargs = engine_kwargs(way, model_dir, workdir, pipeline_parallel_size=PP)
        del kwargs["speculative_config"], kwargs["worker_cls"]
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shared_storage_path": str(workdir / f"target_kv_{name}")
            },
        }
        script = TARGET_KV.format(kwargs=kwargs)
        env = engine_env(way, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        runs[name] = EngineRun(["-c", script], env, workdir / f"target_kv_{name}.log")
    return runs


def no_relay_run(workdir):
    """Extraction at PP=2, ours eagerly, from a Qwen3-MoE, whose decoder
    relays no aux hidden states between stages."""
    model_dir = write_family_dir(workdir / "qwen3_moe", "qwen3_moe")
    return scenario_run(
        "no_relay",
        "eager",
        model_dir,
        workdir,
        "--scenarios",
        "decode",
        "--pipeline-parallel-size",
        str(PP),
        **pipeline_env("eager"),
    ).engine


def exit_of(run: EngineRun, timeout: float) -> int | None:
    """The exit code of ``run`` (None: still running after ``timeout``)."""
    proc = run.start()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        stop(proc, grace=5.0)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_pp")
    reference, staged = staged_runs(model_dir, workdir, PP, WAYS, *CLIENT_WAVES)
    target_kv = target_kv_runs(model_dir, workdir)
    no_relay = no_relay_run(workdir)
    engines = [reference.engine, *(r.engine for r in staged.values())]
    # The engines run while the two nodes start: both keep the cores busy.
    with ThreadPoolExecutor(2) as pool:
        ran = pool.submit(run_engines, [*engines, *target_kv.values()], 600)
        no_relay_exit = pool.submit(exit_of, no_relay, 300)
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
        "no_relay": (no_relay_exit.result(), no_relay.log),
        "target_kv": {name: workdir / f"target_kv_{name}" for name in target_kv},
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
    assert figures(SUMMARY, line)["owner"] == f" (last of {PP} PP stages)", line
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


def test_a_connector_of_the_targets_kv_saves_every_layer_as_without_the_plugin(runs):
    """No extraction: the plugin changes nothing for ExampleConnector, which
    saves each layer's KV on the stage that holds it."""
    plugin, vllm = (
        {
            str(path.relative_to(folder)): load_file(path)
            for path in sorted(folder.rglob("*.safetensors"))
        }
        for folder in (runs["target_kv"]["plugin"], runs["target_kv"]["vllm"])
    )
    layers = {name.split("/")[-1].removesuffix(".safetensors") for name in vllm}
    assert layers == {f"model.layers.{i}.self_attn.attn" for i in range(4)}
    assert sorted(plugin) == sorted(vllm) and len(vllm) == 3 * 4
    for name, tensors in vllm.items():
        assert tensors.keys() == plugin[name].keys(), name
        assert all(same_bytes(plugin[name][k], t) for k, t in tensors.items()), name


def test_a_target_that_relays_no_aux_states_is_stopped_by_vllms_check(runs):
    """vLLM's load-time check reaches the user and the engine stops."""
    exit_code, log = runs["no_relay"]
    assert exit_code not in (0, None), log_tail(log)  # None: it hung
    message = (
        "Qwen3MoeForCausalLM does not support extract_hidden_states with "
        "pipeline parallelism"
    )
    assert message in log.read_text(errors="replace"), log_tail(log)


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
