"""The CPU stand-in for ``torch.cuda``'s graph API (:mod:`vllm_on_cpu.cuda_graph`),
a fake: a replay re-executes the ops recorded at capture, on the captured
tensors, with no Python of the captured region running.

Each test captures with the stand-in's classes directly (the process-wide
:func:`~vllm_on_cpu.cuda_graph.install` runs in a subprocess of its own), then
changes the static inputs in place and checks the replay against the same
region run eagerly on the new data; the stale cases check that what a CUDA
graph would get wrong comes out wrong here too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract.emulated_graph import GraphCaptureError
from vllm_on_cpu import cuda_graph
from vllm_on_cpu.cuda_graph import CUDAGraph, graph, is_current_stream_capturing


def capture(region) -> CUDAGraph:
    """Under inference mode, as vLLM runs the model: there ``aten::to`` and
    ``aten::reshape`` reach the recorder whole, copying or aliasing."""
    g = CUDAGraph()
    with torch.inference_mode(), graph(g, pool=cuda_graph.graph_pool_handle()):
        region()
    return g


def replay_matches(region, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
    """Capture ``region``, refill ``inputs`` in place, replay; the outputs
    must equal the region run eagerly on the new inputs."""
    g = capture(region)
    for t in inputs:
        t.copy_(
            torch.randint_like(t, 0, 50)
            if not t.is_floating_point()
            else torch.randn_like(t)
        )
    g.replay()
    replayed = [o.clone() for o in outputs]
    region()
    for got, want in zip(replayed, outputs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return g


def test_views_of_static_buffers_read_the_new_data():
    x = torch.randn(4, 6)
    out = torch.empty(3, 4)

    def region():
        out.copy_(x[1:, :4] * 2 + x.t()[:3] + x.view(6, 4)[:3])

    replay_matches(region, [x], [out])


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda x: x.long().float(), id="long-copies"),
        pytest.param(lambda x: x.to(x.dtype), id="to-same-dtype-aliases"),
        pytest.param(
            lambda x: x.t().reshape(-1)[:8].reshape(2, 4), id="reshape-copies"
        ),
        pytest.param(lambda x: x.reshape(2, 4), id="reshape-aliases"),
        pytest.param(lambda x: x.t().contiguous()[:2], id="contiguous-copies"),
        pytest.param(lambda x: x.contiguous()[:2], id="contiguous-aliases"),
    ],
)
def test_ops_that_may_alias_are_rerun_when_they_copied(convert):
    # input_.long() taken for a view replayed capture-time token ids.
    x = torch.randint(0, 50, (4, 2)).float()
    out = torch.empty_like(convert(x))

    def region():
        out.copy_(convert(x) + 1)

    replay_matches(region, [x], [out])


def test_in_place_ops_run_again_at_every_replay():
    x = torch.randn(5)
    acc = torch.zeros(5)

    def region():
        acc.add_(x)
        acc.mul_(2)

    g = capture(region)  # acc = 2x
    g.replay()  # acc = (2x + x) * 2
    torch.testing.assert_close(acc, 6 * x)


# Stands for vLLM's forward context: set while the model runs eagerly, not
# during a FULL replay.
FORWARD_CONTEXT: dict | None = None
_lib = torch.library.Library("cgstandin", "FRAGMENT")
_lib.define("scaled_into(Tensor x, Tensor(a!) out) -> ()")


def _scaled_into(x, out):
    if FORWARD_CONTEXT is None:
        raise RuntimeError("no forward context")
    out.copy_(x * FORWARD_CONTEXT["scale"])


_lib.impl("scaled_into", _scaled_into, "CPU")


def test_ops_with_python_bodies_are_recorded_as_their_inner_ops():
    global FORWARD_CONTEXT
    x = torch.randn(3)
    out = torch.empty(3)
    FORWARD_CONTEXT = {"scale": 3.0}
    try:
        g = capture(lambda: torch.ops.cgstandin.scaled_into(x, out))
    finally:
        FORWARD_CONTEXT = None
    names = [step.func._schema.name for step in g._steps]
    assert "cgstandin::scaled_into" not in names
    assert "aten::mul" in names
    x.copy_(torch.randn(3))
    g.replay()  # the body would raise: no forward context
    torch.testing.assert_close(out, x * 3.0)


def test_vllm_attention_ops_have_python_bodies():
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.attention.attention  # noqa: F401 - registers them

    for op in ("unified_attention_with_output", "unified_kv_cache_update"):
        assert cuda_graph._has_python_body(getattr(torch.ops.vllm, op).default), op


def test_an_interpreted_triton_launch_is_a_step_of_the_graph(monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import GridExecutor, InterpretedFunction

    monkeypatch.setattr(
        GridExecutor, "__call__", cuda_graph._recording_launch(GridExecutor.__call__)
    )

    def double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)

    kernel = InterpretedFunction(double)
    x, out = torch.randn(8), torch.empty(8)
    g = capture(lambda: kernel[(1,)](x, out, 8, BLOCK=8))
    assert any(isinstance(s, cuda_graph._Launch) for s in g._steps)
    before = cuda_graph.counts.launches_replayed
    x.copy_(torch.randn(8))
    g.replay()
    torch.testing.assert_close(out, x * 2)
    assert cuda_graph.counts.launches_replayed == before + 1
    del triton


@pytest.mark.parametrize(
    "sync",
    [
        pytest.param(lambda x: x.sum().item(), id="item"),
        pytest.param(lambda x: torch.nonzero(x), id="nonzero"),
        pytest.param(lambda x: x[x > 0], id="mask-index"),
        pytest.param(lambda x: bool(x.any()), id="bool"),
        pytest.param(lambda x: torch.equal(x, x), id="equal"),
    ],
)
def test_host_syncs_are_refused_at_capture(sync):
    x = torch.randn(4)
    g = CUDAGraph()
    with pytest.raises(GraphCaptureError), graph(g):
        sync(x)
    assert not is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="never captured"):
        g.replay()


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone: its collectives still
    dispatch as ``c10d`` ops, as a DP rank's do. The one an earlier test's
    vLLM objects made (``vllm_on_cpu.harness.single_process_parallel_state``,
    kept for the process) where there is one."""
    import torch.distributed as dist

    from tests.openai_server import free_port

    if dist.is_initialized():
        assert (dist.get_world_size(), dist.get_backend()) == (1, "gloo")
        yield dist
        return

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist
    dist.destroy_process_group()


def test_a_collective_is_a_step_of_the_graph(world_of_one):
    """An MoE layer's gather and reduce in a captured forward: a replay runs
    them again on the captured tensors (and waits for them), as a CUDA graph
    replays the NCCL kernels it captured."""
    dist = world_of_one
    x = torch.randn(4)
    gathered = torch.empty(4)
    total = torch.empty(4)

    def region():
        dist.all_gather_single(gathered, x * 2)
        total.copy_(x + 1)
        dist.all_reduce(total)

    before = cuda_graph.counts.collectives_replayed
    replay_matches(region, [x], [gathered, total])
    assert cuda_graph.counts.collectives_replayed == before + 2


def test_host_work_is_neither_recorded_nor_refused():
    """vLLM's DP bookkeeping reads host tensors inside a captured forward;
    marked as host work it runs at capture, unrecorded, and its Python result
    is the capture's, as on a GPU."""
    across_dp = torch.tensor([3, 5])
    x = torch.randn(4)
    out = torch.empty(4)
    most = cuda_graph.host_work(lambda: int(across_dp.max()))

    g = capture(lambda: out.copy_(x * most()))
    across_dp[0] = 9
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(out, x * 5, rtol=0, atol=0)
    with pytest.raises(GraphCaptureError):
        capture(lambda: out.copy_(x * int(across_dp.max())))


def test_a_tensor_swapped_after_capture_gives_a_stale_result():
    """The caller hands in a new tensor instead of refilling the static one:
    a CUDA graph reads the captured one, and so does this replay."""
    step_input = torch.ones(4)
    out = torch.empty(4)
    g = capture(lambda: out.copy_(step_input * 2))
    step_input = torch.full((4,), 5.0)  # noqa: F841 - the stale case
    g.replay()
    assert out.tolist() == [2.0] * 4  # not 10: the graph never saw the new one


def test_python_values_and_side_effects_are_those_of_the_capture():
    x = torch.ones(2)
    out = torch.empty(2)
    calls = []
    scale = 3.0

    def region():
        calls.append(1)
        out.copy_(x * scale)

    g = capture(region)
    scale = 7.0
    g.replay()
    assert out.tolist() == [3.0, 3.0]
    assert calls == [1]  # the side effect ran once, at capture


def test_capture_state_and_errors():
    g = CUDAGraph()
    assert not is_current_stream_capturing()
    with graph(g):
        assert is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="already under way"):
            CUDAGraph().capture_begin()
    assert not is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="captured already"):
        g.capture_begin()
    g.reset()
    with pytest.raises(RuntimeError, match="without this graph"):
        g.capture_end()
    assert cuda_graph.graph_pool_handle() != cuda_graph.graph_pool_handle()


_OPS = {
    "add": lambda t: t + 1.5,
    "mul": lambda t: t * t,
    "view": lambda t: t.reshape(-1).view(t.shape),
    "long": lambda t: t.long().to(t.dtype),
    "transpose_contiguous": lambda t: t.t().contiguous().t(),
    "reshape": lambda t: t.t().reshape(t.shape),
    "to_same": lambda t: t.to(t.dtype),
    "slice_cat": lambda t: torch.cat([t[:, 1:], t[:, :1]], dim=1),
    "add_": lambda t: t.add_(1),
    "clamp": lambda t: t.clamp(-3, 3),
}


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=8),
    shape=st.tuples(st.integers(1, 5), st.integers(2, 5)),
    seed=st.integers(0, 2**16),
)
def test_any_chain_replays_as_it_runs_eagerly(ops, shape, seed):
    torch.manual_seed(seed)
    x = torch.randint(-5, 5, shape).float()
    out = torch.empty(shape)

    def region():
        t = x.clone()
        for op in ops:
            t = _OPS[op](t)
        out.copy_(t)

    replay_matches(region, [x], [out])


def test_install_puts_the_stand_in_where_vllm_looks():
    code = """
import torch
from vllm_on_cpu import cuda_graph
cuda_graph.install(); cuda_graph.install()
assert torch.cuda.CUDAGraph is cuda_graph.CUDAGraph
assert torch.cuda.graph is cuda_graph.graph
assert not torch.cuda.is_current_stream_capturing()
assert isinstance(torch.cpu.graph_pool_handle(), cuda_graph.GraphPool)
x = torch.arange(4.0)
ref = torch.ops._C.weak_ref_tensor(x)
assert ref.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
from triton.runtime.interpreter import GridExecutor
assert GridExecutor.__call__.__wrapped__ is not None
# The graph API alone says nothing of CUDA: our "cuda" backend still refuses,
# as for any CPU user; declare_cuda (the target way's "cuda" backend) lifts it.
from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.emulated_graph import GraphCaptureError
assert not torch.cuda.is_available()
try:
    CudaGraphManager([1], "cpu", backend="cuda")
except GraphCaptureError:
    pass
else:
    raise AssertionError("backend 'cuda' accepted without CUDA")
cuda_graph.declare_cuda()
assert torch.cuda.is_available() and torch.cuda.synchronize("cpu") is None
CudaGraphManager([1], "cpu", backend="cuda")
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_vllm_breakable_capture_replays_segments_and_eager_breaks(monkeypatch):
    """vLLM's own breakable capture (FULL_AND_PIECEWISE without torch.compile)
    on the stand-in: graph segments around an eager break."""
    pytest.importorskip("vllm")
    from vllm.compilation import breakable_cudagraph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    x, a, b, c = torch.randn(4), torch.empty(4), torch.empty(4), torch.empty(4)
    with breakable_cudagraph.BreakableCUDAGraphCapture() as cap:
        a.copy_(x + 1)
        cap.add_eager(lambda: b.copy_(a * 2))
        c.copy_(b - x)
    assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1)
    x.copy_(torch.randn(4))
    cap.replay()
    torch.testing.assert_close(c, (x + 1) * 2 - x)


_lib.define("attention_like(Tensor x, Tensor(a!) out) -> ()")


def _attention_like(x, out):
    """An op whose body breaks the capture, as vLLM's
    ``eager_break_during_capture`` wraps ``unified_attention_with_output``:
    it reads the forward context, so it must run eagerly at every replay."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    def body():
        if FORWARD_CONTEXT is None:
            raise RuntimeError("no forward context")
        out.copy_(x * FORWARD_CONTEXT["scale"])

    capture = BreakableCUDAGraphCapture.current()
    if capture is None:
        return body()
    capture.add_eager(body)


_lib.impl("attention_like", _attention_like, "CPU")


def test_an_eager_break_inside_an_op_body_splits_the_graph(monkeypatch):
    """The break ends one graph and begins the next inside the op's Python
    body: the eager part must record into neither, and the ops after it
    into the second graph."""
    global FORWARD_CONTEXT
    pytest.importorskip("vllm")
    from vllm.compilation import breakable_cudagraph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    x, a, b, c = torch.randn(4), torch.empty(4), torch.empty(4), torch.empty(4)
    FORWARD_CONTEXT = {"scale": 2.0}
    try:
        with torch.inference_mode():
            with breakable_cudagraph.BreakableCUDAGraphCapture() as cap:
                a.copy_(x + 1)
                torch.ops.cgstandin.attention_like(a, b)
                c.copy_(b - x)
            assert not is_current_stream_capturing()
            assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1)
            x.copy_(torch.randn(4))
            FORWARD_CONTEXT = {"scale": 5.0}  # the step's own, read eagerly
            cap.replay()
    finally:
        FORWARD_CONTEXT = None
    torch.testing.assert_close(c, (x + 1) * 5.0 - x)
