"""The packages kvd-vllm-mlx's text server imports, serving a request: vllm-mlx, kvd's, and only
those tests/kvd_vllm_mlx/requirements.txt lists (and what they depend on). vllm-mlx is installed
without its dependencies (off macOS they bring torch through torchvision): a server that
imports a package not listed fails here, where it is installed, and fails to start in CI's
virtualenv, where it is not."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from daemon_process import Daemon
from model_folders import build_model_folder, words
from packaging.requirements import Requirement
from vllm_servers import chat, vllm_server

REQUIREMENTS = Path(__file__).with_name("requirements.txt")
# kvd's packages (the daemon's too: the tests start one, and uvicorn imports its watchfiles when
# installed), and the virtualenv's own.
OURS = ("kvd-client", "kvd-protocol", "kvd", "pip", "setuptools")
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(?P<module>[\w.]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "a", seed=0)


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def listed() -> list[str]:
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [Requirement(line).name for line in lines if line]


def with_dependencies(names: list[str]) -> set[str]:
    """names and every distribution they require with the extras asked, all the way down;
    one that is not installed is not followed (nothing imports from it)."""
    found: set[str] = set()
    followed: set[tuple[str, ...]] = set()
    waiting = [Requirement(n) for n in names]
    while waiting:
        wanted = waiting.pop()
        name = _name(wanted.name)
        if (name, *sorted(wanted.extras)) in followed:
            continue
        followed.add((name, *sorted(wanted.extras)))
        found.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(
                marker.evaluate({"extra": extra}) for extra in ("", *wanted.extras)
            ):
                waiting.append(requirement)
    return found


def test_the_text_server_imports_only_the_listed_packages(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    python = (sys.executable, "-X", "importtime")
    log = tmp_path / "server.log"
    with vllm_server(model, log, kvd_socket=daemon.socket_path, python=python) as server:
        chat(server, words(300, seed=21))
        assert server.stop() == 0
    tops = {module.split(".")[0] for module in IMPORTED.findall(server.logs())}
    assert {"vllm_mlx", "kvd_client"} <= tops  # the log holds the imports
    owners = metadata.packages_distributions()
    imported = {_name(d) for top in tops for d in owners.get(top, ())}
    allowed = {"vllm-mlx", *with_dependencies([*listed(), *OURS])}  # not vllm-mlx's own
    assert not imported - allowed, (
        f"the server imports {sorted(imported - allowed)}, which "
        f"{REQUIREMENTS.name} does not list (nor anything it lists depends on)"
    )
