"""Compare two sweep CSVs row by row; exit 1 when the current run regresses.

    python perf/gate.py --baseline perf/baselines/cpu.csv --current out/ci_gate/sweep.csv
    python perf/gate.py --update --baseline perf/baselines/cpu.csv --current new.csv

Rows are matched on (engine, mode, num_tokens). What is compared, in which
direction and with what tolerance is data: ``rules.csv`` next to the baseline
(``--rules`` to override). A rule applies ``anywhere`` (correctness, op
counts, ratios measured within one run) or only on the ``same_device``: both
runs on CUDA on the same GPU model (absolute latencies, throughput, energy);
CPU timings from shared machines are never compared absolutely.

Exit status: 0 pass, 1 regression (a failed rule or a baseline row missing
from the current run), 2 refused (different schemas, devices or parameters,
or a bad rules file). ``--update`` prints the same comparison, then replaces
the baseline with the current run unless the current run is incorrect.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import math
import shutil
from dataclasses import dataclass
from typing import Any

import pandas as pd

from perf.report import COLUMNS, KEY, PARAMETERS

PASS, FAIL, REFUSED = 0, 1, 2
RULE_COLUMNS = ["metric", "direction", "tolerance", "where", "why"]
DIRECTIONS = ("higher", "lower", "true", "equal")
WHERE = ("anywhere", "same_device")


class Refused(Exception):
    """The two runs cannot be compared; the message says why."""


@dataclass(frozen=True)
class Rule:
    metric: str
    direction: str  # higher | lower: relative tolerance; true; equal
    tolerance: float
    where: str  # anywhere | same_device
    why: str


@dataclass(frozen=True)
class Check:
    verdict: str  # "ok", "FAIL", "n/a" or "skip" (a same_device rule, not same device)
    ratio: float = math.nan
    limit: Any = math.nan


# --------------------------------------------------------------------------
# Loading


def load_rules(path: Path) -> list[Rule]:
    try:
        frame = pd.read_csv(path, comment="#", skipinitialspace=True)
    except OSError as why:
        raise Refused(f"cannot read rules {path}: {why}") from why
    if list(frame.columns) != RULE_COLUMNS:
        raise Refused(
            f"{path}: columns must be {RULE_COLUMNS}, got {list(frame.columns)}"
        )
    rules = []
    for line, r in enumerate(frame.to_dict("records"), start=1):
        metric, direction, tolerance, where = (
            r["metric"],
            r["direction"],
            r["tolerance"],
            r["where"],
        )
        at = f"{path} rule {line} ({metric})"
        if metric not in COLUMNS:
            raise Refused(f"{at}: {metric!r} is not a sweep column")
        if direction not in DIRECTIONS:
            raise Refused(f"{at}: direction must be one of {DIRECTIONS}")
        if where not in WHERE:
            raise Refused(f"{at}: where must be one of {WHERE}")
        if not tolerance >= 0:
            raise Refused(f"{at}: tolerance must be a number >= 0")
        rules.append(Rule(metric, direction, float(tolerance), where, r["why"]))
    return rules


def load_sweep(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, pd.errors.ParserError) as why:
        raise Refused(f"cannot read sweep CSV {path}: {why}") from why


# --------------------------------------------------------------------------
# Comparability


def check_comparable(base: pd.DataFrame, cur: pd.DataFrame) -> None:
    """Refuse runs that measured different things."""
    if list(base.columns) != list(cur.columns):
        added = [c for c in cur.columns if c not in base.columns]
        removed = [c for c in base.columns if c not in cur.columns]
        raise Refused(
            "the CSVs have different schemas "
            f"(current adds {added}, drops {removed}"
            + (", or orders columns differently" if not added + removed else "")
            + "); regenerate the baseline with --update"
        )
    devices = sorted(set(base["device"])), sorted(set(cur["device"]))
    if devices[0] != devices[1]:
        raise Refused(
            f"baseline ran on {devices[0]}, current on {devices[1]}; compare "
            "against a baseline made on the same kind of device"
        )
    for engine in sorted(set(base["engine"]) & set(cur["engine"])):
        for column in PARAMETERS:
            want = _values(base, engine, column)
            got = _values(cur, engine, column)
            if want != got:
                raise Refused(
                    f"engine {engine!r}: parameter {column} is {got} in the current "
                    f"run but {want} in the baseline; the sweeps measured different "
                    "things"
                )


def _values(frame: pd.DataFrame, engine: str, column: str) -> list[str]:
    return sorted({str(v) for v in frame.loc[frame["engine"] == engine, column]})


def same_device(base: pd.DataFrame, cur: pd.DataFrame) -> str:
    """Empty when absolute figures are comparable, else why not."""
    if set(base["device"]) != {"cuda"}:
        return "CPU timings from shared machines are not compared absolutely"
    names = set(base["device_name"]), set(cur["device_name"])
    if names[0] != names[1]:
        return f"baseline GPU {sorted(names[0])}, current {sorted(names[1])}"
    return ""


# --------------------------------------------------------------------------
# Comparison


def evaluate(rule: Rule, base: Any, cur: Any, not_same_device: str) -> Check:
    if rule.where == "same_device" and not_same_device:
        return Check("skip")
    if rule.direction == "true":
        return _check_true(base, cur)
    if _missing(base) and _missing(cur):
        return Check("n/a")
    if _missing(cur):
        return Check("FAIL", limit="a value")  # the run lost a measurement
    if _missing(base):
        return Check("ok")  # new measurement
    base, cur = float(base), float(cur)
    ratio = cur / base if base else math.nan
    if rule.direction == "equal":
        return Check("ok" if cur == base else "FAIL", ratio, base)
    if rule.direction == "lower":
        limit = base * (1 + rule.tolerance)
        return Check("ok" if cur <= limit else "FAIL", ratio, limit)
    limit = base * (1 - rule.tolerance)
    return Check("ok" if cur >= limit else "FAIL", ratio, limit)


def _check_true(base: Any, cur: Any) -> Check:
    if _missing(base) and _missing(cur):
        return Check("n/a")  # the reference row has no flag
    return Check("ok" if as_bool(cur) is True else "FAIL", limit=True)


def as_bool(value: Any) -> bool | None:
    if _missing(value):
        return None
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


@dataclass
class Comparison:
    table: pd.DataFrame  # one line per compared (row, metric)
    missing: list[tuple]  # baseline rows absent from the current run
    new: list[tuple]  # current rows absent from the baseline
    not_same_device: str  # why same_device rules were skipped, or ""

    @property
    def failures(self) -> int:
        return int((self.table["verdict"] == "FAIL").sum()) + len(self.missing)

    @property
    def passed(self) -> bool:
        return self.failures == 0


def compare(base: pd.DataFrame, cur: pd.DataFrame, rules: list[Rule]) -> Comparison:
    check_comparable(base, cur)
    not_same_device = same_device(base, cur)
    base_rows = {_key(r): r for _, r in base.iterrows()}
    cur_rows = {_key(r): r for _, r in cur.iterrows()}
    lines = []
    for key, b in base_rows.items():
        c = cur_rows.get(key)
        if c is None:
            continue
        for rule in rules:
            check = evaluate(rule, b[rule.metric], c[rule.metric], not_same_device)
            lines.append(
                (*key, rule.metric, b[rule.metric], c[rule.metric])
                + (check.ratio, check.limit, check.verdict)
            )
    table = pd.DataFrame(
        lines,
        columns=[*KEY, "metric", "baseline", "current", "ratio", "limit", "verdict"],
    )
    return Comparison(
        table,
        missing=[k for k in base_rows if k not in cur_rows],
        new=[k for k in cur_rows if k not in base_rows],
        not_same_device=not_same_device,
    )


def _key(row: pd.Series) -> tuple[str, str, int]:
    engine, mode, num_tokens = (row[k] for k in KEY)
    return engine, mode, int(num_tokens)


def render(comparison: Comparison) -> str:
    shown = comparison.table.copy()
    for column in ("baseline", "current", "ratio", "limit"):
        shown[column] = shown[column].map(_fmt)
    out = [shown.to_string(index=False) if len(shown) else "(nothing compared)"]
    out += [f"MISSING from current run: {_fmt_key(k)}" for k in comparison.missing]
    out += [f"new in current run (not gated): {_fmt_key(k)}" for k in comparison.new]
    if comparison.not_same_device:
        out.append(f"same_device rules skipped: {comparison.not_same_device}")
    checks = len(comparison.table)
    failed = int((comparison.table["verdict"] == "FAIL").sum())
    out.append(
        f"gate: {checks} checks, {failed} failed, {len(comparison.missing)} baseline "
        f"rows missing, {len(comparison.new)} new rows -> "
        + ("PASS" if comparison.passed else "FAIL")
    )
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if _missing(value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_key(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(KEY, key, strict=True))


# --------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perf/gate.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--current", type=Path, required=True)
    p.add_argument(
        "--rules", type=Path, help="default: rules.csv in the baseline's folder"
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="print the comparison, then replace the baseline with the current run",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rules_path = args.rules or args.baseline.parent / "rules.csv"
    try:
        rules = load_rules(rules_path)
        cur = load_sweep(args.current)
        if args.update:
            return update(args.baseline, args.current, cur, rules)
        comparison = compare(load_sweep(args.baseline), cur, rules)
    except Refused as why:
        print(f"gate: refused: {why}", file=sys.stderr)
        return REFUSED
    print(render(comparison))
    return PASS if comparison.passed else FAIL


def update(baseline: Path, current: Path, cur: pd.DataFrame, rules: list[Rule]) -> int:
    """Show what changes, then make the current run the baseline."""
    if baseline.exists():
        try:
            print(render(compare(load_sweep(baseline), cur, rules)))
        except Refused as why:
            print(f"gate: the old baseline is not comparable ({why}); replacing it")
    wrong = cur[cur["bit_exact"].map(lambda v: as_bool(v) is False)]
    if len(wrong):
        raise Refused(
            f"{len(wrong)} rows of {current} are not bit-exact; a baseline must be "
            "correct:\n" + wrong[KEY].to_string(index=False)
        )
    baseline.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(current, baseline)
    print(f"gate: baseline {baseline} updated from {current} ({len(cur)} rows)")
    return PASS


if __name__ == "__main__":
    sys.exit(main())
