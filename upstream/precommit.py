"""vLLM's pre-commit hooks on the series, applied to vLLM's own source tree.

    python upstream/precommit.py [--version 0.34.0] [--patches DIR]

Runs every hook of the release's ``.pre-commit-config.yaml`` that selects a
file the series touches, as pre-commit runs it on a commit's changed files
(its ``files``, ``exclude``, ``types``, ``types_or`` and stages), in a copy
of the release's source distribution (``compat/vllm_release.py``) with the
series applied (``git apply``, full context). Exits non-zero on any finding,
and on any selecting hook it cannot run. vLLM's GitHub CI runs the same
hooks with ``--all-files``; the files the series leaves alone are vLLM's.

pre-commit itself would clone each hook's repository, which this CI cannot
reach, so each tool comes from the package registry at the version the hook
pins: ruff and typos at their repository's ``rev``, the local hooks'
``additional_dependencies`` (mypy's included) as listed. They are installed
by this script into a virtual environment of their own under
``$CG_EXTRACT_CACHE`` (never the project's: vLLM pins another ruff), once per
set of pins. mypy's cache lives beside the source distributions
(``$CG_EXTRACT_CACHE/mypy-<version>``).

The hooks' fixes are findings here: ruff check runs without ``--fix``, ruff
format with ``--check``, typos without ``--write-changes``. The two hooks that
read ``git ls-files`` (check-filenames, check-dockerignore-tracked) see a git
index holding the series' files alone. The sign-off hook (commit-msg stage)
is the submitter's (upstream/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import apply_series  # noqa: E402

from compat import vllm_release  # noqa: E402

VERSION = "0.34.0"

# The remote hooks as their repositories' .pre-commit-hooks.yaml define them
# (entry, file filters), with the registry package that is the same tool at
# the hook's ``rev``. One without an entry has no runner here: it must select
# no file of the series.
REMOTE = {
    "ruff-check": {
        "entry": ["ruff", "check", "--force-exclude"],
        "types_or": ["python", "pyi", "jupyter"],
        "package": "ruff",
    },
    "ruff-format": {
        "entry": ["ruff", "format", "--force-exclude", "--check"],
        "types_or": ["python", "pyi", "jupyter"],
        "package": "ruff",
    },
    "typos": {"entry": ["typos"], "types": ["text"], "package": "typos"},
    "clang-format": {},  # the config gives its types_or
    "markdownlint-cli2": {"types": ["markdown"]},
    "actionlint": {"files": r"^\.github/workflows/", "types": ["yaml"]},
    "shellcheck": {"types": ["shell"]},
    "pip-compile": {},
    "check-json": {"types": ["json"]},
}
# The hooks that run ``git ls-files`` (one in its entry, one in its script).
GIT_HOOKS = {"check-filenames", "check-dockerignore-tracked"}
# Arguments the config gives that would change files instead of reporting.
FIXING_ARGS = {"--fix", "--write-changes", "-w"}
# What identify (pre-commit's file typing) says of the extensions the series
# may touch; any other extension is refused rather than guessed.
TAGS = {
    ".py": {"file", "text", "python"},
    ".pyi": {"file", "text", "pyi"},
    ".yaml": {"file", "text", "yaml"},
    ".yml": {"file", "text", "yaml"},
    ".md": {"file", "text", "markdown"},
    ".txt": {"file", "text", "plain-text"},
    ".json": {"file", "text", "json"},
}


def tags(path: str) -> set[str]:
    suffix = Path(path).suffix
    if suffix not in TAGS:
        raise ValueError(f"{path}: no file type known here for {suffix!r}")
    return TAGS[suffix]


@dataclass
class Hook:
    id: str
    repo: str
    rev: str | None
    spec: dict

    @property
    def remote(self) -> dict:
        return REMOTE.get(self.id, {}) if self.repo != "local" else {}

    @property
    def runnable(self) -> bool:
        return self.repo == "local" or "entry" in self.remote

    def option(self, key: str, default=None):
        return self.spec.get(key, self.remote.get(key, default))

    def stages(self, config: dict) -> list[str]:
        return self.spec.get("stages", config.get("default_stages", ["pre-commit"]))

    def selects(self, path: str, config: dict) -> bool:
        """Whether pre-commit would hand this hook ``path``."""
        if re.search(config.get("exclude", "^$"), path):
            return False
        if not re.search(self.option("files", ""), path):
            return False
        if re.search(self.option("exclude", "^$"), path):
            return False
        have = tags(path)
        types, types_or = self.option("types", ["file"]), self.option("types_or", [])
        return set(types) <= have and (not types_or or bool(have & set(types_or)))


def hooks(config: dict) -> list[Hook]:
    return [
        Hook(hook["id"], repo["repo"], repo.get("rev"), hook)
        for repo in config["repos"]
        for hook in repo["hooks"]
    ]


def pins(config: dict) -> list[str]:
    """The registry packages of every hook that runs here, at its pins."""
    found = set()
    for hook in hooks(config):
        if hook.repo == "local":
            if hook.spec.get("language") == "python":
                found.update(hook.spec.get("additional_dependencies", []))
        elif "package" in hook.remote:
            found.add(f"{hook.remote['package']}=={hook.rev.removeprefix('v')}")
    return sorted(found)


def tool_env(config: dict) -> Path:
    """The hooks' virtual environment, made and filled when missing."""
    wanted = pins(config)
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:12]
    env = vllm_release.cache_dir() / f"precommit-tools-{digest}"
    if (env / "installed").is_file():
        return env
    shutil.rmtree(env, ignore_errors=True)
    venv.create(env, with_pip=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    done = subprocess.run([*pip, *wanted], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"installing {wanted} failed:\n{done.stdout}{done.stderr}")
    (env / "installed").write_text("\n".join(wanted) + "\n")
    return env


def series_tree(
    version: str, series: list[Path] | None = None
) -> tuple[Path, list[str]]:
    """The release's source tree with the series applied (hard links to the
    unpacked source distribution, the touched files real copies), at a fixed
    place so that mypy's cache stays valid; and the files the series touches."""
    sdist = vllm_release.sdist(version)
    tree = vllm_release.cache_dir() / "precommit" / f"vllm-{version}-series"
    shutil.rmtree(tree, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(sdist, tree, copy_function=os.link, symlinks=True)
    touched: list[str] = []
    for patch in apply_series.patches() if series is None else series:
        for path in apply_series.touched(patch):
            apply_series.own_copy(tree / path)
            touched.append(path)
        done = apply_series.git_apply(patch, tree)
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply:\n{done.stderr}")
    return tree, sorted(set(touched))


def hook_command(hook: Hook, env: Path) -> list[str]:
    if hook.repo != "local":
        entry = list(hook.remote["entry"])
        entry[0] = str(env / "bin" / entry[0])
        return entry + [a for a in hook.spec.get("args", []) if a not in FIXING_ARGS]
    entry = shlex.split(hook.spec["entry"])
    if hook.spec.get("language") == "python" and entry[0] == "python":
        entry[0] = str(env / "bin" / "python")
    return entry + hook.spec.get("args", [])


@contextlib.contextmanager
def series_index(tree: Path, files: list[str]):
    """A git index of the series' files alone, for the hooks that run
    ``git ls-files``; given to them as GIT_DIR (the tree stays no repository)."""
    git_dir = tree.parent / "series.git"
    shutil.rmtree(git_dir, ignore_errors=True)
    env = {"GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(tree)}
    subprocess.run(["git", "init", "-q"], env={**os.environ, **env}, check=True)
    subprocess.run(
        ["git", "add", "--", *files], cwd=tree, env={**os.environ, **env}, check=True
    )
    try:
        yield env
    finally:
        shutil.rmtree(git_dir, ignore_errors=True)


@dataclass
class Outcome:
    hook: str
    files: list[str]
    returncode: int
    output: str
    seconds: float


def run_hooks(tree: Path, files: list[str], env: Path, version: str) -> list[Outcome]:
    config = config_of(tree)
    outcomes = []
    base = {
        **os.environ,
        "PATH": f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "MYPY_CACHE_DIR": str(vllm_release.cache_dir() / f"mypy-{version}"),
    }
    base.pop("VIRTUAL_ENV", None)
    base.pop("PYTHONPATH", None)
    with series_index(tree, files) as git_env:
        for hook in hooks(config):
            stages = hook.stages(config)
            if not {"pre-commit", "manual"} & set(stages):
                continue  # commit-msg: the sign-off, the submitter's
            selected = [f for f in files if hook.selects(f, config)]
            if not selected and not hook.spec.get("always_run"):
                continue
            if not hook.runnable:
                raise RuntimeError(f"hook {hook.id} selects {selected}: no runner here")
            command = hook_command(hook, env)
            if hook.spec.get("pass_filenames", True):
                command += selected
            run_env = {**base, **git_env} if hook.id in GIT_HOOKS else base
            start = time.monotonic()
            done = subprocess.run(
                command,
                cwd=tree,
                env=run_env,
                capture_output=True,
                text=True,
            )
            outcomes.append(
                Outcome(
                    hook.id,
                    selected,
                    done.returncode,
                    done.stdout + done.stderr,
                    time.monotonic() - start,
                )
            )
    return outcomes


def config_of(tree: Path) -> dict:
    """The release's pre-commit config. A ``rev`` frozen to a commit
    (``pre-commit autoupdate --freeze``, vLLM's since 0.34) becomes the tag its
    ``# frozen:`` comment names: the registry knows the tool by version."""
    import yaml

    text = (tree / ".pre-commit-config.yaml").read_text()
    frozen = dict(re.findall(r"^\s*rev:\s*(\S+)\s*#\s*frozen:\s*(\S+)", text, re.M))
    config = yaml.safe_load(text)
    for repo in config["repos"]:
        if repo.get("rev") in frozen:
            repo["rev"] = frozen[repo["rev"]]
    return config


def check(
    version: str = VERSION, series: list[Path] | None = None
) -> tuple[list[Outcome], list[str], float]:
    """Every selecting hook on the series (``series``, by default this
    folder's): the outcomes, the files it touches, and the seconds the tree
    and the tools took to make ready."""
    start = time.monotonic()
    tree, files = series_tree(version, series)
    env = tool_env(config_of(tree))
    setup = time.monotonic() - start
    return run_hooks(tree, files, env, version), files, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION)
    parser.add_argument(
        "--patches", type=Path, help="a folder of patches to check instead"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    series = sorted(args.patches.glob("*.patch")) if args.patches else None
    outcomes, files, setup = check(args.version, series)
    failed = [o for o in outcomes if o.returncode != 0]
    for o in outcomes:
        verdict = "FAILED" if o.returncode else "passed"
        print(f"{o.hook}: {verdict} ({len(o.files)} files, {o.seconds:.1f} s)")
        if o.returncode:
            print(o.output.rstrip())
    print(
        f"vLLM {args.version} pre-commit on the series ({len(files)} files): "
        f"{len(outcomes) - len(failed)} hooks passed, {len(failed)} failed; "
        f"setup {setup:.1f} s, total {time.monotonic() - start:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
