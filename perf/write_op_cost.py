"""What the write op costs the host on a CPU, and what decided how it is called.

    python perf/write_op_cost.py [--hidden-size 1024] [--layers 3] [--dtype bf16]

Two tables, each case timed in interleaved rounds (``--rounds`` of
``--number`` calls each, one torch thread); a figure is the median of the
rounds' means, ``[min, max]`` the lowest and highest round's:

* ``dispatch``: a kernel that does nothing, called through a
  ``torch.library.Library`` op, through ``torch.library.custom_op``, and as
  :func:`cg_extract.write_op.write_hidden_states` calls it when nothing could
  intercept the op (a check of the dispatch-mode stack, then a Python call);
* ``write`` (``--cold``: a 64 MiB write before every call, untimed, so that
  the op's code and data come from memory as after a model's forward): the
  whole write per token count: ``op`` through the dispatcher,
  ``direct`` as the speculator calls it, ``per_layer`` the write before the
  op; then the CPU body's two ways alone (``copy_rows``, with the
  ``tolist`` of the slots it needs, and ``scatter_layers``), whose crossover
  sets ``cache_write.COPY_UP_TO``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
from torch.library import Library  # noqa: E402

from cg_extract import cache_write, write_op  # noqa: E402
from vllm_on_cpu.harness import DTYPES  # noqa: E402

BLOCK_SIZE = 16


def timed(
    cases: dict, rounds: int, number: int, evict: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Microseconds per call of each case, one figure per round; the cases
    take turns within each round. ``evict`` runs before every call, untimed."""
    per_round = {name: [] for name in cases}
    for _ in range(rounds):
        for name, call in cases.items():
            if evict is None:
                seconds = timeit.timeit(call, number=number)
            else:
                seconds = 0.0
                for _ in range(number):
                    evict()
                    start = time.perf_counter()
                    call()
                    seconds += time.perf_counter() - start
            per_round[name].append(seconds / number * 1e6)
    return per_round


def shown(samples: list[float]) -> str:
    return f"{statistics.median(samples):.1f} [{min(samples):.1f}, {max(samples):.1f}]"


def _nothing(
    aux: list[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """A kernel with the write op's schema that does nothing."""


def dispatch_cases(*args) -> tuple[dict, Library]:
    """``_nothing`` as a ``Library`` op, as a ``custom_op``, and called as
    ``write_op.write_hidden_states`` calls its body; and the library, which
    must outlive the calls."""
    library = Library("cg_extract_cost", "FRAGMENT")
    library.define(f"nothing{write_op.SCHEMA.removeprefix(write_op.NAME)}")
    library.impl("nothing", _nothing, "CPU")
    torch.library.custom_op(
        "cg_extract_cost::nothing_custom",
        mutates_args=("kv_cache",),
        device_types="cpu",
    )(_nothing)
    ops = torch.ops.cg_extract_cost

    def direct():
        if torch._C._len_torch_dispatch_stack():
            return ops.nothing.default(*args)
        return _nothing(*args)

    return {
        "Library op": lambda: ops.nothing.default(*args),
        "custom_op": lambda: ops.nothing_custom.default(*args),
        "mode check + call": direct,
    }, library


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3, help="number of aux layers")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8, 32, 256]
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--number", type=int, default=400)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="write 64 MiB before every call of the write table (untimed), as "
        "a model's forward between two speculator steps would",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype, layers, hidden = DTYPES[args.dtype], args.layers, args.hidden_size

    def inputs(n: int):
        blocks = -(-n // BLOCK_SIZE) + 1
        cache = torch.zeros(blocks, layers, BLOCK_SIZE, hidden, dtype=dtype)
        aux = [torch.randn(n, hidden).to(dtype) for _ in range(layers)]
        slots = torch.randperm((blocks - 1) * BLOCK_SIZE)[:n] + BLOCK_SIZE
        return aux, cache, slots

    cases, _keep = dispatch_cases(*inputs(1))
    print(
        f"dispatch of a kernel that does nothing (us per call, median [min, max] "
        f"of {args.rounds} rounds of {args.number * 10})"
    )
    for name, samples in timed(cases, args.rounds, args.number * 10).items():
        print(f"  {name:18s} {shown(samples)}")

    evict = None
    if args.cold:
        scratch = torch.zeros(16 * 2**20)
        evict = functools.partial(scratch.add_, 1)
    print(
        f"\nwrite, {args.dtype}, hidden {hidden}, {layers} aux layers "
        f"(us per call{', caches evicted before each' if args.cold else ''})"
    )
    bodies = ("copy_rows", "scatter_layers")
    names = ("op", "direct", "per_layer", *bodies)
    print(
        f"{'tokens':>6} " + " ".join(f"{n:>22s}" for n in names) + "  per_layer/direct"
    )
    for n in args.sizes:
        args_n = inputs(n)
        calls = {
            "op": write_op.op,
            "direct": write_op.write_hidden_states,
            "per_layer": cache_write.write_per_layer,
            "scatter_layers": cache_write.scatter_layers,
        }
        cases = {name: functools.partial(f, *args_n) for name, f in calls.items()}
        cases["copy_rows"] = functools.partial(_copy_rows, *args_n)
        number = max(args.number // n // (10 if args.cold else 1), 5)
        got = timed(cases, args.rounds, number, evict)
        ratio = statistics.median(got["per_layer"]) / statistics.median(got["direct"])
        print(f"{n:6d} " + " ".join(f"{shown(got[k]):>22s}" for k in names)
              + f"  {ratio:.2f}")  # fmt: skip


def _copy_rows(aux, cache, slots) -> None:
    cache_write.copy_rows(aux, cache, slots.tolist())


if __name__ == "__main__":
    main()
