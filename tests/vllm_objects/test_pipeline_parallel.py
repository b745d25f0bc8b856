"""Extraction across pipeline stages (:mod:`cg_extract.pipeline_parallel`),
with vLLM's own objects: its config build, its model classes and the check it
makes on them at load, its KV-connector count.

The engine runs of it are ``tests/vllm_engine/test_e2e_pipeline_parallel.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import copy
import json
import os
import subprocess
import sys

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.model_executor.models.registry import ModelRegistry, _ModelRegistry
from vllm.v1.outputs import ModelRunnerOutput

from cg_extract import pipeline_parallel
from cg_extract.config import METHOD
from tests.model_families import FAMILIES, family_engine_args, write_family_dir
from vllm_on_cpu.engine import cpu_env
from vllm_on_cpu.harness import (
    _cpu_safe_model_loading,
    build_vllm_config,
    emulated_graph_keys,
    single_process_parallel_state,
)

PP = {"pipeline_parallel_size": 2}
# The families of vLLM's own model classes (the residual-dtype Llamas are
# registered in their engines' processes only), and the tiny Llama.
VLLMS = sorted(
    family
    for family, config in FAMILIES.items()
    if config["architectures"][0] in ModelRegistry.get_supported_archs()
)
# Those whose decoder relays aux hidden states between stages, in the
# installed vLLM.
RELAYING = {"llama", "qwen3"}


def engine_args(family):
    return {} if family == "llama" else family_engine_args(family)


def family_dir(tmp_path_factory, family):
    if family == "llama":
        from vllm_on_cpu.harness import write_model_dir

        return write_model_dir(tmp_path_factory.mktemp(family))
    return write_family_dir(tmp_path_factory.mktemp(family), family)


@pytest.mark.parametrize(
    "keys", [{}, emulated_graph_keys([1, 2])], ids=["no keys", "graphs"]
)
def test_extraction_across_stages_builds(model_dir, keys):
    cfg = build_vllm_config(model_dir, engine_args=PP, **keys)
    assert cfg.parallel_config.pipeline_parallel_size == 2
    assert cfg.speculative_config.method == METHOD
    assert cfg.speculative_config.draft_model_config.architectures == [
        pipeline_parallel.DRAFT_ARCHITECTURE
    ]


def test_without_the_drafts_answer_vllm_refuses(model_dir, monkeypatch):
    """What users met: vLLM checks the draft's architecture for SupportsPP.
    The plugin answers for that architecture alone."""
    vllms = _ModelRegistry.is_pp_supported_model.__wrapped__
    monkeypatch.setattr(_ModelRegistry, "is_pp_supported_model", vllms)
    with pytest.raises(NotImplementedError, match="Pipeline parallelism is not"):
        build_vllm_config(model_dir, engine_args=PP)


@pytest.mark.parametrize("family", sorted(set(VLLMS) - RELAYING))
def test_a_target_whose_decoder_relays_no_aux_states_is_refused_at_config_time(
    tmp_path_factory, family
):
    path = family_dir(tmp_path_factory, family)
    with pytest.raises(ValueError) as refused:
        build_vllm_config(path, engine_args={**engine_args(family), **PP})
    message = str(refused.value)
    (arch,) = FAMILIES[family]["architectures"]
    assert message.startswith(f"pipeline_parallel_size=2 with method '{METHOD}'")
    assert f"{arch}'s decoder " in message
    assert "supports_aux_hidden_states_over_pp" in message
    assert "LlamaModel" in message and "Qwen2Model" in message
    assert "Use pipeline_parallel_size=1" in message


@pytest.mark.parametrize("family", sorted(RELAYING))
def test_a_target_whose_decoder_relays_them_builds(tmp_path_factory, family):
    path = family_dir(tmp_path_factory, family)
    cfg = build_vllm_config(path, engine_args={**engine_args(family), **PP})
    assert cfg.parallel_config.pipeline_parallel_size == 2


@pytest.mark.parametrize("family", ["llama", *VLLMS])
def test_the_decoder_read_from_the_class_is_the_one_vllm_checks(
    tmp_path_factory, family
):
    """vLLM checks the flag on the instance's decoder when the worker loads
    the model (``verify_supports_aux_hidden_states_over_pp``). Built here
    (one stage, dummy weights), each family's ``model.model`` must be the
    class the plugin read from the source, and vLLM's check must refuse
    exactly where the plugin refuses."""
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        verify_supports_aux_hidden_states_over_pp,
    )

    path = family_dir(tmp_path_factory, family)
    cfg = build_vllm_config(path, engine_args=engine_args(family))
    with set_current_vllm_config(cfg), _cpu_safe_model_loading(torch.device("cpu")):
        single_process_parallel_state()
        if cfg.model_config.is_moe and parallel_state._EP is None:
            parallel_state.destroy_model_parallel()  # an MoE model's EP group
            parallel_state.initialize_model_parallel(1, 1)
        model = get_model(vllm_config=cfg)
    decoder = pipeline_parallel.decoder_class(type(model))
    assert decoder is type(model.model)
    relays = getattr(decoder, pipeline_parallel.AUX_RELAY_FLAG, False)
    assert relays == (family in RELAYING)
    try:
        verify_supports_aux_hidden_states_over_pp(model, METHOD)
        vllm_refuses = False
    except ValueError:
        vllm_refuses = True
    assert vllm_refuses == (not relays)


def test_a_multiconnector_is_refused_across_stages(model_dir, tmp_path):
    """On the stages before the last no connector runs; a MultiConnector may
    hold one that moves their KV cache (silently dropped otherwise)."""
    transfer = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "ExampleHiddenStatesConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                }
            ]
        },
    }
    engine_args = {**PP, "kv_transfer_config": transfer}
    with pytest.raises(ValueError, match="kv_connector 'MultiConnector' with method"):
        build_vllm_config(model_dir, engine_args=engine_args)
    build_vllm_config(model_dir, engine_args={"kv_transfer_config": transfer})


# --------------------------------------------------------------------------
# The KV connector of a stage without the hidden-state layer


def finished_by_step(count: int | None, stand_in_reports: bool | None = None):
    """Two stages' workers through vLLM's own ``KVOutputAggregator``, as the
    executor builds it for a connector whose ``get_finished_count()`` is
    ``count`` (world size 2): the request finishes on step 0; the first
    stage's runner connector is :class:`HiddenStatesOnLastStage` as the
    plugin builds it (or, planted, one that always or never reports); the
    last stage's writer reports it sent on step 2, once its copy is done.
    Returns the step on which the executor saw it finished (None: never).

    Each output is a copy of its own, as it arrives from its worker's
    process: vLLM hands out one shared empty output, which the aggregator
    writes into."""
    from vllm.v1.outputs import KVConnectorOutput

    def sent(output: ModelRunnerOutput) -> ModelRunnerOutput:
        return copy.copy(output)

    aggregator = KVOutputAggregator(count or 2)
    first = pipeline_parallel.HiddenStatesOnLastStage(
        every_worker_reports=count is None
        if stand_in_reports is None
        else stand_in_reports
    )
    for step in range(4):
        finished = {"req"} if step == 0 else set()
        outputs = [
            sent(
                ModelRunnerOutput.with_kv_conn_output_only(first.post_forward(finished))
            ),
            sent(
                ModelRunnerOutput.with_kv_conn_output_only(
                    KVConnectorOutput(finished_sending={"req"} if step == 2 else None)
                )
            ),
        ]
        done = aggregator.aggregate(outputs, output_rank=1).kv_connector_output
        if done is not None and "req" in (done.finished_sending or ()):
            return step
    return None


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
    assert finished_by_step(count) == 2


def test_a_stand_in_that_reported_wrongly_is_caught():
    """The two ways to get it wrong, each seen by the aggregator."""
    assert finished_by_step(1, stand_in_reports=True) == 0  # freed before the write
    assert finished_by_step(None, stand_in_reports=False) is None  # never freed


def test_the_runner_gets_the_stand_in_on_a_stage_without_the_layer(model_dir, tmp_path):
    """MRv2's runner asks ``get_kv_connector`` with its KV caches: without the
    hidden-state layer it gets the stand-in (no connector hook runs); with
    it, vLLM's own connector wrapper, which registers the caches."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
    )
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from vllm_on_cpu.harness import (
        attach_target_graph_outputs,
        load_speculator,
        single_process_group,
    )
    from vllm_on_cpu.hidden_states_connector import kv_transfer_config

    transfer = {"kv_transfer_config": kv_transfer_config(tmp_path)}
    cfg = build_vllm_config(model_dir, engine_args={**PP, **transfer})
    from cg_extract.speculator import ExtractHiddenStatesSpeculator

    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg)
    attach_target_graph_outputs(loaded, [1])  # the runner's KV-cache config
    cfg = loaded.vllm_config
    target = torch.zeros(2)
    with single_process_group(cfg):
        ensure_kv_transfer_initialized(cfg, loaded.speculator.kv_cache_config)
        try:
            stage = model_runner.get_kv_connector(cfg, {"model.layers.0": target})
            last = model_runner.get_kv_connector(
                cfg, {"model.layers.3": target, loaded.layer_name: loaded.kv_cache}
            )
        finally:
            ensure_kv_transfer_shutdown()
    assert isinstance(stage, pipeline_parallel.HiddenStatesOnLastStage)
    assert stage.every_worker_reports is False  # vLLM's connector counts 1
    assert isinstance(last, ActiveKVConnector)


# --------------------------------------------------------------------------
# vLLM's own refusals, unchanged with the plugin loaded

VLLMS_REFUSALS = """
import json
from vllm.engine.arg_utils import EngineArgs
from vllm_on_cpu.harness import speculative_config
common = dict(model={model!r}, load_format="dummy", skip_tokenizer_init=True,
              dtype="float32", pipeline_parallel_size=2,
              speculative_config=speculative_config([1, 2, 3]))
refusals = {{}}
for name, extra in {{"micro-batching": dict(ubatch_size=2),
                    "external launcher":
                        dict(distributed_executor_backend="external_launcher")}}.items():
    try:
        EngineArgs(**common, **extra).create_engine_config()
        refusals[name] = None
    except Exception as error:
        refusals[name] = [isinstance(error, ValueError), str(error)]
print(json.dumps(refusals))
"""


def test_vllms_own_refusals_reach_the_user_unchanged(model_dir):
    """Under Model Runner V2 (as users run it), vLLM refuses pipeline
    parallelism with micro-batching and with the external launcher when the
    config is built (``_get_v2_model_runner_unsupported_features``); the
    plugin adds no check of its own there. Run in a process that can start
    MRv2 on a CPU (:func:`vllm_on_cpu.engine.cpu_env`), the plugin loaded."""
    env = {**os.environ, **cpu_env(), "VLLM_PLUGINS": "cg_extract"}
    env.setdefault("RANK", "0")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("WORLD_SIZE", "2")
    proc = subprocess.run(
        [sys.executable, "-c", VLLMS_REFUSALS.format(model=str(model_dir))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refusals = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, reason in [
        ("micro-batching", "dual batch overlap with pipeline parallelism"),
        ("external launcher", "pipeline parallelism with external_launcher"),
    ]:
        is_value_error, message = refusals[name]
        assert is_value_error, refusals
        assert "Model Runner V2 does not yet support: " in message, message
        assert reason in message, message
        assert "cg_extract" not in message


def test_a_subclass_building_another_decoder_is_read_as_it_builds():
    """MiMo's causal LM subclasses Qwen2's, whose decoder relays aux states,
    and builds its own, which does not (vLLM's mimo.py): the subclass's
    assignment wins, as it does at run time."""
    from vllm.model_executor.models.mimo import MiMoForCausalLM, MiMoModel

    assert pipeline_parallel.decoder_class(MiMoForCausalLM) is MiMoModel
    assert not MiMoModel.supports_aux_hidden_states_over_pp
