"""Real vLLM speculators, KV caches and step inputs on any machine.

Every object the speculator touches can be built in-process, without an
engine: the ``VllmConfig`` (with ``load_format="dummy"``, no weights), the
cache-only draft model, its KV cache and the runner's ``InputBatch``. Tests
and ``perf/sweep.py`` build them here, so both drive the same code a GPU
worker runs between ``init_speculator`` and ``propose``, step by step. (The
whole engine runs on a CPU too, in subprocesses: ``vllm_on_cpu/engine.py``.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def write_model_dir(
    path: Path, hidden_size: int = 256, num_layers: int = 4, dtype: str = "float32"
) -> Path:
    """A Llama ``config.json``: all ``load_format="dummy"`` needs."""
    head_dim = 64  # one the CPU attention backend supports
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden_size,
                "intermediate_size": 2 * hidden_size,
                "num_attention_heads": hidden_size // head_dim,
                "num_key_value_heads": hidden_size // head_dim,
                "head_dim": head_dim,
                "num_hidden_layers": num_layers,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "torch_dtype": dtype,
            }
        )
    )
    return path


def emulated_graph_keys(sizes: list[int]) -> dict[str, Any]:
    """Our keys for graph mode on the emulated backend at ``sizes``: what the
    CPU tests run where a GPU worker would run real graphs."""
    return dict(
        cudagraph=True, cudagraph_backend="emulated", cudagraph_capture_sizes=sizes
    )


def speculative_config(aux_layer_ids: list[int], **extra: Any) -> dict[str, Any]:
    """The ``--speculative-config`` dict a user passes, plus ``extra`` keys."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        },
        **extra,
    }


def build_vllm_config(
    model_dir: Path,
    aux_layer_ids: list[int] = (1, 2, 3),
    dtype: str = "float32",
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    engine_args: dict[str, Any] | None = None,
    **spec_extra: Any,
):
    """``EngineArgs(...).create_engine_config()`` as ``LLM(...)`` would call it.

    ``spec_extra`` goes into the speculative config, ``engine_args`` to
    ``EngineArgs`` itself.
    """
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        speculative_config=speculative_config(list(aux_layer_ids), **spec_extra),
        **(engine_args or {}),
    ).create_engine_config()


@contextlib.contextmanager
def _cpu_safe_model_loading(device: torch.device):
    """vLLM's loader calls ``torch.accelerator.empty_cache()``, which raises on
    a CPU-only torch; it frees nothing there, so skip it."""
    if device.type != "cpu":
        yield
        return
    original = torch.accelerator.empty_cache
    torch.accelerator.empty_cache = lambda: None
    try:
        yield
    finally:
        torch.accelerator.empty_cache = original


@dataclass
class LoadedSpeculator:
    speculator: Any
    vllm_config: Any
    kv_cache: torch.Tensor  # [num_blocks, num_aux_layers, block_size, hidden]
    layer_name: str

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]


def load_speculator(
    cls: type,
    vllm_config,
    device: torch.device | str = "cpu",
    num_blocks: int = 64,
) -> LoadedSpeculator:
    """Construct ``cls``, load its draft model and bind a zeroed KV cache, as
    the MRv2 runner does before ``init_cudagraph_manager`` and ``capture``.

    Each speculator gets its own copy of ``vllm_config``: the draft layer
    registers itself in the config's forward context by name.
    """
    from vllm.config import set_current_vllm_config

    device = torch.device(device)
    vllm_config = copy.deepcopy(vllm_config)
    with set_current_vllm_config(vllm_config), _cpu_safe_model_loading(device):
        single_process_parallel_state()
        speculator = cls(vllm_config, device)
        speculator.load_model(None)
    (layer_name,) = speculator.draft_attn_layer_names
    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    layer.kv_cache = torch.zeros(
        num_blocks,
        layer.num_heads,
        vllm_config.cache_config.block_size,
        layer.head_size,
        dtype=layer.kv_cache_torch_dtype,
        device=device,
    )
    return LoadedSpeculator(speculator, vllm_config, layer.kv_cache, layer_name)


def resolve_layout(vllm_config, specs: dict[str, Any]) -> None:
    """The engine core's step before memory profiling (``v1/engine/core.py``):
    one KV-cache layout for ``specs`` (each layer's ``KVCacheSpec``), from the
    layouts the backends support, recorded in the config."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )

    names = [layout.name for layout in get_supported_kv_cache_layouts([])]
    layout = resolve_kv_cache_layout(vllm_config, [names], specs.values())
    record_kv_cache_layout(vllm_config.cache_config, layout.name)


def vllm_release() -> str:
    """The installed vLLM's release ("0.32.0", "0.33.0", "0.34.0"), for tests that
    state each release's expectation and check the installed one's."""
    import vllm

    return vllm.__version__.split("+")[0]


def kv_cache_planning():
    """The module holding vLLM's KV-cache layout functions
    (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``,
    ``get_kv_cache_configs``): ``kv_cache_utils`` in 0.32,
    ``kv_cache_planning`` from 0.33. The rig's one place that knows where
    each release keeps them (the product's own: ``cg_extract/kv_cache_report.py``)."""
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as planning
    return planning


def get_kv_cache_configs(vllm_config, specs: list[dict[str, Any]], memory: list[int]):
    """vLLM's ``get_kv_cache_configs`` as its engine core calls it: from 0.33
    with the whole model's groups made first (``global_kv_cache_groups``)."""
    planning = kv_cache_planning()
    if not hasattr(planning, "get_global_kv_cache_groups"):  # vLLM 0.32
        return planning.get_kv_cache_configs(vllm_config, specs, memory)
    groups = planning.get_global_kv_cache_groups(vllm_config, specs)
    return planning.get_kv_cache_configs(vllm_config, specs, memory, groups)


def kv_cache_config_of(vllm_config, specs: dict[str, Any], num_blocks: int):
    """The ``KVCacheConfig`` the engine core hands workers for ``specs``:
    vLLM's groups (``get_kv_cache_groups``) in ``num_blocks`` blocks
    (``get_kv_cache_config_from_groups``). Resolves the layout first."""
    planning = kv_cache_planning()
    resolve_layout(vllm_config, specs)
    groups = planning.get_kv_cache_groups(vllm_config, specs)
    cache_config = vllm_config.cache_config
    cache_config.num_gpu_blocks_override = num_blocks
    try:
        return planning.get_kv_cache_config_from_groups(
            vllm_config, groups, available_memory=0
        )
    finally:
        cache_config.num_gpu_blocks_override = None


@dataclass
class KVLayout:
    """A target's KV cache as an engine core lays it out, built in-process:
    its config, every layer's ``KVCacheSpec`` (what the workers hand the
    engine core), vLLM's ``KVCacheConfig`` for them, and the speculator
    built beside the target (None with no speculative config)."""

    vllm_config: Any
    specs: dict[str, Any]
    kv_cache_config: Any
    speculator: Any


def kv_layout(engine_args: dict[str, Any], speculator_cls: type | None) -> KVLayout:
    """``engine_args``'s target built as a worker builds it (dummy weights),
    and, given a speculative config, a ``speculator_cls`` beside it; then
    what the engine core does with their KV-cache specs: the block size the
    backends and a hybrid model's Mamba page want
    (``update_block_size_for_backend``, after the model loads), the layout,
    and vLLM's ``get_kv_cache_configs`` on the budget
    ``kv_cache_memory_bytes`` gives (or ``num_gpu_blocks_override``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    vllm_config = EngineArgs(**engine_args).create_engine_config()
    cpu = torch.device("cpu")
    speculator = None
    with set_current_vllm_config(vllm_config), _cpu_safe_model_loading(cpu):
        # A world of one for this model: an MoE model's has an EP group.
        destroy_model_parallel()
        destroy_distributed_environment()
        single_process_parallel_state()
        get_model(vllm_config=vllm_config)
        if vllm_config.speculative_config is not None:
            speculator = speculator_cls(vllm_config, cpu)
            speculator.load_model(None)
        current_platform.update_block_size_for_backend(vllm_config)
        specs = get_kv_cache_spec(vllm_config)
        resolve_layout(vllm_config, specs)
        budget = vllm_config.cache_config.kv_cache_memory_bytes or 0
        (config,) = get_kv_cache_configs(vllm_config, [specs], [budget])
    if speculator is not None:
        speculator.kv_cache_config = config
    return KVLayout(vllm_config, specs, config, speculator)


def single_process_parallel_state() -> None:
    """A world of one, as every worker has: vLLM's ``CudaGraphManager`` (the
    base of our graphs' lifecycle shell) asks for the pipeline group, and
    ``capture`` enters ``graph_capture``, which needs the tensor, pipeline
    and data parallel groups. Idempotent; call it under the config in use."""
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)


@dataclass
class TargetGraphOutputs:
    """What MRv2's runner holds once the target captured FULL graphs: the graph
    manager's persistent aux-hidden-state buffers (sized, as vLLM sizes them,
    for its largest FULL graph), the token counts of its FULL graphs, the
    block tables' slot rows and the input buffers' padding mask. ``propose``
    then gets views of them. Stands in for the ``ModelCudaGraphManager`` that
    :mod:`cg_extract.target_buffers` refers to, so keep it alive as long."""

    aux_hidden_states: list[torch.Tensor]  # [max(full_sizes), hidden] each
    full_sizes: list[int]
    slot_mappings: torch.Tensor  # [num_kv_cache_groups, max_num_tokens]
    input_buffers: Any  # vllm InputBuffers


def attach_target_graph_outputs(
    loaded: LoadedSpeculator, full_sizes: list[int]
) -> TargetGraphOutputs:
    """Hand the speculator the runner's persistent buffers, as ``set_attn`` and
    the plugin's capture hook do on a GPU worker, for a target with FULL
    graphs of ``full_sizes`` tokens."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.input_batch import InputBuffers

    from cg_extract import target_buffers

    spec = loaded.speculator
    device = loaded.kv_cache.device
    num_blocks, num_layers, _, hidden = loaded.kv_cache.shape
    rows = max(full_sizes)
    outputs = TargetGraphOutputs(
        [
            torch.zeros(rows, hidden, dtype=loaded.kv_cache.dtype, device=device)
            for _ in range(num_layers)
        ],
        list(full_sizes),
        torch.full((1, spec.max_num_tokens), -1, dtype=torch.int64, device=device),
        InputBuffers(spec.max_num_reqs, spec.max_num_tokens, device),
    )
    target_buffers.publish(device, outputs, outputs.full_sizes)
    layer = loaded.vllm_config.compilation_config.static_forward_context[
        loaded.layer_name
    ]
    spec.kv_cache_config = KVCacheConfig(
        num_blocks,
        [],
        [
            KVCacheGroupSpec(
                [loaded.layer_name], layer.get_kv_cache_spec(loaded.vllm_config)
            )
        ],
    )
    # A stand-in for vLLM's BlockTables, whose constructor needs pinned (CUDA
    # host) memory; the speculator reads only its persistent slot_mappings.
    spec.block_tables = _SlotMappingsOnly(outputs.slot_mappings)
    spec.target_input_buffers = outputs.input_buffers
    return outputs


@dataclass
class _SlotMappingsOnly:
    slot_mappings: torch.Tensor


@dataclass
class StepInputs:
    """One ``propose`` call's arguments, as the MRv2 runner builds them."""

    kwargs: dict[str, Any]
    slots: torch.Tensor  # the real (unpadded) slots, one per token
    num_tokens: int

    @property
    def aux_hidden_states(self) -> list[torch.Tensor]:
        return self.kwargs["aux_hidden_states"]


def make_step_inputs(
    loaded: LoadedSpeculator,
    num_tokens: int,
    generator: torch.Generator,
    num_reqs: int | None = None,
    num_padding: int = 0,
    target: TargetGraphOutputs | None = None,
    aux_dtypes: Sequence[torch.dtype] | None = None,
) -> StepInputs:
    """Random aux hidden states and unique slots outside the null block.

    ``aux_dtypes``, one per aux layer, are the dtypes the target's layers
    emit, where a model's differ from the engine's (default: the cache's
    dtype); each state's values use every bit of its own dtype.

    ``num_padding`` extra tokens mimic the target's own graph padding: their
    slot is -1 (vLLM's ``PAD_SLOT_ID``), which the cache-only layer sends to
    block 0. With ``target``, the same values arrive as views of the target's
    persistent buffers, as after a FULL graph replay of the target.
    """
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionMetadata,
    )
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    spec = loaded.speculator
    device = loaded.kv_cache.device
    num_blocks, num_layers, block_size, hidden = loaded.kv_cache.shape
    capacity = (num_blocks - 1) * block_size
    if num_tokens > capacity:
        raise ValueError(f"{num_tokens} tokens do not fit {capacity} cache slots")
    total = num_tokens + num_padding
    num_reqs = num_reqs or max(1, min(num_tokens, spec.max_num_reqs))
    # Slots of blocks >= 1: block 0 is vLLM's null block, never a request's.
    slots = torch.randperm(capacity, generator=generator)[:num_tokens] + block_size
    slot_mapping = torch.full((total,), -1, dtype=torch.int64)
    slot_mapping[:num_tokens] = slots
    # Values with every bit of the dtype each layer emits, so that a
    # narrowing conversion has something to round.
    aux = [
        torch.randn(total, hidden, generator=generator).to(dtype).to(device)
        for dtype in aux_dtypes or [loaded.kv_cache.dtype] * num_layers
    ]
    buffers = InputBuffers(spec.max_num_reqs, spec.max_num_tokens, device)
    batch = InputBatch.make_dummy(num_reqs, total, buffers, is_padding=False)
    batch.is_padding[num_tokens:] = True
    last_sampled = torch.randint(
        0, 1000, (spec.max_num_reqs, 1), generator=generator
    ).to(device)
    perm = torch.randperm(spec.max_num_reqs, generator=generator)[:num_reqs]
    batch.idx_mapping.copy_(perm.to(device))
    kwargs = dict(
        input_batch=batch,
        attn_metadata={
            loaded.layer_name: CacheOnlyAttentionMetadata(slot_mapping.to(device))
        },
        slot_mappings={loaded.layer_name: slot_mapping.to(device)},
        last_hidden_states=torch.empty(0, device=device),
        aux_hidden_states=aux,
        num_sampled=torch.ones(num_reqs, dtype=torch.int32, device=device),
        num_rejected=torch.zeros(num_reqs, dtype=torch.int32, device=device),
        last_sampled=last_sampled,
        next_prefill_tokens=torch.zeros(1, spec.max_num_reqs, device=device),
        temperature=torch.zeros(spec.max_num_reqs, device=device),
        seeds=torch.zeros(spec.max_num_reqs, dtype=torch.int64, device=device),
    )
    inputs = StepInputs(kwargs, slots.to(device), num_tokens)
    return inputs if target is None else as_target_outputs(inputs, loaded, target)


def as_target_outputs(
    inputs: StepInputs, loaded: LoadedSpeculator, target: TargetGraphOutputs
) -> StepInputs:
    """The same step as ``propose`` sees it after a FULL graph replay of the
    target: aux hidden states, slot mapping and padding mask are views of the
    target's persistent buffers, holding the same values."""
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionMetadata,
    )

    kwargs = inputs.kwargs
    batch = kwargs["input_batch"]
    total = len(batch.is_padding)
    aux = [
        buf[:total].copy_(a)
        for buf, a in zip(
            target.aux_hidden_states, kwargs["aux_hidden_states"], strict=True
        )
    ]
    slot_mapping = target.slot_mappings[0, :total].copy_(
        kwargs["slot_mappings"][loaded.layer_name]
    )
    is_padding = target.input_buffers.is_padding[:total].copy_(batch.is_padding)
    return StepInputs(
        {
            **kwargs,
            "input_batch": dataclasses.replace(batch, is_padding=is_padding),
            "attn_metadata": {
                loaded.layer_name: CacheOnlyAttentionMetadata(slot_mapping)
            },
            "slot_mappings": {loaded.layer_name: slot_mapping},
            "aux_hidden_states": aux,
        },
        inputs.slots,
        inputs.num_tokens,
    )


def propose_same_step(
    speculators: list[LoadedSpeculator],
    num_tokens: int,
    seed: int,
    num_padding: int = 0,
    aux_dtypes: Sequence[torch.dtype] | None = None,
    **propose_kwargs: Any,
) -> list[tuple[torch.Tensor, StepInputs]]:
    """One identical step (same seed, so same values and slots) on each
    speculator; their KV caches must have the same shape."""
    results = []
    for loaded in speculators:
        inputs = make_step_inputs(
            loaded,
            num_tokens,
            torch.Generator().manual_seed(seed),
            num_padding=num_padding,
            aux_dtypes=aux_dtypes,
        )
        results.append(
            (loaded.speculator.propose(**inputs.kwargs, **propose_kwargs), inputs)
        )
    return results


# --------------------------------------------------------------------------
# KV connectors, created as a GPU worker creates them


@contextlib.contextmanager
def single_process_group(vllm_config):
    """A one-process gloo group, the worker's distributed setup for TP/PP/DP
    size 1 (connectors read their ranks), torn down on exit. Nothing is done
    when one exists."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if torch.distributed.is_initialized():
        yield
        return
    with set_current_vllm_config(vllm_config):
        single_process_parallel_state()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@dataclass
class Connectors:
    """The step-by-step driver of a KV connector, as MRv2's runner drives it."""

    scheduler: Any  # the scheduler-side connector: builds each step's metadata
    worker: Any  # MRv2's ActiveKVConnector around the worker-side connector

    def bind(self) -> None:
        """``pre_forward``: bind the step's metadata before the forward."""
        from vllm.v1.core.sched.output import SchedulerOutput

        scheduler_output = SchedulerOutput.make_empty()
        scheduler_output.kv_connector_metadata = self.scheduler.build_connector_meta(
            scheduler_output
        )
        self.worker.pre_forward(scheduler_output)

    def step(self, loaded: LoadedSpeculator, inputs: StepInputs) -> torch.Tensor:
        """Bind, ``propose``, then ``post_forward`` (which clears the metadata)."""
        self.bind()
        try:
            return loaded.speculator.propose(**inputs.kwargs)
        finally:
            self.worker.post_forward(set())


@contextlib.contextmanager
def worker_connector(loaded: LoadedSpeculator):
    """``loaded``'s configured connector made the GPU worker's way
    (``ensure_kv_transfer_initialized``, in a process group) and wrapped in
    MRv2's ``ActiveKVConnector``; shut down on exit. Needs the speculator's
    ``kv_cache_config`` (see :func:`attach_target_graph_outputs`)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
    )
    from vllm.v1.worker.gpu.kv_connector import get_kv_connector

    cfg, kv_cache_config = loaded.vllm_config, loaded.speculator.kv_cache_config
    ensure_kv_transfer_initialized(cfg, kv_cache_config)
    try:
        yield Connectors(
            KVConnectorFactory.create_connector(
                cfg, KVConnectorRole.SCHEDULER, kv_cache_config
            ),
            get_kv_connector(cfg, {loaded.layer_name: loaded.kv_cache}),
        )
    finally:
        ensure_kv_transfer_shutdown()
