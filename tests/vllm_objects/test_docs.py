"""What the README tells a user to run runs as written: every command in
its ```bash blocks is checked by what would run it, as far as a CPU machine
allows, and the example it points at runs under vLLM's spawned engine (the
``__main__`` guard). Every relative link in the README, docs/,
perf/README.md and upstream/README.md resolves, to a file and, with
``#anchor``, to one of its headings; every path under ``tests/`` they name
exists (upstream/README.md's aside: it names vLLM's own tests/ too)."""

import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from cg_extract.cache_size import DOCS, SPLIT_DOCS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
EXAMPLE = REPO / "examples" / "extract_hidden_states.py"
BASH_BLOCK = r"^```bash\n.*?^```"


def shell_commands(markdown: str) -> list[list[str]]:
    """The commands of ``markdown``'s ```bash blocks, in words as bash splits
    them: comments dropped, a line ending in ``\\`` joined to the next, a
    quote left open carried over the line break."""
    commands = []
    for block in re.findall(BASH_BLOCK, markdown, flags=re.S | re.M):
        block = block.split("\n", 1)[1].rsplit("```", 1)[0]
        pending = ""
        for line in block.splitlines(keepends=True):
            pending += line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            # An escaped line break (outside quotes and comments, so shlex
            # kept it as the last word's end): bash drops it and reads on.
            if pending.endswith("\\\n") and words and words[-1].endswith("\n"):
                pending = pending[:-2]
                continue
            if words:
                commands.append(words)
            pending = ""
        assert not pending.strip(), f"a ```bash block ends inside {pending!r}"
    return commands


COMMANDS = shell_commands(README)


def test_commands_are_split_as_bash_splits_them(tmp_path):
    """bash itself as the reference: with no ``PATH``, each command it cannot
    find goes to ``command_not_found_handle``, which prints its words."""
    block = """```bash
# a comment, then a command with a comment after it
frob --a 1 '.[x]'   # not a word
frob serve m \\
  --json '{"k": [1, 2],
     "s": "a b # c"}' \\
  --more "two words"  # a comment ending in a backslash \\
frob last
```
"""
    bash = shutil.which("bash") or pytest.skip("no bash here")
    script = "command_not_found_handle() { printf '%s\\0' \"$@\"; printf '\\1'; }\n"
    script += block.split("\n", 1)[1].rsplit("```", 1)[0]
    run = subprocess.run(
        [bash, "-c", script], env={"PATH": str(tmp_path)}, capture_output=True
    )
    by_bash = [
        command.decode().split("\0")[:-1] for command in run.stdout.split(b"\1")[:-1]
    ]
    assert len(by_bash) == 3
    assert shell_commands(block) == by_bash


# --------------------------------------------------------------------------
# One check per kind of command; each raises AssertionError with the reason.


def parsed(parse: Callable[[list[str]], object], argv: list[str]) -> object:
    """``parse(argv)``, with an argparse refusal (its message on stderr, then
    SystemExit) raised as a failure that quotes it."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse(argv)
    except SystemExit:
        raise AssertionError(f"{shlex.join(argv)}: {stderr.getvalue()}") from None


def check_pip(words: list[str], fx: SimpleNamespace) -> None:
    """``pip install -e PATH[EXTRAS]``: PATH is this project, EXTRAS its
    optional dependencies. (What they install, vllm==0.33.0 for CUDA, cannot
    be installed here.)"""
    assert words[1:3] == ["install", "-e"] and len(words) == 4, words
    match = re.fullmatch(r"([^\[\]]+)(?:\[([^\]]*)\])?", words[3])
    assert match, f"not PATH[EXTRAS]: {words[3]!r}"
    pyproject = (REPO / match[1]).resolve() / "pyproject.toml"
    assert pyproject.is_file(), f"no {pyproject}"
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = set(match[2].split(",")) if match[2] else set()
    missing = extras - set(project.get("optional-dependencies", {}))
    assert not missing, f"pyproject.toml has no extra {sorted(missing)}"


def check_make(words: list[str], fx: SimpleNamespace) -> None:
    """``make TARGET...``: make's own database (``-p``, dry) has a rule for
    each target; a target that is only an existing file or folder (``tests``)
    is marked "Not a target" there. (The targets' own work runs in CI:
    ``make lint``, ``make test``, ``make perf-gate``.)"""
    make = shutil.which("make") or pytest.skip("no make here")
    run = subprocess.run(
        [make, "-pn", "-C", str(REPO), *words[1:]],
        env={**os.environ, "LC_ALL": "C"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"{shlex.join(words)}: {run.stderr}"
    for target in [w for w in words[1:] if not w.startswith("-") and "=" not in w]:
        rule = re.search(
            rf"^(# Not a target:\n)?{re.escape(target)}:", run.stdout, re.M
        )
        assert rule and not rule[1], f"the Makefile has no rule to make {target!r}"


def check_vllm(words: list[str], fx: SimpleNamespace) -> None:
    """``vllm serve MODEL --flag value...``: vLLM's own CLI parser, built as
    ``vllm serve`` builds it, takes the flags, then vLLM builds the engine
    config from them, loading its plugins as it does, so vLLM's checks of
    ``--speculative-config`` and ``--kv-transfer-config`` and ours (the
    plugin's, ``cg_extract/config.py``) see the README's JSON. No hub here:
    the model is swapped for a config-only Llama, the one thing not checked."""
    assert words[1] == "serve", f"only `vllm serve` is checked: {words}"
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from cg_extract.config import ADDITIONAL_CONFIG_KEY, KEYS

    # vllm/entrypoints/cli/main.py: a subparser per command, each validated.
    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    (command,) = serve.cmd_init()
    command.subparser_init(subparsers)
    args = parsed(parser.parse_args, words[1:])
    command.validate(args)
    # The model, positional or --model, is the one thing swapped.
    args.model_tag = args.model = fx.model_dir
    args.load_format, args.skip_tokenizer_init = "dummy", True
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    ours = {k: v for k, v in (args.speculative_config or {}).items() if k in KEYS}
    assert (config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) == ours


# The interpreters the README names: any Python, and the one in the .venv
# `make test` builds (the Makefile's VENV).
MAKEFILE_VENV = re.search(r"^VENV := (\S+)$", (REPO / "Makefile").read_text(), re.M)
INTERPRETERS = ("python", f"{MAKEFILE_VENV[1]}/bin/python")


def check_python(words: list[str], fx: SimpleNamespace) -> None:
    """``python SCRIPT ARGS...``: SCRIPT is in this repository and takes
    ARGS, as its own check of them says."""
    script, *args = words[1:]
    assert not script.startswith("-"), (
        f"no check for `{shlex.join(words)}`: add one, or name it in UNCHECKED"
    )
    assert (REPO / script).is_file(), f"no file {script}"
    checks = [c for pattern, c in SCRIPTS.items() if Path(script).match(pattern)]
    assert checks, f"no check for script {script}: add one to SCRIPTS"
    checks[0](REPO / script, args, fx)


def check_sweep(script: Path, args: list[str], fx: SimpleNamespace) -> None:
    """perf/sweep.py's own parse_args, every check it makes before it starts
    an engine. Two of its steps are for the run, not the arguments:
    ``vllm_engine.prepare`` readies the process to start an engine, and
    ``--out``'s folder is made (here, under a temporary folder)."""
    from perf import sweep, vllm_engine

    fx.monkeypatch.setattr(vllm_engine, "prepare", lambda device: None)
    fx.monkeypatch.chdir(fx.tmp_path)
    parsed(sweep.parse_args, args)


def main_guard(tree: ast.Module) -> ast.If:
    """The script's one top-level ``if``, which must be its ``__main__`` guard."""
    (guard,) = [stmt for stmt in tree.body if isinstance(stmt, ast.If)]
    assert ast.unparse(guard.test) == "__name__ == '__main__'", ast.unparse(guard)
    return guard


def check_example(script: Path, args: list[str], fx: SimpleNamespace) -> None:
    """An example's ``main`` takes the arguments: its ``__main__`` guard
    passes ``sys.argv[1:]`` to ``main`` as they are (read with ``ast``; vLLM
    is not imported). (Running it needs a CUDA GPU.)"""
    tree = ast.parse(script.read_text())
    guard = main_guard(tree)
    assert ast.unparse(guard.body) == "main(*sys.argv[1:])", ast.unparse(guard.body)
    (main,) = [
        f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"
    ]
    taken = main.args.posonlyargs + main.args.args
    most = float("inf") if main.args.vararg else len(taken)
    least = len(taken) - len(main.args.defaults)
    assert least <= len(args) <= most, (
        f"{script.name}'s main takes {least} to {most} arguments, given {args}"
    )


SCRIPTS = {"perf/sweep.py": check_sweep, "examples/*.py": check_example}
CHECKS = {"pip": check_pip, "make": check_make, "vllm": check_vllm}
CHECKS.update(dict.fromkeys(INTERPRETERS, check_python))
# Commands the README may show that no check here can run, each with why
# (its whole line, as shlex.join writes it). Every other command must have a
# check, so a new command is checked or named here.
UNCHECKED: dict[str, str] = {}


def check(words: list[str], fx: SimpleNamespace) -> None:
    if shlex.join(words) in UNCHECKED:
        pytest.skip(UNCHECKED[shlex.join(words)])
    assert words[0] in CHECKS, (
        f"no check for `{shlex.join(words)}`: add one to CHECKS, or name it in "
        "UNCHECKED with why it cannot be checked"
    )
    CHECKS[words[0]](words, fx)


@pytest.fixture
def fx(model_dir, monkeypatch, tmp_path):
    return SimpleNamespace(
        model_dir=str(model_dir), monkeypatch=monkeypatch, tmp_path=tmp_path
    )


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: shlex.join(w)[:60])
def test_the_readme_command_runs_as_written(words, fx):
    check(words, fx)


def test_the_readme_shows_commands():
    assert {words[0] for words in COMMANDS} >= {"pip", "make", "vllm", "python"}


def planted(old: str, new: str) -> list[list[str]]:
    """The README's commands that change when ``old``, in a ```bash block,
    becomes ``new``."""
    blocks = [b for b in re.findall(BASH_BLOCK, README, flags=re.S | re.M) if old in b]
    assert len(blocks) == 1 and blocks[0].count(old) == 1, (
        f"{old!r} is not once in the README's bash blocks: plant another bug"
    )
    (block,) = blocks
    readme = README.replace(block, block.replace(old, new))
    return [w for w in shell_commands(readme) if w not in COMMANDS]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("--speculative-config", "--speculativ-config", "unrecognized arguments"),
        ('"cudagraph": true}', '"cudagraph": true', "cannot be converted"),
        (
            '"cudagraph": true}',
            '"cudagraph": "yes"}',
            "'cudagraph' must be true or false",
        ),
        (
            '"method": "extract_hidden_states"',
            '"method": "eagle"',
            "apply only to method",
        ),
        (
            '"kv_role": "kv_producer"',
            '"kv_role": "producer"',
            "--kv-transfer-config: 1 validation error for KVTransferConfig\nkv_role",
        ),
        ("make test ", "make tests ", "no rule to make 'tests'"),
        ("-e '.[gpu]'", "-e '.[gpus]'", "no extra ['gpus']"),
        ("--workload decode", "--workload decoding", "invalid choice: 'decoding'"),
        ("--out out/decode.csv", "--out out/decode.png", "must end in .csv"),
        ("/tmp/hidden_states  #", "/tmp/hidden_states x  #", "0 to 2 arguments"),
        ("python examples/", "python example/", "no file example/"),
        ("\nmake test", "\nfrob test", "no check for `frob test`"),
    ],
)
def test_a_planted_bug_in_a_readme_command_fails(old, new, message, fx):
    (words,) = planted(old, new)
    with pytest.raises(Exception, match=re.escape(message)):
        check(words, fx)


def test_the_readme_runs_the_example_it_links():
    assert f"]({EXAMPLE.relative_to(REPO)})" in README
    assert any(words[1:2] == [str(EXAMPLE.relative_to(REPO))] for words in COMMANDS)


def test_the_example_and_the_serve_command_ask_for_the_same():
    """The README's ``vllm serve`` and the example it calls "the same from
    Python" give one speculative config."""
    (serve,) = [words for words in COMMANDS if words[:2] == ["vllm", "serve"]]
    given = json.loads(serve[serve.index("--speculative-config") + 1])
    (call,) = [
        node
        for node in ast.walk(ast.parse(EXAMPLE.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "LLM"
    ]
    keywords = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(keywords["speculative_config"]) == given


def top_level_calls(source: str) -> list[str]:
    """What the module calls at import, outside functions and the
    ``__main__`` guard: plain names and attributes (``vllm.LLM(...)``) alike."""
    tree = ast.parse(source)
    return [
        ast.unparse(node.func)
        for stmt in tree.body
        if not isinstance(stmt, ast.FunctionDef | ast.If)
        for node in ast.walk(stmt)
        if isinstance(node, ast.Call)
    ]


def test_the_example_builds_its_engine_only_under_the_main_guard():
    """vLLM's engine process imports the script again: an LLM built at
    module level there fails with multiprocessing's bootstrapping error."""
    source = EXAMPLE.read_text()
    assert top_level_calls(source) == []
    assert main_guard(ast.parse(source))


def test_a_module_level_engine_is_seen():
    """The check above sees an engine built at import, however it is named."""
    assert top_level_calls("import vllm\nllm = vllm.LLM(model='m')\n") == ["vllm.LLM"]
    assert top_level_calls("from vllm import LLM\nx = [LLM('m')]\n") == ["LLM"]


MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKDOWN += [REPO / "perf" / "README.md", REPO / "upstream" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation but
    ``-`` and ``_`` dropped, spaces as ``-``, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links whose file or heading does not exist."""
    broken = []
    for link in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not ours to check
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists() or (
            anchor and file.suffix == ".md" and anchor not in anchors(file.read_text())
        ):
            broken.append(link)
    return broken


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("link", [DOCS, SPLIT_DOCS])
def test_the_docs_our_log_lines_name_resolve(link):
    """The bill warning's and the refusal hint's section, from the root of a
    checkout (where a user reads the log's path)."""
    path, _, anchor = link.partition("#")
    assert anchor in anchors((REPO / path).read_text())


# A path under tests/ that a doc names, in a code span or not; a move of tests/
# must take the docs along. upstream/README.md names vLLM's own tests/ too.
TESTS_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*")


def missing_tests_paths(markdown: str) -> list[str]:
    """The paths under this repository's ``tests/`` that ``markdown`` names
    and that do not exist (a sentence's full stop is not part of a path)."""
    named = (path.rstrip(".") for path in TESTS_PATH.findall(markdown))
    return [path for path in named if not (REPO / path).exists()]


@pytest.mark.parametrize(
    "path",
    [path for path in MARKDOWN if path.parent.name != "upstream"],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_the_tests_a_doc_names_exist(path):
    assert missing_tests_paths(path.read_text()) == []


def test_a_tests_path_that_is_gone_is_seen():
    doc = (
        "`tests/torch_alone/`, `pytest tests/cuda -q` and tests/conftest.py."
        " Not `tests/test_gone.py`, nor tests/gone/ (vllm/tests/v1/x.py is vLLM's).\n"
    )
    assert missing_tests_paths(doc) == ["tests/test_gone.py", "tests/gone/"]


def test_the_readme_reads_in_five_minutes():
    """Status, what it is, install, switch it on, see it work, keys, limits,
    links; the rest is in docs/."""
    assert len(README.splitlines()) <= 150


def test_the_readme_has_links():
    assert LINK.findall(README)


def test_a_broken_link_or_anchor_is_seen(tmp_path):
    (tmp_path / "a.md").write_text("# Its Heading, `code`\n\n## Twice\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](a.md) [ok](a.md#its-heading-code) [ok](a.md#twice-1) [web](https://x)"
        " [no file](b.md) [no heading](a.md#nothing) [here](#missing)\n"
    )
    assert broken_links(doc) == ["b.md", "a.md#nothing", "#missing"]
