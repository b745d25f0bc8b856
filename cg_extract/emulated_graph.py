"""An emulated CUDA graph: a recorded step that replays by running again
under inspection, so that a machine without CUDA proves the graph contract
(:mod:`cg_extract.cudagraph_manager`) is kept.

Capture runs the step under a dispatch mode that records every aten op with its
non-tensor arguments, the address, offset, shape, stride and dtype of every
tensor that was not allocated inside the step, and the size of everything
it allocates. Replay runs the step again and raises
:class:`StaticMemoryViolation` before the first op that differs: another
tensor (a fresh one instead of the static buffer), another shape, a
Python value baked in at capture (a scalar argument that changed), or an
allocation capture did not make. Ops a CUDA graph cannot hold (host
syncs, data-dependent shapes) raise at capture.

What it does not catch: Python side effects that issue no aten op (a
counter, a log line, a connector callback that touches no tensor) still run
at every emulated replay, whereas a real replay skips them; stream and
event misuse; reads of memory a real graph would see stale because an
asynchronous copy had not finished; what a dispatcher op's own kernel does
below the mode (the write op is recorded as one op with its tensor
arguments, its CPU body's host read is not seen). Those need a GPU run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Step = Callable[[int], None]


class GraphCaptureError(RuntimeError):
    """The step cannot be captured as a CUDA graph."""


class StaticMemoryViolation(GraphCaptureError):
    """A replay touched memory, shapes or values other than its capture did."""


# Ops a CUDA graph cannot contain: they wait for the device or size their
# output from device data.
_UNCAPTURABLE = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::bincount",
}


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    """``x[mask]``: a boolean index sizes the output from device data."""
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in args[1]
    )


def uncapturable(name: str, args: tuple[Any, ...]) -> bool:
    """Whether aten op ``name`` with ``args`` waits for the device or sizes
    its output from device data, so that a CUDA graph cannot hold it."""
    return name in _UNCAPTURABLE or (name == "aten::index" and _has_mask_index(args))


@dataclass(frozen=True)
class _TensorRef:
    """Where an op's tensor argument lives. External memory is named by its
    address, internal (step-allocated) memory by its allocation index."""

    kind: str  # "external" | "internal" | "empty"
    where: int  # data pointer of the storage, or allocation index
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        place = (
            f"external tensor at 0x{self.where:x}"
            if self.kind == "external"
            else f"step-allocated tensor #{self.where}"
        )
        return (
            f"{place} (offset {self.offset}, shape {list(self.shape)}, "
            f"stride {list(self.stride)}, {self.dtype})"
        )


@dataclass(frozen=True)
class _OpRecord:
    name: str
    args: tuple[Any, ...]  # _TensorRef or plain values, in pytree order
    allocs: tuple[tuple[int, torch.dtype], ...]  # (nbytes, dtype) of new storages


class _Recorder(TorchDispatchMode):
    """Records (at capture) or checks against a record (at replay) every op."""

    def __init__(self, size: int, expected: list[_OpRecord] | None = None):
        super().__init__()
        self.size = size
        self.expected = expected
        self.records: list[_OpRecord] = []
        # Every storage touched is held so that no address is reused while the
        # graph lives: a real graph pins the memory it captured the same way.
        self.held: dict[int, torch.UntypedStorage] = {}
        self.internal: dict[int, int] = {}  # data_ptr -> allocation index

    def _ref(self, t: torch.Tensor) -> _TensorRef:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0:
            # Empty tensors own no memory; they all share address 0.
            return _TensorRef("empty", 0, 0, tuple(t.shape), tuple(t.stride()), t.dtype)
        self.held.setdefault(ptr, storage)
        kind, where = (
            ("internal", self.internal[ptr])
            if ptr in self.internal
            else (
                "external",
                ptr,
            )
        )
        return _TensorRef(
            kind,
            where,
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if uncapturable(name, args):
            raise GraphCaptureError(
                f"{name} (size {self.size}) synchronises with the host or sizes "
                "its output from device data; a CUDA graph cannot capture it"
            )
        leaves, _ = tree_flatten((args, kwargs))
        refs = tuple(self._ref(x) if isinstance(x, torch.Tensor) else x for x in leaves)
        index = len(self.records)
        if self.expected is not None:
            self._check_inputs(index, name, refs)

        out = func(*args, **kwargs)

        allocs = []
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() and ptr not in self.held:
                self.held[ptr] = storage
                self.internal[ptr] = len(self.internal)
                allocs.append((storage.nbytes(), t.dtype))
        record = _OpRecord(name, refs, tuple(allocs))
        if self.expected is not None and record.allocs != self.expected[index].allocs:
            raise StaticMemoryViolation(
                f"replay of size {self.size}: op #{index} {name} allocated "
                f"{list(record.allocs)} but at capture {list(self.expected[index].allocs)}"
                "; a CUDA graph replays the allocations it captured"
            )
        self.records.append(record)
        return out

    def _check_inputs(self, index: int, name: str, refs: tuple[Any, ...]) -> None:
        expected = self.expected
        assert expected is not None
        where = f"replay of size {self.size}: op #{index} {name}"
        if index >= len(expected):
            raise StaticMemoryViolation(
                f"{where} was not captured (capture recorded {len(expected)} ops); "
                "the step's work must not depend on Python state that changes "
                "between capture and replay"
            )
        want = expected[index]
        if want.name != name:
            raise StaticMemoryViolation(
                f"{where}: capture ran {want.name} here; the step took another path "
                "than at capture, which a CUDA graph replay cannot do"
            )
        if len(want.args) != len(refs):
            raise StaticMemoryViolation(
                f"{where}: {len(refs)} arguments, {len(want.args)} at capture"
            )
        for i, (got, exp) in enumerate(zip(refs, want.args, strict=True)):
            if got == exp or (got != got and exp != exp):  # NaN == NaN here
                continue
            if isinstance(exp, _TensorRef) or isinstance(got, _TensorRef):
                raise StaticMemoryViolation(
                    f"{where} argument {i}: captured {_show(exp)}, replay passed "
                    f"{_show(got)}. A CUDA graph replays the addresses and shapes "
                    "it captured: copy new data into the static buffer instead"
                )
            raise StaticMemoryViolation(
                f"{where} argument {i}: captured value {exp!r}, replay {got!r}. "
                "A CUDA graph bakes Python values in at capture; pass them "
                "through a static tensor instead"
            )

    def finish(self) -> None:
        if self.expected is not None and len(self.records) != len(self.expected):
            raise StaticMemoryViolation(
                f"replay of size {self.size} ran {len(self.records)} ops, capture "
                f"recorded {len(self.expected)}; the replayed step skipped work "
                "that a CUDA graph would still do"
            )


def _show(arg: Any) -> str:
    return arg.describe() if isinstance(arg, _TensorRef) else repr(arg)


class EmulatedGraph:
    """A recorded step that replays by running again under inspection."""

    def __init__(self, step: Step, size: int, recorder: _Recorder):
        self.step = step
        self.size = size
        self.records = recorder.records
        self._held = recorder.held
        self.held_bytes = sum(
            recorder.held[p].nbytes() for p in recorder.internal if p in recorder.held
        )

    @classmethod
    def capture(cls, step: Step, size: int) -> EmulatedGraph:
        recorder = _Recorder(size)
        with recorder:
            step(size)
        return cls(step, size, recorder)

    def replay(self) -> None:
        recorder = _Recorder(self.size, expected=self.records)
        with recorder:
            self.step(self.size)
        recorder.finish()
