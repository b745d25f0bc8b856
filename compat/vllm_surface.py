"""Every vLLM name cg_extract imports, wraps, patches or overrides, with the
signature it has in a given vLLM, read from source with ``ast``: nothing is
imported, so it works on a wheel for a GPU (no CUDA, no vLLM install).

    python compat/vllm_surface.py                       # the installed vLLM
    python compat/vllm_surface.py vllm-0.33.0-...whl    # a wheel
    python compat/vllm_surface.py "$(python compat/vllm_release.py 0.33.0)"  # its sdist
    python compat/vllm_surface.py /path/to/site-packages --out compat/vllm-X.txt

One line per name, sorted: ``module:qualname<TAB>kind<TAB>signature``; a
name the source lacks reads ``MISSING``. The names come from cg_extract's
own source (its ``vllm`` imports, the classes it subclasses and their
methods it overrides) and :data:`PATCHED` (what ``plugin.register`` swaps or
wraps). ``compat/vllm-<version>.txt`` holds the output for each version
``cg_extract.plugin.TESTED_VLLM`` names; ``tests/torch_alone/test_compat_surface.py``
keeps them true.
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "cg_extract"
# What the plugin replaces, wraps or reads in vLLM beyond the names it
# imports: plugin.register's patches, and private members it reads.
PATCHED = [
    ("vllm.config", "VllmConfig._get_v2_model_runner_unsupported_features"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager._capture_descs"),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager.capture"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache"),
    (
        "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
        "ExtractHiddenStatesSpeculator",
    ),
    # Pipeline parallelism (cg_extract/pipeline_parallel.py): wrapped, and
    # what it reads to tell the runner and the connector and how it counts.
    ("vllm.model_executor.models.registry", "_ModelRegistry.is_pp_supported_model"),
    ("vllm.v1.worker.gpu.model_runner", "get_kv_connector"),
    ("vllm.config", "VllmConfig.use_v2_model_runner"),
    (
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "KVConnectorFactory.get_connector_class",
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "KVConnectorBase_V1.get_finished_count",
    ),
    # split_kv_cache_groups (cg_extract/kv_cache_groups.py): the grouping it
    # wraps, the name the engine core calls it reads, and what it checks.
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_groups"),
    ("vllm.v1.core.kv_cache_planning", "get_kv_cache_groups"),
    ("vllm.v1.engine.core", "get_kv_cache_configs"),
    (
        "vllm.v1.core.kv_cache_planning",
        "DefaultKVCacheConfigBuilder.get_kv_cache_groups",
    ),
]
# Names the plugin imports on one release only, each in a ``try`` whose
# ``except ImportError`` imports the other release's: where vLLM moved or
# changed a function between the tested releases. Each is MISSING in the
# other release's file, and present in its own.
RELEASE_ONLY = {
    # 0.33 moved KV-cache planning out of kv_cache_utils and makes the
    # groups before get_kv_cache_configs, which takes them (issue 45).
    ("vllm.v1.core.kv_cache_planning", "get_global_kv_cache_groups"): "0.33.0",
    ("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs"): "0.33.0",
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs"): "0.32.0",
    ("vllm.v1.core", "kv_cache_planning"): "0.33.0",
    ("vllm.v1.core.kv_cache_planning", "get_kv_cache_groups"): "0.33.0",
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_groups"): "0.32.0",
    (
        "vllm.v1.core.kv_cache_planning",
        "DefaultKVCacheConfigBuilder.get_kv_cache_groups",
    ): "0.33.0",
    ("vllm.v1.core.kv_cache_config_builder", "get_kv_cache_config_builder"): "0.33.0",
    ("vllm.v1.core.kv_cache_planning", "DefaultKVCacheConfigBuilder"): "0.33.0",
}
MISSING = "MISSING"
# A method of ours in a class derived from vLLM's that no vLLM class in its
# bases defines: it overrides nothing (today).
NOT_IN_VLLM = "not_in_vllm"


# --------------------------------------------------------------------------
# What the plugin uses


def plugin_surface(package: Path = PLUGIN) -> list[tuple[str, str]]:
    """(module, qualname) of every vLLM name ``package`` depends on."""
    names: set[tuple[str, str]] = set(PATCHED)
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm"
            ):
                for alias in node.names:
                    imported[alias.asname or alias.name] = (node.module, alias.name)
                    names.add((node.module, alias.name))
            elif isinstance(node, ast.Import):
                names.update(
                    (a.name, "") for a in node.names if a.name.startswith("vllm")
                )
        for node in ast.walk(tree):  # methods overriding a vLLM base class's
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in imported:
                    module, name = imported[base.id]
                    names.update(
                        (module, f"{name}.{item.name}")
                        for item in node.body
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    )
    return sorted(names)


def tested_releases(package: Path = PLUGIN) -> dict[tuple[str, str], str]:
    """``cg_extract.plugin.TESTED_VLLM``, read without importing the plugin
    (which needs vLLM)."""
    for node in ast.parse((package / "plugin.py").read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "TESTED_VLLM"
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"no TESTED_VLLM in {package / 'plugin.py'}")


# --------------------------------------------------------------------------
# What a vLLM source has


class Source:
    """vLLM's Python files, from a folder holding ``vllm/`` or a wheel."""

    def __init__(self, where: Path):
        self.where = where
        self._wheel = zipfile.ZipFile(where) if where.suffix == ".whl" else None
        self._files = set(self._wheel.namelist()) if self._wheel else set()
        self._trees: dict[str, ast.Module | None] = {}

    def _read_file(self, name: str) -> str | None:
        if self._wheel is not None:
            return self._wheel.read(name).decode() if name in self._files else None
        path = self.where / name
        return path.read_text() if path.is_file() else None

    def version(self) -> str:
        text = self._read_file("vllm/_version.py") or ""
        for node in ast.parse(text).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("__version__", "version")
                for t in node.targets
            ):
                return ast.literal_eval(node.value)
        return "unknown"

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            base = name.replace(".", "/")
            text = self._read_file(f"{base}.py") or self._read_file(
                f"{base}/__init__.py"
            )
            self._trees[name] = None if text is None else ast.parse(text)
        return self._trees[name]

    def is_package(self, name: str) -> bool:
        return self._read_file(f"{name.replace('.', '/')}/__init__.py") is not None

    def describe(self, module: str, qualname: str, depth: int = 0) -> tuple[str, str]:
        """(kind, signature) of ``module:qualname``."""
        tree = self.module(module)
        if tree is None:
            return MISSING, f"no module {module}"
        if not qualname:
            return "module", ""
        head, _, rest = qualname.partition(".")
        if self.module(f"{module}.{head}") is not None and not rest:
            return "module", ""
        for node in tree.body:
            found = _defines(node, head)
            if found is None:
                continue
            if isinstance(found, tuple):  # a re-export: follow it
                source, name = found
                source = _absolute(source, module, node.level, self.is_package(module))
                if depth > 5:
                    return MISSING, f"re-exports past {source}"
                return self.describe(
                    source, ".".join(filter(None, [name, rest])), depth + 1
                )
            if not rest:
                return _signature(found)
            if isinstance(found, ast.ClassDef):
                return self._member(module, found, rest, depth)
            return MISSING, f"{head} is not a class"
        if any(_defines(n, "__getattr__") for n in tree.body):
            return "dynamic", f"{module}.__getattr__"
        return MISSING, f"{module} has no {head}"

    def _member(
        self, module: str, cls: ast.ClassDef, name: str, depth: int
    ) -> tuple[str, str]:
        for node in cls.body:
            found = _defines(node, name)
            if found is not None and not isinstance(found, tuple):
                return _signature(found)
        for method in cls.body:  # an attribute __init__ or another method sets
            for node in ast.walk(method):
                target = getattr(node, "target", None) or next(
                    iter(getattr(node, "targets", None) or []), None
                )
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == name
                    and ast.unparse(target.value) == "self"
                ):
                    annotation = getattr(node, "annotation", None)
                    return "attribute", ast.unparse(annotation) if annotation else ""
        for base in cls.bases:  # vLLM's bases, looked up from cls's module
            base_name = ast.unparse(base).split("[")[0]
            if "." in base_name or depth > 5:
                continue
            kind, signature = self.describe(module, f"{base_name}.{name}", depth + 1)
            if kind not in (MISSING, NOT_IN_VLLM):
                return kind, f"{signature} (from {base_name})"
        return NOT_IN_VLLM, f"neither {cls.name} nor its vLLM bases define it"


def _defines(node: ast.stmt, name: str):
    """The definition of ``name`` in ``node``, (module, name) for an import,
    or None."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node if node.name == name else None
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return (
            node
            if any(isinstance(t, ast.Name) and t.id == name for t in targets)
            else None
        )
    if isinstance(node, ast.ImportFrom):
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                return (node.module or "", alias.name)
    if isinstance(node, ast.If | ast.Try):  # definitions under a guard
        for child in [*node.body, *getattr(node, "orelse", [])]:
            found = _defines(child, name)
            if found is not None:
                return found
    return None


def _absolute(module: str, importer: str, level: int, importer_is_package: bool) -> str:
    if not level:
        return module
    parts = importer.split(".")
    keep = len(parts) - level + (1 if importer_is_package else 0)
    return ".".join([*parts[:keep], *filter(None, [module])])


def _signature(node: ast.AST) -> tuple[str, str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        deco = "".join(f"@{ast.unparse(d)} " for d in node.decorator_list)
        return "function", f"{deco}({ast.unparse(node.args)})"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        init = next(
            (
                n
                for n in node.body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__"
            ),
            None,
        )
        return "class", f"({bases})" + (
            f" __init__({ast.unparse(init.args)})" if init else ""
        )
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    text = ast.unparse(value) if value is not None else ""
    return "value", text if len(text) <= 80 else f"{text[:77]}..."


# --------------------------------------------------------------------------


def record(where: Path) -> Iterator[str]:
    source = Source(where)
    for module, qualname in plugin_surface():
        kind, signature = source.describe(module, qualname)
        yield f"{module}:{qualname}\t{kind}\t{signature}"


def installed_vllm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm_surface: no vllm installed here; give a wheel or folder")
    return Path(next(iter(spec.submodule_search_locations))).parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("where", nargs="?", type=Path,
                   help="a vLLM wheel, or a folder holding vllm/ (default: the installed one)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write here (default: print)")
    args = p.parse_args(argv)
    where = args.where or installed_vllm()
    if not where.exists():
        p.error(f"{where}: no such wheel or folder")
    lines = [
        f"# vLLM {Source(where).version()}: python compat/vllm_surface.py",
        *record(where),
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
