"""Gate a sweep CSV; exit 1 when it regresses.

    python perf/gate.py --current out/ci_gate/sweep.csv --baseline perf/baselines/cpu.csv \
        --machine-baselines perf/baselines/cpu [--update]

The checks are data (``rules.csv`` next to ``--baseline``, else
perf/baselines/rules.csv): each selects rows
by mode and token count and checks its metric on the current run alone
(``run``; ``cpu_run``: a CPU run only), against any baseline (``baseline``), or against a baseline from
the same machine model (``same_machine``) or GPU (``same_gpu``). The baseline
is ``--machine-baselines``/<machine>.csv when there is one, else the reference
``--baseline``; the output says which. perf/README.md ("The gate") explains
the rules. Exit 0 pass, 1 regression, 2 refused (one line on stderr naming
the file and the problem).
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

from perf.machine import machine_key
from perf.report import COLUMNS, KEY, MEASURED, PARAMETERS, TEXT

PASS, FAIL, REFUSED = 0, 1, 2
RULE_COLUMNS = ["metric", "engines", "modes", "tokens", "where", "direction", "limit",
                "why"]  # fmt: skip
WHERE = ("run", "cpu_run", "baseline", "same_machine", "same_gpu")
RUN_ALONE = ("run", "cpu_run")
DIRECTIONS = ("true", "higher", "lower")
# Measured figures a sweep writes as a number >= 0, or leaves empty (NaN) where
# it has none (NVML on a CPU, a speedup without its reference row); anything
# else in a CSV is refused before a rule sees it.
VERDICTS = ("bit_exact", "close_to_upstream", "zero_copy_where_due")
FIGURES = [c for c in MEASURED if c not in (*KEY, "device", *VERDICTS, *TEXT)]
# ... and these every row has: a timed step takes some time.
TIMED = ["p50_us"]


class Refused(Exception):
    """The input cannot be gated; the message names the file and the problem."""


@dataclass(frozen=True)
class Rule:
    line: int  # its number among the rules file's rules, from 1
    metric: str
    engines: str  # names; "*" every one; "!name" every one but that one
    modes: str  # the same, for modes
    min_tokens: int
    max_tokens: float
    where: str
    direction: str
    limit: float  # run: the bound itself; otherwise the relative tolerance
    why: str

    def applies(self, engine: str, mode: str, num_tokens: int) -> bool:
        return (
            _selects(self.engines, engine)
            and _selects(self.modes, mode)
            and self.min_tokens <= num_tokens <= self.max_tokens
        )

    def describe(self) -> str:
        return (
            f"rule {self.line} ({self.metric}, engines {self.engines}, "
            f"modes {self.modes})"
        )


def _selects(spec: str, name: str) -> bool:
    names = spec.split()
    wanted = [n for n in names if not n.startswith("!")]
    if f"!{name}" in names:
        return False
    return not wanted or "*" in wanted or name in wanted


# --------------------------------------------------------------------------
# Loading


def load_rules(path: Path) -> list[Rule]:
    frame = _read_csv(path, "rules", comment="#", dtype=str, keep_default_na=False)
    frame.columns = [c.strip() for c in frame.columns]
    if list(frame.columns) != RULE_COLUMNS:
        raise Refused(
            f"rules {path}: columns must be {RULE_COLUMNS}, got {list(frame.columns)}"
        )
    known = known_modes()
    rules = []
    for line, r in enumerate(frame.to_dict("records"), start=1):
        r = {k: v.strip() for k, v in r.items()}
        at = f"rules {path} rule {line} ({r['metric']})"
        if r["metric"] not in COLUMNS:
            raise Refused(f"{at}: {r['metric']!r} is not a sweep column")
        if r["where"] not in WHERE:
            raise Refused(f"{at}: where {r['where']!r} is not one of {WHERE}")
        if r["direction"] not in DIRECTIONS:
            raise Refused(f"{at}: direction {r['direction']!r} not one of {DIRECTIONS}")
        limit = 0 if r["direction"] == "true" and not r["limit"] else r["limit"]
        limit = float(pd.to_numeric(limit, errors="coerce"))
        if not limit >= 0 or math.isinf(limit):
            raise Refused(f"{at}: limit {r['limit']!r} is not a number >= 0")
        low, high = _token_range(r["tokens"], at)
        engines, modes = r["engines"] or "*", r["modes"] or "*"
        _check_names(at, "engine", engines, list(known))
        selected = [e for e in known if _selects(engines, e)]
        _check_names(at, "mode", modes, sorted({m for e in selected for m in known[e]}))
        rule = Rule(line, r["metric"], engines, modes, low, high, r["where"],
                    r["direction"], limit, r["why"])  # fmt: skip
        rules.append(rule)
    return rules


def known_modes() -> dict[str, list[str]]:
    """Every engine the sweep has, and its modes: what a rule may name."""
    from perf.engines import ENGINE_MODULES, engine_modes

    return {engine: engine_modes(engine) for engine in ENGINE_MODULES}


def _check_names(at: str, kind: str, spec: str, known: list[str]) -> None:
    """A name no sweep can produce is a typo that would switch the rule off."""
    for name in spec.split():
        bare = name.removeprefix("!")
        if bare != "*" and bare not in known:
            raise Refused(
                f"{at}: {kind} {name!r} is not one the sweep has "
                f"(its {kind}s here: {', '.join(known)})"
            )


def _token_range(text: str, at: str) -> tuple[int, float]:
    """``*``, ``N``, ``N-`` or ``N-M``."""
    if text in ("", "*"):
        return 1, math.inf
    low, dash, high = text.partition("-")
    try:
        low, high = int(low), (int(high) if high else math.inf) if dash else int(low)
    except ValueError:
        raise Refused(f"{at}: tokens {text!r} is not *, N, N- or N-M") from None
    if not 1 <= low <= high:
        # Would select no row, and a rule that selects nothing passes.
        raise Refused(f"{at}: tokens {text!r} selects no size; N-M needs 1 <= N <= M")
    return low, high


def load_sweep(path: Path, role: str) -> pd.DataFrame:
    """A sweep CSV that can be gated: rows, keys that are whole token counts,
    each key once."""
    frame = _read_csv(path, role)
    at = f"{role} {path}"
    absent = [c for c in [*KEY, "device", "device_name"] if c not in frame.columns]
    if absent:
        raise Refused(f"{at}: not a sweep CSV (no column {', '.join(absent)})")
    if frame.empty:
        raise Refused(f"{at}: no rows (a header only)")
    tokens = pd.to_numeric(frame["num_tokens"], errors="coerce")
    bad = ~((tokens >= 1) & (tokens % 1 == 0))
    if bad.any():
        i = bad.idxmax()
        raise Refused(
            f"{at}: line {i + 2}: num_tokens {frame['num_tokens'][i]!r} is not a "
            "whole number >= 1"
        )
    frame["num_tokens"] = tokens.astype(int)
    _check_figures(frame, at)
    twice = frame.duplicated(KEY)
    if twice.any():
        raise Refused(f"{at}: {_fmt_key(_key(frame[twice].iloc[0]))} appears twice")
    if frame["device_name"].nunique() != 1:
        raise Refused(f"{at}: rows from several machines {_names(frame)}")
    return frame


def _check_figures(frame: pd.DataFrame, at: str) -> None:
    """Refuse a figure no measurement gives: negative, infinite or not a
    number at all, or a row without a p50 (a rule would count such a value
    as better, or skip it)."""
    for column in [c for c in FIGURES if c in frame.columns]:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = (
            (values < 0)
            | values.abs().eq(math.inf)
            | (values.isna() & frame[column].notna())
        )
        if column in TIMED:
            bad |= ~(values > 0)
        if bad.any():
            i = bad.idxmax()
            value = frame[column][i]
            shown = repr(value) if isinstance(value, str) else str(float(value))
            raise Refused(
                f"{at}: line {i + 2} ({_fmt_key(_key(frame.loc[i]))}): {column} "
                f"{shown} is not "
                + ("a time > 0" if column in TIMED else "a number >= 0")
            )


def _read_csv(path: Path, role: str, **kwargs) -> pd.DataFrame:
    if not path.is_file():
        raise Refused(f"{role} {path}: no such file")
    try:
        return pd.read_csv(path, **kwargs)
    except pd.errors.EmptyDataError:
        raise Refused(f"{role} {path}: empty file") from None
    except (OSError, ValueError) as why:  # ParserError and decode errors included
        raise Refused(f"{role} {path}: cannot read: {why}") from None


# --------------------------------------------------------------------------
# What the two runs have in common


def check_comparable(base: pd.DataFrame, cur: pd.DataFrame) -> None:
    """Refuse runs that measured different things."""
    if list(base.columns) != list(cur.columns):
        added = [c for c in cur.columns if c not in base.columns]
        removed = [c for c in base.columns if c not in cur.columns]
        raise Refused(
            f"the CSVs have different schemas (current adds {added}, drops "
            f"{removed}{', or orders columns differently' if not added + removed else ''})"
            "; regenerate the baseline with --update"
        )
    devices = sorted(set(base["device"])), sorted(set(cur["device"]))
    if devices[0] != devices[1]:
        raise Refused(
            f"baseline ran on {devices[0]}, current on {devices[1]}; compare "
            "against a baseline made on the same kind of device"
        )
    for engine in sorted(set(base["engine"]) & set(cur["engine"])):
        for column in PARAMETERS:
            want, got = _values(base, engine, column), _values(cur, engine, column)
            if want != got:
                raise Refused(
                    f"engine {engine!r}: parameter {column} is {got} in the current "
                    f"run but {want} in the baseline; the sweeps measured different "
                    "things"
                )


def _values(frame: pd.DataFrame, engine: str, column: str) -> list[str]:
    return sorted({str(v) for v in frame.loc[frame["engine"] == engine, column]})


def key_of(frame: pd.DataFrame) -> str | None:
    return machine_key(frame["device"].iloc[0], frame["device_name"].iloc[0])


def why_not_comparable(base: pd.DataFrame, cur: pd.DataFrame) -> dict[str, str]:
    """For each baseline ``where``, empty when its rules apply, else why not."""
    keys = key_of(base), key_of(cur)
    if keys[0] is None:
        machine = f"the baseline's machine is unknown ({_names(base)}, no CPU identity)"
    elif keys[0] != keys[1]:
        machine = f"another machine (baseline {keys[0]}, current {keys[1]})"
    else:
        machine = ""
    gpu = "not a GPU run" if base["device"].iloc[0] != "cuda" else machine
    cpu = "" if cur["device"].iloc[0] == "cpu" else "not a CPU run"
    return {"baseline": "", "same_machine": machine, "same_gpu": gpu, "cpu_run": cpu}


def _names(frame: pd.DataFrame) -> str:
    return ", ".join(sorted(set(frame["device_name"])))


# --------------------------------------------------------------------------
# Checking


@dataclass(frozen=True)
class Check:
    verdict: str  # ok, better (an improvement beyond the tolerance), FAIL
    limit: Any = math.nan


def check_run(rule: Rule, cur: Any) -> Check:
    if rule.direction == "true":
        return Check("ok" if as_bool(cur) is True else "FAIL", True)
    if _missing(cur):
        return Check("FAIL", "a value")
    ok = cur >= rule.limit if rule.direction == "higher" else cur <= rule.limit
    return Check("ok" if ok else "FAIL", rule.limit)


def check_baseline(rule: Rule, base: Any, cur: Any) -> Check | None:
    """None when neither run has the figure."""
    if rule.direction == "true":
        return check_run(rule, cur)
    if _missing(base) and _missing(cur):
        return None
    if _missing(cur):
        return Check("FAIL", "a value")  # the run lost a measurement
    if _missing(base):
        return Check("ok")  # a new measurement
    sign = 1 if rule.direction == "lower" else -1  # lower is better: +1
    limit = base * (1 + sign * rule.limit)
    if sign * (cur - limit) > 0:
        return Check("FAIL", limit)
    better = sign * (cur - base * (1 - sign * rule.limit)) < 0
    return Check("better" if better else "ok", limit)


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
    table: pd.DataFrame  # one line per (row, rule) checked
    missing: list[tuple]  # baseline rows absent from the current run
    new: list[tuple]  # current rows absent from the baseline
    skipped: dict[str, str]  # where -> why its rules were not applied
    unmatched: list[str]  # rules that select no row of the current run

    def count(self, verdict: str) -> int:
        return int((self.table["verdict"] == verdict).sum())

    @property
    def passed(self) -> bool:
        return self.count("FAIL") == 0 and not self.missing


def compare(base: pd.DataFrame, cur: pd.DataFrame, rules: list[Rule]) -> Comparison:
    check_comparable(base, cur)
    skipped = {w: why for w, why in why_not_comparable(base, cur).items() if why}
    base_rows = {_key(r): r for _, r in base.iterrows()}
    lines = []
    matched: set[int] = set()
    for _, c in cur.iterrows():
        key = _key(c)
        b = base_rows.get(key)
        for rule in rules:
            if not rule.applies(*key):
                continue
            matched.add(rule.line)
            if rule.where in skipped:
                continue
            m = rule.metric
            if rule.where in RUN_ALONE:
                check = check_run(rule, c[m])
            elif b is None:
                continue
            else:
                check = check_baseline(rule, b[m], c[m])
            if check is not None:
                base_value = math.nan if b is None or rule.where in RUN_ALONE else b[m]
                lines.append(
                    (*key, m, rule.where, base_value, c[m], check.limit, check.verdict)
                )
    columns = [*KEY, "metric", "where", "baseline", "current", "limit", "verdict"]
    cur_keys = {_key(r) for _, r in cur.iterrows()}
    return Comparison(
        pd.DataFrame(lines, columns=columns),
        missing=[k for k in base_rows if k not in cur_keys],
        new=[k for k in cur_keys if k not in base_rows],
        skipped=skipped,
        unmatched=[r.describe() for r in rules if r.line not in matched],
    )


def _key(row: pd.Series) -> tuple[str, str, int]:
    engine, mode, num_tokens = (row[k] for k in KEY)
    return engine, mode, int(num_tokens)


def render(comparison: Comparison, against: str = "") -> str:
    shown = comparison.table.copy()
    for column in ("baseline", "current", "limit"):
        shown[column] = shown[column].map(_fmt)
    out = [shown.to_string(index=False) if len(shown) else "(nothing compared)"]
    out += [f"MISSING from current run: {_fmt_key(k)}" for k in comparison.missing]
    out += [f"new in current run: {_fmt_key(k)}" for k in sorted(comparison.new)]
    out += [f"{w} rules not applied: {why}" for w, why in comparison.skipped.items()]
    out += [f"{r}: no row of the current run" for r in comparison.unmatched]
    out.append(
        f"gate: {'PASS' if comparison.passed else 'FAIL'}: {len(shown)} checks, "
        f"{comparison.count('FAIL')} failed, {comparison.count('better')} better, "
        f"{len(comparison.missing)} baseline rows missing, {len(comparison.new)} new"
        + (f"; {against}" if against else "")
    )
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if _missing(value):
        return ""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4g}"
    return str(int(value)) if isinstance(value, float) else str(value)


def _fmt_key(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(KEY, key, strict=True))


# --------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perf/gate.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--current", type=Path, required=True, help="the sweep CSV to gate")
    p.add_argument("--baseline", type=Path, required=True, help="the reference")
    p.add_argument("--machine-baselines", type=Path, help="folder of <machine>.csv")
    p.add_argument(
        "--rules",
        type=Path,
        help="default: rules.csv next to --baseline, else perf/baselines/rules.csv",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="print the comparison, then make the current run this machine "
        "model's baseline, <machine>.csv in --machine-baselines (required)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return gate(args)
    except Refused as why:
        print(f"gate: refused: {' '.join(str(why).split())}", file=sys.stderr)
        return REFUSED


def gate(args: argparse.Namespace) -> int:
    cur = load_sweep(args.current, "current run")
    base_path, target, note = choose_baseline(args, cur)
    if args.update:
        return update(args, cur, target)
    base = load_sweep(base_path, "baseline")
    rules = load_rules(rules_path(args))
    try:
        comparison = compare(base, cur, rules)
    except Refused as why:
        raise Refused(
            f"baseline {base_path}, current run {args.current}: {why}"
        ) from None
    print(note)
    print(render(comparison, f"baseline {base_path}"))
    return PASS if comparison.passed else FAIL


PROJECT_RULES = Path(__file__).resolve().parent / "baselines" / "rules.csv"


def rules_path(args: argparse.Namespace) -> Path:
    """--rules, else the rules.csv next to --baseline, else the project's."""
    if args.rules:
        return args.rules
    beside = args.baseline.parent / "rules.csv"
    return beside if beside.is_file() else PROJECT_RULES


def choose_baseline(args: argparse.Namespace, cur: pd.DataFrame):
    """(the baseline to compare with, the one --update writes, why)."""
    if not args.machine_baselines:
        if args.update:
            raise Refused(
                f"--update writes this machine model's baseline into "
                f"--machine-baselines DIR and never the reference {args.baseline}; "
                "add --machine-baselines (e.g. perf/baselines/cpu), or copy the "
                "CSV over the reference yourself if that is what you mean"
            )
        return args.baseline, args.baseline, f"gate: baseline {args.baseline}"
    key = key_of(cur)
    if key is None:
        raise Refused(
            f"current run {args.current}: no machine identity in its device_name "
            f"({_names(cur)}), so no baseline of its own can be chosen"
        )
    own = args.machine_baselines / f"{key}.csv"
    if own.is_file():
        return own, own, f"gate: baseline {own}: made on this machine model ({key})"
    return (
        args.baseline,
        own,
        (
            f"gate: baseline {args.baseline}: the reference, as there is no {own} for "
            "this machine model; timing ratios are checked only through the floors"
        ),
    )


def update(args: argparse.Namespace, cur: pd.DataFrame, target: Path) -> int:
    """Show what changes, then make the current run the baseline."""
    if target.is_file():
        rules = load_rules(rules_path(args))
        try:
            print(render(compare(load_sweep(target, "old baseline"), cur, rules)))
        except Refused as why:
            print(f"gate: the old baseline is not comparable ({why}); replacing it")
    wrong = cur[cur["bit_exact"].map(lambda v: as_bool(v) is False)]
    if len(wrong):
        raise Refused(
            f"current run {args.current}: {len(wrong)} rows are not bit-exact "
            f"(first: {_fmt_key(_key(wrong.iloc[0]))}); a baseline must be correct"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.current, target)
    print(f"gate: baseline {target} updated from {args.current} ({len(cur)} rows)")
    return PASS


if __name__ == "__main__":
    sys.exit(main())
