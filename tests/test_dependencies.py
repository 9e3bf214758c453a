"""Every third-party module the package imports is installed by its runtime requirements.

A new user runs `pip install -e .` (no extras) and then any command: a module that only
arrives with the test extra (as `regex` once did, through transformers) breaks them while CI,
which installs the extra, stays green. This test reads the imports of every module of the
package and checks each against the distributions that the runtime requirements pull in,
transitively, as `importlib.metadata` records them.

An import inside ``try: ... except ImportError`` is optional by construction (CuPy, torch for
PowerInfer's activation export, datasets): the code around it says what to install. A subpackage
that belongs to an extra (``serving/``, the ``serve`` extra) may import what that extra installs,
and is itself imported only under such a guard.
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("powerinfer_tools", "solver", "formats")
OWN_MODULES = {"powerinfer_tools", "solver", "formats"}
DISTRIBUTION = "powerinfer-tools"
EXTRA_PACKAGES = {"powerinfer_tools/serving": "serve"}  # folder -> the extra that installs what it imports


def _guarded_by_import_error(handlers: list[ast.ExceptHandler]) -> bool:
    names = []
    for handler in handlers:
        caught = handler.type
        elements = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        names += [e.id for e in elements if isinstance(e, ast.Name)]
    return "ImportError" in names or "ModuleNotFoundError" in names


def _imports(tree: ast.AST, optional: bool = False, full_names: bool = False):
    """(top-level module, or with ``full_names`` the whole dotted name; line; optional) for every
    absolute import below ``tree``."""
    def named(module: str) -> str:
        return module if full_names else module.split(".")[0]

    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Try):
            guarded = optional or _guarded_by_import_error(node.handlers)
            yield from _imports(ast.Module(body=node.body, type_ignores=[]), guarded, full_names)
            rest = node.handlers + node.orelse + node.finalbody
            yield from _imports(ast.Module(body=rest, type_ignores=[]), optional, full_names)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield named(alias.name), node.lineno, optional
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield named(node.module), node.lineno, optional
        yield from _imports(node, optional, full_names)


def _extra_of(path: Path) -> str:
    """The extra whose requirements a module may import ("" for the core)."""
    relative = path.relative_to(REPO).as_posix()
    return next((extra for folder, extra in EXTRA_PACKAGES.items() if relative.startswith(folder + "/")), "")


def _module_imports(full_names: bool = False):
    """(path, module, line, optional) for every absolute import of the package's modules."""
    for folder in PACKAGE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for module, line, optional in _imports(tree, full_names=full_names):
                yield path, module, line, optional


def third_party_imports(extra: str = "") -> dict[str, list[str]]:
    """Required (unguarded) third-party module -> where it is imported, in the modules of ``extra``."""
    found: dict[str, list[str]] = {}
    for path, module, line, optional in _module_imports():
        if optional or module in OWN_MODULES or module in sys.stdlib_module_names or _extra_of(path) != extra:
            continue
        found.setdefault(module, []).append(f"{path.relative_to(REPO)}:{line}")
    return found


def runtime_closure(distribution: str, extra: str = "") -> set[str]:
    """Canonical names of ``distribution`` and everything its requirements pull in: the non-extra ones,
    and with ``extra``, that extra's."""
    seen: set[str] = set()
    pending = [distribution]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            requirement = Requirement(spec)
            wanted = extra if name == canonicalize_name(distribution) else ""
            if requirement.marker is None or requirement.marker.evaluate({"extra": wanted}):
                pending.append(requirement.name)
    return seen


def test_the_import_scan_sees_guarded_and_unguarded_imports():
    tree = ast.parse("import a.b\nfrom c import d\ndef f():\n    try:\n        import e\n"
                     "    except ImportError:\n        pass\n    import g\n")
    assert sorted(_imports(tree)) == [("a", 1, False), ("c", 2, False), ("e", 5, True), ("g", 8, False)]


def test_every_runtime_import_is_a_declared_dependency():
    providers = metadata.packages_distributions()
    closure = runtime_closure(DISTRIBUTION)
    undeclared = {
        module: places
        for module, places in third_party_imports().items()
        if not {canonicalize_name(d) for d in providers.get(module, [])} & closure
    }
    assert not undeclared, (
        "imported at run time but not installed by `pip install powerinfer-tools` "
        f"(add to [project] dependencies in pyproject.toml): {undeclared}"
    )


def test_an_extra_s_modules_import_only_what_it_installs_and_are_imported_under_a_guard():
    providers = metadata.packages_distributions()
    for folder, extra in EXTRA_PACKAGES.items():
        closure = runtime_closure(DISTRIBUTION, extra)
        undeclared = {module: places for module, places in third_party_imports(extra).items()
                      if not {canonicalize_name(d) for d in providers.get(module, [])} & closure}
        assert not undeclared, f"imported by {folder} but not installed by powerinfer-tools[{extra}]: {undeclared}"
        package = folder.replace("/", ".")
        unguarded = [f"{path.relative_to(REPO)}:{line}" for path, module, line, optional in _module_imports(True)
                     if module.startswith(package) and not optional and _extra_of(path) != extra]
        assert not unguarded, f"{package} imported outside a try/except ImportError: {unguarded}"
