"""Our ``--speculative-config`` keys: parsing, validation, and the trip to workers.

vLLM's ``SpeculativeConfig`` forbids unknown keys, so the plugin takes ours out
of the user's dict before vLLM sees it and stores them under
``VllmConfig.additional_config["cg_extract"]``, a plain dict that is pickled to
every worker with the rest of the config. Keys may also be given there
directly; a key given in both places must have the same value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

METHOD = "extract_hidden_states"
ADDITIONAL_CONFIG_KEY = "cg_extract"
BACKENDS = ("auto", "cuda", "emulated")
# Where a key was given, as error messages name it.
SPECULATIVE_CONFIG = "speculative config"
ADDITIONAL_CONFIG = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"


@dataclass(frozen=True)
class ExtractGraphConfig:
    cudagraph: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    cudagraph_backend: str = "auto"
    # Not a graph key: it changes vLLM's KV-cache grouping
    # (cg_extract.kv_cache_groups).
    split_kv_cache_groups: bool = False

    @classmethod
    def from_dict(
        cls, options: Mapping[str, Any], where: str = SPECULATIVE_CONFIG
    ) -> ExtractGraphConfig:
        """Validate user-supplied keys; every error names where the key was
        given, the key and the value."""
        unknown = sorted(set(options) - set(KEYS))
        if unknown:
            raise ValueError(_unknown_key_message(unknown, where))
        for name in ("cudagraph", "split_kv_cache_groups"):
            value = options.get(name, False)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{where} key {name!r} must be true or false, "
                    f"got {value!r} ({type(value).__name__})"
                )
        backend = options.get("cudagraph_backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(
                f"{where} key 'cudagraph_backend' must be one of "
                f"{list(BACKENDS)}, got {backend!r}"
            )
        sizes = options.get("cudagraph_capture_sizes")
        if sizes is not None:
            sizes = _validate_sizes(sizes, where)
        return cls(
            options.get("cudagraph", False),
            sizes,
            backend,
            options.get("split_kv_cache_groups", False),
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ExtractGraphConfig:
        """Our keys as they reached this process (defaults when absent)."""
        return cls.from_dict(_given(vllm_config) or {}, ADDITIONAL_CONFIG)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.cudagraph_capture_sizes is not None:
            d["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        return d

    def validate_for(
        self,
        vllm_config: Any,
        cuda_available: bool,
        sources: Mapping[str, str] | None = None,
    ) -> None:
        """Checks that need the whole engine config; run when it is built.

        ``sources`` says where each key was given (the speculative config
        unless named), for the messages.
        """
        sources = sources or {}

        def key(name: str) -> str:
            return f"{sources.get(name, SPECULATIVE_CONFIG)} key {name!r}"

        spec = vllm_config.speculative_config
        method = spec.method if spec is not None else None
        given = _given(vllm_config) is not None
        if given and method != METHOD:
            # Name what was given: the keys and where, or the (empty) dict
            # under additional_config when that is all there was.
            keys = ", ".join(key(k) for k in sorted(sources)) or ADDITIONAL_CONFIG
            raise ValueError(
                f"{keys}: cg_extract keys apply only to method '{METHOD}', got "
                + (f"method {method!r}" if spec else "no speculative config")
            )
        if given and spec.num_speculative_tokens != 1:
            raise ValueError(
                f"speculative config key 'num_speculative_tokens' must be 1 with "
                f"method '{METHOD}' (it stores hidden states and proposes one "
                f"token, always accepted), got {spec.num_speculative_tokens}"
            )
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        too_big = [s for s in self.cudagraph_capture_sizes or () if s > max_tokens]
        if too_big:
            raise ValueError(
                f"{key('cudagraph_capture_sizes')} has {too_big} above "
                f"max_num_batched_tokens={max_tokens}; use sizes <= {max_tokens} "
                "or raise --max-num-batched-tokens"
            )
        if self.cudagraph_backend == "cuda" and not cuda_available:
            raise ValueError(
                f"{key('cudagraph_backend')} is 'cuda' but this machine has no "
                "CUDA device; use 'auto' (graphs where CUDA exists) or "
                "'emulated' (the CPU check of the graph contract)"
            )
        if not self.cudagraph:
            _graph_keys_without_graphs(sources)


KEYS = tuple(ExtractGraphConfig.__dataclass_fields__)
# Keys that shape the graphs, so mean nothing while 'cudagraph' is false.
GRAPH_KEYS = ("cudagraph_capture_sizes", "cudagraph_backend")


def _graph_keys_without_graphs(sources: Mapping[str, str]) -> None:
    """Graph keys given with graphs off: an error when 'cudagraph' was left
    out (the likelier slip: the user wants graphs), a warning when it was
    set false (graphs switched off on purpose, the rest kept for later)."""
    given = [f"{sources[k]} key {k!r}" for k in GRAPH_KEYS if k in sources]
    if not given:
        return
    if "cudagraph" not in sources:
        raise ValueError(
            f"{', '.join(given)} given without 'cudagraph': cg_extract captures "
            'graphs only with "cudagraph": true; add it, or drop '
            f"{'them' if len(given) > 1 else 'it'} to run eagerly"
        )
    from cg_extract import get_logger

    get_logger(__name__).warning(
        "cg_extract: %s unused: %s key 'cudagraph' is false, so no graphs are captured",
        ", ".join(given),
        sources["cudagraph"],
    )


def given_keys(vllm_config: Any) -> set[str]:
    """The keys of ours the user gave (the plugin carries only those)."""
    return set(_given(vllm_config) or ())


def _given(vllm_config: Any) -> Mapping[str, Any] | None:
    """Our keys in the config, or None where none were given (or where the
    config is not vLLM's: vLLM's own tests hand its functions mocks)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping):
        return None
    return additional.get(ADDITIONAL_CONFIG_KEY)


def near_our_section(key: str) -> bool:
    """An ``additional_config`` key that is a near spelling of ours
    (``cg_extrakt``, ``cg-extract``) but not ours."""
    ours = ADDITIONAL_CONFIG_KEY.replace("_", "")
    squashed = key.lower().replace("-", "").replace("_", "")
    return (
        key != ADDITIONAL_CONFIG_KEY
        and len(squashed) >= len(ours) - 1  # not a mere part ("extract")
        and difflib.SequenceMatcher(None, squashed, ours).ratio() >= 0.85
    )


def check_additional_config_keys(additional: Mapping[str, Any]) -> None:
    """``additional_config`` is free-form (other plugins keep theirs there),
    so only a near spelling of our section, or one of our keys placed beside
    it instead of in it, is taken as ours; either would be dropped silently."""
    for key in additional:
        if near_our_section(key):
            raise ValueError(
                f"unknown additional_config key {key!r}; did you mean "
                f"{ADDITIONAL_CONFIG_KEY!r}? cg_extract reads "
                f"{ADDITIONAL_CONFIG} (keys {list(KEYS)})"
            )
        if key in KEYS:
            raise ValueError(
                f"additional_config key {key!r} is cg_extract's: give it in "
                f"{ADDITIONAL_CONFIG}, e.g. additional_config="
                f"{ {ADDITIONAL_CONFIG_KEY: {key: additional[key]}} }, or in "
                "the speculative config"
            )


def merge_our_keys(
    from_spec: Mapping[str, Any], direct: Any
) -> tuple[ExtractGraphConfig, dict[str, str]]:
    """Our keys from the speculative config and from
    ``additional_config["cg_extract"]`` (``direct``, None when absent), each
    validated where it was given. A key in both must have the same value.

    Returns the config and where each given key came from.
    """
    if direct is None:
        direct = {}
    if not isinstance(direct, Mapping):
        raise ValueError(
            f"{ADDITIONAL_CONFIG} must be a dict of cg_extract keys "
            f"{list(KEYS)}, got {direct!r}"
        )
    ours = ExtractGraphConfig.from_dict(from_spec, SPECULATIVE_CONFIG)
    theirs = ExtractGraphConfig.from_dict(direct, ADDITIONAL_CONFIG)
    clashes = [
        k
        for k in KEYS
        if k in from_spec and k in direct and getattr(ours, k) != getattr(theirs, k)
    ]
    if clashes:
        raise ValueError(
            f"cg_extract key(s) {clashes} given in both the {SPECULATIVE_CONFIG} "
            f"({ {k: from_spec[k] for k in clashes} }) and {ADDITIONAL_CONFIG} "
            f"({ {k: direct[k] for k in clashes} }) with different values; "
            "give each key in one place"
        )
    sources = {k: ADDITIONAL_CONFIG for k in direct}
    sources.update({k: SPECULATIVE_CONFIG for k in from_spec})
    return ExtractGraphConfig.from_dict({**direct, **from_spec}), sources


def _validate_sizes(sizes: Any, where: str) -> tuple[int, ...]:
    key = f"{where} key 'cudagraph_capture_sizes'"
    if not isinstance(sizes, list | tuple) or not sizes:
        raise ValueError(
            f"{key} must be a non-empty list of positive integers, got {sizes!r}"
        )
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s <= 0]
    if bad:
        raise ValueError(
            f"{key} must hold positive integers, got {bad} in {list(sizes)}"
        )
    dups = sorted({s for s in sizes if list(sizes).count(s) > 1})
    if dups:
        raise ValueError(
            f"{key} has duplicate sizes {dups} in {list(sizes)}; list each size once"
        )
    return tuple(sizes)


def split_speculative_config(
    spec: Mapping[str, Any], vllm_keys: Iterable[str], method: str | None = METHOD
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a user's speculative-config dict into vLLM's keys and ours.

    Keys are compared as vLLM compares them (``-`` read as ``_``). With our
    ``method``, a key that is neither vLLM's nor ours but looks like ours
    (``cudagraphs``, ``capture_sizes``, ``cg_backend``) is an error here
    rather than vLLM's generic one; with another method it is left to vLLM,
    as suggesting a key of ours would only lead to a second refusal.
    """
    vllm_keys = set(vllm_keys)
    theirs, ours = {}, {}
    for key, value in spec.items():
        norm = key.replace("-", "_")
        if norm in KEYS:
            ours[norm] = value
            continue
        if method == METHOD and norm not in vllm_keys and looks_like_ours(norm):
            raise ValueError(_unknown_key_message([key], SPECULATIVE_CONFIG))
        theirs[key] = value
    return theirs, ours


def _unknown_key_message(keys: list[str], where: str) -> str:
    guesses = [
        f"did you mean {guess!r}" + (f" for {key!r}?" if len(keys) > 1 else "?")
        for key in keys
        if (guess := looks_like_ours(key.replace("-", "_"))) is not None
    ]
    names = ", ".join(repr(k) for k in keys)
    return " ".join(
        [f"unknown {where} key {names};", *guesses, f"cg_extract accepts {list(KEYS)}"]
    )


# Words people use for ours: "cg_backend", "cuda_graph", "enable_cudagraph".
_ALIASES = {"cg": "cudagraph", "graph": "cudagraph", "cudagraphs": "cudagraph"}
_FILLER = {"enable", "enabled", "use", "num"}


def _words(key: str) -> set[str]:
    key = key.lower().replace("cuda_graph", "cudagraph")
    words = (_ALIASES.get(w, w).removesuffix("s") for w in key.split("_") if w)
    return {w for w in words if w not in _FILLER}


def looks_like_ours(key: str) -> str | None:
    """The key of ours ``key`` most likely means: a near spelling
    (``cudagrpah``), or at least half the same words (``capture_sizes``)."""
    key = key.replace("-", "_")
    squashed = key.lower().replace("_", "")
    for name in KEYS:
        target = name.replace("_", "")
        if (
            squashed in (target, target + "s")
            or difflib.SequenceMatcher(None, squashed, target).ratio() >= 0.85
        ):
            return name
    words = _words(key)
    overlap = {
        name: len(words & _words(name)) / len(words | _words(name)) for name in KEYS
    }
    best = max(KEYS, key=overlap.__getitem__)
    return best if words and overlap[best] >= 0.5 else None
