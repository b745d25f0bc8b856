"""perf/sweep.py: schema, interleaving, measurement, bad inputs, Ctrl-C.

Imports no vLLM at module import: `perf/gpu_check.sh` runs the cuda-marked
tests that import it (tests/cuda/test_sweep_cuda.py) on a GPU machine without it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from cg_extract.cache_write import write_stacked
from perf import report, sweep
from perf.engines import Engine, Mode, Params, Runner, caches_equal
from perf.kernel_engine import KernelEngine
from perf.measure import count_step, graph_steps_kept, interleaved_schedule
from perf.nvml import NvmlSampler

REPO = Path(__file__).resolve().parents[2]
ISSUE_COLUMNS = [
    *("engine", "mode", "device", "num_tokens", "padded_tokens"),
    *("p50_us", "p90_us", "p99_us", "host_us", "tokens_per_s", "speedup_vs_upstream"),
    *("ops_per_step", "bytes_per_step", "bw_floor_frac", "gpu_util_pct"),
    *("gpu_mem_used_mib", "power_w", "sm_clock_mhz", "energy_mj_per_step", "bit_exact"),
]
TINY = ["--hidden-size", "128", "--layers", "1", "2", "--iters", "4", "--warmup", "1"]


def params(device="cpu", max_tokens=40, dtype="fp32") -> Params:
    return Params(
        device=torch.device(device),
        hidden_size=128,
        aux_layers=(1, 2, 3),
        dtype=dtype,
        capture_sizes=(1, 2, 4, 8, 16),
        max_tokens=max_tokens,
    )


def settings(sizes=(3,), iters=6, batch=2) -> sweep.Settings:
    return sweep.Settings(
        sizes=sizes, iters=iters, warmup=1, batch=batch, seed=0, copy_bw=1e10
    )


def read_csv(path: Path) -> pd.DataFrame:
    frame = pd.read_csv(path)
    assert list(frame.columns) == report.COLUMNS
    return frame


# --------------------------------------------------------------------------
# Schema


def test_schema_has_the_required_columns_once():
    assert len(set(report.COLUMNS)) == len(report.COLUMNS)
    assert set(ISSUE_COLUMNS) <= set(report.COLUMNS)
    assert set(report.TABLE) <= set(report.COLUMNS)


def test_readme_documents_every_column():
    readme = (REPO / "perf" / "README.md").read_text()
    schema = readme.split("## CSV schema")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `(\w+)` \|", schema, flags=re.M)
    assert documented == report.COLUMNS  # every column, in the CSV's order


def test_rows_outside_the_schema_are_refused():
    with pytest.raises(ValueError, match="outside the schema"):
        report.to_frame([{"engine": "x", "latency": 1}])


# --------------------------------------------------------------------------
# Interleaving


def test_schedule_rotates_the_first_mode_each_round():
    assert interleaved_schedule(["a", "b", "c"], iters=25, batch=10) == [
        ("a", 10), ("b", 10), ("c", 10),
        ("b", 10), ("c", 10), ("a", 10),
        ("c", 5), ("a", 5), ("b", 5),
    ]  # fmt: skip


@pytest.mark.parametrize(("iters", "batch"), [(1, 10), (7, 3), (30, 30), (31, 4)])
def test_schedule_gives_every_mode_its_iterations(iters, batch):
    schedule = interleaved_schedule(["a", "b"], iters, batch)
    for mode in "ab":
        assert sum(n for m, n in schedule if m == mode) == iters
    # never two batches of one mode in a row within a round pair
    modes = [m for m, _ in schedule]
    assert all(len(set(modes[i : i + 2])) == 2 for i in range(0, len(modes), 2))


class RecordingRunner(Runner):
    """Writes like the kernel engine's eager mode and logs each step."""

    def __init__(self, engine: RecordingEngine, mode: str):
        self.mode = mode
        self.log = engine.log
        self.kv_cache = torch.zeros(5, 1, 4, 2)

    def step(self, inputs):
        self.log.append(self.mode)
        hidden, slots = inputs
        write_stacked(hidden, self.kv_cache, slots)
        return slots[:1]


class RecordingEngine(Engine):
    name = "recording"
    MODES = {
        m: Mode(m, lambda engine, m=m: RecordingRunner(engine, m))
        for m in ("upstream", "eager", "graph")
    }

    def __init__(self):
        super().__init__(params(max_tokens=8))
        self.block_size = 4
        self.log: list[str] = []

    def make_inputs(self, num_tokens, generator):
        hidden = torch.randn(num_tokens, 1, 2, generator=generator)
        return hidden, torch.arange(num_tokens) + 4


def test_timed_steps_run_in_schedule_order():
    engine = RecordingEngine()
    engine.build(["upstream", "eager", "graph"])
    rows = sweep.measure_size(engine, 3, settings(iters=5, batch=2), NvmlSampler(), {})
    schedule = interleaved_schedule(["upstream", "eager", "graph"], 5, 2)
    timed = [mode for mode, n in schedule for _ in range(n)]
    assert engine.log[-len(timed) :] == timed
    assert [r["mode"] for r in rows] == ["upstream", "eager", "graph"]
    assert [r["bit_exact"] for r in rows] == [None, True, True]
    assert rows[1]["speedup_vs_upstream"] == rows[0]["p50_us"] / rows[1]["p50_us"]
    assert all(math.isnan(r["gpu_util_pct"]) for r in rows)  # no NVML: NaN


# --------------------------------------------------------------------------
# What a step is measured to do


def test_bytes_model_on_the_ops_of_a_cache_write():
    cache = torch.zeros(4, 3, 8, 16)
    hidden = torch.randn(5, 3, 16)
    slots = torch.tensor([8, 9, 17, 30, -1])
    count = count_step(lambda: write_stacked(hidden, cache, slots))
    by_op = {op.name: op.bytes for op in count.dispatched}
    slot_bytes = 5 * 8
    payload = 5 * 3 * 16 * 4
    assert by_op["aten.clamp_min.default"] == 2 * slot_bytes
    # the scatter reads the values and both index tensors, writes what it selects
    assert by_op["aten.index_put_.default"] == payload + 2 * slot_bytes + payload
    assert count.padded_tokens(5) == 5 and not count.replayed


def test_bytes_model_views_allocations_copies():
    x = torch.zeros(10, 4)
    y = torch.ones(10, 4)

    def op_bytes(fn):
        return count_step(fn).bytes

    assert op_bytes(lambda: x[2:5]) == 0
    assert op_bytes(lambda: torch.empty(100)) == 0
    assert op_bytes(lambda: x.copy_(y)) == 2 * 160
    assert op_bytes(lambda: x[:3].fill_(1)) == 48  # a view, then a write
    assert op_bytes(lambda: y[torch.tensor([1, 2])]) == 2 * 32 + 16
    assert op_bytes(lambda: torch.stack([y, y], out=torch.empty(2, 10, 4))) == 4 * 160


def build_kernel(backend: str, device="cpu") -> KernelEngine:
    engine = KernelEngine(params(device), graph_backend=backend)
    with graph_steps_kept():
        engine.build(["upstream", "eager", "graph", "graph_copy_in"])
    return engine


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17, 40])
def test_kernel_graph_path_is_bit_exact_emulated(num_tokens):
    """The graph runner's copy-in and padding, checked with the emulated
    backend (never timed, never in a CSV)."""
    engine = build_kernel("emulated")
    inputs = engine.make_inputs(num_tokens, torch.Generator().manual_seed(1))
    for runner in engine.runners.values():
        assert sweep.bit_exact(engine, runner, inputs, runner.receive(inputs))
    expected_pad = {1: 1, 3: 4, 16: 16, 17: 17, 40: 40}[num_tokens]
    for mode in ("graph", "graph_copy_in"):
        runner = engine.runners[mode]
        received = runner.receive(inputs)
        graph = count_step(lambda runner=runner, r=received: runner.step(r))
        assert graph.padded_tokens(num_tokens) == expected_pad
        assert bool(graph.replayed) == (num_tokens <= 16)
        assert caches_equal(runner.kv_cache, engine.reference.kv_cache)


@pytest.mark.parametrize("num_tokens", [1, 8, 16])
def test_zero_copy_replay_is_the_only_write_work(num_tokens):
    """With inputs in the target's persistent buffers and a captured size,
    the step dispatches only the draft-token gather; the replay moves each
    hidden-state byte once in and once out (plus slot indices)."""
    engine = build_kernel("emulated")
    inputs = engine.make_inputs(num_tokens, torch.Generator().manual_seed(4))
    graph = engine.runners["graph"]
    received = graph.receive(inputs)
    count = count_step(lambda: graph.step(received))
    moving = [op.name for op in count.dispatched if op.bytes]  # views move nothing
    assert moving == ["aten.index.Tensor"]
    payload = engine.payload_bytes(num_tokens)
    (replayed_write,) = count.replayed  # the write op, nothing else
    assert replayed_write.name == "cg_extract.write_hidden_states.default"
    assert replayed_write.bytes == 2 * payload + num_tokens * 8  # int64 slots
    copy_in = engine.runners["graph_copy_in"]
    assert len(count_step(lambda: copy_in.step(inputs)).dispatched) > 1


def test_a_different_cache_is_not_bit_exact():
    engine = build_kernel("emulated")
    inputs = engine.make_inputs(3, torch.Generator().manual_seed(1))
    eager = engine.runners["eager"]
    original = eager.step

    def off_by_one(inputs):
        draft = original(inputs)
        eager.kv_cache[1, 0, 0, 0] += 1
        return draft

    eager.step = off_by_one
    assert not sweep.bit_exact(engine, eager, inputs, eager.receive(inputs))


def test_graph_mode_needs_cuda_and_says_so():
    engine = build_kernel("cuda")
    assert "graph" not in engine.runners
    assert "CUDA device" in engine.skipped["graph"]


# --------------------------------------------------------------------------
# Bad input: each refused before anything is timed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "nope"], "invalid choice: 'nope'"),
        (["--engine", "kernel", "--modes", "fast"], "invalid choice: 'fast'"),
        (["--sizes", "4", "0"], "0 is not a positive integer"),
        (["--sizes", "-3"], "-3 is not a positive integer"),
        (["--iters", "0"], "0 is not a positive integer"),
        (["--layers", "1", "1"], "--layers has duplicates"),
        (["--sizes", "1", "1"], "--sizes has duplicates: 1 1"),
        (["--engine", "speculator", "--hidden-size", "100"], "multiple of 64"),
        (
            ["--engine", "kernel", "--hidden-size", "1048576", "--sizes", "65536"],
            "GiB is available",
        ),
        (["--engine", "kernel", "--out", "x.txt"], "must end in .csv"),
        (["--engine", "kernel", "--capture-sizes", "4", "4"], "duplicates"),
        (["--nvml-interval", "0"], "0 is not a positive number of seconds"),
        (["--nvml-interval", "-0.5"], "-0.5 is not a positive number of seconds"),
        (["--nvml-interval", "nan"], "nan is not a positive number of seconds"),
        (["--nvml-interval", "inf"], "inf is not a positive number of seconds"),
        (
            ["--engine", "speculator", "--block-size", "32"],
            "--block-size 32: only the kernel engine takes a block size; speculator",
        ),
        (
            ["--engine", "speculator", "kernel", "--block-size", "16"],
            "--block-size 16: only the kernel engine",
        ),
    ],
)
def test_bad_input_is_refused_with_a_message(argv, message, capsys, tmp_path):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "s.csv")]
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_capture_sizes_are_stored_sorted_and_the_kernel_block_size_honoured(
    tmp_path,
):
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--sizes", "3", "--capture-sizes", "8", "4", "1"]
    args = sweep.parse_args([*argv, "--out", str(out)])
    assert args.capture_sizes == [1, 4, 8] and args.block_size == 16
    assert sweep.main([*argv, "--block-size", "8", "--out", str(out), *TINY]) == 0
    frame = read_csv(out)
    assert set(frame["capture_sizes"]) == {"1 4 8"} and set(frame["block_size"]) == {8}


def test_unwritable_output_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        sweep.parse_args(["--engine", "kernel", "--out", str(blocker / "s.csv")])
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "kernel", "--device", "cuda"], "no CUDA device"),
    ],
)
def test_no_cuda_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(argv)
    assert exit_info.value.code != 0
    assert message in str(exit_info.value.code) + capsys.readouterr().err


# --------------------------------------------------------------------------
# Whole runs


def test_kernel_sweep_writes_csv_png_meta_and_table(tmp_path, capsys):
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--sizes", "1", "3", "40", "--out", str(out)]
    assert sweep.main([*argv, *TINY]) == 0
    frame = read_csv(out)
    assert len(frame) == 9  # 3 eager modes x 3 sizes; graph left out on CPU
    assert set(frame["mode"]) == {"upstream", "eager", "per_layer"}
    assert frame.loc[frame["mode"] != "upstream", "bit_exact"].all()
    assert frame["gpu_util_pct"].isna().all()  # no NVML on CPU: empty, not 0
    assert (frame["ops_per_step"] > 0).all()
    assert (frame["bytes_per_step"] >= 2 * frame["payload_bytes"]).all()
    notes = json.loads(out.with_suffix(".meta.json").read_text())
    assert "CUDA device" in notes["skipped_modes"]["kernel"]["graph"]
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "kernel/graph left out" in printed and "speedup_vs_upstream" in printed


def test_ctrl_c_keeps_the_finished_sizes(tmp_path, monkeypatch):
    make_inputs = KernelEngine.make_inputs

    def interrupted_at_8(self, num_tokens, generator):
        if num_tokens == 8:
            raise KeyboardInterrupt
        return make_inputs(self, num_tokens, generator)

    monkeypatch.setattr(KernelEngine, "make_inputs", interrupted_at_8)
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--sizes", "1", "3", "8", "16", "--out", str(out)]
    assert sweep.main([*argv, *TINY]) == sweep.INTERRUPTED
    assert sorted(set(read_csv(out)["num_tokens"])) == [1, 3]
    assert json.loads(out.with_suffix(".meta.json").read_text())["interrupted"]


def test_ctrl_c_while_the_report_is_written_keeps_the_rows(tmp_path, monkeypatch):
    plot = report.plot
    # Python's own handler, or SIG_IGN in a job a shell started without job
    # control: the sweep must give back whichever it found.
    before = signal.getsignal(signal.SIGINT)

    def interrupted_plot(*args):
        os.kill(os.getpid(), signal.SIGINT)  # the real signal, as a user sends it
        plot(*args)

    monkeypatch.setattr(report, "plot", interrupted_plot)
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--sizes", "1", "3", "--out", str(out)]
    assert sweep.main([*argv, *TINY]) == sweep.INTERRUPTED
    assert sorted(set(read_csv(out)["num_tokens"])) == [1, 3]
    assert out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.with_suffix(".meta.json").read_text())["interrupted"]
    assert signal.getsignal(signal.SIGINT) is before


def test_one_mode_without_upstream_writes_its_plot(tmp_path):
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--modes", "eager", "--sizes", "1", "3"]
    assert sweep.main([*argv, "--out", str(out), *TINY]) == 0
    frame = read_csv(out)
    assert set(frame["mode"]) == {"eager"} and frame["speedup_vs_upstream"].isna().all()
    assert out.with_suffix(".png").stat().st_size > 0


def test_no_mode_that_can_run_is_refused_with_the_reason(tmp_path, capsys):
    out = tmp_path / "k.csv"
    argv = ["--engine", "kernel", "--modes", "graph", "--device", "cpu", "--sizes", "3"]
    assert sweep.main([*argv, "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert "no mode can run here (kernel/graph: real CUDA graphs need a CUDA" in err
    assert not out.exists()  # no header-only CSV


def test_plot_titles_the_engines_reference_and_keeps_each_series_colour(
    tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    frame = pd.read_csv(REPO / "perf" / "baselines" / "cpu.csv")
    for engines, title in [
        (["kernel"], "Speedup vs vLLM's arithmetic in torch"),
        (["speculator"], "Speedup vs vLLM's own speculator"),
        (["speculator", "kernel"], "Speedup vs each engine's upstream"),
    ]:
        report.plot(frame[frame["engine"].isin(engines)], tmp_path / "p.png")
        latency, speedup = figures.pop().axes
        assert speedup.get_title() == title
        colours = {line.get_label(): line.get_color() for line in latency.lines}
        assert len(set(colours.values())) == len(colours) == 2 * len(engines)
        plotted = [line for line in speedup.lines if line.get_label() in colours]
        assert {line.get_label() for line in plotted} == {
            f"{engine}/eager" for engine in engines
        }
        assert all(colours[line.get_label()] == line.get_color() for line in plotted)


def test_plot_says_which_modes_were_left_out_and_why(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    frame = pd.read_csv(REPO / "perf" / "baselines" / "cpu.csv")
    why = "real CUDA graphs need a CUDA device; this run is on cpu"
    left_out = {
        e: {"graph": why, "graph_copy_in": why} for e in ("speculator", "kernel")
    }
    report.plot(frame, tmp_path / "p.png", left_out)
    (note,) = [t.get_text() for t in figures.pop().texts if "Left out" in t.get_text()]
    assert note == (
        "Left out: speculator/graph, speculator/graph_copy_in, kernel/graph, "
        f"kernel/graph_copy_in: {why}"
    )
    report.plot(frame, tmp_path / "p.png")
    assert not [t for t in figures.pop().texts if "Left out" in t.get_text()]


def test_plot_says_what_was_measured_where_and_reads_its_axes(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    frame = pd.read_csv(REPO / "perf" / "baselines" / "cpu.csv")
    report.plot(frame, tmp_path / "p.png")
    figure = figures.pop()
    first = frame.iloc[0]
    assert figure._suptitle.get_text() == (
        "extract_hidden_states, sweep engine speculator, kernel: p50 of "
        f"{first['iters']} iterations per mode and size ({first['warmup']} warm-up), "
        f"CPU threads: {first['cpu_threads']}\n{first['device_name']} | "
        f"{first['dtype']}, hidden {first['hidden_size']}, aux layers "
        f"{first['aux_layers']} | {first['vllm_version']}, commit "
        f"{first['git_commit']}"
    )
    latency, speedup = figure.axes
    assert speedup.get_yscale() == latency.get_yscale() == "log"  # as documented
    (one,) = [line for line in speedup.lines if list(line.get_ydata()) == [1, 1]]
    assert one.get_label() == "1.0: as fast as upstream"
    legend = [t.get_text() for t in speedup.get_legend().get_texts()]
    assert "1.0: as fast as upstream" in legend


def test_csv_floats_are_rounded_and_the_table_has_one_number_format(tmp_path):
    frame = pd.read_csv(REPO / "perf" / "baselines" / "cpu.csv")
    frame.loc[0, "p50_us"] = 56.21800005428668
    frame.loc[0, "tokens_per_s"] = 17834.56789
    report.write(frame, tmp_path / "r.csv", {})
    written = pd.read_csv(tmp_path / "r.csv")
    assert written.loc[0, "p50_us"] == 56.22
    assert written.loc[0, "tokens_per_s"] == 17830
    assert "56.218" not in (tmp_path / "r.csv").read_text()
    assert (written["ops_per_step"] == frame["ops_per_step"]).all()  # ints kept
    table = report.table(frame)
    assert "e+" not in table and "17,835" in table
    upstream = [line.split() for line in table.splitlines() if " upstream " in line]
    assert upstream and all(row[-1] == "(ref)" for row in upstream)


def test_kernel_engine_runs_without_vllm(tmp_path):
    """What a GPU machine without vLLM does: vLLM cannot be imported at all."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from perf import sweep\n"
        f"argv = ['--sizes', '2', '--out', {str(tmp_path / 'k.csv')!r}, *{TINY!r}]\n"
        "assert sweep.main(argv) == 0\n"
        "assert not any(m.split('.')[0] == 'vllm' and sys.modules[m] for m in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(read_csv(tmp_path / "k.csv")["engine"]) == {"kernel"}


@pytest.fixture(scope="module")
def vllm_available():
    pytest.importorskip("vllm")


def test_speculator_sweep_is_bit_exact(tmp_path, vllm_available):
    out = tmp_path / "s.csv"
    argv = ["--engine", "speculator", "--sizes", "3", "40", "--out", str(out)]
    assert sweep.main([*argv, *TINY]) == 0
    frame = read_csv(out)
    assert sorted(zip(frame["mode"], frame["num_tokens"], strict=True)) == [
        ("eager", 3), ("eager", 40), ("per_layer", 3), ("per_layer", 40),
        ("upstream", 3), ("upstream", 40),
    ]  # fmt: skip
    ours = frame[frame["mode"] != "upstream"]
    assert ours["bit_exact"].all()
    assert frame.loc[frame["mode"] == "upstream", "bit_exact"].isna().all()
    notes = json.loads(out.with_suffix(".meta.json").read_text())
    if not torch.cuda.is_available():
        assert "CUDA device" in notes["skipped_modes"]["speculator"]["graph"]


def test_the_sweep_opens_with_what_it_measures(tmp_path, vllm_available):
    """vLLM's lines about the engine the speculator engine never starts
    ("using the V1 model runner instead", Triton's) no longer open the
    output; the sweep's own line saying what is timed does."""
    out = tmp_path / "s.csv"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    argv = ["--engine", "speculator", "--sizes", "3", "--out", str(out), *TINY]
    proc = subprocess.run(
        [sys.executable, str(REPO / "perf" / "sweep.py"), *argv],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == (
        "sweep: speculator engine on cpu: the propose() of vLLM's "
        "extract_hidden_states speculator and of cg_extract's, called directly "
        "(no vLLM engine or model runner starts)"
    )
    printed = proc.stdout + proc.stderr
    for line in ("V1 model runner", "Triton is not installed", "Triton is installed"):
        assert line not in printed


def test_speculator_graph_path_emulated(vllm_available):
    """Our graph mode end to end on CPU, through the emulated backend: bit
    exact, padded, and its replayed work counted (never timed)."""
    from perf.speculator_engine import SpeculatorEngine

    engine = SpeculatorEngine(params(), graph_backend="emulated")
    with graph_steps_kept():
        engine.build(["graph"])
    graph = engine.runners["graph"]
    for num_tokens, padded in [(3, 4), (40, 40)]:
        inputs = engine.make_inputs(num_tokens, torch.Generator().manual_seed(2))
        assert sweep.bit_exact(engine, graph, inputs, graph.receive(inputs))
        count = count_step(lambda inputs=inputs: graph.step(inputs))
        assert count.padded_tokens(num_tokens) == padded
        assert bool(count.replayed) == (num_tokens <= 16)


def test_graph_capture_cost_goes_to_the_meta_json():
    """Emulated here: the summary the sweep writes for every graph mode."""
    engine = KernelEngine(params(), graph_backend="emulated")
    with graph_steps_kept():
        engine.build(["upstream", "eager", "graph", "graph_copy_in"])
    summaries = engine.graph_summaries()
    assert set(summaries) == {"graph", "graph_copy_in"}
    graph, copy_in = summaries["graph"], summaries["graph_copy_in"]
    assert set(graph["capture_times_s"]) == {"copy_in", "zero_copy"}
    assert set(copy_in["capture_times_s"]) == {"copy_in"}
    for summary in summaries.values():
        per_size = summary["capture_times_s"]["copy_in"]
        assert sorted(per_size) == list(params().capture_sizes)
        assert all(t > 0 for t in per_size.values())
        assert summary["capture_time_s"] >= sum(per_size.values())
    assert graph["zero_copy_sizes"] == list(params().capture_sizes)
    json.dumps(summaries)  # what report.write stores


def test_emulated_counts_show_a_zero_copy_step(capsys):
    from perf import emulated_counts

    emulated_counts.main(
        ["--sizes", "8", "--hidden-size", "1024", "--layers", "1", "2"]
    )
    rows = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()[1:]
    }
    # tokens, dispatched, moving, replayed
    assert rows["graph"][1:5] == ["8", "1", "1", "1"]
    assert float(rows["upstream"][-2]) > 2.99 and float(rows["graph"][-2]) < 1.01
    assert {row[-1] for row in rows.values()} == {"clean"}  # block 0 never written


def test_a_whole_engines_plot_and_table_read_as_requests_and_prompts(
    tmp_path, monkeypatch
):
    """The vllm engine's committed CPU run: its x is prompts per run, its
    latency a request's, its title says CPU timings are informative only and
    names the model (it has no hidden-size parameter); a third panel stacks
    the target's steps by graph mode, per mode; replays print as counts."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    frame = pd.read_csv(REPO / "perf" / "baselines" / "cpu_vllm.csv")
    report.plot(frame, tmp_path / "p.png")
    figure = figures.pop()
    latency, speedup, target = figure.axes
    assert latency.get_xlabel() == speedup.get_xlabel() == "prompts per run"
    # One bar a mode and graph mode, stacked in the CSV's order, as high as
    # the CSV's counts.
    stacks = [c.patches for c in target.containers]
    assert [c.get_label() for c in target.containers] == [
        name for name, _ in report.TARGET_STEPS.values()
    ]
    for column, bars in zip(report.TARGET_STEPS, stacks, strict=True):
        assert [b.get_height() for b in bars] == frame[column].tolist(), column
    assert latency.get_ylabel() == "p50 request latency (us)"
    title = figure._suptitle.get_text()
    assert "model tiny dummy Llama" in title and "hidden nan" not in title
    assert title.endswith(
        "vLLM's engine on a CPU: timings informative only, not GPU figures"
    )
    header, *lines = report.table(frame).splitlines()
    (graph,) = [line for line in lines if " graph " in line]
    for column in ("copy_in_replays", "eager_steps", "target_full_steps"):  # aligned
        end = header.index(column) + len(column)
        assert (
            graph[:end].split()[-1]
            == f"{frame.set_index('mode').loc['graph', column]:.0f}"
        )
