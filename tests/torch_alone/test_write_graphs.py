"""WriteGraphs with the step's arithmetic in torch alone (no vLLM), on the
emulated backend here and on real CUDA graphs where a GPU is present: the
same comparison the speculator tests make, for a GPU machine without vLLM."""

import pytest
import torch

from cg_extract.cache_write import write_stacked
from cg_extract.capture_sizes import CaptureSizes
from cg_extract.emulated_graph import StaticMemoryViolation
from cg_extract.write_graphs import GraphInputs, WriteGraphs
from cg_extract.write_op import write_hidden_states

SIZES = CaptureSizes([1, 2, 4, 8, 16, 24, 32, 48, 64])
LAYERS, HIDDEN, BLOCK, BLOCKS = 3, 128, 16, 12

BACKENDS = [
    pytest.param("emulated", "cpu", id="emulated"),
    pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda),
]


class Rig:
    """A KV cache, the target's persistent buffers and WriteGraphs over them."""

    def __init__(self, backend, device, dtype, zero_copy=True):
        self.device, self.dtype = torch.device(device), dtype
        self.cache = torch.zeros(
            BLOCKS, LAYERS, BLOCK, HIDDEN, dtype=dtype, device=device
        )
        self.reference = torch.zeros_like(self.cache)
        self.persistent = GraphInputs(
            [
                torch.zeros(SIZES.max_size, HIDDEN, dtype=dtype, device=device)
                for _ in range(LAYERS)
            ],
            torch.full((256,), -1, dtype=torch.int64, device=device),
        )
        self.graphs = WriteGraphs(
            SIZES, self.device, backend, LAYERS, HIDDEN, dtype,
            write=lambda aux, slots: write_hidden_states(aux, self.cache, slots),
        )  # fmt: skip
        self.graphs.capture(self.persistent if zero_copy else None, progress=False)

    def inputs(self, n, gen, in_place):
        slots = torch.randperm((BLOCKS - 1) * BLOCK, generator=gen)[:n] + BLOCK
        aux = [
            torch.randn(n, HIDDEN, generator=gen).to(self.dtype) for _ in range(LAYERS)
        ]
        aux = [a.to(self.device) for a in aux]
        slots = slots.to(self.device)
        if in_place:  # as after a FULL graph replay of the target
            aux = [
                buf[:n].copy_(a)
                for buf, a in zip(self.persistent.aux_hidden_states, aux, strict=True)
            ]
            slots = self.persistent.slot_mapping[:n].copy_(slots)
        return aux, slots

    def step(self, n, gen, in_place):
        aux, slots = self.inputs(n, gen, in_place)
        write_stacked(
            torch.stack(aux, dim=1), self.reference, slots
        )  # vLLM's arithmetic
        path = self.graphs.run(aux, slots, SIZES.pad(n))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return path

    def same(self):
        """vLLM's arithmetic sends padding to block 0; the op writes it nowhere."""
        return not self.cache[0].any() and torch.equal(
            self.cache[1:].view(torch.uint8), self.reference[1:].view(torch.uint8)
        )


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_paths_match_vllms_arithmetic(backend, device, dtype):
    rig = Rig(backend, device, dtype)
    gen = torch.Generator().manual_seed(3)
    paths = {"zero_copy": 0, "copy_in": 0}
    for step in range(600 if backend == "emulated" else 3000):
        in_place = bool(torch.randint(0, 2, (), generator=gen))
        n = int(torch.randint(1, SIZES.max_size + 1, (), generator=gen))
        if in_place:
            n = SIZES.pad(n)  # the target replays only its captured sizes
        path = rig.step(n, gen, in_place)
        assert path == ("zero_copy" if in_place else "copy_in"), f"step {step}"
        paths[path] += 1
        assert rig.same(), f"caches differ at step {step} ({path}, n={n})"
    assert min(paths.values()) > 200
    assert rig.graphs.zero_copy_sizes == list(SIZES.sizes)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_padding_is_written_nowhere(backend, device):
    rig = Rig(backend, device, torch.float32, zero_copy=False)
    gen = torch.Generator().manual_seed(4)
    rig.step(40, gen, in_place=False)  # leaves rows 33..39 of the static buffer set
    rig.cache.zero_()
    rig.reference.zero_()
    aux, slots = rig.inputs(33, gen, in_place=False)
    write_stacked(torch.stack(aux, dim=1), rig.reference, slots)
    assert rig.graphs.run(aux, slots, 48) == "copy_in"
    assert (rig.graphs.slot_mapping[33:48] == -1).all()
    touched = set((rig.cache.flatten(1).abs().sum(1) != 0).nonzero().flatten().tolist())
    owned = set((slots // BLOCK).tolist())
    assert touched == owned, "the stale padded rows are written nowhere"
    assert rig.same()


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_real_or_emulated_graph_memory_and_time_reported(backend, device):
    if device == "cuda":  # cached free blocks that each capture's empty_cache frees
        torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    rig = Rig(backend, device, torch.bfloat16)
    assert rig.graphs.capture_time_s > 0
    if backend == "cuda":
        # Neither the cache emptied on the way nor anything but the graphs counts.
        assert 0 < rig.graphs.graph_memory_bytes < 64 * 2**20
    else:  # the step is the one op, which allocates nothing a graph would hold
        assert rig.graphs.graph_memory_bytes == 0
    assert rig.graphs.captured_sizes == list(SIZES.sizes)
    rig.graphs.release()
    assert rig.graphs.captured_sizes == [] and rig.graphs.zero_copy_sizes == []
    # Nothing left to replay: every step runs eagerly.
    assert all(rig.graphs.padded_size(n) is None for n in range(1, SIZES.max_size + 1))


def test_emulator_rejects_zero_copy_over_other_memory(monkeypatch):
    rig = Rig("emulated", "cpu", torch.float32)
    monkeypatch.setattr(WriteGraphs, "_reads_in_place", lambda self, given: True)
    with pytest.raises(StaticMemoryViolation):
        rig.step(16, torch.Generator().manual_seed(5), in_place=False)


def test_in_place_check_wants_the_captured_views():
    rig = Rig("emulated", "cpu", torch.float32)
    gen = torch.Generator().manual_seed(6)
    aux, slots = rig.inputs(16, gen, in_place=True)
    assert rig.graphs.run(aux, slots, 16) == "zero_copy"
    # Same buffers, other views: every other row, a later offset, a copy.
    assert rig.graphs.run([a[::1][:16] for a in aux], slots, 16) == "zero_copy"
    every_other = [buf[:32:2] for buf in rig.persistent.aux_hidden_states]
    assert rig.graphs.run(every_other, slots, 16) == "copy_in"
    shifted = [buf[1:17] for buf in rig.persistent.aux_hidden_states]
    assert rig.graphs.run(shifted, slots, 16) == "copy_in"
    assert rig.graphs.run(aux, slots.clone(), 16) == "copy_in"


def test_a_view_as_another_dtype_is_not_the_captured_view():
    """The target's bf16 buffers read as fp16: same address, shape and
    stride as the captured views, other values. The zero-copy graph would
    read them as bf16; the copy-in path converts them, as vLLM's write does."""
    rig = Rig("emulated", "cpu", torch.bfloat16)
    aux, slots = rig.inputs(16, torch.Generator().manual_seed(7), in_place=True)
    as_fp16 = [a.view(torch.float16) for a in aux]
    assert all(
        (h.data_ptr(), h.shape, h.stride()) == (a.data_ptr(), a.shape, a.stride())
        for h, a in zip(as_fp16, aux, strict=True)
    )
    converted = torch.stack(as_fp16, dim=1).to(torch.bfloat16)
    write_stacked(converted, rig.reference, slots)
    assert rig.graphs.run(as_fp16, slots, 16) == "copy_in"
    assert rig.same()


def test_zero_copy_capture_writes_no_live_slot():
    """The target's slot row may still hold the last step's slots when we
    capture; warm-up and capture run the write over it. They must write to
    the null block only."""
    cache = torch.zeros(BLOCKS, LAYERS, BLOCK, HIDDEN)
    persistent = GraphInputs(
        [torch.randn(SIZES.max_size, HIDDEN) for _ in range(LAYERS)],
        torch.randperm((BLOCKS - 1) * BLOCK)[: SIZES.max_size] + BLOCK,  # live
    )
    graphs = WriteGraphs(
        SIZES, torch.device("cpu"), "emulated", LAYERS, HIDDEN, torch.float32,
        write=lambda aux, slots: write_hidden_states(aux, cache, slots),
    )  # fmt: skip
    graphs.capture(persistent, SIZES.sizes, progress=False)
    assert graphs.zero_copy_sizes == list(SIZES.sizes)
    assert not cache[1:].any(), "capture overwrote slots a request owns"


def test_zero_copy_sizes_above_the_persistent_rows_are_refused():
    persistent = GraphInputs(
        [torch.zeros(16, HIDDEN) for _ in range(LAYERS)], torch.full((16,), -1)
    )
    graphs = WriteGraphs(
        SIZES, torch.device("cpu"), "emulated", LAYERS, HIDDEN, torch.float32,
        write=lambda aux, slots: None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"zero-copy sizes \[24\] exceed .* 16 rows"):
        graphs.capture(persistent, [8, 16, 24], progress=False)


def test_static_buffers_and_emulated_graph_memory_are_counted_exactly():
    rig = Rig("emulated", "cpu", torch.bfloat16, zero_copy=False)
    rows = SIZES.max_size
    assert rig.graphs.static_bytes == rows * (LAYERS * HIDDEN * 2 + 8)
    # The emulated figure is what the largest graph allocates in its step
    # (the write's temporaries, if any), static buffers not included.
    largest = rig.graphs.copy_in._graphs[rows]
    assert rig.graphs.graph_memory_bytes == largest.held_bytes
