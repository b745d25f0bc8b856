"""A STAND-IN for the CUDA steps of ``perf/gpu_check.sh``, on a machine
without CUDA: ``GPU_CHECK_STAND_IN=tests/torch_alone/gpu_check_stand_in.py`` makes the
script run ``$PY tests/torch_alone/gpu_check_stand_in.py tests|sweep|split COMMAND...`` instead
of ``$PY COMMAND...``, so that the verdict branches a GPU run takes run here.
Nothing it writes is a GPU result; the script's summary says so.

``GPU_CHECK_STAND_IN_OUTCOME`` picks what the steps give back:

* ``pass``: pytest runs two passing tests (a ``runner_imitation:`` line
  among them); the sweep is the real ``kernel`` sweep, on the CPU, small;
* ``failed``: one of the two tests fails;
* ``skipped``: the real ``pytest -m cuda tests/``, which skips every test here;
* ``not_exact``: as ``pass``, and one sweep row's ``bit_exact`` made False.

The split step (where vLLM imports) starts no engine: its stand-in writes
the two rows a run of both modes would, ``split``'s bit-exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUTCOME = os.environ.get("GPU_CHECK_STAND_IN_OUTCOME", "pass")
TESTS = """
def test_stand_in_passes():
    print("runner_imitation: STAND-IN, not a GPU figure")

def test_stand_in_{}():
    assert {}
"""


def stand_in_tests(command: list[str]) -> int:
    if OUTCOME == "skipped":
        return subprocess.call([sys.executable, *command])
    junit = next(a for a in command if a.startswith("--junitxml="))
    with tempfile.TemporaryDirectory() as folder:
        test_file = Path(folder) / "test_stand_in.py"
        failing = OUTCOME == "failed"
        test_file.write_text(
            TESTS.format(*(("fails", False) if failing else ("also_passes", True)))
        )
        return subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                str(test_file),
                "-q",
                "-rA",
                "-s",
                "-p",
                "no:cacheprovider",
                junit,
            ]  # fmt: skip
        )


def stand_in_sweep(command: list[str]) -> int:
    out = Path(command[command.index("--out") + 1])
    small = ["--device", "cpu", "--sizes", "1", "3", "--iters", "3", "--warmup", "0",
             "--hidden-size", "128", "--layers", "1", "2"]  # fmt: skip
    argv = [a for a in command if a not in ("--device", "cuda")]
    rc = subprocess.call([sys.executable, *argv, *small])
    if rc == 0 and OUTCOME == "not_exact":
        import pandas as pd

        frame = pd.read_csv(out)
        frame.loc[frame["bit_exact"].notna().idxmax(), "bit_exact"] = False
        frame.to_csv(out, index=False)
    return rc


SPLIT_ROWS = "engine,mode,num_tokens,tokens_per_s,bit_exact\nvllm,eager,8,50.0,\nvllm,split,8,40.0,True\n"


def stand_in_split(command: list[str]) -> int:
    out = Path(command[command.index("--out") + 1])
    out.write_text(SPLIT_ROWS)
    print(f"STAND-IN rows, no engine ran:\n{SPLIT_ROWS}")
    return 0


if __name__ == "__main__":
    step, *command = sys.argv[1:]
    steps = {"tests": stand_in_tests, "sweep": stand_in_sweep, "split": stand_in_split}
    sys.exit(steps[step](command))
