#!/usr/bin/env bash
# GPU check for a CUDA machine WITHOUT vLLM (torch with CUDA, triton,
# nvidia-ml-py, and cg_extract's base dependencies: tqdm, pandas, matplotlib,
# plus pytest). Runs the cuda-marked tests (the runner imitation of
# tests/test_runner_imitation.py among them, whose capture times, graph memory
# and replays per path land in pytest.log), then a `kernel` sweep with real
# CUDA graphs and CUDA-event timing (capture cost in kernel.meta.json).
# Steps are capped (150 s + 120 s) so that the check fits in 5 minutes and a
# second try fits in a task's device time; they are stopped with SIGINT, on
# which pytest prints its summary and the sweep keeps its finished rows.
#
#   perf/gpu_check.sh OUTDIR
#
# OUTDIR gets: env.log, pytest.log, junit.xml, sweep.log, kernel.csv,
# kernel.png, kernel.meta.json, summary.txt. Exit status: 0 when the tests
# and the sweep both passed.
set -uo pipefail
OUT=${1:?usage: perf/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}

{
    date -u
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import importlib, importlib.util
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "pynvml", "tqdm", "pandas", "matplotlib", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except ImportError as why:
        print(name, "MISSING:", why)
print("vllm importable:", importlib.util.find_spec("vllm") is not None)
EOF
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if grep -q MISSING "$OUT/env.log" || ! "$PY" -c "import torch; assert torch.cuda.is_available()"; then
    echo "gpu_check: this machine lacks CUDA or a module listed as MISSING above" | tee "$OUT/summary.txt"
    exit 3
fi

# Other test files skip themselves without vLLM (importorskip); a collection
# error in one must not hide the results of the rest.
timeout -s INT -k 10 150 "$PY" -m pytest -m cuda tests/ -q -rA -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$OUT/junit.xml" \
    > "$OUT/pytest.log" 2>&1
tests_rc=$?

timeout -s INT -k 10 120 "$PY" perf/sweep.py --engine kernel --device cuda \
    --out "$OUT/kernel.csv" > "$OUT/sweep.log" 2>&1
sweep_rc=$?

{
    echo "pytest -m cuda tests/: exit $tests_rc"
    tail -n 1 "$OUT/pytest.log"
    grep '^runner_imitation:' "$OUT/pytest.log"
    echo "kernel sweep: exit $sweep_rc"
    tr '\r' '\n' < "$OUT/sweep.log" | grep -v '^sweep:' | tail -n 60
} | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$sweep_rc" -eq 0 ]
