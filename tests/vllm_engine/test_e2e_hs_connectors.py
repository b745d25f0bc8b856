"""The users' own connector package through the real engine: hs-connectors'
``FP8HiddenStatesConnector`` and ``MooncakeHiddenStatesConnector``, loaded
with ``kv_connector_module_path`` as the ``speculators`` project loads them,
with only their CUDA stream hand-off replaced for the CPU
(:mod:`tests.vllm_engine.cpu_fp8_hidden_states_connector`,
:mod:`tests.vllm_engine.cpu_mooncake_hidden_states_connector`).

The three ways (vLLM's speculator, ours eager, ours with graphs) run the
decode scenario with the FP8 connector, whose decode steps replay graphs,
saving the generated tokens' rows too. Their FP8 files must be byte-identical,
and the package's own reader (``hs_connectors.transfer.FP8Transfer``) must
give back each request's tokens and dequantized hidden states. Ours with
graphs runs it once more with the Mooncake connector, across two pipeline
stages, on a local Mooncake store, read back with ``MooncakeTransfer``:
full-precision samples, which must quantize to the FP8 files' bytes.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM
# hs-connectors is a declared test dependency (pyproject's test extra): no
# importorskip, a broken install is an error below, not a silent skip.

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.openai_server import free_ports
from tests.vllm_engine.cpu_mooncake_hidden_states_connector import mooncake_master
from tests.vllm_engine.generate_scenarios import scenario_run
from tests.vllm_engine.real_engine import require_cpu_engine, run_engines
from tests.write_cases import same_bytes
from vllm_on_cpu.engine import AUX_LAYER_IDS, WAYS, pipeline_env

pytestmark = pytest.mark.e2e

SCENARIO = "decode"
# What FP8HiddenStatesConnector writes (its docstring and _write_tensors).
FP8_KEYS = ["hidden_states", "hidden_states_scales", "token_ids"]


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_hs_connectors")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.fail(
            f"Mooncake's store does not load ({e}): pip install the test extras "
            "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1"
        )
    common = [model_dir, workdir, "--scenarios", SCENARIO, "--connector"]
    runs = {way: scenario_run(f"fp8_{way}", way, *common, "fp8") for way in WAYS}
    with mooncake_master(*free_ports(2), workdir / "mooncake_master.log") as master:
        runs["mooncake"] = scenario_run(
            "mooncake",
            "graphs",
            *common,
            "mooncake",
            "--mooncake-master",
            master,
            "--pipeline-parallel-size",
            "2",
            **pipeline_env("graphs"),
        )
        run_engines([run.engine for run in runs.values()], timeout=600)
    return {name: run.results()[SCENARIO] for name, run in runs.items()}


def test_the_graph_way_replayed(runs):
    (graphs,) = runs["graphs"]["stats_after"]
    (eager,) = runs["eager"]["stats_after"]
    assert graphs["stats"]["copy_in_replays"] > 0
    assert eager["stats"]["replays"] == 0 and eager["stats"]["eager_steps"] > 0
    (vllm,) = runs["vllm"]["stats_after"]
    assert vllm["stats"] is None  # vLLM's own class


@pytest.mark.parametrize("way", ["eager", "graphs"])
def test_fp8_files_are_vllms_bytes(runs, way):
    ours, theirs = runs[way]["requests"], runs["vllm"]["requests"]
    assert len(ours) == len(theirs) > 0
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert got["output"] == want["output"]
        a, b = load_file(got["path"]), load_file(want["path"])
        assert sorted(a) == sorted(b) == FP8_KEYS, i
        assert a["hidden_states"].dtype == torch.float8_e4m3fn
        for key in FP8_KEYS:
            assert same_bytes(a[key], b[key]), f"request {i}: {key} differ"


def test_the_packages_reader_reads_them(runs, model_dir):
    """Through ``FP8Transfer.get_generated``, as the speculators trainer
    reads a sample: the request's tokens (prompt and generated but the last)
    and a float32 row per token and aux layer, equal across the ways."""
    from hs_connectors.transfer import FP8Transfer

    hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    samples = {}
    for way in WAYS:
        for i, request in enumerate(runs[way]["requests"]):
            reader = FP8Transfer(Path(request["path"]).parent, torch.float32)
            sample = reader.get_generated({"hidden_states_path": request["path"]})
            tokens = request["prompt"] + request["output"][:-1]
            assert sorted(sample) == ["hidden_states", "token_ids"]
            assert sample["token_ids"].tolist() == tokens
            states = sample["hidden_states"]
            assert states.dtype == torch.float32
            assert states.shape == (len(tokens), len(AUX_LAYER_IDS), hidden_size)
            assert torch.isfinite(states).all() and states.abs().amax() > 0
            samples.setdefault(i, []).append(states)
    assert samples, "no request read back"
    for i, states in samples.items():
        assert len(states) == len(WAYS), f"request {i}"
        assert all(same_bytes(s, states[0]) for s in states), f"request {i}"


def test_mooncake_samples_are_the_fp8_files_before_quantizing(runs):
    """What ``MooncakeTransfer`` reads back (ours with graphs, the last of two
    stages, full precision) quantized with the package's own FP8 quantizer
    gives the FP8 files' bytes."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    first, last = runs["mooncake"]["stats_after"]
    assert first is None and last["stats"]["copy_in_replays"] > 0
    samples, fp8 = runs["mooncake"]["requests"], runs["vllm"]["requests"]
    assert len(samples) == len(fp8) > 0
    for i, (got, want) in enumerate(zip(samples, fp8, strict=True)):
        assert got["output"] == want["output"]
        sample, file = load_file(got["path"]), load_file(want["path"])
        assert sorted(sample) == ["hidden_states", "token_ids"]
        assert sample["hidden_states"].dtype == torch.float32
        assert same_bytes(sample["token_ids"], file["token_ids"]), i
        states, scales = quantize_tensor_to_fp8(sample["hidden_states"])
        assert same_bytes(states, file["hidden_states"]), f"request {i}"
        assert same_bytes(scales, file["hidden_states_scales"]), f"request {i}"


def test_every_worker_counted_leaves_no_send_counted(runs):
    """Mooncake's connector counts every worker (``get_finished_count()`` is
    None), so the stage without the hidden-state layer reports each finished
    request at once (:class:`cg_extract.pipeline_parallel.HiddenStatesOnLastStage`).
    That leaves nothing in vLLM's aggregator only because the connector delays
    the blocks of every finished request, each reported by the last stage in
    turn: after the requests, no send is still counted."""
    assert runs["mooncake"]["sends_still_counted"] == []
    assert all(run["sends_still_counted"] == [] for run in runs.values())


def test_free_ports_are_different():
    """The master's two ports (and any others taken together) never
    coincide; ports taken one at a time often do, within a few hundred."""
    ports = free_ports(500)
    assert len(set(ports)) == len(ports)
