"""The target model's persistent graph outputs, as its graph manager left them.

When the target replays a FULL CUDA graph, MRv2 hands ``propose`` views of the
persistent aux-hidden-state buffers of the runner's ``ModelCudaGraphManager``.
The speculator is never given that manager, so the plugin wraps its
``capture`` and publishes the buffers here, per device, for the speculator's
own ``capture`` (which the runner calls right after) to read them directly.
"""

from __future__ import annotations

import torch

_aux_hidden_states: dict[torch.device, list[torch.Tensor]] = {}


def publish(device: torch.device | str, aux_hidden_states: list[torch.Tensor]) -> None:
    _aux_hidden_states[torch.device(device)] = list(aux_hidden_states)


def aux_hidden_states(device: torch.device | str) -> list[torch.Tensor]:
    """The published buffers (``[max_capture_size, hidden]`` each), or []."""
    return _aux_hidden_states.get(torch.device(device), [])


def clear() -> None:
    _aux_hidden_states.clear()
