"""``LLM.generate`` through vLLM's real MRv2 engine on a CPU, three ways.

One engine per way, all started at once, each running every scenario of
:mod:`tests.vllm_engine.generate_scenarios` in turn: vLLM's own speculator (the plugin not
loaded), ours eagerly, ours with emulated graphs (captured after the worker's
start-up, as a GPU worker's ``capture_model`` would). Every scenario must
leave, for every request, the same saved hidden states and token ids, byte
for byte, and the same generated tokens, in all three; and the graph run must
have replayed during it.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch

from tests.vllm_engine.generate_scenarios import (
    GENERATE_SCENARIOS,
    PREFIX,
    scenario_run,
)
from tests.vllm_engine.real_engine import (
    assert_runs_its_speculator,
    assert_same_request,
    require_cpu_engine,
    run_engines,
)
from vllm_on_cpu.engine import (
    AUX_LAYER_IDS,
    MAX_NUM_BATCHED_TOKENS,
    WAYS,
    load_saved,
)

pytestmark = pytest.mark.e2e

HIDDEN_SIZE = 256  # vllm_on_cpu.harness.write_model_dir's


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    """Each way's results, per scenario (see generate_scenarios.main)."""
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_generate")
    runs = {way: scenario_run(way, way, model_dir, workdir) for way in WAYS}
    run_engines([run.engine for run in runs.values()], timeout=600)
    return {way: run.results() for way, run in runs.items()}


def stats(result: dict, when: str) -> dict:
    (rank0,) = result[when]  # one rank
    return rank0


def stats_delta(result: dict, key: str) -> int:
    return (
        stats(result, "stats_after")["stats"][key]
        - (stats(result, "stats_before")["stats"][key])
    )


def test_each_way_runs_its_speculator(results):
    for way, result in results.items():
        for name, scenario in result.items():
            assert_runs_its_speculator(way, stats(scenario, "stats_after"), name)


# What each scenario is named for, seen in the vLLM run (the others must
# match it request by request).
def _chunked(requests, evidence):
    assert evidence["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS
    assert all(len(r["prompt"]) > MAX_NUM_BATCHED_TOKENS for r in requests)


def _decode(requests, evidence):
    assert all(len(r["output"]) == evidence["max_tokens"] > 1 for r in requests)


def _prefix_hits(requests, evidence):
    first, *rest = requests
    assert first["cached"] == 0
    assert [r["cached"] for r in rest] == [evidence["shared_prefix"]] * len(rest)
    assert evidence["shared_prefix"] == PREFIX


def _preemption(requests, evidence):
    assert evidence["preemptions"] > 0


def _aborted(requests, evidence):
    by_name = {r["name"]: r for r in requests}
    victim = by_name.pop(evidence["aborted"])
    assert by_name, "no request besides the aborted one"
    assert victim["finish_reason"] == "abort"
    assert len(victim["output"]) == evidence["aborted_after_tokens"] < 30
    assert all(len(r["output"]) == 30 for r in by_name.values())


def _many_lengths(requests, evidence):
    assert [len(r["prompt"]) for r in requests] == evidence["lengths"]


SHOWS = {
    "chunked_prefill": _chunked,
    "decode": _decode,
    "prefix_cache_hits": _prefix_hits,
    "preemption": _preemption,
    "aborted_mid_flight": _aborted,
    "many_prompt_lengths": _many_lengths,
}


def test_every_scenario_is_checked():
    assert list(SHOWS) == GENERATE_SCENARIOS


@pytest.mark.parametrize("scenario", GENERATE_SCENARIOS)
def test_three_ways_save_the_same_bytes(results, scenario):
    reference = results["vllm"][scenario]
    # Non-empty, or every all() of SHOWS would hold and the loop check nothing.
    assert reference["requests"], f"{scenario}: vLLM's run made no requests"
    SHOWS[scenario](reference["requests"], reference["evidence"])
    for i, want in enumerate(reference["requests"]):
        saved = load_saved(want["path"])
        # The connector's contract, checked on vLLM's own run: the prompt's
        # rows (and the generated tokens' but the last, when asked for),
        # every one written.
        tokens = want["prompt"] + (want["output"][:-1] if want["with_outputs"] else [])
        assert saved["token_ids"].tolist() == tokens, f"{scenario} request {i}"
        hidden = saved["hidden_states"]
        assert hidden.shape == (len(tokens), len(AUX_LAYER_IDS), HIDDEN_SIZE)
        assert hidden.dtype == torch.float32
        assert bool((hidden.abs().sum(dim=(1, 2)) > 0).all()), "a row never written"
        for way in ("eager", "graphs"):
            got = results[way][scenario]["requests"][i]
            what = f"{scenario}, request {i}, {way} against vLLM's speculator"
            assert_same_request(got, want, saved, what)
    assert len(results["eager"][scenario]["requests"]) == len(reference["requests"])
    assert len(results["graphs"][scenario]["requests"]) == len(reference["requests"])


@pytest.mark.parametrize("scenario", GENERATE_SCENARIOS)
def test_the_graph_run_replayed(results, scenario):
    graphs, eager = results["graphs"][scenario], results["eager"][scenario]
    assert stats_delta(graphs, "copy_in_replays") > 0
    assert stats_delta(graphs, "zero_copy_replays") == 0  # no target graphs on CPU
    assert stats_delta(eager, "replays") == 0
    assert stats_delta(eager, "eager_steps") > 0
