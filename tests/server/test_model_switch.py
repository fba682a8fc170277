"""kvd-mlx-lm-server follows the model mlx_lm.server loads for each request (its public
ModelProvider.load): a request naming another model folder is stored under that model's
identity, and one back on the default model never gets the other's entries."""

from __future__ import annotations

import re
import time
from pathlib import Path

from daemon_process import Daemon
from http_servers import HttpServer, http_server
from kvd_client.client import Client
from model_folders import build_model_folder, words

SETTLE_SECONDS = 30.0


def _ask(server: HttpServer, model: str, prompt: str) -> tuple[int, int]:
    """prompt_tokens and cached_tokens of a greedy completion by model."""
    reply = server.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.0,
        max_tokens=4,
    )
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return reply.usage.prompt_tokens, int(cached or 0)


def _identities_with_entries(daemon: Daemon, count: int) -> list[str]:
    """The identities kvd holds entries of, once there are count of them."""
    deadline = time.monotonic() + SETTLE_SECONDS
    with Client.connect(daemon.socket_path, require=True) as client:
        while True:
            held = sorted({entry.identity for entry in client.list_entries()})
            if len(held) >= count or time.monotonic() > deadline:
                return held
            time.sleep(0.05)


def test_a_request_for_another_model_is_stored_under_its_identity_and_not_served_to_the_first(
    daemon: Daemon, tmp_path: Path
) -> None:
    a = build_model_folder(tmp_path / "a", seed=0)
    b = build_model_folder(tmp_path / "b", seed=1)
    prompt = words(300, seed=71)
    log = tmp_path / "server.log"
    with http_server(a, log, kvd_socket=daemon.socket_path) as server:
        _ask(server, str(b), prompt)
        assert len(_identities_with_entries(daemon, 1)) == 1
        prompt_tokens, cached = _ask(server, "default_model", prompt)
        assert cached == 0  # model b's cache of the same prompt is not model a's
        assert len(_identities_with_entries(daemon, 2)) == 2
        assert server.stop() == 0
    assert len(re.findall(r"kvd: model \S+ \(llama-", log.read_text())) == 3  # a, b, a again
    assert prompt_tokens > 0
