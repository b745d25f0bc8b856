"""Ops and bytes per step of every ``kernel`` mode, graph modes included, on a
machine without CUDA: the graph modes run on the emulated backend, so this
prints counts only, never timings (an emulated replay re-runs Python).
``block 0``: whether the step wrote the null block (a padded graph size sends
its padded rows to slot -1).

    python perf/emulated_counts.py [--sizes 1 8 100 256 1024]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

import argparse  # noqa: E402

import torch  # noqa: E402

from perf.engines import Params  # noqa: E402
from perf.kernel_engine import KernelEngine  # noqa: E402
from perf.measure import count_step, graph_steps_kept  # noqa: E402

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Block 0 holds this before each step; any write there (zeros included) shows.
SENTINEL = 1.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 100, 256, 1024])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args(argv)
    params = Params(
        torch.device("cpu"),
        args.hidden_size,
        tuple(args.layers),
        "bf16",
        CAPTURE_SIZES,
        max(args.sizes),
    )
    engine = KernelEngine(params, graph_backend="emulated")
    with graph_steps_kept():
        engine.build(KernelEngine.MODES)
    print(f"{'mode':14} {'tokens':>6} {'dispatched':>10} {'moving':>6} "
          f"{'replayed':>8} {'bytes/step':>11} {'/ 2x payload':>12} {'block 0':>7}")  # fmt: skip
    for n in args.sizes:
        inputs = engine.make_inputs(n, torch.Generator().manual_seed(n))
        for mode, runner in engine.runners.items():
            received = runner.receive(inputs)
            runner.reset_cache()
            runner.kv_cache[0].fill_(SENTINEL)  # no real token's slot is there
            count = count_step(lambda r=runner, x=received: r.step(x))
            clean = bool((runner.kv_cache[0] == SENTINEL).all())
            runner.reset_cache()
            moving = sum(1 for op in count.dispatched if op.bytes)
            floor = 2 * engine.payload_bytes(n)
            print(f"{mode:14} {n:6} {len(count.dispatched):10} {moving:6} "
                  f"{len(count.replayed):8} {count.bytes:11} {count.bytes / floor:12.3f} "
                  f"{'clean' if clean else 'written':>7}")  # fmt: skip


if __name__ == "__main__":
    main()
