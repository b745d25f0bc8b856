"""The target model's persistent graph outputs, as its graph manager left them.

When the target replays a FULL CUDA graph, MRv2 hands ``propose`` views of the
persistent aux-hidden-state buffers of the runner's ``ModelCudaGraphManager``.
The speculator is never given that manager, so the plugin wraps its
``capture`` and publishes the manager here, per device, with the token counts
of its planned FULL graphs, for the speculator's own ``capture`` (which the
runner calls right after) to read them directly.

Only a weak reference to the manager is kept: when vLLM drops it (the memory
profiler's teardown, a re-initialised KV cache), its buffers are freed and
nothing is published any more, without this module having to be told.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TargetGraphs:
    aux_hidden_states: list[torch.Tensor]  # [max FULL size, hidden] each
    full_sizes: tuple[int, ...]  # token counts of the planned FULL graphs


_published: dict[torch.device, tuple[weakref.ref, tuple[int, ...]]] = {}


def publish(
    device: torch.device | str, manager: Any, full_sizes: list[int] | tuple[int, ...]
) -> None:
    """``manager``: anything with an ``aux_hidden_states`` list that lives as
    long as those buffers are the target's (vLLM's ``ModelCudaGraphManager``)."""
    _published[torch.device(device)] = (
        weakref.ref(manager),
        tuple(sorted(set(full_sizes))),
    )


def get(device: torch.device | str) -> TargetGraphs | None:
    """What the live target manager on ``device`` published, or None.

    The buffers are read now, not at :func:`publish`: vLLM's manager
    allocates them inside its own capture, and our capture (which asks)
    runs after it in ``capture_model``. None when it has not captured yet."""
    entry = _published.get(torch.device(device))
    manager = entry[0]() if entry else None
    if manager is None or not manager.aux_hidden_states:
        return None
    return TargetGraphs(list(manager.aux_hidden_states), entry[1])


def clear() -> None:
    _published.clear()
