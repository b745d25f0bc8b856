"""``torch.ops.cg_extract.write_hidden_states``: the hidden-state write as
one dispatcher op, the only write every path of the speculator runs.

    write_hidden_states(Tensor[] aux, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()

stores row ``t`` of aux layer ``l`` at ``kv_cache[slot // block_size, l,
slot % block_size]`` for each ``slot = slot_mapping[t] >= 0`` and does
nothing for a negative slot (vLLM's padding): no write to block 0, no read of
the padded rows. ``aux`` are ``L`` tensors of ``[n, H]`` with any strides,
so the target's separate persistent buffers and views of one stacked buffer
go in alike.

Registered with ``torch.library.Library`` (``define`` plus one ``impl`` per
dispatch key) rather than ``torch.library.custom_op``, whose Python wrapper
costs more per call than the write itself at one token. Being one op is what
lets ``TorchDispatchMode`` see it: the emulated CUDA graph backend records
it with every tensor argument (a raw Triton launch would be invisible to it)
and the sweep counts it as one op; the ops its CPU body runs stay below the
mode. CUDA runs the Triton kernel of :mod:`cg_extract.write_kernel`
(imported at the first CUDA call), CPU the torch body in
:mod:`cg_extract.cache_write`, Meta only checks the arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.library import Library

from cg_extract import cache_write

NAMESPACE = "cg_extract"
NAME = "write_hidden_states"
SCHEMA = f"{NAME}(Tensor[] aux, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()"

# Registrations live as long as this object; module scope keeps it.
_LIBRARY = Library(NAMESPACE, "DEF")
_LIBRARY.define(SCHEMA)


def _cpu(
    aux: Sequence[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    cache_write.check_write_args(aux, kv_cache, slot_mapping)
    cache_write.write_owned_slots(aux, kv_cache, slot_mapping)


def _cuda(
    aux: Sequence[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    from cg_extract import write_kernel  # Triton: imported where CUDA runs

    cache_write.check_write_args(aux, kv_cache, slot_mapping)
    write_kernel.write_owned_slots(aux, kv_cache, slot_mapping)


_LIBRARY.impl(NAME, _cpu, "CPU")
_LIBRARY.impl(NAME, _cuda, "CUDA")
_LIBRARY.impl(NAME, cache_write.check_write_args, "Meta")

write_hidden_states = getattr(getattr(torch.ops, NAMESPACE), NAME).default
