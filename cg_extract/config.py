"""Our ``--speculative-config`` keys: parsing, validation, and the trip to workers.

vLLM's ``SpeculativeConfig`` forbids unknown keys, so the plugin takes ours out
of the user's dict before vLLM sees it and stores them under
``VllmConfig.additional_config["cg_extract"]``, a plain dict that is pickled to
every worker with the rest of the config.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

METHOD = "extract_hidden_states"
ADDITIONAL_CONFIG_KEY = "cg_extract"
BACKENDS = ("auto", "cuda", "emulated")

# KV connectors that read hidden states from the cache after a request
# finishes and do nothing per forward (their ``save_kv_layer`` is a no-op), so
# a graph replay, which skips Python, loses nothing. Others may do their work
# in ``save_kv_layer`` and are refused in graph mode.
GRAPH_SAFE_CONNECTORS = ("ExampleHiddenStatesConnector",)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


@dataclass(frozen=True)
class ExtractGraphConfig:
    cudagraph: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    cudagraph_backend: str = "auto"

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> ExtractGraphConfig:
        """Validate user-supplied keys; every error names the key and value."""
        unknown = sorted(set(options) - set(KEYS))
        if unknown:
            raise ValueError(
                f"unknown cg_extract key(s) {unknown}; accepted: {list(KEYS)}"
            )
        cudagraph = options.get("cudagraph", False)
        if not _is_bool(cudagraph):
            raise ValueError(
                f"speculative config key 'cudagraph' must be true or false, "
                f"got {cudagraph!r} ({type(cudagraph).__name__})"
            )
        backend = options.get("cudagraph_backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(
                f"speculative config key 'cudagraph_backend' must be one of "
                f"{list(BACKENDS)}, got {backend!r}"
            )
        sizes = options.get("cudagraph_capture_sizes")
        if sizes is not None:
            sizes = _validate_sizes(sizes)
        return cls(cudagraph, sizes, backend)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ExtractGraphConfig:
        """Our keys as they reached this process (defaults when absent)."""
        additional = getattr(vllm_config, "additional_config", None) or {}
        return cls.from_dict(additional.get(ADDITIONAL_CONFIG_KEY, {}))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.cudagraph_capture_sizes is not None:
            d["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        return d

    def validate_for(self, vllm_config: Any, cuda_available: bool) -> None:
        """Checks that need the whole engine config; run when it is built."""
        spec = vllm_config.speculative_config
        method = spec.method if spec is not None else None
        if self != ExtractGraphConfig() and method != METHOD:
            raise ValueError(
                f"speculative config keys {sorted(self.to_dict())} apply only to "
                f"method '{METHOD}', got method {method!r}"
            )
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        too_big = [s for s in self.cudagraph_capture_sizes or () if s > max_tokens]
        if too_big:
            raise ValueError(
                f"speculative config key 'cudagraph_capture_sizes' has {too_big} "
                f"above max_num_batched_tokens={max_tokens}; use sizes <= "
                f"{max_tokens} or raise --max-num-batched-tokens"
            )
        if method == METHOD:
            _refuse_micro_batching(vllm_config.parallel_config)
        if self.cudagraph_backend == "cuda" and not cuda_available:
            raise ValueError(
                "speculative config key 'cudagraph_backend' is 'cuda' but this "
                "machine has no CUDA device; use 'auto' (graphs where CUDA "
                "exists) or 'emulated' (the CPU check of the graph contract)"
            )
        if not self.cudagraph:
            return
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:
            raise ValueError(
                f"'cudagraph': true with method '{METHOD}' does not support "
                f"pipeline parallelism (pipeline_parallel_size={pp}); use "
                "pipeline_parallel_size=1"
            )
        unsafe = [
            c
            for c in _connector_names(vllm_config.kv_transfer_config)
            if c not in GRAPH_SAFE_CONNECTORS
        ]
        if unsafe:
            raise ValueError(
                f"'cudagraph': true cannot run with KV connector {unsafe[0]!r}: "
                "a graph replay skips the connector's per-forward save_kv_layer, "
                "which would lose hidden states. Graph mode runs with no "
                f"connector or with {list(GRAPH_SAFE_CONNECTORS)}; otherwise set "
                "'cudagraph': false"
            )


KEYS = tuple(ExtractGraphConfig.__dataclass_fields__)


def _refuse_micro_batching(parallel_config: Any) -> None:
    """MRv2 micro-batches (DBO) only with data parallelism, and then hands
    ``propose`` no slot mappings: vLLM's own class fails there too, with a
    TypeError at the first micro-batched step."""
    if parallel_config.use_ubatching and parallel_config.data_parallel_size > 1:
        raise ValueError(
            f"method '{METHOD}' cannot run with micro-batching "
            f"(enable_dbo={parallel_config.enable_dbo}, "
            f"ubatch_size={parallel_config.ubatch_size}, "
            f"data_parallel_size={parallel_config.data_parallel_size}): Model "
            "Runner V2 passes a micro-batched step no slot mappings to write "
            "hidden states to; turn off enable_dbo and set ubatch_size to 1"
        )


def _connector_names(kv_transfer_config: Any) -> list[str]:
    """The configured connectors; a MultiConnector stands for its children."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return []
    if kv_transfer_config.kv_connector == "MultiConnector":
        children = kv_transfer_config.kv_connector_extra_config.get("connectors", [])
        return [child.get("kv_connector") for child in children]
    return [kv_transfer_config.kv_connector]


def _validate_sizes(sizes: Any) -> tuple[int, ...]:
    key = "cudagraph_capture_sizes"
    if not isinstance(sizes, list | tuple) or not sizes:
        raise ValueError(
            f"speculative config key '{key}' must be a non-empty list of positive "
            f"integers, got {sizes!r}"
        )
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s <= 0]
    if bad:
        raise ValueError(
            f"speculative config key '{key}' must hold positive integers, got "
            f"{bad} in {list(sizes)}"
        )
    dups = sorted({s for s in sizes if list(sizes).count(s) > 1})
    if dups:
        raise ValueError(
            f"speculative config key '{key}' has duplicate sizes {dups} in "
            f"{list(sizes)}; list each size once"
        )
    return tuple(sizes)


def split_speculative_config(
    spec: Mapping[str, Any], vllm_keys: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a user's speculative-config dict into vLLM's keys and ours.

    Keys are compared as vLLM compares them (``-`` read as ``_``). A key that
    is neither vLLM's nor ours but looks like ours (``cudagraphs``,
    ``cuda_graph``) is an error here rather than vLLM's generic one.
    """
    vllm_keys = set(vllm_keys)
    theirs, ours = {}, {}
    for key, value in spec.items():
        norm = key.replace("-", "_")
        if norm in KEYS:
            ours[norm] = value
            continue
        if norm not in vllm_keys:
            guess = _looks_like_ours(norm)
            if guess is not None:
                raise ValueError(
                    f"unknown speculative config key {key!r}; did you mean "
                    f"{guess!r}? cg_extract accepts {list(KEYS)}"
                )
        theirs[key] = value
    return theirs, ours


def _looks_like_ours(key: str) -> str | None:
    squashed = key.lower().replace("_", "")
    for name in KEYS:
        target = name.replace("_", "")
        if (
            squashed in (target, target + "s")
            or difflib.SequenceMatcher(None, squashed, target).ratio() >= 0.85
        ):
            return name
    return None
