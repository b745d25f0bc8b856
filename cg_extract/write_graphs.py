"""CUDA graphs of the hidden-state write, in torch alone.

Two sets of graphs over the same capture sizes, both replaying the caller's
``write(aux_hidden_states, slot_mapping)``:

* copy-in graphs read static buffers this class owns. ``run`` stacks the aux
  hidden states into them (one kernel), copies the slots, points the padded
  tail at slot -1 (which the write skips) and replays;
* zero-copy graphs read the target's persistent buffers directly: after a
  FULL graph replay of the target, ``propose`` is handed views of exactly
  those. They exist for the sizes the caller names (the target's FULL
  sizes), which need not be capture sizes. ``run`` checks address, shape,
  stride and dtype of every input and, when they are the captured views,
  only replays. Anything else (other memory, another stride, a size without
  a zero-copy graph) takes the copy-in graph, or runs ``write`` eagerly in
  the one case neither fits: a zero-copy size above the largest capture size
  whose inputs are not in place.

The static buffers are allocated when this object is built; build it where
the caller's memory accounting should see them (the speculator builds it in
``capture()``, inside the window vLLM measures).

No vLLM here, and only device work in ``write``: the speculator runs vLLM's
connector hooks on the host after a replay; the ``kernel`` sweep and the GPU
tests supply :data:`cg_extract.write_op.write_hidden_states` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cg_extract.capture_sizes import CaptureSizes
from cg_extract.cudagraph_manager import (
    CudaGraphManager,
    GraphScope,
    default_graph_scope,
)

PAD_SLOT_ID = -1  # vLLM's padding slot; the cache write skips it

Write = Callable[[Sequence[torch.Tensor], torch.Tensor], None]  # (aux, slots)


@dataclass
class GraphInputs:
    """What the write reads: the aux hidden states and their slots (a
    padded row's slot is -1, so the write needs no padding mask).

    Either the static buffers of the copy-in graphs or the target's persistent
    buffers that ``propose`` receives views of after a FULL graph replay.
    """

    aux_hidden_states: list[torch.Tensor]  # [rows, hidden] each
    slot_mapping: torch.Tensor  # [rows], the draft layer's slot row

    @property
    def rows(self) -> int:
        return min(len(self.slot_mapping), *(len(a) for a in self.aux_hidden_states))

    def first(self, size: int) -> GraphInputs:
        """Views of the first ``size`` rows: what a graph of ``size`` reads."""
        return GraphInputs(
            [a[:size] for a in self.aux_hidden_states],
            self.slot_mapping[:size],
        )


@dataclass
class _ReplayInputs:
    inputs: GraphInputs | None = None


class WriteGraphs:
    def __init__(
        self,
        capture_sizes: CaptureSizes,
        device: torch.device,
        backend: str,
        num_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        write: Write,
        pool: Any = None,
        graph_scope: GraphScope = default_graph_scope,
    ):
        self.write = write
        self.copy_in = CudaGraphManager(
            capture_sizes, device, backend, pool, graph_scope
        )
        hidden = self.copy_in.static_buffer(
            "hidden_states", (num_layers, hidden_size), dtype
        )
        self.hidden_states = hidden
        self.slot_mapping = self.copy_in.static_buffer(
            "slot_mapping", (), torch.int64, fill_value=PAD_SLOT_ID
        )
        static = GraphInputs(
            [hidden[:, i] for i in range(num_layers)], self.slot_mapping
        )
        self._copy_in_inputs = {
            size: static.first(size) for size in capture_sizes.sizes
        }
        self.zero_copy: CudaGraphManager | None = None
        self._zero_copy_inputs: dict[int, GraphInputs] = {}
        # What a replaying step reads: None at capture (the captured views),
        # the caller's tensors at a zero-copy replay. A real replay ignores
        # it; the emulator re-runs the step and checks it is the same memory.
        self._replay = _ReplayInputs()

    @property
    def captured_sizes(self) -> list[int]:
        return self.copy_in.captured_sizes

    @property
    def zero_copy_sizes(self) -> list[int]:
        return self.zero_copy.captured_sizes if self.zero_copy else []

    @property
    def capture_time_s(self) -> float:
        return sum(g.capture_time_s for g in self._managers())

    @property
    def capture_times_s(self) -> dict[str, dict[int, float]]:
        """Seconds per size (warm-up and capture), by graph set."""
        times = {"copy_in": self.copy_in.capture_times_s}
        if self.zero_copy is not None:
            times["zero_copy"] = self.zero_copy.capture_times_s
        return times

    @property
    def graph_memory_bytes(self) -> int:
        """What the captures took, static buffers not included."""
        return sum(g.graph_memory_bytes for g in self._managers())

    @property
    def static_bytes(self) -> int:
        return self.copy_in.static_bytes

    def summary(self) -> dict[str, Any]:
        """What capture cost, for reports: sizes, seconds, bytes."""
        return {
            "backend": self.copy_in.backend,
            "captured_sizes": self.captured_sizes,
            "zero_copy_sizes": self.zero_copy_sizes,
            "capture_time_s": self.capture_time_s,
            "capture_times_s": self.capture_times_s,
            "graph_memory_bytes": self.graph_memory_bytes,
            "static_bytes": self.static_bytes,
        }

    def _managers(self) -> list[CudaGraphManager]:
        return [g for g in (self.copy_in, self.zero_copy) if g is not None]

    def padded_size(self, num_tokens: int) -> int | None:
        """The size ``run`` is given for ``num_tokens``: the copy-in graph's
        padded size, else ``num_tokens`` itself when only a zero-copy graph
        has it, else None (run eagerly)."""
        padded = self.copy_in.padded_size(num_tokens)
        if padded is None and num_tokens in self._zero_copy_inputs:
            return num_tokens
        return padded

    def capture(
        self,
        persistent: GraphInputs | None = None,
        zero_copy_sizes: Sequence[int] | None = None,
        progress: bool = True,
        desc: str = "Capturing hidden-state write graphs",
    ) -> None:
        """Copy-in graphs for every capture size, then, over ``persistent``,
        zero-copy graphs for exactly ``zero_copy_sizes`` (None: the capture
        sizes that fit its rows, for callers whose buffers follow them)."""
        self._capture(self.copy_in, self._copy_in_inputs, progress, f"{desc} (copy-in)")
        if persistent is None:
            return
        if zero_copy_sizes is None:
            zero_copy_sizes = [
                s for s in self.copy_in.capture_sizes.sizes if s <= persistent.rows
            ]
        if not zero_copy_sizes:
            return
        too_big = [s for s in zero_copy_sizes if s > persistent.rows]
        if too_big:
            raise ValueError(
                f"zero-copy sizes {too_big} exceed the persistent buffers' "
                f"{persistent.rows} rows"
            )
        # Warm-up and capture run the write over the slot row as it stands:
        # rows a past step left there name live slots, which it would
        # overwrite with stale states. vLLM's capture fills the row with the
        # padding slot before capturing (get_dummy_slot_mappings); so do we.
        persistent.slot_mapping.fill_(PAD_SLOT_ID)
        sizes = sorted(set(zero_copy_sizes))
        self._zero_copy_inputs = {size: persistent.first(size) for size in sizes}
        self.zero_copy = CudaGraphManager(
            sizes,
            self.copy_in.device,
            self.copy_in.backend,
            self.copy_in.pool,
            self.copy_in.graph_scope,
        )
        self._capture(
            self.zero_copy, self._zero_copy_inputs, progress, f"{desc} (zero-copy)"
        )

    def _capture(
        self,
        graphs: CudaGraphManager,
        inputs: dict[int, GraphInputs],
        progress: bool,
        desc: str,
    ) -> None:
        # The step holds what it reads, not self: the emulator keeps it in
        # each graph, and a graph holding self back would be a cycle.
        write, replay = self.write, self._replay

        def step(size: int) -> None:
            x = replay.inputs or inputs[size]
            write(x.aux_hidden_states, x.slot_mapping)

        graphs.capture(step, desc, progress=progress)

    def run(
        self,
        aux_hidden_states: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        padded: int,
    ) -> str:
        """Write one step of ``n = len(slot_mapping)`` tokens, ``padded`` being
        :meth:`padded_size` of ``n``; returns the path taken: "zero_copy",
        "copy_in", or "eager" (a zero-copy-only size, inputs not in place)."""
        given = GraphInputs(list(aux_hidden_states), slot_mapping)
        n = len(slot_mapping)
        if self._reads_in_place(given):
            self._replay.inputs = given
            try:
                self.zero_copy.replay(n)
            finally:
                self._replay.inputs = None
            return "zero_copy"
        if self.copy_in.padded_size(n) != padded:
            self.write(aux_hidden_states, slot_mapping)
            return "eager"
        torch.stack(aux_hidden_states, dim=1, out=self.hidden_states[:n])
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:padded].fill_(PAD_SLOT_ID)
        self.copy_in.replay(padded)
        return "copy_in"

    def _reads_in_place(self, given: GraphInputs) -> bool:
        captured = self._zero_copy_inputs.get(len(given.slot_mapping))
        if captured is None or len(given.aux_hidden_states) != len(
            captured.aux_hidden_states
        ):
            return False
        pairs = zip(
            (*given.aux_hidden_states, given.slot_mapping),
            (*captured.aux_hidden_states, captured.slot_mapping),
            strict=True,
        )
        return all(_same_view(got, want) for got, want in pairs)

    def release(self) -> None:
        """Drop every graph and the views of the caller's persistent buffers."""
        for graphs in self._managers():
            graphs.release()
        self.zero_copy = None
        self._zero_copy_inputs = {}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
