"""kvd-mlx-lm-server on an mlx-lm whose surface changed: a copy of the installed mlx_lm package
with one edit (a method renamed, a signature or option changed, a replaced name no longer
looked up), put first on the server process's path. The server must stop at start with an
error naming the version found and the tested range, never serve without its tier; an mlx-lm
outside the tested range with every hook in place serves, with a warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
from http_servers import chat, free_port, http_server
from kvd_client import mlx_lm_hooks
from model_folders import build_model_folder, words

FOUND_VERSION = "9.9.9"  # the copy's own: the message must name it, not the installed one
START_SECONDS = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "a", seed=0)


def changed_mlx_lm(root: Path, old: str = "", new: str = "") -> Path:
    """A folder holding a copy of the installed mlx_lm, its version FOUND_VERSION, and old
    replaced by new in the one module that holds it (nothing replaced when old is empty)."""
    package = root / "mlx_lm"
    shutil.copytree(
        Path(mlx_lm.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    (package / "_version.py").write_text(f"__version__ = {FOUND_VERSION!r}\n")
    if old:
        holders = (package / "server.py", package / "generate.py", package / "models" / "cache.py")
        texts = {p: p.read_text() for p in holders}
        found = [(p, text) for p, text in texts.items() if text.count(old) == 1]
        assert len(found) == 1, f"{old!r} is not in the installed mlx_lm once"
        path, text = found[0]
        path.write_text(text.replace(old, new))
    return root


def run_server(site: Path, model: Path, kvd_socket: Path) -> subprocess.CompletedProcess[str]:
    """kvd-mlx-lm-server with site first on its path, until it exits by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-m", "kvd_client.mlx_lm_server", "--model", str(model)]
    port = ["--port", str(free_port()), "--host", "127.0.0.1"]
    return subprocess.run(
        [*command, *port, "--kvd-socket", str(kvd_socket)],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        env=env,
        check=False,
    )


CHANGES = {
    "load renamed": (
        "    def load(self, model_path, adapter_path=None, draft_model_path=None):",
        "    def load_model(self, model_path, adapter_path=None, draft_model_path=None):",
        "mlx_lm.server.ModelProvider.load is missing",
    ),
    "fetch_nearest_cache takes another argument": (
        "    def fetch_nearest_cache(self, model: Any, tokens: List[int]):",
        "    def fetch_nearest_cache(self, model: Any, tokens: List[int], limit: int = 0):",
        "mlx_lm.server.LRUPromptCache.fetch_nearest_cache is (self, model, tokens, limit=0), "
        "not (self, model, tokens)",
    ),
    "run builds its prompt cache under another name": (
        "    prompt_cache = LRUPromptCache(model_provider.cli_args.prompt_cache_size)",
        "    from .models.cache import LRUPromptCache as PromptCache\n\n"
        "    prompt_cache = PromptCache(model_provider.cli_args.prompt_cache_size)",
        "mlx_lm.server.run no longer looks up LRUPromptCache by that name",
    ),
    "the single-request path calls stream_generate by another name": (
        "            for gen in stream_generate(",
        "            for gen in generate_stream(",
        "mlx_lm.server.ResponseGenerator._serve_single no longer looks up stream_generate by "
        "that name",
    ),
    "the batched path builds its BatchGenerator by another name": (
        "batch_generator = BatchGenerator(",
        "batch_generator = ContinuousBatcher(",
        "mlx_lm.server.ResponseGenerator._generate no longer looks up BatchGenerator by that name",
    ),
    "insert_segments takes another argument": (
        "        stop_sequences: Optional[List[StopSequences]] = None,\n    ):\n"
        "        num_segments = len(segments)",
        "        stop_sequences: Optional[List[StopSequences]] = None,\n"
        "        prefill_only: bool = False,\n    ):\n        num_segments = len(segments)",
        "mlx_lm.generate.BatchGenerator.insert_segments is (self, segments, max_tokens=None, "
        "caches=None, all_tokens=None, samplers=None, logits_processors=None, "
        "stop_sequences=None, prefill_only=False), not ",
    ),
    "a cache layer tells no more whether it is empty": (
        '    def empty(self):\n        """\n        Return if the cache is empty or not.',
        '    def is_empty(self):\n        """\n        Return if the cache is empty or not.',
        "mlx_lm.models.cache._BaseCache.empty is missing",
    ),
    "--kv-bits renamed": (
        '"--kv-bits",\n        type=int,\n        default=None,',  # the server's, not generate's
        '"--kv-quant-bits",\n        type=int,\n        default=None,',
        "its command line has no kv_bits",
    ),
    "model_key of another form": (
        "self.model_key = (model_path, adapter_path, draft_model_path)",
        "self.model_key = model_path",
        "ModelProvider.model_key is ",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_server_on_a_changed_mlx_lm_stops_at_start_naming_the_version_and_the_tested_range(
    model: Path, tmp_path: Path, change: str
) -> None:
    old, new, problem = CHANGES[change]
    site = changed_mlx_lm(tmp_path / "site", old, new)
    ran = run_server(site, model, tmp_path / "kvd.sock")
    assert ran.returncode == 1, ran.stderr
    tested = mlx_lm_hooks.tested_range_text()
    last = ran.stderr.strip().splitlines()[-1]  # the message, not a traceback
    assert last.startswith(f"kvd-mlx-lm-server does not run on mlx-lm {FOUND_VERSION}: "), last
    assert problem in last
    assert last.endswith(f"It is tested with mlx-lm{tested}: pip install 'mlx-lm{tested}'")
    assert "Traceback" not in ran.stderr


def test_an_untested_mlx_lm_with_every_hook_in_place_serves_with_a_warning(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = changed_mlx_lm(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "server.log"
    with http_server(model, log, kvd_socket=str(tmp_path / "kvd.sock")) as server:
        answer = chat(server, [{"role": "user", "content": words(50, seed=1)}], stream=False)
        assert answer.prompt_tokens > 0
        assert server.stop() == 0
    assert (
        f"mlx-lm {FOUND_VERSION} is outside the range kvd-mlx-lm-server is tested with "
        f"(mlx-lm{mlx_lm_hooks.tested_range_text()})"
    ) in log.read_text()


def test_the_declared_mlx_lm_range_is_closed() -> None:
    """pip never installs an mlx-lm newer than the ones the server is tested with."""
    bounds = {bound.operator for bound in mlx_lm_hooks.tested_range()}
    assert ">=" in bounds
    assert bounds & {"<=", "<"}
