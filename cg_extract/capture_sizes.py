"""Which token counts get a CUDA graph, and what each batch pads to.

Pure arithmetic, no torch and no vLLM. The default sizes are the token counts
of the target's own graphs, as vLLM resolves them, so that the draft step pads
to exactly the size the target already padded to:

* before vLLM 0.34, ``VllmConfig._set_cudagraph_sizes``'s one list
  (:func:`default_capture_sizes`);
* from 0.34, whose model runner V2 splits that list into prefill token counts
  and decode request counts, every prefill size and every decode request count
  times the decode query length (:func:`split_capture_sizes`), which is what
  0.34 itself records in ``cudagraph_capture_sizes`` after resolution.

Which rule applies is the adapter's call (``vllm_graphs.capture_sizes``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# vLLM's platform ceiling for the default list (1024 on data-centre Blackwell).
DEFAULT_MAX_CAPTURE_SIZE = 512
SM100_MAX_CAPTURE_SIZE = 1024
# vLLM 0.34's SM100 default for the widest prefill graph and decode token budget.
SM100_MAX_TOKENS = 8192


class CaptureSizes:
    """A sorted set of capture sizes with an O(1) ``pad``."""

    def __init__(self, sizes: Iterable[int]):
        sizes = list(sizes)
        if not sizes:
            raise ValueError("capture sizes must not be empty")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise ValueError(
                    f"capture size {s!r} is not a positive integer; "
                    "capture sizes are token counts >= 1"
                )
        if len(set(sizes)) != len(sizes):
            dups = sorted({s for s in sizes if sizes.count(s) > 1})
            raise ValueError(f"capture sizes contain duplicates: {dups}")
        self.sizes: tuple[int, ...] = tuple(sorted(sizes))
        self.max_size: int = self.sizes[-1]
        # _pad_table[n] is the smallest captured size >= n, for 0 <= n <= max.
        table = [0] * (self.max_size + 1)
        it = iter(self.sizes)
        current = next(it)
        for n in range(1, self.max_size + 1):
            if n > current:
                current = next(it)
            table[n] = current
        table[0] = self.sizes[0]
        self._pad_table = table

    def pad(self, n: int) -> int | None:
        """Smallest captured size >= ``n``; None above the largest (run eager)."""
        if n > self.max_size:
            return None
        return self._pad_table[max(n, 0)]

    def __contains__(self, n: int) -> bool:
        return n in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"CaptureSizes({list(self.sizes)})"

    @classmethod
    def from_vllm_inputs(
        cls,
        capture_sizes: Sequence[int] | None,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        uniform_decode_query_len: int,
        sm100: bool = False,
        split: SplitSizes | None = None,
    ) -> CaptureSizes:
        """The token counts of the target's graphs.

        ``capture_sizes`` is the compilation config's resolved list (from vLLM
        0.34 the token count of every captured graph). When it is empty or None
        (the platform resolved no graphs, e.g. a CPU build), the sizes are
        rebuilt from the scheduler limits the way vLLM does for a single decode
        tier: with 0.34's ``split`` fields as given (:func:`split_capture_sizes`),
        else the one list of earlier releases (:func:`default_capture_sizes`).
        ``sm100``: the platform is data-centre Blackwell (wider defaults).
        """
        if capture_sizes:
            return cls(s for s in set(capture_sizes) if s <= max_num_batched_tokens)
        args = (max_num_batched_tokens, max_num_seqs, uniform_decode_query_len)
        if split is not None:
            return cls(split_capture_sizes(*args, split, sm100))
        ceiling = SM100_MAX_CAPTURE_SIZE if sm100 else DEFAULT_MAX_CAPTURE_SIZE
        return cls(default_capture_sizes(*args, ceiling))


def default_capture_sizes(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    uniform_decode_query_len: int,
    max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE,
) -> list[int]:
    """vLLM's default capture list: 1, 2, 4, then steps of 8 below 256 and 16
    above, capped at ``min(max_num_seqs * q * 2, ceiling, max_num_batched_tokens)``,
    plus ``max_num_batched_tokens`` and the uniform decode sizes that fit."""
    q = uniform_decode_query_len
    ceiling = min(max_num_seqs * q * 2, max_capture_size)
    decode_sizes: list[int] = []
    if q > 1:
        reqs = min(max_num_seqs, max_capture_size)
        counts = [n for n in (1, 2, 4) if n <= reqs]
        counts += range(8, min(reqs + 1, 256), 8)
        counts += range(256, reqs + 1, 16)
        decode_sizes = [n * q for n in set(counts) | {reqs} if n * q <= ceiling]
    elif max_num_seqs <= ceiling:
        decode_sizes = [max_num_seqs]
    ceiling = min(max_num_batched_tokens, ceiling)
    sizes = [n for n in (1, 2, 4) if n <= ceiling]
    sizes += range(8, min(ceiling + 1, 256), 8)
    sizes += range(256, ceiling + 1, 16)
    if max_num_batched_tokens <= ceiling:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in decode_sizes if s <= max_num_batched_tokens]
    return sorted(set(sizes))


@dataclass(frozen=True)
class SplitSizes:
    """vLLM 0.34's capture fields of ``compilation_config`` as given (None:
    unset): prefill token counts, decode request counts, their caps, the
    decode token budget, and the deprecated one list (not with the first
    four)."""

    prefill_token_sizes: Sequence[int] | None = None
    max_prefill_tokens: int | None = None
    decode_request_sizes: Sequence[int] | None = None
    max_decode_requests: int | None = None
    max_decode_tokens: int | None = None
    legacy_sizes: Sequence[int] | None = None


def split_capture_sizes(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    uniform_decode_query_len: int,
    given: SplitSizes = SplitSizes(),
    sm100: bool = False,
) -> list[int]:
    """vLLM 0.34's token counts of the target's graphs (``VllmConfig.
    _split_cudagraph_capture_sizes``, one decode tier, prefill and decode
    graphs): the prefill token sizes, and each decode request size ``n`` as
    ``n * q`` tokens while ``n`` fits ``max_num_seqs`` and the decode token
    budget. Unset fields default to the one list's sizes (and the request
    counts that round them up to whole requests), or on SM100, unless the
    deprecated list is given, to 0.34's token and request grids."""
    tokens, seqs, q = max_num_batched_tokens, max_num_seqs, uniform_decode_query_len
    legacy = given.legacy_sizes is not None
    if legacy and given != SplitSizes(
        legacy_sizes=given.legacy_sizes, max_decode_tokens=given.max_decode_tokens
    ):
        # As 0.34 does, but for re-resolving its own resolution.
        raise ValueError(
            "the deprecated cudagraph_capture_sizes cannot be combined with "
            "the prefill and decode capture sizes"
        )
    if legacy:
        shared = sorted({s for s in given.legacy_sizes if s <= tokens})
    else:
        ceiling = SM100_MAX_CAPTURE_SIZE if sm100 else DEFAULT_MAX_CAPTURE_SIZE
        shared = default_capture_sizes(tokens, seqs, q, ceiling)
    wide = sm100 and not legacy
    budget = given.max_decode_tokens
    if wide and budget is None:
        budget = SM100_MAX_TOKENS

    prefill_cap = given.max_prefill_tokens
    if given.prefill_token_sizes is not None:
        prefill = _explicit(given.prefill_token_sizes, tokens, prefill_cap, "prefill")
    elif prefill_cap is not None or wide:
        top = SM100_MAX_TOKENS if prefill_cap is None else prefill_cap
        prefill = prefill_grid(min(top, tokens))
    else:
        prefill = shared

    decode_cap = given.max_decode_requests
    if given.decode_request_sizes is not None:
        decode = _explicit(given.decode_request_sizes, seqs, decode_cap, "decode")
    elif decode_cap is not None or wide:
        decode = decode_grid(seqs if decode_cap is None else min(decode_cap, seqs))
    else:
        top = max(shared, default=0)
        decode = sorted(
            {min(-(-s // q), seqs) for s in shared if -(-s // q) * q <= top}
        )

    # A decode batch pads to the smallest graph that holds it, so the first
    # request count above the limit is captured at the limit.
    limit = min(seqs, min(tokens, budget or tokens) // q)
    reachable = decode[: bisect.bisect_left(decode, limit) + 1] if limit >= 1 else []
    decode_tokens = {min(n, limit) * q for n in reachable}
    return sorted(decode_tokens | set(prefill))


def prefill_grid(max_tokens: int) -> list[int]:
    """vLLM 0.34's token-count grid: 1, 2, 4, every 8 up to 64, four sizes
    per doubling up to 1024, then every 256 and every 512 beyond ~7.3k."""
    return _walk_grid(max_tokens, lambda t: min(t, max(8, t / 4), 0.07 * max(t, 4096)))


def decode_grid(max_requests: int) -> list[int]:
    """vLLM 0.34's request-count grid: every count up to 6, then strides
    of 2, 4, 8, 16, 32 as the count grows (64 sizes at 1024)."""
    return _walk_grid(max_requests, lambda n: 0.65 * n ** (2 / 3))


def _walk_grid(limit: int, step: Callable[[int], float]) -> list[int]:
    grid, size = [], 1
    while size < limit:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = (size // stride + 1) * stride
    return [*grid, limit] if limit else []


def _explicit(sizes: Sequence[int], limit: int, cap: int | None, kind: str):
    kept = sorted({s for s in sizes if 1 <= s <= limit})
    if cap is not None and kept and kept[-1] > cap:
        raise ValueError(f"{kind} capture sizes hold {kept[-1]}, above their cap {cap}")
    return kept
