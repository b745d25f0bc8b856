"""Count what one step of 0002's speculator dispatches, eager and replayed,
with a KV connector present, on a CPU (the figures of 0002's "Motivation").

    python upstream/count_ops_0002.py [--out DIR] [--tokens 3 8] [--ops]
    CG_EXTRACT_EXPECT_VLLM=0.33.0 .venv-0.33/bin/python upstream/count_ops_0002.py

(70 to 80 s each on 2 CPUs, most of it vLLM's import and config; no test
runs it.)

Applies the series to the installed vLLM in a scratch copy
(``upstream/apply_series.py``; ``DIR/series``, a temporary folder without
``--out``), imports vLLM from it, and builds the patched
``ExtractHiddenStatesSpeculator`` as 0002's unit test does: its tiny Llama
config (dummy weights), its ``StandInRunner`` (real ``BlockTables``,
``KVCacheConfig``, ``InputBatch``; capture sizes 1 2 4 8 16), and the
connector vLLM's ``ensure_kv_transfer_initialized`` makes from a
``KVTransferConfig`` naming ``ExampleHiddenStatesConnector`` (kv_producer),
its caches registered and metadata bound, as the runner's connector mixin
does around a step. The example connector is used as it is: its CUDA stream
is reached only from ``get_finished`` (a finished request's save), never
from a step's hooks, which are ``pass``.

Each step's ``propose`` runs under a ``TorchDispatchMode`` that counts aten
ops, split into (a) the speculator's own (everything in ``propose`` outside
the two below), (b) the connector hooks' (inside ``wait_for_layer_load`` and
``save_kv_layer``) and (c) the ops a graph replay ran (what a CUDA graph
holds: one launch on a GPU). "kernels" counts the ops that are neither views
nor allocations, an inference from the op kinds of what would launch a GPU
kernel. Host work is counted by call: ``set_forward_context`` entries, the
layer's ``dummy_attention`` (``maybe_transfer_kv_layer``) and its hooks,
``get_layers_from_vllm_config``, ``CudaGraphManager.dispatch`` and graph
replays. The replayed step runs under each of three CPU doubles of
``torch.cuda``'s graph API (eager steps touch none of them):

* ``stand-in``: ``vllm_on_cpu/cuda_graph.py``'s ``CUDAGraph``: records the
  captured region's ops and replays them with no Python; a view of its
  input is not recorded (it launches nothing);
* ``test-double``: 0002's own ``RecordedGraph``
  (``tests/v1/spec_decode/test_extract_hidden_states_cudagraph.py``): the
  same with every view recorded, and two ``detach`` that torch dispatches
  after the region's two ``torch.empty(0)`` under that double's mode;
* ``emulator``: ``cg_extract/emulated_graph.py``: a replay runs the captured
  Python again under a recorder that checks every op against the capture,
  so the captured region's host work (a ``set_forward_context`` entry, the
  layer's ``dummy_attention``, which runs no hook without attention
  metadata) runs at each replay, which a CUDA graph does not.

The kernels a graph holds are the same under the three; what they hold
besides (views, allocations) and what their replay dispatches (the stand-in
and the test double copy each output an op allocated at capture back into
the captured tensor: 3 ``copy_``) is theirs, not a GPU's.

Only the split (a) / (b) and the host counts stand for a GPU; nothing here
is timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TEST = "tests/v1/spec_decode/test_extract_hidden_states_cudagraph.py"
DOUBLES = ("stand-in", "test-double", "emulator")


def patched_copy(out: Path) -> Path:
    """``out/series``: the installed vLLM with the series applied (kept and
    reused when it exists)."""
    sys.path.insert(0, str(HERE))
    import apply_series

    copy = out / "series"
    if not copy.exists():
        spec = importlib.util.find_spec("vllm")  # found, not imported
        assert spec is not None and spec.submodule_search_locations
        installed = Path(next(iter(spec.submodule_search_locations)))
        apply_series.apply_series(installed, copy, strict=False)
        # The unit test file 0002 adds (left out above: the package's
        # checkout has no tests/).
        (copy / "tests").mkdir()
        (patch,) = HERE.glob("0002-*.patch")
        done = apply_series.git_apply(patch, copy, "--include", TEST)
        if done.returncode != 0 or not (copy / TEST).exists():
            raise RuntimeError(f"{TEST} from {patch.name}: {done.stderr}")
    return copy


class Count:
    """Per-step tallies: ops by bucket, host calls by (bucket, what)."""

    def __init__(self):
        # Op names dispatched in propose, by bucket ("graph": what a double's
        # replay dispatched), and the ops the replayed graph holds.
        self.ops: dict[str, list[str]] = {"spec": [], "hooks": [], "graph": []}
        self.held: list[str] = []
        self.calls: Counter = Counter()
        self.bucket = ["spec"]

    @contextmanager
    def inside(self, bucket: str):
        self.bucket.append(bucket)
        try:
            yield
        finally:
            self.bucket.pop()

    def call(self, what: str) -> None:
        where = self.bucket[-1]
        self.calls[what if where == "spec" else f"{what} ({where})"] += 1


COUNT: Count | None = None


def op_name(func) -> str:
    return func._schema.name.split("::")[1]


def is_kernel(name: str) -> bool:
    """Whether aten op ``name`` would launch a kernel on a GPU, inferred from
    its kind: neither an allocation nor a view (an alias it does not write)."""
    import torch

    if name in ("empty", "empty_strided", "empty_like", "new_empty"):
        return False
    packet = getattr(torch.ops.aten, name)
    schema = getattr(packet, packet.overloads()[0])._schema
    return not any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def counted(what: str, fn):
    def wrapper(*args, **kwargs):
        if COUNT is not None:
            COUNT.call(what)
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def in_bucket(bucket: str, what: str, fn):
    def wrapper(*args, **kwargs):
        if COUNT is None:
            return fn(*args, **kwargs)
        COUNT.call(what)
        with COUNT.inside(bucket):
            return fn(*args, **kwargs)

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="scratch folder (default: a temporary one)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--ops", action="store_true", help="name every op counted")
    args = parser.parse_args(argv)
    if "vllm" in sys.modules:
        raise RuntimeError("vllm was imported before its patched copy")
    # vLLM's speculator, not the cg_extract plugin's (an installed vLLM
    # plugin that would take its place).
    os.environ["VLLM_PLUGINS"] = ""
    scratch = (
        tempfile.TemporaryDirectory() if args.out is None else nullcontext(args.out)
    )
    with scratch as out:
        copy = patched_copy(Path(out))
        sys.path[:0] = [str(copy), str(ROOT)]
        return run(copy, args.tokens, args.ops)


def run(copy: Path, token_counts: list[int], show_ops: bool) -> int:
    global COUNT
    import torch
    import vllm
    from torch.utils._python_dispatch import TorchDispatchMode

    # (the copy's files are symlinks to the installed ones: not resolved)
    if copy.absolute() not in Path(os.path.abspath(vllm.__file__)).parents:
        raise RuntimeError(f"imported {vllm.__file__}, not the series' copy")
    expected = os.environ.get("CG_EXTRACT_EXPECT_VLLM")
    if expected and vllm.__version__ != expected:
        raise RuntimeError(
            f"CG_EXTRACT_EXPECT_VLLM={expected}, imported {vllm.__version__}"
        )

    # 0002's unit test module, from the patched checkout: its stand-in runner,
    # world, test double and slots.
    spec = importlib.util.spec_from_file_location("test_0002", copy / TEST)
    t = importlib.util.module_from_spec(spec)
    sys.modules["test_0002"] = t
    spec.loader.exec_module(t)

    import vllm.model_executor.models.extract_hidden_states as model_file
    import vllm.v1.worker.gpu.spec_decode.extract_hidden_states as spec_file
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
        ExampleHiddenStatesConnector,
        ExampleHiddenStatesConnectorMetadata,
    )
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffer_utils
    from vllm.v1.worker.gpu import buffer_utils, cudagraph_utils
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    from cg_extract import emulated_graph
    from vllm_on_cpu import cuda_graph

    # What the test's without_cuda fixture puts in place (the graph API is
    # chosen per double below).
    cudagraph_utils.graph_capture = lambda device: nullcontext()
    cudagraph_utils.capture_pool = lambda pool, cfg: nullcontext(pool)
    cudagraph_utils.current_stream = lambda: None
    type(current_platform).get_global_graph_pool = lambda self: None
    type(current_platform).graph_pool_handle = lambda self: None
    torch.accelerator.synchronize = lambda *a: None
    torch.accelerator.empty_cache = lambda: None
    buffer_utils.UvaBuffer = cpu_buffer_utils.UvaBuffer

    # The emulator behind torch.cuda's graph API: the capture's recorder
    # around the region, the step it replays being the forward_fn the
    # manager captured (the last one create_forward_fn made).
    last_forward_fn = []
    manager_capture = CudaGraphManager.capture

    def capture(self, create_forward_fn, *a, **k):
        def create(desc, warmup):
            fn = create_forward_fn(desc, warmup)
            last_forward_fn[:] = [fn]
            return fn

        return manager_capture(self, create, *a, **k)

    CudaGraphManager.capture = capture

    class EmulatorGraph:
        def __init__(self, keep_graph=False):
            self.emulated = None

        def replay(self):
            self.emulated.replay()

    class emulator_capture:  # noqa: N801 - torch.cuda.graph
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode=""):
            self.graph = cuda_graph

        def __enter__(self):
            self.recorder = emulated_graph._Recorder(0)
            self.recorder.__enter__()

        def __exit__(self, *exc):
            self.recorder.__exit__(*exc)
            if exc[0] is None:
                (fn,) = last_forward_fn
                step = lambda size, fn=fn: fn(CUDAGraphMode.NONE)  # noqa: E731
                self.graph.emulated = emulated_graph.EmulatedGraph(
                    step, 0, self.recorder
                )

    graph_api = {
        "stand-in": (cuda_graph.CUDAGraph, cuda_graph.graph),
        "test-double": (t.RecordedGraph, t.recorded_capture),
        "emulator": (EmulatorGraph, emulator_capture),
    }
    # The ops each double's graph holds, as it holds them.
    held = {
        cuda_graph.CUDAGraph: lambda g: [op_name(s.func) for s in g._steps],
        t.RecordedGraph: lambda g: [op_name(op[0]) for op in g.ops],
        EmulatorGraph: lambda g: [r.name.split("::")[1] for r in g.emulated.records],
    }

    def graph_replay(cls):
        replay = in_bucket("graph", "graph replays", cls.replay)

        def wrapper(self):
            if COUNT is not None:
                COUNT.held = held[cls](self)
            return replay(self)

        return wrapper

    for cls, _ in graph_api.values():
        cls.replay = graph_replay(cls)

    # Host work counted by call, where the speculator and the model file
    # reach it (module globals, read at call time).
    spec_file.set_forward_context = counted(
        "set_forward_context", spec_file.set_forward_context
    )
    spec_file.get_layers_from_vllm_config = counted(
        "get_layers_from_vllm_config", spec_file.get_layers_from_vllm_config
    )
    model_file.dummy_attention = counted("dummy_attention", model_file.dummy_attention)
    CudaGraphManager.dispatch = counted(
        "CudaGraphManager.dispatch", CudaGraphManager.dispatch
    )

    class OpCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if COUNT is None:  # the warm step
                return out
            bucket = "hooks" if "hooks" in COUNT.bucket else COUNT.bucket[-1]
            COUNT.ops[bucket].append(op_name(func))
            return out

    # 0002's unit test's config and runner (its `loaded` fixture).
    model_dir = copy.parent / "llama"
    model_dir.mkdir(exist_ok=True)
    import json

    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": t.HIDDEN_SIZE,
                "intermediate_size": 2 * t.HIDDEN_SIZE,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "num_hidden_layers": 4,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "torch_dtype": "float32",
            }
        )
    )
    vllm_config = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=t.BLOCK_SIZE,
        max_num_seqs=t.MAX_NUM_REQS,
        max_num_batched_tokens=t.MAX_NUM_TOKENS,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
            },
        },
    ).create_engine_config()
    cc = vllm_config.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cc.cudagraph_capture_sizes = t.CAPTURE_SIZES
    cc.max_cudagraph_capture_size = t.CAPTURE_SIZES[-1]
    device = torch.device("cpu")
    with set_current_vllm_config(vllm_config):
        t.init_world()
        speculator = spec_file.ExtractHiddenStatesSpeculator(vllm_config, device)
        speculator.load_model(None)
    runner = t.StandInRunner(vllm_config, speculator)
    layouts = get_supported_kv_cache_layouts([runner.layer.get_attn_backend()])
    resolve_kv_cache_layout(
        vllm_config, [[x.name for x in layouts]], runner.get_kv_cache_spec().values()
    )

    propose = speculator.propose
    assert propose.__func__.__module__ == spec_file.__name__, propose.__func__

    def counted_propose(*a, **k):
        with OpCounter():
            return propose(*a, **k)

    speculator.propose = counted_propose

    def measure(mode, double, connector, num_tokens):
        """One warm step, then the counted one."""
        global COUNT
        torch.cuda.CUDAGraph, torch.cuda.graph = graph_api[double or "stand-in"]
        runner.speculator.cudagraph_manager = None
        runner.start(mode)
        vllm_config.kv_transfer_config = (
            KVTransferConfig(kv_connector=connector, kv_role="kv_producer")
            if connector
            else None
        )
        if connector:
            ensure_kv_transfer_initialized(vllm_config, runner.kv_cache_config)
            conn = get_kv_transfer_group()
            assert isinstance(conn, ExampleHiddenStatesConnector)
            conn.register_kv_caches({runner.layer_name: runner.layer.kv_cache})
            for hook in ("wait_for_layer_load", "save_kv_layer"):
                setattr(conn, hook, in_bucket("hooks", hook, getattr(conn, hook)))
            conn.bind_connector_metadata(ExampleHiddenStatesConnectorMetadata())
        try:
            runner.step(t.random_slots(num_tokens, 0, device), seed=0)
            COUNT = Count()
            runner.step(t.random_slots(num_tokens, 0, device), seed=1)
            count, COUNT = COUNT, None
        finally:
            if connector:
                ensure_kv_transfer_shutdown()
        return count

    print(
        f"vllm {vllm.__version__} with upstream/000[1-3] ({copy}); torch "
        f"{torch.__version__}; {cpu_model()}, {os.cpu_count()} CPUs; capture "
        f"sizes {t.CAPTURE_SIZES}; connector 'example': ExampleHiddenStatesConnector"
    )
    print(
        "spec/hook ops: aten ops propose dispatched, outside and inside the "
        "connector's hooks;\ngraph ops: what the replayed graph holds (one launch "
        "on a GPU); kern: of those, neither view nor allocation\n"
    )
    head = (
        f"{'tokens':>6} {'connector':9} {'step':6} {'graph double':12} "
        f"{'spec ops':>8} {'kern':>4} {'hook ops':>8} {'graph ops':>9} {'kern':>4}  host calls"
    )
    print(head)
    print("-" * len(head))
    named = {}
    for n in token_counts:
        rows = [
            (CUDAGraphMode.NONE, None, None),
            (CUDAGraphMode.FULL, "stand-in", None),
        ]
        rows += [(CUDAGraphMode.NONE, None, "ExampleHiddenStatesConnector")]
        rows += [
            (CUDAGraphMode.FULL, d, "ExampleHiddenStatesConnector") for d in DOUBLES
        ]
        for mode, double, connector in rows:
            c = measure(mode, double, connector, n)
            step = "replay" if c.calls["graph replays"] else "eager"
            assert (step == "replay") == (mode == CUDAGraphMode.FULL)
            assert c.calls["graph replays"] <= 1
            spec_k = sum(map(is_kernel, c.ops["spec"]))
            graph = (
                f"{len(c.held):9} {sum(map(is_kernel, c.held)):4}"
                if c.held
                else f"{'-':>9} {'-':>4}"
            )
            calls = ", ".join(f"{w} {k}" for w, k in sorted(c.calls.items()))
            print(
                f"{n:6} {'example' if connector else 'none':9} {step:6} {double or '-':12} "
                f"{len(c.ops['spec']):8} {spec_k:4} {len(c.ops['hooks']):8} {graph}  {calls}"
            )
            named.setdefault((step, double, bool(connector)), c)
    if show_ops:
        print()
        star = lambda ops: " ".join(o + ("" if is_kernel(o) else "*") for o in ops)  # noqa: E731
        for (step, double, conn), c in named.items():
            label = f"{step} {double or '-'} {'example' if conn else 'none'}"
            print(f"{label:30} spec:  {star(c.ops['spec'])}")
            if c.ops["hooks"]:
                print(f"{'':30} hooks: {star(c.ops['hooks'])}")
            if c.held:
                print(f"{'':30} graph: {star(c.held)}")
                print(f"{'':30} its replay dispatched: {star(c.ops['graph'])}")
        print("(* a view or an allocation: no kernel)")
    return 0


def cpu_model() -> str:
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
