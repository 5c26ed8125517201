"""The shape of the Python package: its subpackages import each other without cycles, no module imports
another's private names, and no file grows past what a reader holds.

Every `import` is read from the source (those inside functions included), so a cycle hidden by a
function-level import fails here as an import-time one would. Imports under `if TYPE_CHECKING:` count
between packages but not between modules of one package (a module may name its sibling's types)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cpumla"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py") if p.name != "build.py" or p.parent.name != "native"}


def type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, sub.end_lineno + 1))
    return lines


def imports(mod: str):
    """(imported module, imported name or None, typing only) for every cpumla import in mod."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = type_checking_lines(tree)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:           # else not cpumla's, or its compiled extension
                    yield a.name, None, node.lineno in typing_only
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base not in MODULES:             # not cpumla's, or its compiled extension
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:                     # `from cpumla import native`: the module itself
                    yield full, None, node.lineno in typing_only
                else:
                    yield base, a.name, node.lineno in typing_only


def unit(mod: str) -> str:
    """The package a module belongs to: cpumla.<first part>, or cpumla itself."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def graphs():
    packages: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for mod in MODULES:
        for target, _, typing_only in imports(mod):
            if target == mod:
                continue
            if unit(target) != unit(mod):
                packages.setdefault(unit(mod), set()).add(unit(target))
            elif not typing_only:
                modules.setdefault(mod, set()).add(target)
    return packages, modules


def test_the_packages_import_each_other_without_cycles():
    packages, _ = graphs()
    assert {"cpumla.cli", "cpumla.runtime", "cpumla.models", "cpumla.native"} <= set(packages) | \
        {t for ts in packages.values() for t in ts}, "the walk found none of the packages"
    found = cycle(packages)
    assert found is None, "packages import each other in a circle: " + " -> ".join(found)


def test_the_modules_of_a_package_import_each_other_without_cycles():
    _, modules = graphs()
    found = cycle(modules)
    assert found is None, "modules import each other in a circle: " + " -> ".join(found)


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for mod in MODULES:
        for target, name, _ in imports(mod):
            if name and name.startswith("_") and not name.startswith("__") and target != mod:
                bad.append(f"{mod} imports {target}.{name}")
        tree = ast.parse(MODULES[mod].read_text())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names if (isinstance(n, ast.Import) and a.name.startswith("cpumla"))
                   or (isinstance(n, ast.ImportFrom) and f"{n.module}.{a.name}" in MODULES)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                    and n.attr.startswith("_") and not n.attr.startswith("__"):
                bad.append(f"{mod} uses {n.value.id}.{n.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_longer_than_a_reader_holds(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES}): split it along a seam"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The checks above read imports the way they must: one inside a function counts."""
    src = "def f():\n    from cpumla.runtime import engine\n"
    tree = ast.parse(src)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found and found[0].module == "cpumla.runtime"
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
