"""kvd-vllm-mlx on a vllm-mlx whose surface changed: a copy of the installed vllm_mlx package
with one edit, first on the server's path. The server stops before it serves, exit code 1, its
last line naming the version found, what changed and the tested range."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx_lm
import pytest
import vllm_mlx
from http_servers import START_SECONDS, free_port
from kvd_client import vllm_mlx_hooks
from kvd_client.vllm_mlx_batch import PREFILL_COUNTERS
from mlx_lm.generate import BatchGenerator
from model_folders import build_model_folder
from vllm_servers import command, environment

FOUND_VERSION = "0.6.99"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "a", seed=0)


def changed_vllm_mlx(root: Path, module: str, old: str, new: str) -> Path:
    """A folder holding a copy of the installed vllm_mlx, its version FOUND_VERSION, and old
    replaced by new in module (a file of the package), where it is once."""
    package = root / "vllm_mlx"
    shutil.copytree(
        Path(vllm_mlx.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    init = package / "__init__.py"
    version = f'__version__ = "{vllm_mlx.__version__}"'
    assert init.read_text().count(version) == 1
    init.write_text(init.read_text().replace(version, f'__version__ = "{FOUND_VERSION}"'))
    path = package / module
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in the installed {module} once"
    path.write_text(text.replace(old, new))
    return root


CHANGES = {
    "fetch takes another argument": (
        "memory_cache.py",
        "    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:",
        "    def fetch(\n        self, tokens: list[int], limit: int = 0\n"
        "    ) -> tuple[list[Any] | None, list[int]]:",
        "vllm_mlx.memory_cache.MemoryAwarePrefixCache.fetch is (self, tokens, limit=0), "
        "not (self, tokens)",
    ),
    "the scheduler builds its prefix cache under another name": (
        "scheduler.py",
        "                self.memory_aware_cache = MemoryAwarePrefixCache(",
        "                from .memory_cache import MemoryAwarePrefixCache as PrefixCache\n\n"
        "                self.memory_aware_cache = PrefixCache(",
        "vllm_mlx.scheduler.Scheduler.__init__ no longer looks up MemoryAwarePrefixCache by "
        "that name",
    ),
    "the scheduler builds its batch generator under another name": (
        "scheduler.py",
        "        bg = BatchGenerator(",
        "        from mlx_lm.generate import BatchGenerator as Batches\n\n        bg = Batches(",
        "vllm_mlx.scheduler.Scheduler._create_batch_generator no longer looks up "
        "BatchGenerator by that name",
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_hook_stops_the_server_with_one_line_naming_version_change_and_range(
    model: Path, tmp_path: Path, change: str
) -> None:
    module, old, new, problem = CHANGES[change]
    site = changed_vllm_mlx(tmp_path / "site", module, old, new)
    env = environment(tmp_path / "home")
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run(
        command(model, free_port(), str(tmp_path / "kvd.sock")),
        capture_output=True,
        text=True,
        env=env,
        timeout=START_SECONDS,
        check=False,
    )
    tested = vllm_mlx_hooks.tested_range_text()
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"kvd-vllm-mlx does not run on vllm-mlx {FOUND_VERSION}: {problem}. It is tested "
        f"with vllm-mlx{tested}: pip install 'vllm-mlx{tested}'"
    )
    assert "Traceback" not in done.stderr


def test_a_batch_generator_without_its_prefill_counters_is_a_changed_hook(model: Path) -> None:
    """The prefill the tier is told is read from mlx-lm's counters: mlx-lm's BatchGenerator
    has them, and one without them is refused as any changed hook is, naming what is missing."""
    built = BatchGenerator(mlx_lm.load(str(model))[0])
    vllm_mlx_hooks.check_attributes(built, PREFILL_COUNTERS, "mlx-lm's BatchGenerator")
    delattr(built, "_prompt_time_counter")  # as a release that renamed it would build it
    with pytest.raises(vllm_mlx_hooks.VllmMlxChangedError) as changed:
        vllm_mlx_hooks.check_attributes(built, PREFILL_COUNTERS, "mlx-lm's BatchGenerator")
    assert changed.value.problems == ["mlx-lm's BatchGenerator has no _prompt_time_counter"]
