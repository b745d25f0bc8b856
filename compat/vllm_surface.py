"""Every vLLM name cg_extract imports, wraps, patches or overrides, with the
signature it has in a given vLLM, read from source with ``ast``: nothing is
imported, so it works on a wheel for a GPU (no CUDA, no vLLM install).

    python compat/vllm_surface.py                       # the installed vLLM
    python compat/vllm_surface.py vllm-0.33.0-...whl    # a wheel
    python compat/vllm_surface.py 0.34.0                # its pinned wheel
    python compat/vllm_surface.py "$(python compat/vllm_release.py 0.33.0)"  # its sdist
    python compat/vllm_surface.py /path/to/site-packages --out compat/vllm-X.txt
    python compat/vllm_surface.py --diff 0.33.0 0.34.0  # what a port must mend

One line per name, sorted: ``module:qualname<TAB>kind<TAB>signature``; a
name the source lacks reads ``MISSING``. The names come from cg_extract's
own source (its ``vllm`` imports, the classes it subclasses and their
methods it overrides, the attributes it reads on the names it imports, such
as ``envs.VLLM_USE_V2_MODEL_RUNNER``), :data:`PATCHED` (what
``plugin.register`` swaps or wraps) and :data:`READ` (attributes it reads on
vLLM objects it is handed). ``compat/vllm-<version>.txt`` holds the output for each version
``cg_extract.plugin.TESTED_VLLM`` names; ``tests/torch_alone/test_compat_surface.py``
keeps them true.

``--diff OLD NEW`` (each a wheel, a folder, or a version whose wheel
``compat/vllm_release.py`` pins) prints, one line each, sorted, the names
that are ``gone`` from NEW, that ``changed signature`` (old -> new), that are
``new`` in NEW, and the module-level functions the plugin rebinds in a module
that another module of NEW, and not of OLD, imports by ``from X import name``
(``bypassed``: that module keeps vLLM's function, not the plugin's).
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
    # Our speculator where the runner builds it (vLLM 0.32, 0.33), vLLM's
    # own class (the tests' reference), and (0.34) the lookup our draft
    # model's config class fills (cg_extract/draft_model.py).
    ("vllm.v1.worker.gpu.model_runner", "init_speculator"),
    (
        "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
        "ExtractHiddenStatesSpeculator",
    ),
    ("vllm.v1.worker.gpu.spec_decode", "init_speculator"),
    # Pipeline parallelism (cg_extract/pipeline_parallel.py): wrapped, and
    # what it reads to tell the runner and the connector and how it counts.
    ("vllm.v1.worker.gpu.model_runner", "get_kv_connector"),
    ("vllm.v1.worker.extensible_kv_cache", "get_kv_connector"),
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
# Attributes the plugin reads on vLLM objects it is handed (its reads on
# names it imports, ``envs.X`` and the like, are found in its source).
READ = [
    ("vllm.config", "SpeculativeConfig.disable_padded_drafter_batch"),
]
# Names the plugin uses on some tested releases only (where vLLM moved,
# changed or dropped a name, the plugin imports or reads each release's in a
# ``try`` or behind a version check): each is MISSING in the other releases'
# files, and present in those named.
SINCE_0_33 = ("0.33.0", "0.34.0")
BEFORE_0_34 = ("0.32.0", "0.33.0")
RELEASE_ONLY: dict[tuple[str, str], tuple[str, ...]] = {
    # 0.33 moved KV-cache planning out of kv_cache_utils and makes the
    # groups before get_kv_cache_configs, which takes them (issue 45).
    ("vllm.v1.core.kv_cache_planning", "get_global_kv_cache_groups"): SINCE_0_33,
    ("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs"): SINCE_0_33,
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs"): ("0.32.0",),
    ("vllm.v1.core", "kv_cache_planning"): SINCE_0_33,
    ("vllm.v1.core.kv_cache_planning", "get_kv_cache_groups"): SINCE_0_33,
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_groups"): ("0.32.0",),
    (
        "vllm.v1.core.kv_cache_planning",
        "DefaultKVCacheConfigBuilder.get_kv_cache_groups",
    ): SINCE_0_33,
    ("vllm.v1.core.kv_cache_config_builder", "get_kv_cache_config_builder"): SINCE_0_33,
    ("vllm.v1.core.kv_cache_planning", "DefaultKVCacheConfigBuilder"): SINCE_0_33,
    # 0.34 dropped Model Runner V1 and padded drafter batches, and looks the
    # speculator up by its config class (issue 61).
    ("vllm", "envs.VLLM_USE_V2_MODEL_RUNNER"): BEFORE_0_34,
    ("vllm.config", "VllmConfig.use_v2_model_runner"): BEFORE_0_34,
    (
        "vllm.config",
        "VllmConfig._get_v2_model_runner_unsupported_features",
    ): BEFORE_0_34,
    ("vllm.config", "SpeculativeConfig.disable_padded_drafter_batch"): BEFORE_0_34,
    (
        "vllm.v1.worker.gpu.spec_decode.extract_hidden_states_config",
        "ExtractHiddenStatesSpeculatorConfig",
    ): ("0.34.0",),
    ("vllm.v1.worker.extensible_kv_cache", "get_kv_connector"): ("0.34.0",),
}
MISSING = "MISSING"
# A method of ours in a class derived from vLLM's that no vLLM class in its
# bases defines: it overrides nothing (today).
NOT_IN_VLLM = "not_in_vllm"


# --------------------------------------------------------------------------
# What the plugin uses


def plugin_surface(package: Path = PLUGIN) -> list[tuple[str, str]]:
    """(module, qualname) of every vLLM name ``package`` depends on."""
    return sorted(_scan(package)[0])


def overrides(package: Path = PLUGIN) -> set[tuple[str, str]]:
    """(module, qualname) of the vLLM methods ``package``'s classes override:
    the names that read ``not_in_vllm`` (not ``MISSING``) where vLLM lacks
    them."""
    return _scan(package)[1]


def _scan(package: Path) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    names: set[tuple[str, str]] = {*PATCHED, *READ}
    overriding: set[tuple[str, str]] = set()
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
        for node in ast.walk(tree):
            # methods overriding a vLLM base class's
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in imported:
                        module, name = imported[base.id]
                        overriding.update(
                            (module, f"{name}.{item.name}")
                            for item in node.body
                            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                        )
            # attributes read on an imported name: envs.X, CUDAGraphMode.NONE
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
                and not node.attr.startswith("__")
            ):
                module, name = imported[node.value.id]
                names.add((module, f"{name}.{node.attr}"))
    return names | overriding, overriding


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
        if self.module(f"{module}.{head}") is not None:
            if not rest:
                return "module", ""
            return self.describe(f"{module}.{head}", rest, depth + 1)
        for node in tree.body:
            found = _defines(node, head)
            if found is None:
                continue
            if isinstance(found, tuple):  # a re-export: follow it
                source, name, level = found
                source = _absolute(source, module, level, self.is_package(module))
                if depth > 5:
                    return MISSING, f"re-exports past {source}"
                return self.describe(
                    source, ".".join(filter(None, [name, rest])), depth + 1
                )
            if not rest:
                return _signature(found)
            if isinstance(found, ast.ClassDef):
                return self._member(module, found, rest, depth)
            cls = _instance_of(found)
            if cls is not None and depth <= 5:  # an attribute of an instance
                return self.describe(module, f"{cls}.{rest}", depth + 1)
            return MISSING, f"{head} is not a class"
        getattr_ = next(
            filter(None, (_defines(n, "__getattr__") for n in tree.body)), None
        )
        if getattr_ is not None:
            served = _served(tree, getattr_)
            if served is None or head in served:
                return "dynamic", f"{module}.__getattr__"
        return MISSING, f"{module} has no {head}"

    def modules(self) -> Iterator[str]:
        """Every module of ``vllm``, by name."""
        if self._wheel is not None:
            files = sorted(self._files)
        else:
            files = sorted(
                p.relative_to(self.where).as_posix()
                for p in (self.where / "vllm").rglob("*.py")
            )
        for name in files:
            if name.startswith("vllm/") and name.endswith(".py"):
                yield name[: -len(".py")].removesuffix("/__init__").replace("/", ".")

    def origin(self, module: str, name: str, depth: int = 0) -> str | None:
        """The module that defines ``module``'s ``name``, through re-exports."""
        tree = self.module(module)
        for node in tree.body if tree is not None else []:
            found = _defines(node, name)
            if isinstance(found, tuple) and depth <= 5:
                source = _absolute(found[0], module, found[2], self.is_package(module))
                return self.origin(source, found[1], depth + 1)
            if found is not None:
                return module
        return None

    def importers(self, module: str, name: str) -> set[str]:
        """The other modules that bind ``module``'s ``name`` when imported, by
        ``from X import name`` at module level (an import in a function reads
        the module's attribute when it runs): a rebinding of ``module.name``
        does not reach them."""
        origin = self.origin(module, name)
        found = set()
        for other in self.modules():
            if other == module:
                continue
            base = other.replace(".", "/")
            text = self._read_file(f"{base}.py") or self._read_file(
                f"{base}/__init__.py"
            )
            if not text or name not in text:
                continue
            for node in _module_level(self.module(other).body):
                if isinstance(node, ast.ImportFrom) and any(
                    alias.name == name for alias in node.names
                ):
                    source = _absolute(
                        node.module or "", other, node.level, self.is_package(other)
                    )
                    if self.origin(source, name) == origin:
                        found.add(other)
        return found

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
    """The definition of ``name`` in ``node``, (module, name, level) for an
    import, or None."""
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
                return (node.module or "", alias.name, node.level)
    if isinstance(node, ast.If | ast.Try):  # definitions under a guard
        for child in [*node.body, *getattr(node, "orelse", [])]:
            found = _defines(child, name)
            if found is not None:
                return found
    return None


def _instance_of(node: ast.AST) -> str | None:
    """The class a module-level value is an instance of, where it says:
    ``x: C`` (or ``x: "C"``), ``x = C(...)``."""
    if isinstance(node, ast.AnnAssign):
        cls = node.annotation
        if isinstance(cls, ast.Constant) and isinstance(cls.value, str):
            return cls.value if cls.value.isidentifier() else None
    elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
        cls = node.value.func
    else:
        return None
    return cls.id if isinstance(cls, ast.Name) else None


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run when a module is imported, guards opened (but not
    ``if TYPE_CHECKING:``, which runs no import)."""
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
            "TYPE_CHECKING"
        ):
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.If | ast.Try):
            yield from _module_level([*node.body, *node.orelse])
            yield from _module_level(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)
        else:
            yield node


def _served(tree: ast.Module, getattr_) -> set[str] | None:
    """The names a module-level ``__getattr__(name)`` serves, when it says
    which: a chain of ``if name == "x"`` / ``if name in LITERAL`` (a dict, set,
    list or tuple of strings bound at module level) / ``if name in
    globals()`` (names the module defines anyway) ending in ``raise
    AttributeError``; None when it may serve anything."""
    if not isinstance(getattr_, ast.FunctionDef) or not getattr_.args.args:
        return None
    param = getattr_.args.args[0].arg
    served: set[str] = set()
    body = list(getattr_.body)
    while body:
        node, *rest = body
        if isinstance(node, ast.Import | ast.ImportFrom) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            body = rest
            continue
        if isinstance(node, ast.Raise):
            ok = isinstance(node.exc, ast.Call) and ast.unparse(node.exc.func) == (
                "AttributeError"
            )
            return served if ok else None
        if not isinstance(node, ast.If):
            return None
        names = _compared(tree, node.test, param)
        if names is None:
            return None
        served |= names
        body = node.orelse + rest
    return None  # falls off the end: returns None for any name


def _compared(tree: ast.Module, test: ast.expr, param: str) -> set[str] | None:
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.left, ast.Name)
        and test.left.id == param
    ):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant):
        return {right.value}
    if not isinstance(op, ast.In):
        return None
    if ast.unparse(right) == "globals()":
        return set()
    if isinstance(right, ast.Name):
        bound = next(filter(None, (_defines(n, right.id) for n in tree.body)), None)
        if not isinstance(bound, ast.Assign | ast.AnnAssign) or bound.value is None:
            return None
        right = bound.value
    keys = right.keys if isinstance(right, ast.Dict) else getattr(right, "elts", None)
    if keys is None or not all(
        isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys
    ):
        return None
    return {k.value for k in keys}


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
    source, overriding = Source(where), overrides()
    for module, qualname in plugin_surface():
        kind, signature = source.describe(module, qualname)
        if kind == NOT_IN_VLLM and (module, qualname) not in overriding:
            kind = MISSING  # a name the plugin reads, not a method of its own
        yield f"{module}:{qualname}\t{kind}\t{signature}"


def rebound(source: Source) -> list[tuple[str, str]]:
    """The module-level functions the plugin rebinds in a module
    (:data:`PATCHED` names without a class), as ``source`` has them."""
    return [
        (module, qualname)
        for module, qualname in PATCHED
        if "." not in qualname and source.describe(module, qualname)[0] == "function"
    ]


ABSENT = (MISSING, NOT_IN_VLLM)  # not there, or only the plugin's


def diff(old: Path, new: Path) -> dict[str, list[str]]:
    """What changed for the plugin from vLLM ``old`` to vLLM ``new``: for each
    section, its lines, sorted. ``gone``, ``new``: ``name<TAB>kind<TAB>signature``
    as the release that has it reads; ``changed signature``:
    ``name<TAB>kind<TAB>old -> new``; ``bypassed``: ``name<TAB>imported by
    MODULE``, a module that imports a name the plugin rebinds elsewhere, new in
    ``new`` (``(rebound there too)`` where the plugin rebinds it there as well)."""
    sections: dict[str, list[str]] = {
        "gone": [], "changed signature": [], "bypassed": [], "new": [],
    }  # fmt: skip
    for line_was, line_now in zip(record(old), record(new), strict=True):
        name, *was = line_was.split("\t")
        now = line_now.split("\t")[1:]
        if was[0] not in ABSENT and now[0] in ABSENT:
            sections["gone"].append(f"{name}\t{was[0]}\t{was[1]}")
        elif was[0] in ABSENT and now[0] not in ABSENT:
            sections["new"].append(f"{name}\t{now[0]}\t{now[1]}")
        # An annotation quoted in one release only ('VllmConfig') is no change.
        elif was[0] not in ABSENT and [w.replace("'", "") for w in was] != [
            n.replace("'", "") for n in now
        ]:
            kind = was[0] if was[0] == now[0] else f"{was[0]} -> {now[0]}"
            sections["changed signature"].append(
                f"{name}\t{kind}\t{was[1]} -> {now[1]}"
            )
    before, after = Source(old), Source(new)
    rebinds = set(rebound(before)) | set(rebound(after))
    for module, qualname in sorted(rebound(before)):
        also = {m for m, q in rebinds if q == qualname}  # rebound there too
        for importer in sorted(
            after.importers(module, qualname) - before.importers(module, qualname)
        ):
            mended = " (rebound there too)" if importer in also else ""
            sections["bypassed"].append(
                f"{module}:{qualname}\timported by {importer}{mended}"
            )
    return {title: sorted(lines) for title, lines in sections.items()}


def resolve(where: str) -> Path:
    """A wheel or folder, or a version whose wheel vllm_release pins."""
    if Path(where).exists():
        return Path(where)
    try:
        from compat import vllm_release
    except ImportError:  # run as a script: compat/ is on the path
        import vllm_release  # type: ignore[no-redef]
    if where not in vllm_release.WHEELS:
        raise SystemExit(
            f"vllm_surface: {where} is no wheel, folder or pinned version "
            f"({', '.join(vllm_release.WHEELS)})"
        )
    return vllm_release.wheel(where)


def installed_vllm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm_surface: no vllm installed here; give a wheel or folder")
    return Path(next(iter(spec.submodule_search_locations))).parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("where", nargs="?",
                   help="a vLLM wheel, a folder holding vllm/, or a version whose wheel "
                   "compat/vllm_release.py pins (default: the installed vLLM)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write here (default: print)")
    p.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"),
                   help="what changed for the plugin between two vLLMs (wheels, folders or versions)")  # fmt: skip
    args = p.parse_args(argv)
    if args.diff:
        old, new = map(resolve, args.diff)
        lines = [
            f"# vLLM {Source(old).version()} -> {Source(new).version()}: "
            f"python compat/vllm_surface.py --diff"
        ]
        for title, entries in diff(old, new).items():
            lines += [f"{title}:", *(f"  {entry}" for entry in entries)]
    else:
        where = resolve(args.where) if args.where else installed_vllm()
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
