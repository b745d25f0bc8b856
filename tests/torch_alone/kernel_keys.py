"""How many specialisations of the Triton write kernel ``perf/gpu_check.sh``
compiles, and how long compiling them cold for sm_90 takes, with no GPU.

    python -m tests.torch_alone.kernel_keys [--compile]

Each launch is keyed by Triton's own binder for a ``GPUTarget("cuda", 90,
32)`` (dtypes, ints equal to 1, 16-divisible ints and addresses, tuple
lengths, ``BLOCK_H``): one compile per distinct key. The launches are recorded
on CPU: every call of the write op's CPU body gets the tensors the CUDA body
would launch the kernel with (same strides, same offsets; both allocators
align to far more than 16 bytes). What runs: the cases of
``tests/cuda/test_write_kernel_cuda.py``, the emulated twin of every other
``cuda``-marked test (same test, ``emulated`` for ``cuda`` in its id), and the
``kernel`` engine's modes at the settings of the two CUDA sweeps of
``tests/cuda/test_sweep_cuda.py`` and of the check's own sweep. ``--compile`` compiles
each key once, into a fresh Triton cache, and times it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from cg_extract import cache_write, write_kernel

ROOT = Path(__file__).resolve().parents[2]
SM90 = GPUTarget("cuda", 90, 32)


class KernelKeys:
    """The distinct compiles of the write kernel a set of launches needs,
    keyed as Triton's JIT keys them (``JITFunction.run``)."""

    def __init__(self, target: GPUTarget = SM90):
        self.kernel = write_kernel._write_kernel
        self.target = target
        self.backend = make_backend(target)
        self.binder = create_function_from_signature(
            self.kernel.signature, self.kernel.params, self.backend
        )
        self.compiles: dict[str, tuple] = {}  # key -> what triton.compile takes
        self.source = "?"
        self.sources: dict[str, set[str]] = {}  # key -> where it was launched

    def add(self, aux, kv_cache, slot_mapping) -> None:
        if slot_mapping.shape[0] == 0:
            return  # no launch
        _, args, kwargs = write_kernel.launch_args(aux, kv_cache, slot_mapping)
        kwargs |= {
            "debug": knobs.runtime.debug,
            "instrumentation_mode": knobs.compilation.instrumentation_mode,
        }
        bound, specialization, options = self.binder(*args, **kwargs)
        key = repr((specialization, options))
        if key not in self.compiles:
            self.compiles[key] = self.kernel._pack_args(
                self.backend, kwargs, bound, specialization, options
            )
        self.sources.setdefault(key, set()).add(self.source)

    def compile_times(self) -> list[float]:
        """Seconds per key, each compiled once into the (fresh) cache."""
        times = []
        for options, signature, constexprs, attrs in self.compiles.values():
            start = time.perf_counter()
            triton.compile(
                ASTSource(self.kernel, signature, constexprs, attrs),
                target=self.target,
                options=options.__dict__,
            )
            times.append(time.perf_counter() - start)
        return times


@contextmanager
def recording(keys: KernelKeys):
    original = cache_write.write_owned_slots

    def record(aux, kv_cache, slot_mapping):
        keys.add(aux, kv_cache, slot_mapping)
        original(aux, kv_cache, slot_mapping)

    cache_write.write_owned_slots = record
    try:
        yield
    finally:
        cache_write.write_owned_slots = original


class EmulatedTwins:
    """A pytest plugin: runs only the emulated twin of each cuda test."""

    def pytest_collection_modifyitems(self, config, items):
        cuda = {item.nodeid for item in items if "cuda" in item.keywords}
        twins = [
            item
            for item in items
            if "emulated" in item.nodeid
            and item.nodeid.replace("emulated", "cuda") in cuda
        ]
        config.hook.pytest_deselected(items=[i for i in items if i not in twins])
        items[:] = twins


def kernel_test_launches(keys: KernelKeys) -> None:
    from tests.cuda import test_write_kernel_cuda as kernel_tests

    for case_args in kernel_tests.CUDA_CASES:
        case = kernel_tests.cuda_case(*case_args)
        keys.add(case.aux, case.fresh_cache(), case.slots)
    case = kernel_tests.graph_case(0, [])
    aux = [a.clone() for a in case.aux]  # as the graph test's static inputs
    keys.add(aux, case.fresh_cache(), case.slots)
    case = kernel_tests.strided_slots_case()
    keys.add(case.aux, case.fresh_cache(), kernel_tests.strided_view(case.slots))


def sweep_launches(argv: list[str], modes=None) -> None:
    """One step of each ``kernel`` mode at each size, graph modes emulated,
    at the settings ``perf/sweep.py ARGV`` would use on CUDA."""
    from perf import sweep
    from perf.kernel_engine import KernelEngine
    from perf.measure import graph_steps_kept

    cuda = sweep.DEFAULTS["cuda"]
    defaults = [
        "--sizes",
        *map(str, cuda.sizes),
        "--hidden-size",
        str(cuda.hidden_size),
    ]
    defaults += ["--layers", *map(str, cuda.layers)]
    args = sweep.parse_args([*defaults, *argv, "--device", "cpu", "--engine", "kernel"])
    engine = KernelEngine(sweep.make_params(args), graph_backend="emulated")
    with graph_steps_kept():
        engine.build(modes or args.modes_for["kernel"])
    for n in args.sizes:
        inputs = engine.make_inputs(n, torch.Generator().manual_seed(n))
        for runner in engine.runners.values():
            runner.step(runner.receive(inputs))


SOURCES = (
    "perf/gpu_check.sh's kernel sweep",
    "tests/cuda/test_write_kernel_cuda.py",
    "emulated twins of the other cuda tests",
    "tests/cuda/test_sweep_cuda.py",
)


def check_launches(keys: KernelKeys) -> None:
    from tests.torch_alone import test_sweep

    keys.source = SOURCES[0]
    sweep_launches([])
    keys.source = SOURCES[1]
    kernel_test_launches(keys)
    keys.source = SOURCES[2]
    plugins = [EmulatedTwins()]
    if pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins) != 0:
        raise SystemExit("an emulated twin failed")
    keys.source = SOURCES[3]
    p = test_sweep.params()
    sweep_launches(
        ["--sizes", "1", "3", "16", "40", "--hidden-size", str(p.hidden_size)]
        + ["--layers", *map(str, p.aux_layers), "--capture-sizes"]
        + [*map(str, p.capture_sizes)],
        modes=["upstream", "eager", "graph"],
    )
    sweep_launches(["--sizes", "3", "16", "600", *test_sweep.TINY])


def main() -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_keys_")
    keys = KernelKeys()
    with recording(keys):
        check_launches(keys)
    print(f"{len(keys.compiles)} specialisations of the write kernel for sm_90:")
    seen: set[str] = set()
    for source in SOURCES:
        used = {key for key, where in keys.sources.items() if source in where}
        print(f"  {len(used):3} launched by {source} ({len(used - seen)} new)")
        seen |= used
    if "--compile" in sys.argv:
        times = keys.compile_times()
        print(
            f"cold compile for sm_90, Triton {triton.__version__}, one process: "
            f"{sum(times):.1f} s in all, median {sorted(times)[len(times) // 2]:.2f} s, "
            f"max {max(times):.2f} s"
        )


if __name__ == "__main__":
    main()
