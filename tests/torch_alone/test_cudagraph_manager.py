"""CudaGraphManager: replay equals eager, and the emulator catches contract bugs.

The emulated backend runs everywhere; the ``cuda`` backend's tests repeat the
replay property on a real device (the pool and the accounting there:
tests/cuda/test_cudagraph_manager_cuda.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract.capture_sizes import CaptureSizes
from cg_extract.cudagraph_manager import CudaGraphManager, GraphCaptureError
from cg_extract.emulated_graph import StaticMemoryViolation

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"),
]

SIZES = (1, 2, 4, 8, 16, 24, 32)
NUM_LAYERS, HIDDEN, BLOCK_SIZE, NUM_BLOCKS = 3, 8, 4, 16
NULL_SLOT = 0  # padding slots (-1) clamp here; real tokens never use it
F32 = torch.float32


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact, NaN payloads and signed zeros included."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(as_bytes(got), as_bytes(want))


# --------------------------------------------------------------------------
# A realistic step: scatter hidden states into a paged cache


def make_scatter_step(hidden, slots, cache):
    """step(n): cache[slot // B, :, slot % B] = hidden[:n], padding slot -1 -> 0."""

    def step(n: int) -> None:
        slot = slots[:n].clamp(min=0)
        cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE] = hidden[:n]

    return step


@dataclass
class ScatterRig:
    manager: CudaGraphManager
    hidden: torch.Tensor  # static [max, L, H]
    slots: torch.Tensor  # static [max] int64
    cache: torch.Tensor  # [num_blocks, L, block_size, H], outlives the graphs

    def load(self, n: int, seed: int, head: Sequence[float] = ()) -> None:
        """Copy a fresh batch of n tokens into the static inputs, as a caller does.

        Rows past n keep stale data from earlier batches; their slots are -1.
        """
        gen = torch.Generator().manual_seed(seed)
        num_slots = NUM_BLOCKS * BLOCK_SIZE
        real_slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
        batch = torch.randn(n, NUM_LAYERS, HIDDEN, generator=gen)
        batch.view(-1)[: len(head)] = torch.tensor(head, dtype=F32)
        self.hidden[:n].copy_(batch)
        self.slots[:n].copy_(real_slots)
        self.slots[n:].fill_(-1)

    def eager_reference(self, n: int) -> torch.Tensor:
        """The same step, run eagerly at the live size on copies."""
        cache = self.cache.clone()
        make_scatter_step(self.hidden.clone(), self.slots.clone(), cache)(n)
        return cache


def build_rig(backend: str, pool=None) -> ScatterRig:
    device = "cuda" if backend == "cuda" else "cpu"
    manager = CudaGraphManager(SIZES, device, backend=backend, pool=pool)
    hidden = manager.static_buffer("hidden", (NUM_LAYERS, HIDDEN), F32)
    slots = manager.static_buffer("slots", (), torch.int64, fill_value=-1)
    cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, HIDDEN, device=device)
    manager.capture(make_scatter_step(hidden, slots, cache))
    return ScatterRig(manager, hidden, slots, cache)


@pytest.fixture(
    scope="module",
    params=["emulated", pytest.param("cuda", marks=needs_cuda)],
)
def rig(request):
    """One captured scatter step per backend, shared by the tests below."""
    built = build_rig(request.param)
    yield built
    built.manager.release()


def replay_and_compare(rig: ScatterRig, n: int, seed: int, head=()) -> None:
    rig.load(n, seed, head)
    want = rig.eager_reference(n)
    padded = rig.manager.replay(n)
    assert padded == CaptureSizes(SIZES).pad(n)
    if padded == n:
        assert_bytes_equal(rig.cache, want)  # no padding: everything identical
    # Padding rows write stale data into the null slot, which is garbage by
    # contract; every other byte of the cache must match the eager run.
    want[NULL_SLOT // BLOCK_SIZE, :, NULL_SLOT % BLOCK_SIZE] = rig.cache[
        NULL_SLOT // BLOCK_SIZE, :, NULL_SLOT % BLOCK_SIZE
    ]
    assert_bytes_equal(rig.cache, want)
    # And independently of the step's code: each token sits in its slot.
    slots = rig.slots[:n]
    stored = rig.cache[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]
    assert_bytes_equal(stored, rig.hidden[:n])


def test_replay_equals_eager_for_every_captured_size(rig):
    assert rig.manager.captured_sizes == list(SIZES)
    for seed, n in enumerate(SIZES):
        replay_and_compare(rig, n, seed)


def test_replay_equals_eager_for_seeded_random_batches(rig):
    gen = torch.Generator().manual_seed(1234)
    for seed in range(60):
        n = int(torch.randint(1, max(SIZES) + 1, (1,), generator=gen))
        replay_and_compare(rig, n, seed)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, max(SIZES)),
    seed=st.integers(0, 2**31 - 1),
    head=st.lists(st.floats(width=32), max_size=NUM_LAYERS * HIDDEN),
)
def test_replay_equals_eager_for_any_batch(rig, n, seed, head):
    """Random sizes and data, NaN, inf and -0.0 included, survive bit-exact."""
    replay_and_compare(rig, n, seed, head)


def test_replay_output_differs_when_inputs_differ(rig):
    """Guard against a vacuous comparison: new inputs do change the cache."""
    rig.load(5, seed=1)
    rig.manager.replay(5)
    before = rig.cache.clone()
    rig.load(5, seed=2)
    rig.manager.replay(5)
    assert not torch.equal(rig.cache, before)


# --------------------------------------------------------------------------
# Manager surface (emulated)

SMALL = (1, 2, 4, 8)


def emulated(sizes=SMALL) -> CudaGraphManager:
    return CudaGraphManager(sizes, "cpu", backend="emulated")


def copy_step(src: torch.Tensor, dst: torch.Tensor):
    def step(n: int) -> None:
        dst[:n].copy_(src[:n])

    return step


def test_capture_is_largest_first_with_a_warm_up_per_size():
    manager = emulated((4, 1, 16, 2))
    calls: list[int] = []
    manager.capture(calls.append)
    assert calls == [16, 16, 4, 4, 2, 2, 1, 1]  # warm-up, then capture, per size
    assert manager.captured_sizes == [1, 2, 4, 16]
    calls.clear()
    assert manager.replay(3) == 4
    assert calls == [4]  # the emulator replays by running the padded step


def test_replay_returns_padded_size_for_every_count():
    manager = emulated()
    manager.capture(lambda n: None)
    for n in range(0, max(SMALL) + 1):
        assert manager.padded_size(n) == CaptureSizes(SMALL).pad(n)
        assert manager.replay(n) == CaptureSizes(SMALL).pad(n)


def test_replay_above_largest_size_raises_clearly():
    manager = emulated()
    manager.capture(lambda n: None)
    assert manager.padded_size(9) is None
    with pytest.raises(
        GraphCaptureError, match=r"no graph for 9 tokens.*\[1, 2, 4, 8\]"
    ):
        manager.replay(9)


def test_release_forgets_every_graph():
    manager = emulated()
    manager.capture(lambda n: None)
    assert manager.padded_size(3) == 4
    assert manager.capture_time_s > 0 and sorted(manager.capture_times_s) == [
        1,
        2,
        4,
        8,
    ]
    manager.release()
    assert manager.captured_sizes == []
    # What the captures cost goes with them.
    assert manager.graph_memory_bytes == 0
    assert manager.capture_time_s == 0 and manager.capture_times_s == {}
    assert all(manager.padded_size(n) is None for n in range(0, 10))
    with pytest.raises(GraphCaptureError, match="no graph for 3 tokens"):
        manager.replay(3)


def test_nothing_replays_before_capture():
    manager = emulated()
    assert manager.padded_size(1) is None
    with pytest.raises(GraphCaptureError):
        manager.replay(1)


def test_second_capture_needs_release():
    manager = emulated()
    calls: list[int] = []
    manager.capture(calls.append)
    with pytest.raises(GraphCaptureError, match="release"):
        manager.capture(calls.append)
    manager.release()
    calls.clear()
    manager.capture(calls.append)
    assert manager.captured_sizes == list(SMALL) and len(calls) == 2 * len(SMALL)


def test_static_buffer_shape_dtype_fill_and_identity():
    manager = emulated()
    buf = manager.static_buffer("slots", (), torch.int64, fill_value=-1)
    hid = manager.static_buffer("hidden", (3, 5), torch.bfloat16)
    assert buf.shape == (8,) and buf.dtype == torch.int64
    assert torch.equal(buf, torch.full((8,), -1))
    assert hid.shape == (8, 3, 5) and hid.dtype == torch.bfloat16
    assert not hid.any()
    assert manager.buffers == {"slots": buf, "hidden": hid}


def test_static_buffer_duplicate_name_raises():
    manager = emulated()
    first = manager.static_buffer("hidden", (4,), F32)
    with pytest.raises(ValueError, match="'hidden'"):
        manager.static_buffer("hidden", (4,), F32)
    assert manager.buffers["hidden"] is first


def test_unknown_backend_raises_naming_it():
    with pytest.raises(ValueError, match="'tpu'"):
        CudaGraphManager(SMALL, "cpu", backend="tpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error path")
def test_cuda_backend_without_cuda_raises():
    with pytest.raises(GraphCaptureError, match="emulated"):
        CudaGraphManager(SMALL, "cpu", backend="cuda")


def test_bad_capture_sizes_raise():
    with pytest.raises(ValueError, match="capture size 0 is not"):
        emulated((0, 4))


def test_emulated_accounting():
    """Graph memory is what the largest size allocates inside the step."""
    manager = emulated()
    src = manager.static_buffer("src", (6,), F32)
    dst = manager.static_buffer("dst", (6,), F32)
    manager.capture(lambda n: dst[:n].copy_(src[:n] * 2))  # one [n, 6] temp
    assert manager.graph_memory_bytes == max(SMALL) * 6 * 4
    assert manager.capture_time_s > 0


# --------------------------------------------------------------------------
# Bug classes the emulator must catch, each next to its correct form


def test_fresh_tensor_instead_of_static_buffer_raises():
    """(a) The caller rebinds its input name to a new tensor instead of copying."""
    manager = emulated()
    inputs = {"x": manager.static_buffer("x", (4,), F32)}
    out = manager.static_buffer("out", (4,), F32)
    manager.capture(lambda n: out[:n].copy_(inputs["x"][:n] * 2))
    inputs["x"] = torch.ones(8, 4)
    with pytest.raises(StaticMemoryViolation, match="static buffer"):
        manager.replay(3)


def test_other_rows_of_the_same_buffer_raise():
    """(a') Same storage, same shape and stride, another offset: a graph
    captured over ``buf[:4]`` reads those rows at replay, never ``buf[4:8]``."""
    manager = emulated((1, 2, 4))
    out = manager.static_buffer("out", (4,), F32)
    buf = torch.zeros(8, 4)  # a persistent buffer of the caller's
    views = {"x": buf[:4]}  # made outside the step: no slice op to compare
    manager.capture(lambda n: out[:n].copy_(views["x"][:n]), progress=False)
    views["x"] = buf[4:8]
    assert views["x"].data_ptr() != buf.data_ptr()
    assert views["x"].untyped_storage().data_ptr() == buf.data_ptr()
    with pytest.raises(StaticMemoryViolation, match=r"\(offset 0,.*\(offset 16,"):
        manager.replay(4)


def test_copy_into_static_buffer_passes():
    manager = emulated()
    inputs = {"x": manager.static_buffer("x", (4,), F32)}
    out = manager.static_buffer("out", (4,), F32)
    manager.capture(lambda n: out[:n].copy_(inputs["x"][:n] * 2))
    inputs["x"].copy_(torch.ones(8, 4))
    manager.replay(3)
    assert torch.equal(out[:4], torch.full((4, 4), 2.0))


@pytest.mark.parametrize("op", ["fill_", "add_"])
def test_python_value_baked_at_capture_raises(op):
    """(b) A Python number that changes after capture; a graph keeps the old one."""
    manager = emulated()
    out = manager.static_buffer("out", (4,), F32)
    counter = [1]
    manager.capture(lambda n: getattr(out[:n], op)(float(counter[0])))
    counter[0] = 2
    with pytest.raises(StaticMemoryViolation, match="captured value 1.0, replay 2.0"):
        manager.replay(2)


def test_value_through_static_tensor_passes():
    manager = emulated()
    out = manager.static_buffer("out", (4,), F32)
    counter = torch.ones(())
    manager.capture(lambda n: out[:n].fill_(counter))
    counter.fill_(2)
    manager.replay(2)
    assert torch.equal(out[:2], torch.full((2, 4), 2.0))


def test_constant_nan_argument_replays():
    """A fixed NaN scalar is the same value at every replay (NaN != NaN in Python)."""
    manager = emulated()
    out = manager.static_buffer("out", (4,), F32)
    manager.capture(lambda n: out[:n].fill_(float("nan")))
    manager.replay(2)
    assert out[:2].isnan().all()


def test_python_length_that_changes_raises():
    """(c) Slicing by the live batch length, a Python int, changes the shapes."""
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    live = {"len": 2}

    def step(n):
        dst[:n].zero_()
        dst[: live["len"]].copy_(src[: live["len"]])

    manager.capture(step)
    live["len"] = 3
    with pytest.raises(StaticMemoryViolation, match="captured value 2, replay 3"):
        manager.replay(3)


def test_slicing_by_the_padded_size_passes():
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    manager.capture(copy_step(src, dst))
    src[:3].copy_(torch.arange(12.0).view(3, 4))
    src[3:].zero_()  # the caller clears the padding rows it does not use
    manager.replay(3)
    assert torch.equal(dst[:4], src[:4])


def test_python_branch_that_changes_raises():
    """(d) A Python flag picks another op path, with a temporary capture never made."""
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    mode = {"fused": True}

    def step(n):
        if mode["fused"]:
            torch.mul(src[:n], 2, out=dst[:n])
        else:
            doubled = src[:n] * 2
            dst[:n].copy_(doubled)

    manager.capture(step)
    mode["fused"] = False
    with pytest.raises(StaticMemoryViolation, match="op #1 aten::mul.*another path"):
        manager.replay(3)


def test_branch_on_the_size_passes():
    """A branch on the size is fixed per graph, so it is legal."""
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)

    def step(n):
        if n >= 4:
            torch.mul(src[:n], 2, out=dst[:n])
        else:
            dst[:n].copy_(src[:n] * 2)

    manager.capture(step)
    src.copy_(torch.arange(32.0).view(8, 4))
    for n in (1, 3, 8):
        manager.replay(n)
        assert torch.equal(dst[:n], src[:n] * 2)


def test_allocation_capture_did_not_make_raises():
    """(d) Same ops, same tensors, but data sizes an allocation: replay differs."""
    manager = emulated()
    counts = torch.ones(4, dtype=torch.int64)
    out = manager.static_buffer("out", (), torch.int64)

    def step(n):
        index = torch.repeat_interleave(counts)  # length sum(counts): data-dependent
        out[:1].copy_(index.sum(0, keepdim=True))

    manager.capture(step)
    manager.replay(1)  # same data: same allocation
    counts[0] = 3
    with pytest.raises(StaticMemoryViolation, match="repeat_interleave allocated"):
        manager.replay(1)


SYNCING_STEPS = {
    "item": lambda x, m: x.sum().item(),
    "float": lambda x, m: float(x.sum()),
    "bool": lambda x, m: bool(m.any()),
    "nonzero": lambda x, m: m.nonzero(),
    "where_one_arg": lambda x, m: torch.where(m),
    "mask_index": lambda x, m: x[m],
    "uint8_mask_index": lambda x, m: x[m.to(torch.uint8)],  # deprecated, still a mask
    "masked_select": lambda x, m: torch.masked_select(x, m),
    "unique": lambda x, m: torch.unique(x),
    "unique_dim": lambda x, m: torch.unique(x, dim=0),
    "bincount": lambda x, m: torch.bincount(m.long().view(-1)),
}


@pytest.mark.parametrize("name", sorted(SYNCING_STEPS))
def test_host_sync_raises_at_capture(name):
    """(e) Host syncs and data-dependent shapes cannot be captured at all."""
    manager = emulated()
    x = manager.static_buffer("x", (4,), F32)
    m = manager.static_buffer("mask", (4,), torch.bool)
    warm_ups: list[int] = []

    def step(n):
        warm_ups.append(n)
        SYNCING_STEPS[name](x[:n], m[:n])

    with pytest.raises(GraphCaptureError, match="cannot capture"):
        manager.capture(step)
    assert warm_ups == [8, 8]  # the eager warm-up ran, the capture raised
    assert manager.captured_sizes == []


def test_device_side_select_passes():
    manager = emulated()
    x = manager.static_buffer("x", (4,), F32)
    m = manager.static_buffer("mask", (4,), torch.bool)
    out = manager.static_buffer("out", (4,), F32)
    manager.capture(lambda n: out[:n].copy_(torch.where(m[:n], x[:n], 0.0)))
    x.copy_(torch.arange(32.0).view(8, 4))
    m.copy_(torch.arange(32).view(8, 4) % 3 == 0)
    manager.replay(8)
    assert torch.equal(out, torch.where(m, x, 0.0))


def test_replay_that_skips_ops_raises():
    """(f) An early exit taken at replay skips work a real graph would still do."""
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    enabled = {"scale": True}

    def step(n):
        dst[:n].copy_(src[:n])
        if not enabled["scale"]:
            return
        dst[:n].mul_(0.5)

    manager.capture(step)
    enabled["scale"] = False
    with pytest.raises(StaticMemoryViolation, match="skipped work"):
        manager.replay(4)


def test_replay_that_runs_every_op_passes():
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)

    def step(n):
        dst[:n].copy_(src[:n])
        dst[:n].mul_(0.5)

    manager.capture(step)
    src.fill_(3.0)
    manager.replay(4)
    assert torch.equal(dst[:4], torch.full((4, 4), 1.5))


def test_extra_op_at_replay_raises():
    """The mirror of (f): work that capture never recorded."""
    manager = emulated()
    src = manager.static_buffer("src", (4,), F32)
    dst = manager.static_buffer("dst", (4,), F32)
    extra = {"on": False}

    def step(n):
        dst[:n].copy_(src[:n])
        if extra["on"]:
            dst[:n].mul_(0.5)

    manager.capture(step)
    extra["on"] = True
    with pytest.raises(StaticMemoryViolation, match="was not captured"):
        manager.replay(4)
