"""CUDA-graph-enabled extract_hidden_states speculator for vLLM Model Runner V2."""

import functools
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def get_logger(module: str):
    """vLLM's logger for ``module``, named under vLLM's ``vllm`` logger tree
    so that vLLM's default logging config, which configures only that tree,
    prints our INFO lines as it prints its own."""
    from vllm.logger import init_logger

    return init_logger(f"vllm.{module}")


def speaks(vllm_config) -> bool:
    """Whether this rank logs for the speculator: the first rank of the last
    pipeline stage (the stage that holds the speculator) of DP index 0. vLLM's
    first rank is not enough: with pipeline parallelism it holds no
    speculator, and vLLM runs a dense model's DP ranks as independent
    engines, each its own world of DP rank 0
    (``reconfigure_for_independent_dp_rank``); only ``data_parallel_index``
    keeps the rank it was given."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_world_group,
        is_global_first_rank,
        model_parallel_is_initialized,
    )

    if vllm_config.parallel_config.data_parallel_index != 0:
        return False
    if not model_parallel_is_initialized():
        return is_global_first_rank()
    # The pipeline that starts at the world's first rank, at its last stage.
    pp = get_pp_group()
    return pp.is_last_rank and pp.ranks[0] == get_world_group().ranks[0]


def wrap_once(owner: Any, name: str) -> Callable[[Callable[..., Any]], None]:
    """Install the decorated function in place of vLLM's ``owner.<name>``,
    called with vLLM's original first; once per process (vLLM loads plugins
    in every process, some more than once), the original still reachable as
    ``__wrapped__``."""

    def install(replacement: Callable[..., Any]) -> None:
        original = getattr(owner, name)
        if getattr(original, "_cg_extract", False):
            return

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return replacement(original, *args, **kwargs)

        wrapper._cg_extract = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)

    return install
