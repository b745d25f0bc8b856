"""Our write graphs beside a target's FULL graphs, as an MRv2 worker runs them.

Torch alone (no vLLM), so it runs on the GPU machine, which has none. The
pieces stand for the runner's:

* a toy target (a few linear layers) whose FULL graphs, captured first, largest
  first, write their aux hidden states into persistent buffers: the target
  graph manager's outputs;
* a slot row of ``max_num_batched_tokens`` rows that the runner fills each
  step, padded tail -1: ``block_tables.slot_mappings``;
* our copy-in and zero-copy graphs, captured after the target's into the same
  pool, as ``speculator.capture()`` runs after the target's capture.

Steps alternate a target replay (``propose`` then receives views of the
persistent buffers, ``padded`` rows) and an eager target (fresh aux tensors),
with sizes inside and above the capture range. After every step our cache
equals vLLM's arithmetic on the real tokens, byte for byte, and block 0 (where
vLLM's layer sends padding) is untouched.

The ``emulated`` case runs here and in CI; the ``cuda`` case is what
``perf/gpu_check.sh`` runs on a GPU, with thousands of steps; both print
capture time per size, graph memory and steps per path on one line that
starts with ``runner_imitation:`` (``pytest -s``, or ``-rA`` as the GPU check
runs it).
"""

from __future__ import annotations

import json

import pytest
import torch

from cg_extract.cache_write import write_stacked
from cg_extract.capture_sizes import CaptureSizes
from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.write_graphs import PAD_SLOT_ID, GraphInputs, WriteGraphs
from cg_extract.write_op import write_hidden_states

CAPTURE = CaptureSizes([1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128])
MAX_TOKENS = 192  # max_num_batched_tokens: steps above the capture range run eager
LAYERS, HIDDEN, BLOCK = 3, 256, 16
NUM_BLOCKS = MAX_TOKENS // BLOCK + 2  # every slot of a step, plus the null block


class ToyTarget:
    """A few linear layers whose outputs are the aux hidden states.

    ``replay(x)`` runs the captured FULL graph for ``pad(len(x))`` tokens and
    returns views of the persistent outputs; ``forward(x)`` runs eagerly and
    returns fresh tensors, as the target does outside its capture range or
    when a step is not graph-eligible.
    """

    def __init__(self, device, backend, pool, dtype, gen):
        self.weights = [
            (torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
            .to(dtype)
            .to(device)
            for _ in range(LAYERS)
        ]
        self.graphs = CudaGraphManager(CAPTURE, device, backend, pool)
        self.input = self.graphs.static_buffer("input", (HIDDEN,), dtype)
        self.aux = [
            self.graphs.static_buffer(f"aux_{i}", (HIDDEN,), dtype)
            for i in range(LAYERS)
        ]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        aux = []
        for w in self.weights:
            x = torch.tanh(x @ w)
            aux.append(x)
        return aux

    def capture(self) -> None:
        def step(size: int) -> None:
            for buf, out in zip(self.aux, self.forward(self.input[:size]), strict=True):
                buf[:size].copy_(out)

        self.graphs.capture(step, "Capturing toy target graphs", progress=False)

    def replay(self, x: torch.Tensor) -> list[torch.Tensor]:
        n = len(x)
        self.input[:n].copy_(x)  # rows n..padded keep stale input: padding
        padded = self.graphs.replay(n)
        return [buf[:padded] for buf in self.aux]


class Worker:
    """The runner's persistent buffers, the target, our graphs, a reference."""

    def __init__(self, backend: str, device: str, dtype: torch.dtype, seed: int):
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator().manual_seed(seed)
        pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self.target = ToyTarget(self.device, backend, pool, dtype, self.gen)
        self.slot_row = torch.full(
            (MAX_TOKENS,), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )
        shape = (NUM_BLOCKS, LAYERS, BLOCK, HIDDEN)
        self.cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.reference = torch.zeros_like(self.cache)
        self.graphs = WriteGraphs(
            CAPTURE, self.device, backend, LAYERS, HIDDEN, dtype,
            write=lambda aux, slots: write_hidden_states(aux, self.cache, slots),
            pool=pool,
        )  # fmt: skip
        self.counts = {"zero_copy": 0, "copy_in": 0, "eager": 0}

    def capture(self) -> None:
        # The runner's order: the target's FULL graphs, then speculator.capture().
        self.target.capture()
        persistent = GraphInputs(self.target.aux, self.slot_row)
        self.graphs.capture(persistent, progress=False)

    def step(self, n: int, target_replays: bool) -> str:
        x = torch.randn(n, HIDDEN, generator=self.gen).to(self.dtype).to(self.device)
        slots = torch.randperm((NUM_BLOCKS - 1) * BLOCK, generator=self.gen)[:n]
        slots = (slots + BLOCK).to(self.device)  # block 0 is the null block
        graph_target = target_replays and CAPTURE.pad(n) is not None
        rows = CAPTURE.pad(n) if graph_target else n
        # The runner's prepare_inputs: real slots, then the padded tail.
        self.slot_row[:n].copy_(slots)
        self.slot_row[n:rows].fill_(PAD_SLOT_ID)
        aux = self.target.replay(x) if graph_target else self.target.forward(x)
        # propose(): aux_hidden_states[0].shape[0] tokens, the slot row's views.
        num_tokens = aux[0].shape[0]
        assert num_tokens == rows
        got_slots = self.slot_row[:rows]
        write_stacked(torch.stack([a[:n] for a in aux], dim=1), self.reference, slots)
        padded = self.graphs.padded_size(num_tokens)
        if padded is None:
            write_hidden_states(aux, self.cache, got_slots)
            path = "eager"
        else:
            path = self.graphs.run(aux, got_slots, padded)
        self.counts[path] += 1
        return path

    def same(self) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # The whole cache: the reference writes real slots only, and so does
        # the op (padding lands nowhere, not even in the null block 0).
        return torch.equal(
            self.cache.view(torch.uint8), self.reference.view(torch.uint8)
        )

    def report(self) -> dict:
        return {
            "device": str(self.device)
            + (
                f" ({torch.cuda.get_device_name()})"
                if self.device.type == "cuda"
                else ""
            ),
            "dtype": str(self.dtype),
            "capture_s_per_size": {
                "target": _rounded(self.target.graphs.capture_times_s),
                **{k: _rounded(v) for k, v in self.graphs.capture_times_s.items()},
            },
            "graph_memory_mib": {
                "target": self.target.graphs.graph_memory_bytes / 2**20,
                "write_graphs": self.graphs.graph_memory_bytes / 2**20,
            },
            "steps_per_path": dict(self.counts),
        }


def _rounded(times: dict[int, float]) -> dict[int, float]:
    return {size: round(t, 6) for size, t in sorted(times.items(), reverse=True)}


@pytest.mark.parametrize(
    "backend, device, steps",
    [
        pytest.param("emulated", "cpu", 1000, id="emulated"),
        pytest.param("cuda", "cuda", 5000, id="cuda", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_write_graphs_beside_target_graphs(backend, device, steps, dtype):
    worker = Worker(backend, device, dtype, seed=11)
    worker.capture()
    assert worker.graphs.captured_sizes == list(CAPTURE.sizes)
    assert worker.graphs.zero_copy_sizes == list(CAPTURE.sizes)
    gen = torch.Generator().manual_seed(12)
    for step in range(steps):
        n = int(torch.randint(1, MAX_TOKENS + 1, (), generator=gen))
        target_replays = step % 2 == 0
        path = worker.step(n, target_replays)
        if n > CAPTURE.max_size:
            expected = "eager"
        else:
            expected = "zero_copy" if target_replays else "copy_in"
        assert path == expected, f"step {step}: n={n}"
        assert worker.same(), f"caches differ at step {step} ({path}, n={n})"
    counts = worker.counts
    assert min(counts.values()) >= steps // 8, counts
    print("runner_imitation:", json.dumps(worker.report()))
