"""The package's layering rules (docs/architecture.md), checked on its source.

- No import cycle between folders: the top-level modules (errors, fileio, progress, ...) import
  no subpackage, and the subpackages' imports form no cycle.
- formats/ imports no pipeline stage: only the top-level utilities and itself.
- No private name imported across modules.
- GGUF tensor names are spelled only in formats/ (constants.py and the architecture tables).
- No function longer than 60 lines.

And of the tests: no test module imports another; what they share lives in helper modules (gguf_fixtures.py,
cli_checks.py, serving.py, ...) or conftest.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SOURCE_FOLDERS = ("powerinfer_tools", "solver", "formats")
GGUF_NAME = re.compile(r"blk\.|ffn_down_t|token_embd|output_norm|output\.weight|gpu_idx|gpu_bucket")
MAX_FUNCTION_LINES = 60


def sources() -> dict[str, tuple[Path, ast.Module]]:
    """Module name -> (path, syntax tree) for every module of the package."""
    found = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            parts = ["powerinfer_tools"] + parts if parts[0] != "powerinfer_tools" else parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = (path, ast.parse(path.read_text(encoding="utf-8")))
    return found


def runtime_imports(tree: ast.AST):
    """ImportFrom nodes that run (those under ``if TYPE_CHECKING:`` only name types)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom):
            yield node
        yield from runtime_imports(node)


def folder_of(module: str) -> str:
    """The subpackage a module belongs to (its ``__init__`` included), or "(top)"."""
    parts = module.split(".")
    if len(parts) == 1:
        return "(top)"
    is_subpackage = parts[1] in ("solver", "formats") or (REPO / "powerinfer_tools" / parts[1]).is_dir()
    return parts[1] if is_subpackage else "(top)"


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, (_, tree) in sources().items():
        for node in runtime_imports(tree):
            assert node.level == 0, f"{module}: relative import (the package uses absolute imports)"
            if node.module and node.module.startswith("powerinfer_tools"):
                target = node.module if node.module != "powerinfer_tools" else f"powerinfer_tools.{node.names[0].name}"
                a, b = folder_of(module), folder_of(target)
                if a != b:
                    graph.setdefault(a, set()).add(b)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_folders():
    graph = folder_graph()
    assert not graph.get("(top)"), f"top-level modules import subpackages: {graph.get('(top)')}"
    assert find_cycle(graph) is None, f"folders import each other in a cycle: {find_cycle(graph)}"


def test_formats_import_no_pipeline_stage():
    assert folder_graph().get("formats", set()) <= {"(top)"}, folder_graph()["formats"]


def test_no_private_name_is_imported_across_modules():
    private = [
        f"{module}: {node.module}.{alias.name}"
        for module, (_, tree) in sources().items()
        for node in runtime_imports(tree)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, private


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_gguf_tensor_names_are_spelled_only_in_formats():
    spelled = []
    for module, (path, tree) in sources().items():
        if folder_of(module) == "formats":
            continue
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if GGUF_NAME.search(node.value):
                    spelled.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not spelled, spelled


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in sources().values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


FAMILY_MODULES = {"powerinfer_tools.models"} | {
    f"powerinfer_tools.models.{path.stem}" for path in (REPO / "powerinfer_tools" / "models").glob("*.py")
    if "ARCHITECTURE =" in path.read_text(encoding="utf-8")}
# What names a family: its row (``spec.architecture``) and the fields of a file or config that say which it is.
FAMILY_FIELDS = {"architecture", "gguf_name", "gguf_names", "name", "model_type", "model_types"}


def _names_a_family(node: ast.AST) -> bool:
    """``x.architecture``, ``spec.architecture.name``, ``config["model_type"]``, ``config.get("model_type")``."""
    if isinstance(node, ast.Attribute):
        return node.attr in FAMILY_FIELDS and (node.attr != "name" or _names_a_family(node.value))
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in FAMILY_FIELDS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in FAMILY_FIELDS
    return False


def _is_text(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_text(item) for item in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def family_tests(tree: ast.AST) -> list[int]:
    """Lines that compare a family's name with text, or look something up by it (``TABLES[spec.architecture]``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_names_a_family, operands)) and any(map(_is_text, operands)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _names_a_family(node.slice):
            lines.append(node.lineno)
    return lines


def test_the_finder_of_family_tests_finds_them():
    found = family_tests(ast.parse('spec.architecture == "gemma3"\nif config.get("model_type") in ("llama", "x"): pass\n'
                                   'TABLES[spec.architecture]\nspec.architecture.name != "opt"\n'
                                   'model.architecture == BAMBOO\nkind == "llama"\n'))
    assert found == [1, 2, 3, 4]


def test_only_a_familys_module_tests_an_architecture_name():
    """Everything the code asks about a family is in its row (formats/architecture.py): code elsewhere asks the row,
    never which family it is."""
    tested = [f"{path.relative_to(REPO)}:{line}" for module, (path, tree) in sources().items()
              if module not in FAMILY_MODULES for line in family_tests(tree)]
    assert not tested, tested


def imported_modules(tree: ast.AST):
    """(line, module name) of every absolute import in ``tree``, nested ones too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_no_test_module_imports_another():
    """A test module imported by another is a helper module in disguise, whose imports and fixtures come along (a
    memory limit reached test_typed_metadata as test_fuzz's autouse fixture, imported by name): what test modules
    share belongs in a helper module or conftest.py."""
    test_modules = {path.stem for path in TESTS.glob("test_*.py")}
    imports = [f"{path.name}:{line} imports {module}"
               for path in sorted(TESTS.glob("*.py"))
               for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8")))
               if module.split(".")[0] in test_modules]
    assert not imports, imports
