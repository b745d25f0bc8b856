"""The README's example is the example file, and that file runs under
vLLM's spawned engine (the ``__main__`` guard); the README's links resolve."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
EXAMPLE = REPO / "examples" / "extract_hidden_states.py"


def test_the_readme_example_is_the_example_file():
    (block,) = re.findall(r"```python\n(import sys\n.*?)```", README, flags=re.S)
    assert EXAMPLE.read_text().endswith(block)


def test_the_example_builds_its_engine_only_under_the_main_guard():
    """vLLM's engine process imports the script again: an LLM built at
    module level there fails with multiprocessing's bootstrapping error."""
    tree = ast.parse(EXAMPLE.read_text())
    top_level_calls = [
        node.func.id
        for stmt in tree.body
        if not isinstance(stmt, ast.FunctionDef | ast.If)
        for node in ast.walk(stmt)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    assert top_level_calls == []
    (guard,) = [stmt for stmt in tree.body if isinstance(stmt, ast.If)]
    assert ast.unparse(guard.test) == "__name__ == '__main__'"


def test_the_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    assert [link for link in links if not (REPO / link).exists()] == []
