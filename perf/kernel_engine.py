"""The ``kernel`` engine: the speculator step's arithmetic in torch alone.

For a GPU machine without vLLM. Each mode runs the code the matching
speculator runs, less vLLM's forward context and connector hooks (Python, no
device work): the write op (:mod:`cg_extract.write_op`) and, for the graph
modes, :class:`~cg_extract.write_graphs.WriteGraphs`; ``per_layer`` is the
write before the op, one scatter per aux layer (:mod:`cg_extract.cache_write`).
Imports no vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cg_extract.cache_write import write_per_layer, write_stacked
from cg_extract.capture_sizes import CaptureSizes
from cg_extract.write_graphs import PAD_SLOT_ID, GraphInputs, WriteGraphs
from cg_extract.write_op import write_hidden_states
from perf.engines import Engine, Mode, Runner

MAX_NUM_REQS = 256


@dataclass
class KernelInputs:
    aux_hidden_states: list[torch.Tensor]  # L tensors of [n, H]
    slot_mapping: torch.Tensor  # [n] int64, unique, outside block 0
    last_sampled: torch.Tensor  # [MAX_NUM_REQS, 1]
    idx_mapping: torch.Tensor  # [num_reqs]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def draft_tokens(inputs: KernelInputs) -> torch.Tensor:
    """``last_sampled[idx_mapping, :1]``: the draft every mode returns."""
    return inputs.last_sampled[inputs.idx_mapping, :1]


class UpstreamKernel(Runner):
    """vLLM's arithmetic: stack into a temporary, copy it into the staging
    buffer, scatter the buffer into the cache."""

    def __init__(self, engine: KernelEngine):
        p = engine.params
        self.kv_cache = engine.new_cache()
        self.hidden_states = engine.zeros(p.max_tokens, p.num_layers, p.hidden_size)

    def step(self, inputs: KernelInputs) -> torch.Tensor:
        draft = draft_tokens(inputs)
        n = inputs.num_tokens
        stacked = torch.stack(inputs.aux_hidden_states, dim=1)
        self.hidden_states[:n].copy_(stacked)
        write_stacked(self.hidden_states[:n], self.kv_cache, inputs.slot_mapping)
        return draft


class EagerKernel(Runner):
    """Our eager path: the write op, each aux hidden state scattered
    straight to its cache slot (``per_layer``: the same through one scatter
    per layer, the write before the op)."""

    def __init__(self, engine: KernelEngine, kv_cache=None, write=write_hidden_states):
        self.write = write
        self.kv_cache = engine.new_cache() if kv_cache is None else kv_cache

    def step(self, inputs: KernelInputs) -> torch.Tensor:
        draft = draft_tokens(inputs)
        self.write(inputs.aux_hidden_states, self.kv_cache, inputs.slot_mapping)
        return draft


class GraphKernel(Runner):
    """Our graph path (:class:`~cg_extract.write_graphs.WriteGraphs` over the
    write op); above the largest capture size, the eager path.

    ``in_place``: the inputs arrive as views of persistent buffers, as after a
    FULL graph replay of the target, so captured sizes replay with no copy.
    Otherwise every step copies its inputs into the static buffers first.
    """

    def __init__(self, engine: KernelEngine, in_place: bool):
        engine.require_cuda_graphs()
        p = engine.params
        self.kv_cache = engine.new_cache()
        self.eager = EagerKernel(engine, kv_cache=self.kv_cache)
        self.graphs = WriteGraphs(
            CaptureSizes(p.capture_sizes),
            engine.device,
            engine.graph_backend,
            p.num_layers,
            p.hidden_size,
            p.torch_dtype,
            write=lambda aux, slots: write_hidden_states(aux, self.kv_cache, slots),
        )
        self.persistent = None
        if in_place:
            rows = max(p.capture_sizes)
            self.persistent = GraphInputs(
                [engine.zeros(rows, p.hidden_size) for _ in p.aux_layers],
                torch.full((rows,), PAD_SLOT_ID, device=engine.device),
            )
        self.graphs.capture(self.persistent, progress=False)

    def graph_summary(self) -> dict:
        return self.graphs.summary()

    def receive(self, inputs: KernelInputs) -> KernelInputs:
        n = inputs.num_tokens
        if self.persistent is None or n > self.persistent.rows:
            return inputs
        aux = [
            buf[:n].copy_(a)
            for buf, a in zip(
                self.persistent.aux_hidden_states, inputs.aux_hidden_states, strict=True
            )
        ]
        slots = self.persistent.slot_mapping[:n].copy_(inputs.slot_mapping)
        return dataclasses.replace(inputs, aux_hidden_states=aux, slot_mapping=slots)

    def step(self, inputs: KernelInputs) -> torch.Tensor:
        n = inputs.num_tokens
        padded = self.graphs.padded_size(n)
        if padded is None:
            return self.eager.step(inputs)
        draft = draft_tokens(inputs)
        self.graphs.run(inputs.aux_hidden_states, inputs.slot_mapping, padded)
        return draft


class KernelEngine(Engine):
    name = "kernel"
    MODES = {
        "upstream": Mode(
            "stack into a temporary, copy into a buffer, write_stacked", UpstreamKernel
        ),
        "eager": Mode("the write op, write_hidden_states", EagerKernel),
        "per_layer": Mode(
            "the write before the op: one scatter per aux layer, write_per_layer",
            lambda engine: EagerKernel(engine, write=write_per_layer),
        ),
        "graph": Mode(
            "inputs in persistent buffers (target replayed a FULL graph): "
            "zero-copy replay of the fused write",
            lambda engine: GraphKernel(engine, in_place=True),
        ),
        "graph_copy_in": Mode(
            "fresh inputs (target ran eagerly): copy into static buffers, replay",
            lambda engine: GraphKernel(engine, in_place=False),
        ),
    }

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.params.torch_dtype, device=self.device)

    def new_cache(self) -> torch.Tensor:
        p = self.params
        return self.zeros(self.num_blocks(), p.num_layers, p.block_size, p.hidden_size)

    def make_inputs(self, num_tokens: int, generator: torch.Generator) -> KernelInputs:
        p = self.params
        capacity = (self.num_blocks() - 1) * p.block_size
        slots = torch.randperm(capacity, generator=generator)[:num_tokens]
        num_reqs = min(num_tokens, MAX_NUM_REQS)
        aux = [
            torch.randn(num_tokens, p.hidden_size, generator=generator)
            for _ in p.aux_layers
        ]
        return KernelInputs(
            aux_hidden_states=[a.to(self.device, p.torch_dtype) for a in aux],
            slot_mapping=(slots + p.block_size).to(self.device),
            last_sampled=torch.randint(
                0, 1000, (MAX_NUM_REQS, 1), generator=generator
            ).to(self.device),
            idx_mapping=torch.randperm(MAX_NUM_REQS, generator=generator)[:num_reqs].to(
                self.device, torch.int32
            ),
        )


ENGINE = KernelEngine
MODES = KernelEngine.MODES
