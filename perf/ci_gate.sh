#!/usr/bin/env bash
# The CI perf gate: a short CPU sweep, then perf/gate.py against the CPU baseline.
#
#   perf/ci_gate.sh            # sweep + gate; exit 1 on a regression
#   perf/ci_gate.sh --update   # sweep, show the diff, make this run the baseline
#
# The sweep's parameters live here only: the baseline was made by this script,
# and the gate refuses a run with other parameters. About a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/ci_gate}
BASELINE=perf/baselines/cpu.csv

"$PY" perf/sweep.py \
    --engine speculator kernel --device cpu \
    --sizes 1 3 8 32 100 256 300 1024 \
    --hidden-size 1024 --layers 1 2 3 --dtype bf16 \
    --iters 100 --warmup 5 --batch 5 --threads 1 \
    --out "$OUT/sweep.csv"
"$PY" perf/gate.py --baseline "$BASELINE" --current "$OUT/sweep.csv" "$@"
