"""No module of kvd or kvd_protocol imports one that imports it back, directly or through
others: each package's modules form a layered graph, read from the bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

import kvd_protocol
import pytest

import kvd


def module_names(package: Path, name: str) -> dict[str, Path]:
    """Every module of the package by dotted name (the package itself for __init__.py)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = [name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module imports anywhere in its source (in functions and
    under TYPE_CHECKING too: an import that only hides a circle is still one)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + is_package]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in known else source)
    return {t for t in targets if t in known and t != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of graph, as a path that ends where it starts; None if none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if (cycle := visit(node)) is not None:
            return cycle
    return None


def import_graph(package: Path, name: str) -> dict[str, set[str]]:
    modules = module_names(package, name)
    return {m: imported(m, p, set(modules)) for m, p in modules.items()}


@pytest.mark.parametrize("package", [kvd, kvd_protocol], ids=lambda p: p.__name__)
def test_no_import_circle(package: object) -> None:
    root = Path(package.__file__).parent  # type: ignore[attr-defined]
    graph = import_graph(root, package.__name__)  # type: ignore[attr-defined]
    assert len(graph) > 10  # the walk found the package's modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_a_circle_is_found(tmp_path: Path) -> None:
    """The check itself: a circle through three modules, and one through a package's
    __init__ re-export, are both reported; a layered package is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from pkg import b\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from .c import C\n")
    (package / "c.py").write_text("import pkg.a\nC = 1\n")
    assert find_cycle(import_graph(package, "pkg")) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("from pkg import A\nC = 1\n")
    assert find_cycle(import_graph(package, "pkg")) == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg"]
    (package / "c.py").write_text("C = 1\n")
    assert find_cycle(import_graph(package, "pkg")) is None
