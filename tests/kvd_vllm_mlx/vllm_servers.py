"""vllm-mlx server processes on free loopback ports: kvd-vllm-mlx, or stock vllm-mlx as the
reference it must answer exactly like, each with a home of its own (vllm-mlx saves its prefix
cache under ~/.cache at exit and loads it at start: a restart must not be served by that)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from http_servers import HttpServer, free_port, running_server

SERVED = "tiny"
MAX_TOKENS = 12


class VllmServer(HttpServer):
    healthy = "healthy"


def command(
    model: Path,
    port: int,
    kvd_socket: str | None,
    extra: Sequence[str] = (),
    python: Sequence[str] = (sys.executable,),
) -> list[str]:
    """python: the interpreter and its own options."""
    serve = [
        *("serve", str(model), "--port", str(port), "--host", "127.0.0.1"),
        *("--continuous-batching", "--served-model-name", SERVED, *extra),
    ]
    if kvd_socket is None:
        return [*python, "-m", "vllm_mlx.cli", *serve]
    return [*python, "-m", "kvd_client.vllm_mlx_server", *serve, "--kvd-socket", kvd_socket]


def environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), HF_HUB_OFFLINE="1")
    return env


@contextmanager
def vllm_server(
    model: Path,
    log: Path,
    *,
    kvd_socket: str | None,
    extra: Sequence[str] = (),
    python: Sequence[str] = (sys.executable,),
) -> Iterator[VllmServer]:
    """A ready server process of model; with kvd_socket None, stock vllm-mlx."""
    port = free_port()
    launch = command(model, port, kvd_socket, extra, python)
    env = environment(log.with_suffix(".home"))
    with running_server(VllmServer, launch, port, log, env) as server:
        yield server


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int


def chat(server: HttpServer, text: str) -> Reply:
    """A greedy chat completion of one user turn."""
    reply = server.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": text}],
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    assert reply.usage is not None
    return Reply(reply.choices[0].message.content or "", reply.usage.prompt_tokens)
