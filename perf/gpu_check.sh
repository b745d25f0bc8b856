#!/usr/bin/env bash
# GPU check for a CUDA machine WITHOUT vLLM (python3 with torch, triton,
# nvidia-ml-py, tqdm, pandas, matplotlib, pytest, hypothesis). Steps: env,
# collect (neither needs CUDA; without it the check stops after them), the
# cuda-marked tests, a `kernel` sweep, and where vLLM imports (not on the
# machines lent so far: the step then says so and passes) the whole engine
# with and without split_kv_cache_groups. perf/README.md ("GPU check") gives what
# each runs and writes, its cap (the whole check ends within 285 s plus the
# verdict; a capped step gets 5 s more, tests and sweep stopped by SIGINT) and
# the exit status: 0 passed, 1 a CUDA step failed, 2 could not start, 3 no
# CUDA here.
#
#   perf/gpu_check.sh OUTDIR        (PY=... to use another interpreter)
#
# OUTDIR gets two files (a GPU machine returns at most 8): summary.txt, one
# line per step and a verdict; gpu_check.tar.gz, every log and result.
# GPU_CHECK_STAND_IN=SCRIPT (tests/torch_alone/test_gpu_check.py only): a STAND-IN writes
# the CUDA steps' results (`$PY SCRIPT tests|sweep ARGS...`); summary.txt says so.
set -uo pipefail
OUT=${1:?usage: perf/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
STAND_IN=${GPU_CHECK_STAND_IN:-}
SUMMARY="$OUT/summary.txt" ARCHIVE="$OUT/gpu_check.tar.gz"
rm -f "$ARCHIVE"
: > "$SUMMARY"
# The steps write here; on exit it becomes the one archive.
W=$(mktemp -d "$OUT/gpu_check.XXXXXX")
trap 'tar -czf "$ARCHIVE" -C "$W" . && rm -rf "$W"' EXIT
not_started=() failed=()

note() { echo "$*" | tee -a "$SUMMARY"; }
joined() { printf '%s; ' "$@" | sed 's/; $//'; }
verdict() {
    note "gpu_check: $2${STAND_IN:+ [STAND-IN results: no GPU ran]}"
    exit "$1"
}
BUDGET=285 START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
# timed SECONDS SIGNAL LOG CMD...: runs CMD under a cap; sets rc and took.
timed() {
    local cap=$1 sig=$2 log=$3 start=$SECONDS
    shift 3
    timeout -s "$sig" -k 5 "$cap" "$@" > "$log" 2>&1
    rc=$? took=$((SECONDS - start))
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then rc=capped; fi  # 137: it ignored $sig
}

# --- env ---------------------------------------------------------------------
timed 90 KILL "$W/env.log" bash -c 'date -u; timeout 10 nvidia-smi || echo "nvidia-smi failed"
"$0" - <<EOF
import importlib, importlib.util
import torch
print("python", __import__("sys").version.split()[0])
print("torch", torch.__version__, "CUDA", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "pynvml", "tqdm", "pandas", "matplotlib", "pytest", "hypothesis"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "ok"))
    except ImportError as why:
        print(name, "MISSING:", why)
print("vllm importable:", importlib.util.find_spec("vllm") is not None)
print("cuda available:", torch.cuda.is_available())
EOF' "$PY"
cat "$W/env.log"
if ! grep -q '^cuda available:' "$W/env.log"; then
    note "env: $PY could not list the environment (exit $rc, ${took} s; env.log)"
    verdict 2 "could not start: $PY with torch is needed (set PY=...)"
fi
missing=$(grep MISSING "$W/env.log" | cut -d' ' -f1 | paste -sd ' ' -)
note "env: ${took} s; $(grep '^torch ' "$W/env.log")${missing:+; MISSING: $missing}"
[ -n "$missing" ] && not_started+=("modules missing: $missing")
# The split step's share of the budget, taken from the others where it runs.
split_keep=0
grep -q '^vllm importable: True' "$W/env.log" && split_keep=120

# --- collect: needs no CUDA --------------------------------------------------
timed 90 KILL "$W/collect.log" "$PY" -m pytest tests/ --collect-only -q -p no:cacheprovider
errors=$(grep -E '^ERROR ' "$W/collect.log" | sed 's/^ERROR //' | paste -sd ' ' -)
note "collect: exit $rc, ${took} s: $(tail -n 1 "$W/collect.log")"
if [ "$rc" = capped ]; then
    not_started+=("collecting tests/ ran past its 90 s cap")
elif [ "$rc" != 0 ]; then
    not_started+=("tests/ does not collect (exit $rc): ${errors:-see collect.log}")
fi

if [ -n "$STAND_IN" ]; then
    note "STAND-IN: no GPU ran; the CUDA steps' results below come from $STAND_IN"
elif ! grep -q '^cuda available: True' "$W/env.log"; then
    [ ${#not_started[@]} -gt 0 ] && verdict 2 "could not start: $(joined "${not_started[@]}")"
    verdict 3 "no CUDA here: torch sees no CUDA device; env and collect passed, the CUDA steps did not run"
fi
[ -n "$missing" ] && verdict 2 "could not start: $(joined "${not_started[@]}")"

# --- tests: CUDA -------------------------------------------------------------
# A collection error must not hide the results of the other files.
cap=$(($(left) - 5 - 75 - 5 - split_keep))  # the sweep keeps 75 s
cap=$((cap > 140 ? 140 : (cap < 10 ? 10 : cap)))
timed $cap INT "$W/pytest.log" "$PY" ${STAND_IN:+"$STAND_IN" tests} -m pytest -m cuda \
    tests/ -q -rA -p no:cacheprovider --continue-on-collection-errors --junitxml="$W/junit.xml"
note "tests: exit $rc, ${took} s: $(tail -n 1 "$W/pytest.log")"
grep '^runner_imitation:' "$W/pytest.log" | tee -a "$SUMMARY"
# pytest exits 0 when every test skipped: a run with no cuda test run is no pass.
ran=$("$PY" -c 'import sys, xml.etree.ElementTree as E
s = E.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s.find("testsuite")
print(int(s.get("tests")) - int(s.get("skipped")))' "$W/junit.xml" 2>/dev/null) || ran=unknown
case $rc in  # pytest: 1 some failed; 2 to 5 it ran none or stopped
    0) [ "$ran" = 0 ] && failed+=("every cuda test skipped (pytest.log)")
       [ "$ran" = unknown ] && failed+=("junit.xml unreadable: how many cuda tests ran is unknown") ;;
    1) failed+=("cuda tests (pytest.log)") ;;
    capped) failed+=("the cuda tests reached their ${cap} s cap") ;;
    *) not_started+=("pytest -m cuda ran no tests (exit $rc, pytest.log)") ;;
esac

# --- sweep: CUDA -------------------------------------------------------------
cap=$(($(left) - 5 - split_keep))
cap=$((cap < 10 ? 10 : cap))
timed $cap INT "$W/sweep.log" "$PY" ${STAND_IN:+"$STAND_IN" sweep} perf/sweep.py \
    --engine kernel --device cuda --out "$W/kernel.csv"
note "sweep: exit $rc, ${took} s"
table() { tr '\r' '\n' < "$1" | grep -v '^sweep:' | tail -n "$2" | tee -a "$SUMMARY"; }
table "$W/sweep.log" 60
case $rc in  # sweep: 2 refused its arguments or no mode can run
    0) ;;
    2) not_started+=("the kernel sweep refused to run (sweep.log)") ;;
    capped) failed+=("the kernel sweep reached its ${cap} s cap (kernel.csv has the rows that finished)") ;;
    *) failed+=("kernel sweep (exit $rc, sweep.log)") ;;
esac
# inexact CSV: whether a sweep's CSV has rows with bit_exact False (printed).
inexact() {
    [ -s "$1" ] && ! "$PY" - "$1" <<'EOF'
import sys
import pandas as pd
frame = pd.read_csv(sys.argv[1])
wrong = frame[frame["bit_exact"].eq(False)]
print(wrong[["mode", "num_tokens"]].to_string(index=False) if len(wrong) else "")
sys.exit(1 if len(wrong) else 0)
EOF
}
inexact "$W/kernel.csv" && failed+=("kernel sweep rows with bit_exact False")

# --- split: CUDA and vLLM ----------------------------------------------------
# What split_kv_cache_groups costs a decode step: vLLM's engine on a tiny
# dummy GPT-OSS, ours eager without and with the key (split's files must be
# eager's, bit_exact). The GPU machines lent so far have no vLLM (nor room
# for it): there the step is not run, and says so, without failing.
split=""
if [ "$split_keep" = 0 ]; then
    note "split: not run: vLLM is not importable here (env.log), and the split_kv_cache_groups measurement runs vLLM's engine (its CPU figures: docs/measurements.md)"
else
    cap=$(($(left) - 5))
    cap=$((cap < 10 ? 10 : cap))
    timed $cap INT "$W/split.log" "$PY" ${STAND_IN:+"$STAND_IN" split} perf/sweep.py \
        --engine vllm --device cuda --family gpt_oss --modes eager split \
        --workload decode --sizes 8 --clients 8 --prompt-len 64 --max-tokens 16 \
        --iters 3 --warmup 1 --out "$W/split.csv"
    note "split: exit $rc, ${took} s"
    table "$W/split.log" 6
    case $rc in
        0) split=", the kernel sweep and the split_kv_cache_groups measurement" ;;
        capped) failed+=("the split measurement reached its ${cap} s cap") ;;
        *) failed+=("split measurement (exit $rc, split.log)") ;;
    esac
    inexact "$W/split.csv" && failed+=("split rows with bit_exact False (split.csv)")
fi

[ ${#not_started[@]} -gt 0 ] && verdict 2 "could not start: $(joined "${not_started[@]}")"
[ ${#failed[@]} -gt 0 ] && verdict 1 "a CUDA step failed: $(joined "${failed[@]}")"
verdict 0 "passed: the cuda tests ($ran run)${split:- and the kernel sweep}"
