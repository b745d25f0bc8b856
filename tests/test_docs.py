"""The README's example is the example file, and that file runs under
vLLM's spawned engine (the ``__main__`` guard); every relative link in the
README, docs/, perf/README.md and upstream/README.md resolves, to a file and, with ``#anchor``,
to one of its headings."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
EXAMPLE = REPO / "examples" / "extract_hidden_states.py"


def test_the_readme_example_is_the_example_file():
    (block,) = re.findall(r"```python\n(import sys\n.*?)```", README, flags=re.S)
    assert EXAMPLE.read_text().endswith(block)


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
    tree = ast.parse(source)
    (guard,) = [stmt for stmt in tree.body if isinstance(stmt, ast.If)]
    assert ast.unparse(guard.test) == "__name__ == '__main__'"


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
