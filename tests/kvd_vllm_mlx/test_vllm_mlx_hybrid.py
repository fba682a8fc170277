"""kvd-vllm-mlx with a hybrid model (qwen3_next: Gated DeltaNet layers, whose recurrent state
cannot be trimmed, and attention): prefill checkpoints and the prompt boundary through vllm-mlx's
continuous batching. A real kvd, real server processes, a tiny hybrid model folder built here,
the openai client at temperature 0; every answer is compared with stock vllm-mlx's, and every
restore is on a server started after the prompt it restores from was sent."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon
from kvd_client.client import Client
from mlx_lm.tokenizer_utils import load as load_tokenizer
from model_folders import build_model_folder, words
from vllm_servers import Reply, chat, vllm_server

INTERVAL = 256  # tokens between checkpoints: two of the daemon's 128-token blocks
CHECKPOINTS = ("--kvd-checkpoint-interval", str(INTERVAL))
MODEL_TYPE = "qwen3_next"  # a hybrid the mlx-lm of vllm-mlx 0.6.0 (0.31) runs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "hybrid"
    return build_model_folder(folder, seed=0, model_type=MODEL_TYPE)


def _prompt_tokens(model: Path, text: str) -> list[int]:
    """A user turn's tokens, as the server's tokenizer and chat template make them."""
    tokenizer: Any = load_tokenizer(model)  # mlx-lm ships no type hints
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _restored(log: str) -> list[tuple[int, int]]:
    found = re.findall(r"kvd: restored (\d+) of (\d+) prompt tokens", log)
    return [(int(held), int(prompt)) for held, prompt in found]


def _hits(daemon: Daemon) -> int:
    with Client.connect(daemon.socket_path, require=True) as client:
        hits = client.status()["hits"]
    assert isinstance(hits, int)
    return hits


def test_a_restarted_server_restores_a_prompt_whose_end_changed_and_answers_as_stock(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    """The last 100 of 2,000 words changed: a fresh server restores the shared tokens to
    within one checkpoint interval (a prefill checkpoint); an exact repeat of the first prompt
    restores all of it but its last token (the prompt boundary). Both answer as stock."""
    first = f"{words(1900, seed=21)} {words(100, seed=22)}"
    changed = f"{words(1900, seed=21)} {words(100, seed=23)}"
    with vllm_server(model, tmp_path / "stock.log", kvd_socket=None) as stock:
        expected = {text: chat(stock, text) for text in (changed, first)}
    with vllm_server(
        model, tmp_path / "first.log", kvd_socket=daemon.socket_path, extra=CHECKPOINTS
    ) as server:
        assert chat(server, first) == expected[first]
        assert server.stop() == 0  # SIGTERM: what waits to be stored is sent first
    hits = _hits(daemon)
    with vllm_server(
        model, tmp_path / "fresh.log", kvd_socket=daemon.socket_path, extra=CHECKPOINTS
    ) as fresh:
        replies: list[Reply] = [chat(fresh, text) for text in (changed, first)]
        assert replies == [expected[changed], expected[first]]
        assert fresh.stop() == 0
    a, b = _prompt_tokens(model, first), _prompt_tokens(model, changed)
    assert (len(b), len(a)) == (replies[0].prompt_tokens, replies[1].prompt_tokens)
    shared = next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    restored = _restored(fresh.logs())
    assert len(restored) == 2, fresh.logs()
    (held, prompt), repeat = restored
    assert prompt == len(b)
    assert shared - INTERVAL <= held <= shared
    assert held % INTERVAL == 0  # a checkpoint's position
    assert repeat == (len(a) - 1, len(a))
    assert _hits(daemon) == hits + 2
    assert "2 prompts restored" in fresh.logs()
    assert re.search(
        r"prefill checkpoints: \d+ taken .*, 1 prompts restored from them", fresh.logs()
    )
