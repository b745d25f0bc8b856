"""Which token counts get a CUDA graph, and what each batch pads to.

Pure arithmetic, no torch and no vLLM. The default list mirrors the one vLLM's
``VllmConfig._set_cudagraph_sizes`` builds for the target model, so that the
draft step pads to exactly the size the target already padded to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# vLLM's platform ceiling for the default list (1024 on data-centre Blackwell).
DEFAULT_MAX_CAPTURE_SIZE = 512


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
        max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE,
    ) -> CaptureSizes:
        """The sizes vLLM would capture for the target.

        ``capture_sizes`` is the compilation config's resolved list; when it is
        empty or None (the platform resolved no graphs, e.g. a CPU build), the
        default list is rebuilt from the scheduler limits the way vLLM does for
        a single decode tier.
        """
        if capture_sizes:
            return cls(s for s in set(capture_sizes) if s <= max_num_batched_tokens)
        return cls(
            default_capture_sizes(
                max_num_batched_tokens,
                max_num_seqs,
                uniform_decode_query_len,
                max_capture_size,
            )
        )


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
