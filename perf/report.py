"""The sweep's outputs: the CSV (fixed schema), its sidecar, the plot, the table.

Every column is documented in perf/README.md ("CSV schema"); the gate refuses
to compare files whose columns differ, so change ``COLUMNS`` and the README
together, and regenerate the baselines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

KEY = ["engine", "mode", "num_tokens"]

# The measured columns, in CSV order: (name, how the printed table shows it,
# the tables that show it: "s" the step engines', "v" the whole engine's).
# Fixed-point in the table: no 1.78e+04 beside 68.3.
_F1, _F2, _F0, _FK = "{:.1f}".format, "{:.2f}".format, "{:.0f}".format, "{:,.0f}".format
_MEASURED = [
    ("engine", None, "sv"),
    ("mode", None, "sv"),
    ("device", None, ""),
    ("num_tokens", None, "sv"),
    ("padded_tokens", None, "s"),
    ("p50_us", _F1, "sv"),
    ("p90_us", None, ""),
    ("p99_us", _F1, "s"),
    ("host_us", None, ""),
    ("tokens_per_s", _FK, "sv"),
    ("prompts_per_s", "{:,.1f}".format, "sv"),
    ("speedup_vs_upstream", _F2, "sv"),
    ("speedup_vs_eager", _F2, "s"),
    ("slowdown_vs_baseline", _F2, "sv"),
    ("ops_per_step", None, "s"),
    ("replayed_ops_per_step", None, ""),
    ("launches_per_step", None, ""),
    ("bytes_per_step", None, "s"),
    ("payload_bytes", None, ""),
    ("bw_floor_frac", _F2, "s"),
    ("gpu_util_pct", None, ""),
    ("gpu_mem_used_mib", None, ""),
    ("power_w", None, ""),
    ("sm_clock_mhz", None, ""),
    ("energy_mj_per_step", None, ""),
    ("cudagraph_mode", None, "v"),
    ("captured_sizes", None, "v"),
    ("copy_in_replays", _F0, "v"),
    ("zero_copy_replays", _F0, "v"),
    ("eager_steps", _F0, "v"),
    ("target_full_steps", _F0, "v"),
    ("target_piecewise_steps", _F0, "v"),
    ("target_eager_steps", _F0, "v"),
    ("bit_exact", str, "sv"),
    ("close_to_upstream", str, "v"),
    ("zero_copy_where_due", str, "v"),
]
# The whole engine's target steps by the graph mode they ran in, and their
# colours, not the modes' (C0, C1, ...): the PNG's third panel.
TARGET_STEPS = {
    "target_full_steps": ("FULL graph", "tab:purple"),
    "target_piecewise_steps": ("PIECEWISE graph", "tab:olive"),
    "target_eager_steps": ("eager", "tab:gray"),
}
MEASURED = [name for name, _, _ in _MEASURED]
# Measured columns that hold words, not figures.
TEXT = ["cudagraph_mode", "captured_sizes"]
TABLE = [name for name, _, shown in _MEASURED if "s" in shown]
VLLM_TABLE = [name for name, _, shown in _MEASURED if "v" in shown]
TABLE_FORMATS = {name: form for name, form, _ in _MEASURED if form}

# What the engines were built for: the gate refuses to compare runs that differ.
PARAMETERS = ["hidden_size", "aux_layers", "dtype", "block_size", "capture_sizes",
              "model", "workload", "prompt_len", "max_tokens", "clients"]  # fmt: skip

# Where and how the run was made: the same on every row.
RUN = ["iters", "warmup", "cpu_threads", "device_name", "driver", "torch_version",
       "vllm_version", "cg_extract_version", "git_commit", "run_utc",
       "copy_bw_gbps"]  # fmt: skip

COLUMNS = MEASURED + PARAMETERS + RUN

# Modes whose p50 the other rows of the same size are compared with.
SPEEDUP_REFERENCES = {"upstream": "speedup_vs_upstream", "eager": "speedup_vs_eager"}


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Fill the speedup columns of one size's rows from their p50s."""
    p50 = {row["mode"]: row["p50_us"] for row in rows}
    for row in rows:
        for reference, column in SPEEDUP_REFERENCES.items():
            base = p50.get(reference, math.nan)
            row[column] = base / row["p50_us"] if row["p50_us"] > 0 else math.nan


def to_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    rows = list(rows)
    for row in rows:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"row has columns outside the schema: {sorted(unknown)}")
    return pd.DataFrame(rows, columns=COLUMNS)


# Significant digits kept in the CSV: run-to-run noise is percents, so more
# digits than this are noise.
SIGNIFICANT = 4


def rounded(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every float rounded to :data:`SIGNIFICANT` digits
    (``56.21800005428668`` is written ``56.22``); integers as they are."""
    out = frame.copy()
    for column in out.columns:
        if pd.api.types.is_float_dtype(out[column]):
            out[column] = out[column].map(
                lambda v: v if pd.isna(v) else float(f"{v:.{SIGNIFICANT}g}")
            )
    return out


def sidecar_paths(csv_path: Path) -> tuple[Path, Path]:
    """The PNG and the ``.meta.json`` written next to the CSV."""
    return csv_path.with_suffix(".png"), csv_path.with_suffix(".meta.json")


def write(frame: pd.DataFrame, csv_path: Path, notes: Mapping[str, Any]) -> None:
    """CSV, PNG, then the sidecar notes (skipped modes and why, NVML status,
    op lists, interrupted): last, so that they can record a Ctrl-C that came
    while the others were written."""
    png, meta = sidecar_paths(csv_path)
    rounded(frame).to_csv(csv_path, index=False)
    plot(frame, png, notes.get("skipped_modes", {}))
    meta.write_text(json.dumps(notes, indent=2, default=str) + "\n")


# What each engine's `upstream` mode is, for the speedup panel's title.
UPSTREAM = {
    "speculator": "vLLM's own speculator",
    "kernel": "vLLM's arithmetic in torch",
}


def plot(
    frame: pd.DataFrame,
    png: Path,
    left_out: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Latency and speedup against token count, and for the whole engine the
    target's steps by graph mode; ``left_out`` (engine -> mode -> why, the
    sweep's ``skipped_modes``) is written under the panels, so that a figure
    without the graph modes says so and why."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if whole_engine(frame) else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5))
    latency, speedup = axes[:2]
    if panels == 3:
        plot_target_steps(axes[2], frame)
    series = frame.groupby(["engine", "mode"], sort=False)
    for index, ((engine, mode), rows) in enumerate(series):
        rows = rows.sort_values("num_tokens")
        style = {"marker": "o", "label": f"{engine}/{mode}", "color": f"C{index % 10}"}
        latency.plot(rows["num_tokens"], rows["p50_us"], **style)
        if mode != "upstream" and rows["speedup_vs_upstream"].notna().any():
            speedup.plot(rows["num_tokens"], rows["speedup_vs_upstream"], **style)
    engines = set(frame["engine"])
    # A whole engine's size is prompts per run and its latency a request's.
    xlabel = "prompts per run" if whole_engine(frame) else "tokens per step"
    what = "request" if whole_engine(frame) else "step"
    latency.set(
        xlabel=xlabel, ylabel=f"p50 {what} latency (us)", title=f"{what} latency"
    )
    reference = "each engine's upstream"
    if len(engines) == 1 and engines <= UPSTREAM.keys():
        reference = UPSTREAM[next(iter(engines))]
    speedup.set(
        xlabel=xlabel,
        ylabel="p50 upstream / p50 mode (log)",
        title=f"Speedup vs {reference}",
    )
    for ax in (latency, speedup):
        if not ax.lines:  # nothing to scale: e.g. a run without upstream
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        ax.set_xscale("log")
        ax.set_yscale("log")
        if ax is speedup:
            ax.axhline(
                1.0, color="grey", linewidth=0.8, label="1.0: as fast as upstream"
            )
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if len(frame):
        title = plot_title(frame)
        if "vllm" in engines and frame.iloc[0]["device"] == "cpu":
            title += (
                "\nvLLM's engine on a CPU: timings informative only, not GPU figures"
            )
        fig.suptitle(title, fontsize="small")
    note = left_out_note(left_out or {})
    fig.tight_layout(rect=(0, 0.06 * bool(note), 1, 1))
    if note:
        fig.text(0.01, 0.01, note, fontsize="small", wrap=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_target_steps(ax: Any, frame: pd.DataFrame) -> None:
    """Stacked bars, one per mode (and size, where several): how many of
    the timed runs' steps the target ran as a FULL graph, as a PIECEWISE
    graph and eagerly."""
    rows = frame.dropna(subset=list(TARGET_STEPS), how="all")
    if rows.empty:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        return
    sizes = rows["num_tokens"].nunique() > 1
    labels = [
        f"{mode}\n{size} prompts" if sizes else mode
        for mode, size in zip(rows["mode"], rows["num_tokens"], strict=True)
    ]
    bottom = [0.0] * len(rows)
    for column, (name, colour) in TARGET_STEPS.items():
        counts = rows[column].fillna(0).tolist()
        ax.bar(labels, counts, bottom=bottom, label=name, color=colour)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set(ylabel="steps in the timed runs", title="The target's steps by graph mode")
    ax.legend(fontsize="small")


def whole_engine(frame: pd.DataFrame) -> bool:
    """Rows of the ``vllm`` engine alone: requests and prompts, not steps."""
    return set(frame["engine"]) == {"vllm"}


def plot_title(frame: pd.DataFrame) -> str:
    """What was measured, on which machine, how often and with what."""
    first = frame.iloc[0]
    engines = ", ".join(dict.fromkeys(frame["engine"]))
    # A whole engine's hidden size is its model's, not a sweep parameter.
    shape = (
        f"model {first['model']}"
        if pd.isna(first["hidden_size"])
        else f"hidden {first['hidden_size']}"
    )
    return (
        f"extract_hidden_states, sweep engine {engines}: p50 of "
        f"{first['iters']} iterations per mode and size ({first['warmup']} warm-up), "
        f"CPU threads: {first['cpu_threads']}\n"
        f"{first['device_name']} | {first['dtype']}, {shape}, "
        f"aux layers {first['aux_layers']} | {first['vllm_version']}, "
        f"commit {first['git_commit']}"
    )


def left_out_note(left_out: Mapping[str, Mapping[str, str]]) -> str:
    """One line per reason: "Left out: kernel/graph, ...: why"."""
    by_reason: dict[str, list[str]] = {}
    for engine, modes in left_out.items():
        for mode, why in modes.items():
            by_reason.setdefault(why, []).append(f"{engine}/{mode}")
    return "\n".join(
        f"Left out: {', '.join(series)}: {why}" for why, series in by_reason.items()
    )


def table(frame: pd.DataFrame) -> str:
    """The short table printed at the end of a sweep."""
    if frame.empty:
        return "(no rows)"
    shown = frame[VLLM_TABLE if whole_engine(frame) else TABLE].copy()
    for column, form in TABLE_FORMATS.items():
        if column in shown:
            shown[column] = shown[column].map(
                lambda v, f=form: "" if pd.isna(v) else f(v)
            )
    shown = shown.fillna("")
    # The reference is what the other rows are compared with: no verdict.
    reference = shown["mode"] == ("eager" if whole_engine(frame) else "upstream")
    shown.loc[reference, "bit_exact"] = shown.loc[reference, "bit_exact"].replace(
        "", "(ref)"
    )
    return shown.to_string(index=False)
