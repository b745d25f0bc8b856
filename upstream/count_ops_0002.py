"""Count what a step of 0002's speculator dispatches, eager and replayed, with
and without ExampleHiddenStatesConnector, on a CPU (0002's "Motivation").

    python upstream/count_ops_0002.py
    CG_EXTRACT_EXPECT_VLLM=0.33.0 .venv-0.33/bin/python upstream/count_ops_0002.py

The series goes onto the installed vLLM in a scratch copy with its release's
tests/ (``compat/vllm_release.py``); 0002's unit test's ``host`` and ``loaded``
fixtures give the speculator and runner. Ops: the aten ops ``propose``
dispatches outside the connector's hooks and in them, and those the replayed
graph holds; in brackets, those that would be GPU kernels (not a view or an
allocation: "*" marks those). Host calls not shown: none. Graphs: the unit
tests' stand-in (``vllm_on_cpu/cuda_graph.py`` as ``graph_unit_stand_in.py``
installs it: a replay runs the recorded ops) or cg_extract's emulator (a replay
reruns the captured Python, checked op by op; its host calls show as "(graph)").
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from contextlib import contextmanager
from itertools import product
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # apply_series; this repository
import apply_series  # noqa: E402

from cg_extract import emulated_graph  # noqa: E402
from compat.vllm_release import sdist  # noqa: E402
from vllm_on_cpu.cuda_graph import _is_view  # noqa: E402
from vllm_on_cpu.graph_unit_stand_in import fake_cuda_graphs  # noqa: E402

TEST = "tests/v1/spec_decode/test_extract_hidden_states_cudagraph.py"
ROW = "{:>6} {:9} {:15} {:>8} {:>8} {:>9}  {}"
ALLOCATIONS = ("aten::empty", "aten::empty_strided", "aten::empty_like")
HEAD = "tokens|connector|step|spec ops|hook ops|graph ops|host calls"
COUNT = None  # the counted step's tallies; None outside it


def counted(what: str, fn, bucket: str | None = None):
    """``fn``, its calls counted by the bucket they are made in; with
    ``bucket``, what it dispatches goes there."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if COUNT is None:
            return fn(*args, **kwargs)
        where = COUNT.where[-1]
        COUNT.calls[f"{what} ({where})" if where in ("graph", "hooks") else what] += 1
        COUNT.where.append(bucket or where)
        try:
            return fn(*args, **kwargs)
        finally:
            COUNT.where.pop()

    return wrapper


class OpCounter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if COUNT is not None:
            COUNT.ops[COUNT.where[-1]].append(func)
        return func(*args, **(kwargs or {}))


class EmulatedCUDAGraph:
    """``torch.cuda``'s CUDAGraph and graph on cg_extract's emulator."""

    forward_fn = None  # the speculator's last _cache_hidden_states call
    replays = 0  # main reads the ops of a replayed stand-in graph only

    def __init__(self, cuda_graph=None, *args, **kwargs):
        self.cuda_graph, self.recorder = cuda_graph, emulated_graph._Recorder(0)

    def __enter__(self):
        self.recorder.__enter__()

    def __exit__(self, *exc):
        self.recorder.__exit__(*exc)
        step = functools.partial(lambda fn, size: fn(), self.forward_fn)
        self.cuda_graph.emulated = emulated_graph.EmulatedGraph(step, 0, self.recorder)

    def replay(self):
        self.emulated.replay()


def measure(t, runner, connector: bool, step: str, num_tokens: int):
    """A warm step, then the counted one (its tallies returned)."""
    global COUNT
    runner.vllm_config.kv_transfer_config = connector and t.KVTransferConfig(
        kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer"
    )
    with fake_cuda_graphs() as m:
        if step == "replay emulator":
            m.setattr(torch.cuda, "CUDAGraph", EmulatedCUDAGraph)
            m.setattr(torch.cuda, "graph", EmulatedCUDAGraph)
        replay = counted("graph replays", torch.cuda.CUDAGraph.replay, "graph")
        m.setattr(torch.cuda.CUDAGraph, "replay", replay)
        runner.speculator.cudagraph_manager = None
        runner.start(t.CUDAGraphMode.NONE if step == "eager" else t.CUDAGraphMode.FULL)
        if connector:
            t.ensure_kv_transfer_initialized(runner.vllm_config, runner.kv_cache_config)
            conn = t.get_kv_transfer_group()
            conn.register_kv_caches({runner.layer_name: runner.layer.kv_cache})
            for hook in ("wait_for_layer_load", "save_kv_layer"):
                setattr(conn, hook, counted(hook, getattr(conn, hook), "hooks"))
            conn.bind_connector_metadata(t.ExampleHiddenStatesConnectorMetadata())
        try:
            runner.step(t.random_slots(num_tokens, 0, runner.device), seed=0)
            COUNT = SimpleNamespace(calls=Counter(), ops=defaultdict(list))
            COUNT.where = ["runner"]  # the bucket that ops and calls go to
            with OpCounter():  # ops in propose ("spec") and below it
                runner.step(t.random_slots(num_tokens, 0, runner.device), seed=1)
            return COUNT
        finally:
            COUNT = None
            if connector:
                t.ensure_kv_transfer_shutdown()


def is_kernel(func) -> bool:  # neither a view nor an allocation
    return not _is_view(func) and func._schema.name not in ALLOCATIONS


def ops(funcs) -> str:
    return f"{len(funcs)} ({sum(map(is_kernel, funcs))})" if funcs else "-"


def names(funcs) -> str:
    return " ".join(f._schema.name[6:] + "*" * (not is_kernel(f)) for f in funcs)


def main() -> int:
    os.environ["VLLM_PLUGINS"] = ""  # vLLM's speculator, not cg_extract's
    scratch = tempfile.TemporaryDirectory(prefix="count_ops_0002-")  # removed at exit
    series = Path(scratch.name) / "series"
    (installed,) = importlib.util.find_spec("vllm").submodule_search_locations
    release = re.search(r"version = '(.+)'", Path(installed, "_version.py").read_text())
    apply_series.apply_series(Path(installed), series, False, sdist(release[1]))
    sys.path.insert(0, str(series))
    import vllm

    expected = os.environ.get("CG_EXTRACT_EXPECT_VLLM", vllm.__version__)
    if series not in Path(vllm.__file__).parents or vllm.__version__ != expected:
        raise RuntimeError(f"imported vllm {vllm.__version__} from {vllm.__file__}")
    spec = importlib.util.spec_from_file_location("test_0002", series / TEST)
    t = sys.modules["test_0002"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t)
    import vllm.model_executor.models.extract_hidden_states as model_file
    import vllm.v1.worker.gpu.spec_decode.extract_hidden_states as spec_file

    for name in ("set_forward_context", "get_layers_from_vllm_config"):  # host work
        setattr(spec_file, name, counted(name, getattr(spec_file, name)))
    model_file.dummy_attention = counted("dummy_attention", model_file.dummy_attention)
    cpu = re.search(r"model name\s*: (.*)", Path("/proc/cpuinfo").read_text())
    versions = f"vllm {vllm.__version__} + upstream/000[1-3], torch {torch.__version__}"
    print(f"{versions}, {cpu and cpu[1]}, {os.cpu_count()} CPUs; {t.CAPTURE_SIZES=}")
    print(ROW.format(*HEAD.split("|")))
    # The test's fixtures as pytest enters them (tmp_path_factory: a folder).
    fixture = lambda f: contextmanager(f._get_wrapped_function())  # noqa: E731
    tmp = SimpleNamespace(mktemp=lambda name: Path(tempfile.mkdtemp(dir=series.parent)))
    with fixture(t.host)(), fixture(t.loaded)(tmp, None) as runner:
        speculator = runner.speculator
        speculator.propose = counted("propose", speculator.propose, "spec")
        cache = speculator._cache_hidden_states  # the step a graph captures

        def remembered(*args):
            EmulatedCUDAGraph.forward_fn = functools.partial(cache, *args)
            return cache(*args)

        speculator._cache_hidden_states = remembered
        steps = ("eager", "replay stand-in", "replay emulator")
        for num_tokens, conn, step in product((3, 8), ("none", "Example"), steps):
            c = measure(t, runner, conn != "none", step, num_tokens)
            assert bool(c.calls["graph replays"]) == (step != "eager")
            graphs = speculator.cudagraph_manager.graphs.values()
            held = [s.func for g in graphs if g.replays for s in g._steps]
            held = held or c.ops["graph"]  # emulator: what it reran
            spec, hooks = c.ops["spec"], c.ops["hooks"]
            del c.calls["propose"]  # (its wrapper: the "spec" bucket)
            calls = ", ".join(f"{w} {k}" for w, k in sorted(c.calls.items()))
            cells = num_tokens, conn, step, ops(spec), ops(hooks), ops(held), calls
            print(ROW.format(*cells))
            print(f"{'':6} spec: {names(spec)}; graph: {names(held)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
