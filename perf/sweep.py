"""Time the extract_hidden_states step, mode by mode, across token counts.

    python perf/sweep.py                       # defaults for this machine
    python perf/sweep.py --engine kernel --sizes 1 3 64 300 4096 --out out/k.csv

Writes a CSV (schema: perf/report.py, documented in perf/README.md), a PNG
and a ``.meta.json`` next to it, and prints a short table. Every input is
checked before anything is allocated or timed; Ctrl-C writes the sizes that
finished. ``python perf/sweep.py --help`` lists the options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import functools
import logging
import math
import os
import signal
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from cg_extract.capture_sizes import CaptureSizes, default_capture_sizes
from perf import machine, report
from perf.engines import (
    ENGINE_MODULES,
    REFERENCE_MODE,
    VLLM_DTYPES,
    Engine,
    Params,
    Runner,
    caches_equal,
    default_modes,
    engine_modes,
    engine_module,
    estimate_bytes,
)
from perf.measure import (
    Timings,
    copy_bandwidth,
    count_launches,
    count_step,
    graph_steps_kept,
    interleaved_schedule,
    synchronize,
    time_steps,
)
from perf.nvml import NvmlSampler, nvml_index
from tests.model_families import FAMILIES, family_config
from vllm_on_cpu.harness import DTYPES


@dataclass(frozen=True)
class Defaults:
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    hidden_size: int
    layers: tuple[int, ...]


# A GPU sweep covers vLLM's default capture range (to 512) and beyond; the CPU
# one keeps `make sweep` under a minute on two cores.
DEFAULTS = {
    "cuda": Defaults(
        sizes=(1, 2, 3, 4, 8, 16, 32, 64, 100, 128, 256, 300, 512, 1024, 4096),
        iters=200,
        warmup=10,
        hidden_size=4096,
        layers=(1, 2, 3, 4),
    ),
    "cpu": Defaults(
        sizes=(1, 3, 8, 32, 100, 256, 300, 1024, 4096),
        iters=100,
        warmup=3,
        hidden_size=1024,
        layers=(1, 2, 3),
    ),
    # Whole-engine runs: sizes are prompts per run (vLLM's hidden-state
    # benchmark: 64 prompts, 8 clients); the hidden size is the model's own.
    "vllm": Defaults(
        sizes=(64,), iters=3, warmup=1, hidden_size=0, layers=(1, 2, 3, 4)
    ),
    # The tiny dummy model through the CPU engine: a minute or two.
    "vllm-cpu": Defaults(
        sizes=(16,), iters=2, warmup=0, hidden_size=0, layers=(1, 2, 3)
    ),
}
# --engine vllm: (prompt length, decode tokens) by device.
VLLM_LENGTHS = {"cuda": (2048, 128), "cpu": (64, 16)}
# The model column of a run on the tiny model (its folder is temporary).
DUMMY_MODEL = "tiny dummy Llama (vllm_on_cpu.harness.write_model_dir)"
KERNEL_BLOCK_SIZE = 16
# The copy that measures the bandwidth floor: large enough to leave every cache.
COPY_BYTES = {"cuda": 2**30, "cpu": 2**28}
# Fraction of available memory the sweep may plan to use.
MEMORY_HEADROOM = 0.8
REFUSED = 2
INTERRUPTED = 130


# --------------------------------------------------------------------------
# Command line


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (>= 1)")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def all_modes() -> list[str]:
    return list(dict.fromkeys(m for e in ENGINE_MODULES for m in engine_modes(e)))


def _epilog() -> str:
    """Each engine's modes, and the defaults that depend on the device."""
    lines = []
    for name in ENGINE_MODULES:
        modes = engine_module(name).MODES
        described = "; ".join(f"{m}: {spec.summary}" for m, spec in modes.items())
        lines.append(f"{name} modes: {described}.")
    cuda, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    names = ("iters", "warmup", "hidden_size", "layers")
    lines.append(
        "Defaults by device (cuda / cpu): "
        + ", ".join(
            f"--{name.replace('_', '-')} {_show(getattr(cuda, name))} / "
            f"{_show(getattr(cpu, name))}"
            for name in names
        )
        + "."
    )
    return "\n\n".join(textwrap.fill(line, width=79) for line in lines)


def _show(value: object) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perf/sweep.py",
        description=__doc__.split("\n\n")[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        nargs="+",
        choices=list(ENGINE_MODULES),
        help="speculator: real propose of real vLLM speculators; kernel: the same "
        "arithmetic in torch alone (no vLLM); vllm: a whole LLM on --model "
        "(default: speculator where vLLM imports, else kernel)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=all_modes(),
        help="modes to time, interleaved (default: every mode of the engine but "
        "vllm's split; modes this machine cannot run are left out with the reason)",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=positive_int,
        help="tokens per step (default: "
        + "; ".join(f"{d}: {' '.join(map(str, v.sizes))}" for d, v in DEFAULTS.items())
        + ")",
    )
    p.add_argument("--iters", type=positive_int, help="timed steps per mode and size")
    p.add_argument("--warmup", type=non_negative_int, help="untimed steps first")
    p.add_argument(
        "--batch",
        type=positive_int,
        default=5,
        help="steps per mode per round of the interleaving (default: 5)",
    )
    p.add_argument("--hidden-size", type=positive_int, help="the target's hidden size")
    p.add_argument(
        "--layers",
        nargs="+",
        type=non_negative_int,
        help="aux hidden-state layer ids (their count is L)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="(default: bf16; fp32 for --engine vllm on a CPU)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        help=f"the kernel engine's KV cache block (default: {KERNEL_BLOCK_SIZE}); "
        "refused with the other engines, which use vLLM's",
    )
    p.add_argument(
        "--capture-sizes",
        nargs="+",
        type=positive_int,
        help="graph sizes (default: vLLM's list for max_num_seqs=256, up to 512)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if present")
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch CPU threads (default: 1 on cpu, torch's choice on cuda). One "
        "thread keeps a busy neighbour on a shared machine from stalling every "
        "parallel op for a scheduler tick",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out/sweep.csv"),
        help="CSV path; .png and .meta.json go next to it (default: out/sweep.csv)",
    )
    p.add_argument(
        "--nvml-interval",
        type=positive_float,
        default=0.02,
        help="seconds between NVML samples (default: 0.02)",
    )
    vllm = p.add_argument_group("--engine vllm")
    vllm.add_argument(
        "--model",
        help="what vLLM's --model takes: a Hugging Face name or a local folder "
        "(required on a GPU unless --family; on a CPU a tiny dummy Llama by default)",
    )
    vllm.add_argument(
        "--family",
        # vLLM's own model classes (the residual-dtype Llamas are the tests').
        choices=sorted(f for f, c in FAMILIES.items() if "residual_dtypes" not in c),
        help="instead of --model: a tiny dummy-weight model of this family "
        "(tests/model_families.py; gpt_oss: the layout split_kv_cache_groups "
        "splits, for --modes eager split)",
    )
    vllm.add_argument(
        "--workload",
        choices=list(engine_module("vllm").WORKLOADS),
        default="prefill",
        help="prefill: max_tokens 1, as data generation and vLLM's hidden-state "
        "benchmark; decode: --max-tokens per prompt (default: prefill)",
    )
    for index, (flag, what) in enumerate(
        [
            ("--prompt-len", "tokens per prompt"),
            ("--max-tokens", "generated per prompt with --workload decode"),
        ]
    ):
        by_device = " / ".join(f"{d} {v[index]}" for d, v in VLLM_LENGTHS.items())
        vllm.add_argument(
            flag, type=positive_int, help=f"{what} (default: {by_device})"
        )
    vllm.add_argument(
        "--clients",
        type=positive_int,
        default=8,
        help="requests in flight, each reading its file back (default: 8)",
    )
    vllm.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="each mode's engine; they run one at a time (default: vLLM's; "
        "0.15 of host memory on a CPU)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything; any problem exits before allocation."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    args.engines = args.engine or [default_engine()]
    if "vllm" in args.engines:
        if args.engines != ["vllm"]:
            parser.error(
                "run --engine vllm on its own: its sizes count prompts per "
                "generate call, not tokens per step"
            )
        _check_vllm(parser, args)
    elif args.dtype is None:
        args.dtype = "bf16"
    defaults = DEFAULTS[
        ("vllm" if args.device == "cuda" else "vllm-cpu")
        if args.engines == ["vllm"]
        else args.device
    ]
    for name in ("sizes", "iters", "warmup", "hidden_size", "layers"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    _check_modes(parser, args)
    _check_shape(parser, args)
    _check_memory(parser, args)
    _check_output(parser, args.out)
    return args


def _check_vllm(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The whole engine's own options; then this process is made ready for
    it (on a CPU that must happen before vLLM is imported)."""
    args.dummy_model = args.model is None
    if args.model and args.family:
        parser.error("--model or --family, not both")
    if args.dummy_model and not args.family and args.device == "cuda":
        parser.error(
            "--engine vllm on a GPU needs --model (a name or folder, as vLLM's "
            "--model takes) or --family; the tiny dummy Llama is for CPUs"
        )
    prompt_len, decode_tokens = VLLM_LENGTHS[args.device]
    args.prompt_len = args.prompt_len or prompt_len
    if args.workload == "prefill":
        if args.max_tokens not in (None, 1):
            parser.error(
                f"--max-tokens {args.max_tokens}: --workload prefill generates "
                "one token per prompt; use --workload decode"
            )
        args.max_tokens = 1
    args.max_tokens = args.max_tokens or decode_tokens
    if args.dtype is None and args.family:
        family_dtype = family_config(args.family)["torch_dtype"]
        args.dtype = {v: k for k, v in VLLM_DTYPES.items()}[family_dtype]
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    gmu = args.gpu_memory_utilization
    if gmu is not None and not 0 < gmu <= 1:
        parser.error(f"--gpu-memory-utilization {gmu}: must be in (0, 1]")
    engine_module("vllm").prepare(args.device)


def default_engine() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "kernel"
    return "speculator"


def _check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.modes_for = {}
    for engine in args.engines:
        known = engine_modes(engine)
        wanted = args.modes or default_modes(engine)
        unknown = [m for m in wanted if m not in known]
        if unknown:
            parser.error(
                f"engine {engine!r} has no mode {', '.join(unknown)} "
                f"(its modes: {', '.join(known)})"
            )
        if engine == "vllm":  # the references first: see perf/vllm_engine.py
            wanted = [m for m in known if m in wanted]
        args.modes_for[engine] = list(dict.fromkeys(wanted))


def _check_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("sizes", "layers"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            parser.error(f"--{name} has duplicates: {' '.join(map(str, values))}")
    head_dim = engine_module("speculator").HEAD_DIM
    if "speculator" in args.engines and args.hidden_size % head_dim:
        parser.error(
            f"--hidden-size {args.hidden_size}: the speculator engine's model has "
            f"{head_dim}-wide heads, so the hidden size must be a multiple of {head_dim}"
        )
    if args.capture_sizes is None and args.engines != ["vllm"]:
        args.capture_sizes = default_capture_sizes(max(args.sizes), 256, 2)
    try:
        if args.capture_sizes is not None:  # None: vLLM's own (--engine vllm)
            args.capture_sizes = list(CaptureSizes(args.capture_sizes).sizes)
    except ValueError as why:
        parser.error(f"--capture-sizes: {why}")
    if args.block_size is None:
        args.block_size = KERNEL_BLOCK_SIZE
    elif args.engines != ["kernel"]:
        parser.error(
            f"--block-size {args.block_size}: only the kernel engine takes a block "
            f"size; {', '.join(e for e in args.engines if e != 'kernel')} uses the "
            "one vLLM picks for its config (the CSV's block_size column)"
        )


def _check_memory(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Engines run one after another: the largest must fit, with headroom."""
    if args.engines == ["vllm"]:
        return  # vLLM checks its own; asking CUDA would make a context here
    device = torch.device(args.device)
    available = machine.available_memory(device)
    if available is None:
        return
    params = make_params(args)
    needed = COPY_BYTES[device.type] * 2
    for engine in args.engines:
        runners = len(set(args.modes_for[engine]) | {REFERENCE_MODE})
        needed = max(needed, estimate_bytes(params, runners))
    if needed > MEMORY_HEADROOM * available:
        parser.error(
            f"this sweep needs about {needed / 2**30:.1f} GiB on {device.type} "
            f"(hidden {args.hidden_size} x {len(args.layers)} layers x "
            f"{max(args.sizes)} tokens, {args.dtype}) but only "
            f"{available / 2**30:.1f} GiB is available; use smaller --sizes, "
            "--hidden-size or fewer --layers"
        )


def _check_output(parser: argparse.ArgumentParser, csv_path: Path) -> None:
    if csv_path.suffix != ".csv":
        parser.error(f"--out {csv_path}: must end in .csv (the PNG goes next to it)")
    for path in (csv_path, *report.sidecar_paths(csv_path)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            existed = path.exists()
            with open(path, "a"):
                pass
            if not existed:
                path.unlink()
        except OSError as why:
            parser.error(f"--out: cannot write {path}: {why}")


def make_params(args: argparse.Namespace) -> Params:
    return Params(
        device=torch.device(args.device),
        hidden_size=args.hidden_size,
        aux_layers=tuple(args.layers),
        dtype=args.dtype,
        capture_sizes=tuple(args.capture_sizes or ()),
        max_tokens=max(args.sizes),
        block_size=args.block_size,
    )


# --------------------------------------------------------------------------
# Measuring


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    batch: int
    seed: int
    copy_bw: float  # bytes/s of a large device copy, for the floor


def measure_size(
    engine: Engine,
    num_tokens: int,
    settings: Settings,
    sampler: NvmlSampler,
    op_lists: dict[str, list[str]],
) -> list[dict[str, Any]]:
    """Check, count, warm up, then time every mode on the same inputs."""
    generator = torch.Generator().manual_seed(settings.seed + num_tokens)
    inputs = engine.make_inputs(num_tokens, generator)
    runners = engine.runners
    received = {mode: r.receive(inputs) for mode, r in runners.items()}
    steps = {
        mode: functools.partial(r.step, received[mode]) for mode, r in runners.items()
    }
    exact = {
        mode: bit_exact(engine, runner, inputs, received[mode])
        for mode, runner in runners.items()
        if runner is not engine.reference
    }
    counts = {mode: count_step(step) for mode, step in steps.items()}
    launches = {
        mode: count_launches(step, engine.device) for mode, step in steps.items()
    }
    for mode, step in steps.items():
        op_lists[f"{engine.name}/{mode}/{num_tokens}"] = [
            op.name for op in counts[mode].dispatched
        ] + [f"replayed {op.name}" for op in counts[mode].replayed]
        for _ in range(settings.warmup):
            step()
    synchronize(engine.device)

    timings = {mode: Timings() for mode in runners}
    for mode, n in interleaved_schedule(list(runners), settings.iters, settings.batch):
        with sampler.segment((engine.name, mode, num_tokens)):
            timings[mode].extend(time_steps(steps[mode], n, engine.device))

    floor_s = 2 * engine.payload_bytes(num_tokens) / settings.copy_bw
    rows = []
    for mode, t in timings.items():
        p50_s = t.percentile(50) * 1e-6
        rows.append(
            {
                "engine": engine.name,
                "mode": mode,
                "device": engine.device.type,
                "num_tokens": num_tokens,
                "padded_tokens": counts[mode].padded_tokens(num_tokens),
                **t.columns(),
                "tokens_per_s": num_tokens / p50_s,
                "ops_per_step": len(counts[mode].dispatched),
                "replayed_ops_per_step": len(counts[mode].replayed),
                "launches_per_step": launches[mode],
                "bytes_per_step": counts[mode].bytes,
                "payload_bytes": engine.payload_bytes(num_tokens),
                "bw_floor_frac": floor_s / p50_s,
                **sampler.summary((engine.name, mode, num_tokens), len(t.device_us)),
                "bit_exact": exact.get(mode),
            }
        )
    report.add_speedups(rows)
    return rows


def bit_exact(engine: Engine, runner: Runner, inputs: Any, received: Any) -> bool:
    """One step of ``runner`` (on the inputs as it receives them) and of the
    reference from zeroed caches: same cache bytes outside the null block,
    same draft tokens."""
    reference = engine.reference
    reference.reset_cache()
    runner.reset_cache()
    want = reference.step(inputs)
    got = runner.step(received)
    synchronize(engine.device)
    return caches_equal(runner.kv_cache, reference.kv_cache) and torch.equal(got, want)


def build_engine(name: str, args: argparse.Namespace) -> Engine:
    engine = engine_module(name).ENGINE(make_params(args))
    with graph_steps_kept():
        engine.build(args.modes_for[name])
    return engine


def parameter_columns(engine: Engine | None, args: argparse.Namespace):
    """The columns every row of one engine shares: what it was built for and
    the run's settings (``engine`` is None for the whole-engine ``vllm``)."""
    whole = engine is None
    return {
        "hidden_size": math.nan if whole else args.hidden_size,
        "aux_layers": " ".join(map(str, args.layers)),
        "dtype": args.dtype,
        "block_size": math.nan if whole else engine.block_size,
        "capture_sizes": " ".join(map(str, args.capture_sizes or [])),
        "model": vllm_model_name(args) if whole else "",
        "workload": args.workload if whole else "",
        "prompt_len": args.prompt_len if whole else math.nan,
        "max_tokens": args.max_tokens if whole else math.nan,
        "clients": args.clients if whole else math.nan,
        "iters": args.iters,
        "warmup": args.warmup,
        "cpu_threads": torch.get_num_threads(),
    }


def vllm_model_name(args: argparse.Namespace) -> str:
    if args.family:
        return f"tiny dummy {args.family} (tests/model_families.py)"
    return DUMMY_MODEL if args.dummy_model else args.model


# --------------------------------------------------------------------------
# Main


def start_sampler(device: torch.device, interval_s: float) -> NvmlSampler:
    if device.type != "cuda":
        sampler = NvmlSampler()
        sampler.reason = "the sweep runs on the CPU"
        return sampler
    index = nvml_index(device.index or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return NvmlSampler(index=index, interval_s=interval_s).start()


def run(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # leave an in-process caller as it was


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    # The whole engine's front end holds no device memory and makes no CUDA
    # context: vLLM's worker refuses to start unless total x
    # gpu_memory_utilization is free (vllm/v1/worker/utils.py:request_memory),
    # and the copy's 2 GiB stay in torch's cache. Its rows have no floor.
    whole_engine = args.engines == ["vllm"]
    copy_bw = (
        math.nan if whole_engine else copy_bandwidth(device, COPY_BYTES[device.type])
    )
    settings = Settings(
        tuple(args.sizes), args.iters, args.warmup, args.batch, args.seed, copy_bw
    )
    notes: dict[str, Any] = {
        "argv": args.argv,
        "skipped_modes": {},
        "copy_bandwidth_gbps": None if whole_engine else copy_bw / 1e9,
        "op_lists": {},
        "graphs": {},  # capture time and graph memory, per engine and mode
    }
    rows: list[dict[str, Any]] = []
    for name in args.engines:
        print(f"sweep: {name} engine on {device}: {MEASURES[name]}")
    sampler = start_sampler(device, args.nvml_interval)
    notes["nvml"] = "sampled" if sampler.available else sampler.reason
    # --engine vllm emits once per mode, the others once per size.
    per_engine = len(args.modes_for.get("vllm", [])) or len(args.sizes)
    progress = tqdm(total=len(args.engines) * per_engine, desc="sweep")
    interrupted = False
    try:
        for name in args.engines:
            progress.set_postfix(engine=name)
            engine = None if name == "vllm" else build_engine(name, args)
            columns = parameter_columns(engine, args)

            def emit(size_rows, columns=columns):
                rows.extend({**row, **columns} for row in size_rows)
                progress.update(1)

            if engine is None:
                engine_module("vllm").run(args, sampler, emit)
            else:
                notes["skipped_modes"][name] = engine.skipped
                notes["graphs"][name] = engine.graph_summaries()
                for size in settings.sizes if engine.runners else ():
                    emit(
                        measure_size(engine, size, settings, sampler, notes["op_lists"])
                    )
            del engine  # free its caches before the next engine
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
        sampler.close()
        notes["interrupted"] = interrupted
        if rows or interrupted:
            run_columns = machine.run_columns(device, copy_bw)
            frame = report.to_frame({**row, **run_columns} for row in rows)
            write_report(frame, args.out, notes)
    if not rows and not interrupted:
        left_out = "; ".join(
            f"{engine}/{mode}: {why}"
            for engine, skipped in notes["skipped_modes"].items()
            for mode, why in skipped.items()
        )
        print(
            f"perf/sweep.py: error: no mode can run here ({left_out})", file=sys.stderr
        )
        return REFUSED
    print_summary(frame, args.out, notes)
    return INTERRUPTED if notes["interrupted"] else 0


def write_report(frame, out: Path, notes: dict[str, Any]) -> None:
    """Write the report whole even if Ctrl-C comes meanwhile; a Ctrl-C then
    marks the notes interrupted (they are written last)."""

    def mark_interrupted(*_):
        notes["interrupted"] = True

    try:
        previous = signal.signal(signal.SIGINT, mark_interrupted)
    except ValueError:  # not the main thread, where Ctrl-C is never delivered
        previous = None
    try:
        report.write(frame, out, notes)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def print_summary(frame, out: Path, notes: dict[str, Any]) -> None:
    print()
    print(report.table(frame))
    for engine, skipped in notes["skipped_modes"].items():
        for mode, why in skipped.items():
            print(f"{engine}/{mode} left out: {why}")
    print(f"NVML: {notes['nvml']}")
    if notes["interrupted"]:
        print(f"interrupted: wrote the {len(frame)} rows that finished")
    png, meta = report.sidecar_paths(out)
    print(f"wrote {out}, {png}, {meta}")


# The sweep's first lines: what is timed, before vLLM's own lines (about an
# engine the speculator and kernel engines never start) can suggest otherwise.
MEASURES = {
    "speculator": "the propose() of vLLM's extract_hidden_states speculator and "
    "of cg_extract's, called directly (no vLLM engine or model runner starts)",
    "kernel": "the speculator step's cache write in torch alone (no vLLM)",
    "vllm": "whole vLLM engines serving clients (AsyncLLM), with vLLM's "
    "extract_hidden_states speculator and with cg_extract's",
}


def main(argv: list[str] | None = None) -> int:
    # vLLM's warnings here concern engine settings the sweep chose (runner,
    # Triton, scheduling); VLLM_LOGGING_LEVEL=WARNING shows them.
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        # Logged at vLLM's import, before its level applies.
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
