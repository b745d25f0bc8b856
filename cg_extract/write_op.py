"""``torch.ops.cg_extract.write_hidden_states``: the hidden-state write as
one dispatcher op, the only write every path of the speculator runs.

    write_hidden_states(Tensor[] aux, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()

stores row ``t`` of aux layer ``l`` at ``kv_cache[slot // block_size, l,
slot % block_size]`` for each ``slot = slot_mapping[t] >= 0`` and does
nothing for a negative slot (vLLM's padding): no write to block 0, no read of
the padded rows. ``aux`` are ``L`` tensors of ``[n, H]`` with any strides,
so the target's separate persistent buffers and views of one stacked buffer
go in alike.

Dtypes: ``aux`` must be the cache's dtype, or the op raises ``ValueError``
naming the state; it never converts. vLLM's speculator does convert aux
hidden states of another dtype (it stacks them, mixed dtypes promoting, and
copies the stack into its buffer of the model's dtype), and so does ours,
in ``propose`` before any path (``ExtractHiddenStatesSpeculator.
_as_model_dtype``), so from ``propose`` the refusal is unreachable
(``tests/vllm_objects/test_speculator_graphs.py``, ``tests/vllm_objects/test_zero_copy.py`` and, in
vLLM's engine, the other-dtype families of ``tests/vllm_engine/test_e2e_families.py``).
The conversion stays there rather than in the kernel because torch's ``.to``
is the very rounding vLLM's ``copy_`` does, on every device, while a
conversion inside the Triton kernel would be Triton's, and Triton's
interpreter, the only place this project runs the kernel, narrows
differently: it truncates float32 to bfloat16 where torch (and a GPU's
round-to-nearest-even) rounds, 499 of 1 024 random values apart (Triton
3.9.0, 2-core AMD EPYC VM; ``tests/torch_alone/write_kernel_interpreted.py`` checks the
truncation). The cost, only for models whose layers emit another dtype, is
vLLM's own stacked copy a step, and no zero-copy graphs (the target's
persistent buffers are in the layers' dtype).

Being one op is what lets ``TorchDispatchMode`` see it: the emulated CUDA
graph backend records it with every tensor argument (a raw Triton launch
would be invisible to it) and the sweep counts it as one op; the ops its CPU
body runs stay below the mode. CUDA runs the Triton kernel of
:mod:`cg_extract.write_kernel` (imported at the first CUDA call), CPU the
torch body in :mod:`cg_extract.cache_write`, Meta only checks the arguments.

How it is called. :func:`write_hidden_states` goes through the dispatcher
only where something could intercept the op (a dispatch mode, such as the
emulator's, the sweep's op counter or a fake-tensor trace; a tensor
subclass; a device other than CPU and CUDA); otherwise it checks the
arguments and runs the CPU body or the Triton launch itself, the same
functions the dispatcher would call. (Dynamo, tracing a caller, would break its
graph here rather than record the op; nothing compiles the speculator's
step.) What decided it:
``python perf/write_op_cost.py`` on a 2-core AMD EPYC (family 26 model 2,
torch 2.13.0+cpu, commit 9863434) measured, for a kernel that does nothing,
1.8 us through a ``Library.impl`` op, 11.4 us through
``torch.library.custom_op`` and 0.1 us for the check of the dispatch-mode
stack plus a Python call; so the op stays a ``Library`` registration
(``define`` plus one ``impl`` per dispatch key) and the eager path calls
around the dispatcher. docs/measurements.md ("The write op's fixed cost") has the
figures for the whole write.
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


_write_kernel = None


def _cuda(
    aux: Sequence[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    global _write_kernel
    if _write_kernel is None:
        from cg_extract import write_kernel  # Triton: imported where CUDA runs

        _write_kernel = write_kernel.write_owned_slots
    cache_write.check_write_args(aux, kv_cache, slot_mapping)
    _write_kernel(aux, kv_cache, slot_mapping)


_LIBRARY.impl(NAME, _cpu, "CPU")
_LIBRARY.impl(NAME, _cuda, "CUDA")
_LIBRARY.impl(NAME, cache_write.check_write_args, "Meta")


def _plain(aux: Sequence[torch.Tensor], slot_mapping: torch.Tensor) -> bool:
    """No tensor subclass among the arguments (one would dispatch the op itself)."""
    if type(slot_mapping) is not torch.Tensor:
        return False
    for hidden in aux:  # noqa: SIM110 (a loop costs a third of all() here)
        if type(hidden) is not torch.Tensor:
            return False
    return True


op = getattr(getattr(torch.ops, NAMESPACE), NAME).default
"""The registered op itself (what a dispatch mode records)."""


def write_hidden_states(
    aux: Sequence[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The op: through the dispatcher when anything could intercept it, else
    straight into the body the dispatcher would pick (same checks, same
    bytes, same errors)."""
    if (
        torch._C._len_torch_dispatch_stack()
        or type(kv_cache) is not torch.Tensor
        or not _plain(aux, slot_mapping)
    ):
        op(aux, kv_cache, slot_mapping)
    elif kv_cache.is_cpu:
        _cpu(aux, kv_cache, slot_mapping)
    elif kv_cache.is_cuda:
        _cuda(aux, kv_cache, slot_mapping)
    else:
        op(aux, kv_cache, slot_mapping)
