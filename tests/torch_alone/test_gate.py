"""perf/gate.py on real sweep rows (the committed reference baseline),
transformed as a regression or an improvement would change them: what fails,
what passes, what is compared on which machine, and what is refused."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from perf import gate, report
from perf.machine import machine_key

REPO = Path(__file__).resolve().parents[2]
BASELINES = REPO / "perf" / "baselines"
REFERENCE = BASELINES / "cpu.csv"  # from a CPU whose identity was not recorded
OWN = (
    BASELINES / "cpu" / "AuthenticAMD-f26-m2-s1.csv"
)  # this CPU model's, per_layer too
HERE = "AMD EPYC [AuthenticAMD family 26 model 2 stepping 1] (2 cores)"
OTHER_CPU = "Intel(R) Xeon(R) Processor [GenuineIntel family 6 model 143 stepping 8] (2 cores)"  # fmt: skip
TIMES = ["p50_us", "p90_us", "p99_us", "host_us"]


def real_run(device_name: str = HERE, device: str = "cpu") -> pd.DataFrame:
    """The reference baseline's rows, as if measured on ``device_name``."""
    return pd.read_csv(REFERENCE).assign(device=device, device_name=device_name)


def scale_mode(frame: pd.DataFrame, mode: str, factor: float) -> pd.DataFrame:
    """``mode`` takes ``factor`` times as long; ratios follow, as the sweep
    computes them."""
    frame = frame.copy()
    rows = frame["mode"] == mode
    frame.loc[rows, TIMES] *= factor
    frame.loc[rows, "tokens_per_s"] /= factor
    for _, size in frame.groupby(["engine", "num_tokens"]):
        records = size.to_dict("records")
        report.add_speedups(records)
        for column in report.SPEEDUP_REFERENCES.values():
            frame.loc[size.index, column] = [r[column] for r in records]
    return frame


def rows(frame: pd.DataFrame, mode: str, num_tokens: int | None = None) -> pd.Series:
    selected = frame["mode"] == mode
    return (
        selected
        if num_tokens is None
        else selected & (frame["num_tokens"] == num_tokens)
    )


def write(tmp_path: Path, name: str, frame: pd.DataFrame) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


def run_gate(tmp_path, base: pd.DataFrame, cur: pd.DataFrame, *extra: str) -> int:
    if not (tmp_path / "rules.csv").exists():
        shutil.copy(BASELINES / "rules.csv", tmp_path / "rules.csv")
    argv = ["--baseline", str(write(tmp_path, "base.csv", base))]
    return gate.main([*argv, "--current", str(write(tmp_path, "cur.csv", cur)), *extra])


def failed(output: str) -> set[tuple[str, str]]:
    """(mode, metric) of each failed check in the printed table."""
    return {
        (line.split()[1], line.split()[3])
        for line in output.splitlines()
        if line.rstrip().endswith(" FAIL")
    }


def checked(output: str) -> set[tuple[str, str]]:
    """(mode, metric) of each check in the printed table."""
    verdicts = (" ok", " better", " FAIL")
    return {
        (line.split()[1], line.split()[3])
        for line in output.splitlines()
        if line.rstrip().endswith(verdicts)
    }


def verdict(output: str) -> str:
    return output.strip().splitlines()[-1]


# --------------------------------------------------------------------------
# The committed baselines


def test_committed_baselines_match_the_schema_and_say_which_machine_made_them():
    machine_baselines = sorted((BASELINES / "cpu").glob("*.csv"))
    assert machine_baselines, "no baseline made on a machine with a CPU identity"
    for path in [REFERENCE, *machine_baselines]:
        frame = pd.read_csv(path)
        assert list(frame.columns) == report.COLUMNS, (
            f"{path}: the sweep schema changed; regenerate with perf/ci_gate.sh --update"
        )
        assert frame["bit_exact"].dropna().astype(bool).all()
    for path in machine_baselines:
        names = set(pd.read_csv(path)["device_name"])
        assert len(names) == 1
        assert machine_key("cpu", names.pop()) == path.stem  # the file names its CPU


@pytest.mark.parametrize("device_name", [HERE, "AMD EPYC (2 cores)"])
def test_a_run_passes_against_itself(tmp_path, capsys, device_name):
    frame = real_run(device_name)
    assert run_gate(tmp_path, frame, frame) == gate.PASS
    assert verdict(capsys.readouterr().out).startswith("gate: PASS")


# --------------------------------------------------------------------------
# The same machine model: timing ratios compared


def test_an_eager_path_2x_slower_fails(tmp_path, capsys):
    base = real_run()
    assert run_gate(tmp_path, base, scale_mode(base, "eager", 2.0)) == gate.FAIL
    out = capsys.readouterr().out
    assert failed(out) == {("eager", "speedup_vs_upstream")}  # upstream: not gated
    assert verdict(out).startswith("gate: FAIL")


def test_an_eager_path_1_5x_faster_passes(tmp_path, capsys):
    base = real_run()
    cur = scale_mode(base, "eager", 1 / 1.5)
    upstream = rows(cur, "upstream")
    dropped = (
        cur.loc[upstream, "speedup_vs_eager"] / base.loc[upstream, "speedup_vs_eager"]
    )
    assert (dropped < 0.75).all()  # what the old gate failed 16 times
    assert run_gate(tmp_path, base, cur) == gate.PASS
    out = capsys.readouterr().out
    # the reference row is not gated on itself
    assert ("upstream", "speedup_vs_eager") not in checked(out)
    assert " better" in out


def test_noise_inside_the_tolerance_passes(tmp_path):
    base = real_run()
    assert run_gate(tmp_path, base, scale_mode(base, "eager", 1.2)) == gate.PASS


@pytest.mark.parametrize("kept", [0.7, 0.4])
def test_same_machine_tolerance_is_25_percent_up_to_100_tokens_55_above(
    tmp_path, capsys, kept
):
    """Eager keeps ``kept`` of its speedup over upstream: 0.7 fails the rows
    up to 100 tokens only (limit 0.75 of the baseline there, 0.45 above),
    0.4 fails every row."""
    base = real_run()
    assert run_gate(tmp_path, base, scale_mode(base, "eager", 1 / kept)) == gate.FAIL
    failing = {
        (line.split()[0], int(line.split()[2]))
        for line in capsys.readouterr().out.splitlines()
        if " same_machine " in line and line.endswith(" FAIL")
    }
    eager = base[base["mode"] == "eager"]
    assert failing == {
        (engine, n)
        for engine, n in zip(eager["engine"], eager["num_tokens"], strict=True)
        if n <= 100 or kept < 0.45
    }


def test_cpu_absolute_timings_are_not_gated(tmp_path, capsys):
    base = real_run()
    cur = scale_mode(scale_mode(base, "eager", 10), "upstream", 10)  # a busy neighbour
    assert run_gate(tmp_path, base, cur) == gate.PASS
    assert "same_gpu rules not applied: not a GPU run" in capsys.readouterr().out


# --------------------------------------------------------------------------
# The floors: on the run alone, so on any CPU


@pytest.mark.parametrize("source", [REFERENCE, OWN], ids=["reference", "this-cpu"])
def test_both_committed_runs_hold_the_floors_and_a_2x_slower_eager_fails(
    tmp_path, capsys, source
):
    """The reference (another AMD EPYC, before the write op) and this CPU
    model's baseline: every floor holds as a current run, and an eager step 2x
    slower fails them, whatever the machine: at every size up to 8 tokens,
    where our step is within 2x of the others (above, where it is 3x to 6x
    faster, the same-machine ratios catch it)."""
    run = pd.read_csv(source).assign(device_name="AMD EPYC (2 cores)")
    assert run_gate(tmp_path, run, run) == gate.PASS
    out = capsys.readouterr().out
    floors = [
        line for line in out.splitlines() if " run " in line and "speedup" in line
    ]
    assert len(floors) == len(run[run["mode"].isin(["eager", "per_layer"])])
    assert run_gate(tmp_path, run, scale_mode(run, "eager", 2.0)) == gate.FAIL
    out = capsys.readouterr().out
    failed_sizes = {
        (line.split()[0], int(line.split()[2]))
        for line in out.splitlines()
        if line.endswith(" FAIL") and " run " in line
    }
    small = run[run["num_tokens"] <= 8]
    assert failed_sizes >= set(zip(small["engine"], small["num_tokens"], strict=True))


def on_the_floor(frame: pd.DataFrame, mode: str, metric: str, value: float):
    """Every row of ``mode`` with ``metric`` set to ``value``, as a run of
    another CPU model (so only the floors and the counts are checked)."""
    frame = frame.assign(device_name="AMD EPYC (2 cores)")
    frame.loc[rows(frame, mode), metric] = value
    return frame


@pytest.mark.parametrize(
    ("mode", "metric", "value", "passes"),
    [
        # The floors as perf/README.md states them: eager at least 0.9x
        # upstream, and eager p50 / per_layer p50 at most 1/0.9 = 1.111.
        ("eager", "speedup_vs_upstream", 0.9, True),  # on the bound: holds
        ("eager", "speedup_vs_upstream", 0.899, False),
        ("per_layer", "speedup_vs_eager", 1.111, True),
        ("per_layer", "speedup_vs_eager", 1.112, False),
        ("per_layer", "speedup_vs_eager", 1.3, False),  # 30 % slower than per_layer
    ],
)
def test_a_figure_on_its_floor_passes_and_just_past_it_fails(
    tmp_path, capsys, mode, metric, value, passes
):
    run = pd.read_csv(OWN)  # the baseline with per_layer rows
    cur = on_the_floor(run, mode, metric, value)
    base = run.assign(device_name="AMD EPYC (2 cores)")
    assert run_gate(tmp_path, base, cur) == (gate.PASS if passes else gate.FAIL)
    out = capsys.readouterr().out
    assert (mode, metric) in checked(out)
    assert failed(out) == (set() if passes else {(mode, metric)})


@pytest.mark.parametrize(("value", "passes"), [(1.3, True), (1.5, True), (1.51, False)])
def test_below_32_tokens_the_per_layer_floor_is_the_cpus_dispatch_margin(
    tmp_path, capsys, value, passes
):
    """Below 32 tokens the op's dispatch is as large as the write, and the
    ratio to the per-layer write depends on the CPU (1.21 seen on an AMD EPYC
    family 25 model 17 at 8 tokens): up to 1.5 passes there, past it fails;
    from 32 tokens the 1.111 floor stays (test above)."""
    run = pd.read_csv(OWN).assign(device_name="AMD EPYC (2 cores)")
    cur = run.copy()
    cur.loc[rows(cur, "per_layer") & (cur["num_tokens"] < 32), "speedup_vs_eager"] = (
        value
    )
    assert run_gate(tmp_path, run, cur) == (gate.PASS if passes else gate.FAIL)
    out = capsys.readouterr().out
    assert failed(out) == (set() if passes else {("per_layer", "speedup_vs_eager")})


def test_a_token_range_includes_both_ends(tmp_path, capsys):
    """``N-M`` gates rows of N and of M tokens, none outside; ``N`` only N."""
    (tmp_path / "rules.csv").write_text(
        f"{HEADER}\n"
        "speedup_vs_upstream,speculator,eager,8-100,run,higher,100,x\n"
        "speedup_vs_upstream,kernel,eager,3,run,higher,100,x\n"
    )
    frame = real_run()
    assert run_gate(tmp_path, frame, frame) == gate.FAIL
    out = capsys.readouterr().out
    gated = {
        (line.split()[0], int(line.split()[2]))
        for line in out.splitlines()
        if line.endswith(" FAIL")
    }
    assert gated == {
        ("speculator", 8),
        ("speculator", 32),
        ("speculator", 100),
        ("kernel", 3),
    }


# --------------------------------------------------------------------------
# Any baseline: correctness and counts


def one_more_op(frame):
    frame.loc[rows(frame, "eager", 8), "ops_per_step"] += 1


def more_bytes(frame):
    frame.loc[rows(frame, "eager", 8), "bytes_per_step"] += 1


def a_replayed_op(frame):
    frame.loc[rows(frame, "eager", 8), "replayed_ops_per_step"] += 1


def not_bit_exact(frame):
    frame.loc[rows(frame, "eager", 8), "bit_exact"] = False


def lost_correctness_check(frame):
    frame.loc[rows(frame, "eager", 8), "bit_exact"] = None


def lost_a_count(frame):
    frame.loc[rows(frame, "eager", 8), "ops_per_step"] = math.nan


@pytest.mark.parametrize("machine", [HERE, OTHER_CPU])
@pytest.mark.parametrize(
    ("regress", "metric"),
    [
        (one_more_op, "ops_per_step"),
        (more_bytes, "bytes_per_step"),
        (a_replayed_op, "replayed_ops_per_step"),
        (not_bit_exact, "bit_exact"),
        (lost_correctness_check, "bit_exact"),
        (lost_a_count, "ops_per_step"),  # the baseline has it, the run not
    ],
)
def test_each_deterministic_regression_fails_on_any_machine(
    tmp_path, capsys, machine, regress, metric
):
    cur = real_run(machine)
    cur["bit_exact"] = cur["bit_exact"].astype(object)
    regress(cur)
    assert run_gate(tmp_path, real_run("AMD EPYC (2 cores)"), cur) == gate.FAIL
    assert failed(capsys.readouterr().out) == {("eager", metric)}


def test_every_mode_but_upstream_must_be_bit_exact(tmp_path, capsys):
    run = pd.read_csv(OWN).assign(device_name="AMD EPYC (2 cores)")
    run["bit_exact"] = run["bit_exact"].astype(object)
    modes = sorted(set(run["mode"]) - {"upstream"})
    assert len(modes) > 1
    for mode in modes:
        cur = run.copy()
        cur.loc[rows(cur, mode, 8), "bit_exact"] = False
        assert run_gate(tmp_path, run, cur) == gate.FAIL, mode
        assert failed(capsys.readouterr().out) == {(mode, "bit_exact")}


def test_fewer_ops_and_bytes_pass_and_are_reported(tmp_path, capsys):
    base = real_run()
    cur = base.copy()
    cur.loc[rows(cur, "eager"), ["ops_per_step", "bytes_per_step"]] -= 1
    assert run_gate(tmp_path, base, cur) == gate.PASS
    out = capsys.readouterr().out
    assert "32 better" in verdict(out)  # 16 eager rows x 2 counts


def test_a_missing_row_fails_and_a_new_mode_is_gated_on_the_run(tmp_path, capsys):
    base = real_run()
    assert run_gate(tmp_path, base, base[~rows(base, "eager", 8)]) == gate.FAIL
    assert "MISSING from current run: engine=speculator, mode=eager, num_tokens=8" in (
        capsys.readouterr().out
    )
    new_mode = base[rows(base, "eager")].assign(mode="graph")
    cur = pd.concat([base, new_mode], ignore_index=True)
    assert run_gate(tmp_path, base, cur) == gate.PASS
    assert "16 new" in verdict(capsys.readouterr().out)
    cur["bit_exact"] = cur["bit_exact"].astype(object)
    cur.loc[rows(cur, "graph", 3), "bit_exact"] = False
    assert run_gate(tmp_path, base, cur) == gate.FAIL
    assert failed(capsys.readouterr().out) == {("graph", "bit_exact")}


# --------------------------------------------------------------------------
# Another machine: the floors decide the timing


def test_another_cpu_model_is_compared_by_the_floors(tmp_path, capsys):
    base = real_run(HERE)
    cur = real_run(OTHER_CPU)
    cur = scale_mode(cur, "upstream", 0.9)  # another CPU: other ratios, floors hold
    assert run_gate(tmp_path, base, cur) == gate.PASS
    out = capsys.readouterr().out
    assert "same_machine rules not applied: another machine (baseline " in out
    assert "AuthenticAMD-f26-m2-s1, current GenuineIntel-f6-m143-s8)" in out
    floors = [
        line for line in out.splitlines() if " run " in line and "speedup" in line
    ]
    assert len(floors) == 16  # eager at every size, two engines

    assert run_gate(tmp_path, base, scale_mode(cur, "eager", 2.0)) == gate.FAIL
    out = capsys.readouterr().out
    assert failed(out) == {("eager", "speedup_vs_upstream")}
    assert all(" run " in line for line in out.splitlines() if line.endswith(" FAIL"))


def test_a_baseline_without_a_cpu_identity_matches_no_machine(tmp_path, capsys):
    old = real_run("AMD EPYC (2 cores)")
    assert run_gate(tmp_path, old, scale_mode(old, "eager", 1.2)) == gate.PASS
    assert "the baseline's machine is unknown" in capsys.readouterr().out


def test_the_machine_baseline_is_chosen_when_there_is_one(tmp_path, capsys):
    shutil.copy(BASELINES / "rules.csv", tmp_path / "rules.csv")
    reference = write(tmp_path, "cpu.csv", real_run("AMD EPYC (2 cores)"))
    current = write(tmp_path, "cur.csv", scale_mode(real_run(), "eager", 1.2))
    argv = ["--baseline", str(reference), "--current", str(current)]
    argv += ["--machine-baselines", str(tmp_path / "cpu")]
    assert gate.main(argv) == gate.PASS  # 1.2x slower: the floors still hold
    out = capsys.readouterr().out
    assert out.startswith(f"gate: baseline {reference}: the reference")

    assert gate.main([*argv, "--update"]) == gate.PASS
    own = tmp_path / "cpu" / "AuthenticAMD-f26-m2-s1.csv"
    assert own.read_text() == current.read_text()
    assert reference.read_text() != current.read_text()  # never overwritten
    capsys.readouterr()

    write(tmp_path, "cur.csv", real_run())  # eager back to its speed
    assert gate.main(argv) == gate.PASS
    assert capsys.readouterr().out.startswith(f"gate: baseline {own}: made on this")
    write(tmp_path, "cur.csv", scale_mode(real_run(), "eager", 3.0))
    assert gate.main(argv) == gate.FAIL


# --------------------------------------------------------------------------
# GPUs: absolute timings on the same GPU model only


def test_absolute_timings_are_gated_on_the_same_gpu_only(tmp_path, capsys):
    base = real_run("NVIDIA H200", "cuda")
    cur = scale_mode(scale_mode(base, "eager", 1.3), "upstream", 1.3)
    assert run_gate(tmp_path, base, cur) == gate.FAIL
    assert ("eager", "p50_us") in failed(capsys.readouterr().out)
    assert run_gate(tmp_path, base.assign(device_name="NVIDIA H100"), cur) == gate.PASS
    assert "same_gpu rules not applied: another machine" in capsys.readouterr().out


# --------------------------------------------------------------------------
# Refusals: exit 2, one line naming the file and the problem


def refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("gate: refused: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty file"),
        (",".join(report.COLUMNS) + "\n", "no rows (a header only)"),
        ("engine,mode\nkernel,eager\n", "not a sweep CSV (no column num_tokens"),
    ],
    ids=["empty", "header-only", "not-a-sweep"],
)
def test_unusable_csvs_are_refused(tmp_path, capsys, content, problem):
    (tmp_path / "cur.csv").write_text(content)
    argv = ["--baseline", str(REFERENCE), "--current", str(tmp_path / "cur.csv")]
    assert gate.main(argv) == gate.REFUSED
    assert f"current run {tmp_path / 'cur.csv'}: {problem}" in refusal(capsys)


@pytest.mark.parametrize("value", ["many", None, "2.5", "0"])
def test_a_bad_num_tokens_is_refused(tmp_path, capsys, value):
    base = real_run()
    cur = base.astype({"num_tokens": object})
    cur.loc[5, "num_tokens"] = value
    assert run_gate(tmp_path, base, cur) == gate.REFUSED
    err = refusal(capsys)
    assert f"{tmp_path / 'cur.csv'}: line 7: num_tokens" in err
    assert "is not a whole number >= 1" in err


def test_a_duplicate_row_is_refused(tmp_path, capsys):
    base = real_run()
    assert run_gate(tmp_path, base, pd.concat([base, base.iloc[[3]]])) == gate.REFUSED
    assert "engine=speculator, mode=eager, num_tokens=3 appears twice" in refusal(
        capsys
    )


def test_a_missing_baseline_is_named(tmp_path, capsys):
    current = write(tmp_path, "cur.csv", real_run())
    missing = tmp_path / "nowhere" / "cpu.csv"
    argv = ["--baseline", str(missing), "--current", str(current)]
    assert gate.main(argv) == gate.REFUSED
    assert f"baseline {missing}: no such file" in refusal(capsys)


def test_the_command_line_refuses_without_a_traceback(tmp_path):
    (tmp_path / "cur.csv").write_text("")
    result = subprocess.run(
        [sys.executable, "perf/gate.py", "--baseline", str(REFERENCE)]
        + ["--current", str(tmp_path / "cur.csv")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == gate.REFUSED
    assert (
        result.stderr
        == f"gate: refused: current run {tmp_path / 'cur.csv'}: empty file\n"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.drop(columns=["host_us"]), "different schemas"),
        (lambda f: f.assign(extra=1), "different schemas"),
        (lambda f: f.assign(device="cuda"), "baseline ran on ['cpu'], current on ['cuda']"),
        (lambda f: f.assign(hidden_size=4096), "parameter hidden_size"),
        (lambda f: f.assign(dtype="fp32"), "parameter dtype"),
    ],
)  # fmt: skip
def test_incomparable_runs_are_refused(tmp_path, capsys, change, message):
    base = real_run()
    assert run_gate(tmp_path, base, change(base.copy())) == gate.REFUSED
    assert message in refusal(capsys)


HEADER = ",".join(gate.RULE_COLUMNS)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("latency,*,*,*,run,higher,1,x", "'latency' is not a sweep column"),
        ("p50_us,*,*,*,run,faster,1,x", "direction 'faster'"),
        ("p50_us,*,*,*,somewhere,lower,1,x", "where 'somewhere'"),
        ("p50_us,*,*,*,baseline,lower,-1,x", "limit '-1' is not a number >= 0"),
        ("p50_us,*,*,*,baseline,lower,ten,x", "limit 'ten' is not a number >= 0"),
        ("p50_us,*,*,*,baseline,lower,nan,x", "limit 'nan' is not a number >= 0"),
        ("p50_us,*,*,*,baseline,lower,inf,x", "limit 'inf' is not a number >= 0"),
        ("p50_us,*,*,lots,baseline,lower,1,x", "tokens 'lots'"),
        ("p50_us,*,*,5-3,baseline,lower,1,x", "tokens '5-3' selects no size"),
        ("p50_us,*,*,0,baseline,lower,1,x", "tokens '0' selects no size"),
        ("p50_us,*,eagerr,*,run,lower,1,x", "mode 'eagerr' is not one the sweep has"),
        ("p50_us,*,!upstreem,*,run,lower,1,x", "mode '!upstreem' is not one"),
        ("p50_us,kernal,eager,*,run,lower,1,x", "engine 'kernal' is not one"),
        ("p50_us,vllm,per_layer,*,run,lower,1,x", "mode 'per_layer' is not one"),
    ],
)
def test_bad_rules_are_refused(tmp_path, capsys, rule, message):
    (tmp_path / "rules.csv").write_text(f"{HEADER}\n{rule}\n")
    frame = real_run()
    assert run_gate(tmp_path, frame, frame) == gate.REFUSED
    err = refusal(capsys)
    assert f"rules {tmp_path / 'rules.csv'} rule 1" in err and message in err


def test_a_rule_for_modes_this_run_lacks_is_listed_not_refused(tmp_path, capsys):
    """Graph modes are left out of a CPU sweep: their rules select nothing,
    and the output says so."""
    frame = real_run()
    assert run_gate(tmp_path, frame, frame) == gate.PASS
    out = capsys.readouterr().out
    assert (
        "modes graph graph_copy_in): no row of the current run" in out
        and "gate: PASS" in verdict(out)
    )


@pytest.mark.parametrize("role", ["current run", "baseline"])
@pytest.mark.parametrize(
    ("column", "value", "problem"),
    [
        ("ops_per_step", -1, "is not a number >= 0"),
        ("ops_per_step", math.inf, "is not a number >= 0"),
        ("bytes_per_step", "many", "is not a number >= 0"),
        ("speedup_vs_upstream", -0.5, "is not a number >= 0"),
        ("speedup_vs_upstream", math.inf, "is not a number >= 0"),
        ("speedup_vs_eager", -math.inf, "is not a number >= 0"),
        ("p50_us", math.nan, "is not a time > 0"),
        ("p50_us", -3.0, "is not a time > 0"),
        ("p50_us", 0.0, "is not a time > 0"),
    ],
)
def test_a_figure_no_sweep_gives_is_refused(
    tmp_path, capsys, role, column, value, problem
):
    good = real_run()
    bad = good.astype({column: object})
    bad.loc[6, column] = value
    name = "cur.csv" if role == "current run" else "base.csv"
    base, cur = (good, bad) if role == "current run" else (bad, good)
    assert run_gate(tmp_path, base, cur) == gate.REFUSED
    key = ", ".join(f"{k}={bad.loc[6, k]}" for k in report.KEY)
    err = refusal(capsys)
    assert f"{role} {tmp_path / name}: line 8 ({key}): {column} " in err
    shown = repr(value) if isinstance(value, str) else str(float(value))
    assert f"{column} {shown} {problem}" in err


def test_every_p50_nan_is_refused(tmp_path, capsys):
    frame = real_run().assign(p50_us=math.nan)
    assert run_gate(tmp_path, real_run(), frame) == gate.REFUSED
    assert "line 2 (engine=speculator, mode=upstream, num_tokens=1): p50_us nan" in (
        refusal(capsys)
    )


def test_rules_with_other_columns_are_refused(tmp_path, capsys):
    (tmp_path / "rules.csv").write_text("metric,tolerance\np50_us,0.1\n")
    frame = real_run()
    assert run_gate(tmp_path, frame, frame) == gate.REFUSED
    assert "columns must be" in refusal(capsys)


# --------------------------------------------------------------------------
# Updating


def test_update_prints_the_diff_and_replaces_the_machine_baseline(tmp_path, capsys):
    base = real_run()
    cur = base.copy()
    one_more_op(cur)
    own = write(tmp_path, "cpu/AuthenticAMD-f26-m2-s1.csv", base)
    assert run_gate(tmp_path, base, cur, "--update", "--machine-baselines",
                    str(own.parent)) == gate.PASS  # fmt: skip
    out = capsys.readouterr().out
    assert failed(out) == {("eager", "ops_per_step")}  # the diff being accepted
    assert "updated" in out
    assert own.read_text() == (tmp_path / "cur.csv").read_text()
    assert (tmp_path / "base.csv").read_text() != own.read_text()


def test_update_never_overwrites_the_reference(tmp_path, capsys):
    """Without --machine-baselines, --update used to copy the run over
    --baseline (perf/baselines/cpu.csv)."""
    base = real_run()
    cur = base.copy()
    one_more_op(cur)
    assert run_gate(tmp_path, base, cur, "--update") == gate.REFUSED
    assert "add --machine-baselines" in refusal(capsys)
    assert (tmp_path / "base.csv").read_text() != (tmp_path / "cur.csv").read_text()


def test_a_baseline_elsewhere_uses_the_project_rules(tmp_path, capsys):
    """A --baseline in a folder with no rules.csv is gated by the project's
    rules, not refused about a rules file the user never named."""
    frame = real_run()
    base = write(tmp_path, "elsewhere/base.csv", frame)
    cur = write(tmp_path, "cur.csv", scale_mode(frame, "eager", 3.0))
    assert gate.main(["--baseline", str(base), "--current", str(cur)]) == gate.FAIL
    assert "eager" in {mode for mode, _ in failed(capsys.readouterr().out)}


def test_update_refuses_an_incorrect_run(tmp_path, capsys):
    base = real_run()
    cur = base.copy()
    cur["bit_exact"] = cur["bit_exact"].astype(object)
    not_bit_exact(cur)
    own = write(tmp_path, "cpu/AuthenticAMD-f26-m2-s1.csv", base)
    assert run_gate(tmp_path, base, cur, "--update", "--machine-baselines",
                    str(own.parent)) == gate.REFUSED  # fmt: skip
    assert "2 rows are not bit-exact" in refusal(capsys)
    assert (tmp_path / "base.csv").read_text() != (tmp_path / "cur.csv").read_text()


# --------------------------------------------------------------------------
# The whole engine (`--engine vllm`): correctness and replays, never timings

VLLM_RUN = BASELINES / "cpu_vllm.csv"


def test_a_whole_engine_run_is_gated_on_correctness_and_replays(tmp_path, capsys):
    """The committed CPU run of the vllm engine passes as itself, text columns
    (graph mode, captured sizes, model) and all; its checks are bit_exact,
    the graph mode's replays, zero-copy where due and the target's FULL
    steps with ours, nothing else."""
    run = pd.read_csv(VLLM_RUN)
    assert run_gate(tmp_path, run, run) == 0
    output = capsys.readouterr().out
    assert checked(output) == {
        ("graph", "bit_exact"),
        ("eager", "close_to_upstream"),
        ("graph", "close_to_upstream"),
        ("graph", "copy_in_replays"),
        ("graph", "zero_copy_replays"),
        ("graph", "zero_copy_where_due"),
        ("eager", "target_full_steps"),
        ("graph", "target_full_steps"),
    }


def test_a_gpu_decode_run_that_replays_zero_copy_passes(tmp_path, capsys):
    """On a GPU the target replays FULL decode graphs and ours read its
    buffers in place: no copy-in replay, and a prefill step above the
    largest capture size runs eagerly. The copy-in rule is a CPU run's."""
    run = pd.read_csv(VLLM_RUN).assign(device="cuda", device_name="NVIDIA H200")
    gpu = run.copy()
    graph = gpu["mode"] == "graph"
    gpu.loc[graph, ["copy_in_replays", "zero_copy_replays"]] = [0.0, 40.0]
    gpu.loc[graph, "zero_copy_where_due"] = None  # no step log on a GPU
    assert run_gate(tmp_path, run, gpu) == 0
    output = capsys.readouterr().out
    assert ("graph", "copy_in_replays") not in checked(output)
    assert "cpu_run rules not applied: not a CPU run" in output


@pytest.mark.parametrize(
    "column, value",
    [
        ("copy_in_replays", 0.0),
        ("zero_copy_replays", 0.0),
        ("bit_exact", False),
        ("close_to_upstream", False),
        ("zero_copy_where_due", False),
        ("zero_copy_where_due", None),  # a CPU run whose steps were not logged
        ("target_full_steps", 0.0),
    ],
)
def test_a_whole_engine_without_replays_or_exact_files_fails(
    tmp_path, capsys, column, value
):
    run = pd.read_csv(VLLM_RUN)
    broken = run.copy()
    broken.loc[broken["mode"] == "graph", column] = value
    assert run_gate(tmp_path, run, broken) == 1
    assert failed(capsys.readouterr().out) == {("graph", column)}


def test_a_whole_engines_cpu_timings_are_never_gated(tmp_path, capsys):
    """A CPU engine's timings are the CPU's: a graph mode 10x slower than
    the baseline's, on the same machine, still passes."""
    run = pd.read_csv(VLLM_RUN)
    slow = scale_mode(run, "graph", 10.0)
    assert run_gate(tmp_path, run, slow) == 0
    capsys.readouterr()
