"""The package boundaries of docs/design.md, checked on the installed distributions and sources."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from importlib.metadata import requires
from pathlib import Path
from types import ModuleType

import kvd_client
import kvd_protocol
import pytest

import kvd

DAEMON_ONLY = {"anyio", "structlog", "watchfiles", "psutil", "prometheus-client"}


def _requirement_names(dist: str) -> set[str]:
    """Names of a distribution's unconditional requirements (extras left out)."""
    names = set()
    for req in requires(dist) or []:
        if "extra ==" in req:
            continue
        match = re.match(r"[A-Za-z0-9_.-]+", req)
        assert match is not None
        names.add(match.group(0).lower())
    return names


def test_daemon_distribution_does_not_pull_mlx() -> None:
    names = _requirement_names("kvd")
    assert not {n for n in names if n.startswith("mlx")}
    assert names >= DAEMON_ONLY


def test_the_service_definitions_ship_with_the_daemon() -> None:
    """kvctl service install reads them from the installed package: each is package data."""
    package = Path(kvd.__file__).parent
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["kvd"]
    definitions = [
        p.relative_to(package).as_posix() for p in package.glob("services/**/*") if p.is_file()
    ]
    assert len(definitions) == 5  # kvd's two units and plist, the server's unit and plist
    assert all(any(fnmatch(name, glob) for glob in globs) for name in definitions)


def test_engine_library_does_not_pull_daemon_dependencies() -> None:
    names = _requirement_names("kvd-client")
    assert not names & DAEMON_ONLY
    assert "mlx" in names
    assert "numpy" in names  # imported without the mlx-lm extra (restore.py)
    assert "kvd-protocol" in names


def test_protocol_depends_on_msgpack_and_the_checksum_only() -> None:
    assert _requirement_names("kvd-protocol") == {"msgpack", "xxhash"}


def run_fresh_python(script: str) -> None:
    """Run script in a new interpreter (a clean sys.modules); it fails by exiting non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_every_daemon_module_never_imports_mlx() -> None:
    # __main__ runs the daemon when imported; everything it imports is imported by kvd.cli.
    modules = [
        m.name
        for m in pkgutil.walk_packages(kvd.__path__, "kvd.")
        if not m.name.endswith("__main__")
    ]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    run_fresh_python(script)


# The protocol package is sans-I/O: it may import only these (no socket, os, io, time, ...).
PURE_IMPORTS = {
    "__future__",
    "array",
    "collections",
    "dataclasses",
    "enum",
    "functools",  # cached_property
    "hashlib",
    "itertools",
    "kvd_protocol",  # its own modules
    "math",
    "msgpack",
    "pathlib",  # PurePosixPath only: path strings, no file access
    "posixpath",
    "re",  # an identity's traits are checked by pattern
    "struct",
    "sys",
    "types",
    "typing",
    "xxhash",
    "zlib",
}


def test_protocol_package_imports_no_io_modules() -> None:
    root = Path(kvd_protocol.__file__).parent
    seen: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = {node.module.split(".")[0]}
            else:
                continue
            for top in tops:
                seen.setdefault(top, set()).add(path.name)
    impure = {name: files for name, files in seen.items() if name not in PURE_IMPORTS}
    assert not impure, f"kvd_protocol imports I/O or unexpected modules: {impure}"


def test_the_raw_client_imports_without_mlx_and_the_cache_layer_on_demand() -> None:
    script = (
        "import sys, kvd_client\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
        "from kvd_client import EngineIdentity, ColdTier, Restored, register_codec, CodecError\n"
        "assert EngineIdentity.__module__ == 'kvd_client.identity'\n"
        "assert 'mlx' in sys.modules\n"
    )
    run_fresh_python(script)


def test_the_former_identity_names_warn_and_give_one_class_each() -> None:
    script = (
        "import warnings, kvd_client, kvd_protocol\n"
        "from kvd_client.identity import EngineIdentity\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    assert kvd_client.Identity is EngineIdentity\n"
        "    assert kvd_client.WireIdentity is kvd_protocol.Identity\n"
        "said = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "assert said == ['kvd_client.Identity is deprecated: use kvd_client.EngineIdentity',\n"
        "    'kvd_client.WireIdentity is deprecated: use kvd_protocol.Identity'], said\n"
    )
    run_fresh_python(script)


def _imports(module: str, is_package: bool, tree: ast.Module) -> set[tuple[str, str]]:
    """What each import statement anywhere in the module names (function bodies and
    TYPE_CHECKING blocks included), as (module, fallback): `from X import name` gives
    (X.name, X), for name is a module or a name defined by X."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.name, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.update((f"{base}.{alias.name}", base) for alias in node.names)
    return names


def module_sources(package: ModuleType) -> dict[str, Path]:
    """Each module of package (its __init__ included) and its source file."""
    root = Path(package.__file__ or "").parent
    return {
        package.__name__: root / "__init__.py",
        **{
            m.name: Path(root, *m.name.split(".")[1:]).with_suffix(".py")
            for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
            if not m.ispkg
        },
    }


def import_graph(package: ModuleType) -> dict[str, set[str]]:
    """Each module of package and the modules of the same package it imports."""
    sources = module_sources(package)
    graph = {}
    for name, path in sources.items():
        imports = _imports(name, name == package.__name__, ast.parse(path.read_text()))
        targets = {module if module in sources else fallback for module, fallback in imports}
        graph[name] = {m for m in targets if m in sources and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports that leads back to where it started, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            cycle = visit(target, [*path, name])
            if cycle is not None:
                return cycle
        done.add(name)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_an_import_cycle_through_others() -> None:
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p": {"p.a"}, "p.a": {"p.b"}, "p.b": set()}) is None


@pytest.mark.parametrize("package", [kvd, kvd_client, kvd_protocol], ids=lambda p: p.__name__)
def test_no_module_imports_one_that_imports_it_back(package: ModuleType) -> None:
    graph = import_graph(package)
    assert len(graph) > 3  # the walk found the modules
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports in an acyclic graph, as the modules on it, first the one
    that imports the next."""
    longest: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in longest:
            below = max((chain(target) for target in sorted(graph[name])), key=len, default=[])
            longest[name] = [name, *below]
        return longest[name]

    return max((chain(name) for name in sorted(graph)), key=len, default=[])


def test_the_chain_finder_finds_the_longest_path_of_imports() -> None:
    graph = {"p": {"p.a", "p.c"}, "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": set()}
    assert longest_chain(graph) == ["p", "p.a", "p.b", "p.c"]


# kvd's floors, file by file: the modules on its longest chain of imports (__main__ -> cli
# -> the server -> ... -> kvd.logs). Each floor is a module whose change every one above it
# may feel; a new one is a choice, made here.
KVD_FLOORS = 13


def test_the_daemon_stays_within_its_floors() -> None:
    chain = longest_chain(import_graph(kvd))
    assert len(chain) <= KVD_FLOORS, " -> ".join(chain)
