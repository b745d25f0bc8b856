"""The Makefile's install: PyTorch's CPU index only where pip cannot find
torch==2.13.0+cpu without one, decided without the network."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """A venv with pip and no torch, as `make venv` starts from."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    return venv


def torch_index(venv: Path, **env: str) -> str:
    started = time.monotonic()
    proc = subprocess.run(
        ["make", "-s", "torch-index", f"VENV={venv}"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 60, "the probe must not wait on a network"
    return proc.stdout.strip()


def test_a_machine_without_the_wheel_gets_pytorchs_index(bare_venv):
    # No pip configuration and no local folder: a plain machine.
    assert (
        torch_index(bare_venv, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="") == INDEX
    )


def test_a_machine_with_the_wheel_gets_no_index(bare_venv):
    """Here, where pip is configured with a folder holding the wheel (and
    PyTorch's index cannot be reached), nothing is added."""
    folder = Path(os.environ.get("PIP_FIND_LINKS") or "/opt/wheels")
    if not list(folder.glob("torch-2.13.0+cpu-*.whl")):
        pytest.skip("this machine keeps no torch==2.13.0+cpu wheel locally")
    assert torch_index(bare_venv) == ""


def test_an_installed_torch_counts_as_found():
    venv = Path(sys.executable).parent.parent  # this one has torch 2.13.0+cpu
    import torch

    if torch.__version__ != "2.13.0+cpu":
        pytest.skip(f"torch {torch.__version__} here")
    assert torch_index(venv, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="") == ""


def test_our_tests_package_wins_over_an_installed_one(tmp_path):
    """A GPU machine may have a regular ``tests`` package installed (many
    distributions ship one); a namespace ``tests/`` of ours would lose to it
    wherever it sits on ``sys.path``, and ``from tests.write_cases import``
    would fail in collection and in the engine subprocesses."""
    installed = tmp_path / "site" / "tests"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{installed.parent}"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tests.write_cases, tests; print(tests.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(REPO / "tests" / "__init__.py")
