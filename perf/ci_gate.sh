#!/usr/bin/env bash
# The CI perf gate: a short CPU sweep, then perf/gate.py; then a short sweep of
# vLLM's real engine on this CPU, then perf/gate.py on it.
#
#   perf/ci_gate.sh            # sweep + gate; exit 1 on a regression
#   perf/ci_gate.sh --update   # sweep, show the diff, make this run this machine's baseline
#
# The baseline is perf/baselines/cpu/<vendor>-f<family>-m<model>-s<stepping>.csv
# when this CPU model has one (timing ratios compared), else the reference
# perf/baselines/cpu.csv from another CPU (correctness, op and byte counts and the
# floors in rules.csv only); the gate's first line says which. The sweep's
# parameters live here only: the gate refuses a baseline made with others.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/ci_gate}

"$PY" perf/sweep.py \
    --engine speculator kernel --device cpu \
    --sizes 1 3 8 32 100 256 300 1024 \
    --hidden-size 1024 --layers 1 2 3 --dtype bf16 \
    --iters 100 --warmup 5 --batch 5 --threads 1 \
    --out "$OUT/sweep.csv"
"$PY" perf/gate.py --current "$OUT/sweep.csv" \
    --baseline perf/baselines/cpu.csv --machine-baselines perf/baselines/cpu "$@"

# vLLM's real engine on this CPU, the tiny dummy model, the target replaying
# its own graphs (vllm_on_cpu's fake graph API): gated on bit_exact, graph
# replays, zero-copy ones included (decode steps replay the target's FULL
# graphs), the target's FULL steps with ours, and zero-copy in exactly the
# steps due, every step of the worker's log judged, with 8 clients in flight:
# steps mixing prefills and decodes, then 8 requests decoding together
# (rules.csv); its timings are informative only. The modes the gate needs (no
# baseline: an engine start saved).
"$PY" perf/sweep.py \
    --engine vllm --device cpu --modes upstream eager graph \
    --workload decode --max-tokens 8 --sizes 8 --prompt-len 16 --clients 8 \
    --iters 1 --warmup 0 --threads 1 \
    --out "$OUT/vllm.csv"
# Only run rules apply (no timing or count of a whole engine is compared with
# a baseline), so --update leaves its baseline alone.
"$PY" perf/gate.py --current "$OUT/vllm.csv" \
    --baseline perf/baselines/cpu_vllm.csv
