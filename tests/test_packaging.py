"""The package boundaries of DESIGN.md, checked on the installed distributions and the sources."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import kvd_protocol

import kvd

DAEMON_ONLY = {"anyio", "structlog", "watchfiles", "psutil"}


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


def test_engine_library_does_not_pull_daemon_dependencies() -> None:
    names = _requirement_names("kvd-client")
    assert not names & DAEMON_ONLY
    assert "mlx" in names
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
    "hashlib",
    "itertools",
    "kvd_protocol",  # its own modules
    "math",
    "msgpack",
    "pathlib",  # PurePosixPath only: path strings, no file access
    "posixpath",
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
        "from kvd_client import Identity, ColdTier, Restored, register_codec, CodecError\n"
        "assert Identity.__module__ == 'kvd_client.identity'\n"
        "assert 'mlx' in sys.modules\n"
    )
    run_fresh_python(script)
