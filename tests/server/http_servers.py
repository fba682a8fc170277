"""OpenAI-compatible server processes on free loopback ports: kvd-mlx-lm-server, or stock
mlx_lm.server as the reference a kvd-backed server must answer exactly like; chats with them,
and a wait for what they store in kvd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from kvd_client.client import Client
from model_folders import words
from openai import OpenAI

START_SECONDS = 120.0
STOP_SECONDS = 30.0
SETTLE_SECONDS = 30.0  # bound on waiting for what a server stores in the background

Messages = list[dict[str, str]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class HttpServer:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    healthy: ClassVar[str] = "ok"  # the status /health answers once the server serves

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, text: str, seconds: float = START_SECONDS) -> None:
        """Until the server's log holds text."""
        deadline = time.monotonic() + seconds
        while text not in self.logs():
            if time.monotonic() > deadline:
                raise AssertionError(f"never logged {text!r} within {seconds} s:\n{self.logs()}")
            time.sleep(0.01)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("status") == self.healthy:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not ready within {START_SECONDS} s:\n{self.logs()}")

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"server ignored SIGTERM:\n{self.logs()}") from None
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _command(
    model: Path, port: int, kvd_socket: str | None, extra: Sequence[str], python: str
) -> list[str]:
    common = ["--model", str(model), "--port", str(port), "--host", "127.0.0.1", *extra]
    if kvd_socket is None:
        return [python, "-m", "mlx_lm", "server", *common]
    return [python, "-m", "kvd_client.mlx_lm_server", *common, "--kvd-socket", kvd_socket]


Server = TypeVar("Server", bound=HttpServer)


@contextmanager
def running_server(
    kind: type[Server], command: Sequence[str], port: int, log: Path, env: dict[str, str]
) -> Iterator[Server]:
    """The server command started, its output to log, until it is ready; killed after."""
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = kind(process, port, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@contextmanager
def http_server(
    model: Path,
    log: Path,
    *,
    kvd_socket: str | None,
    extra: Sequence[str] = (),
    python: str = sys.executable,
) -> Iterator[HttpServer]:
    """A ready server process of model; with kvd_socket None, stock mlx_lm.server. python: the
    interpreter of another virtualenv (another mlx-lm)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env["HF_HUB_OFFLINE"] = "1"
    command = _command(model, port, kvd_socket, extra, python)
    with running_server(HttpServer, command, port, log, env) as server:
        yield server


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: list[int] | None  # the generated token ids (the logprobs block; not streamed)
    prompt_tokens: int
    cached_tokens: int


def chat(
    server: HttpServer, messages: list[dict[str, str]], *, stream: bool, seed: int | None = None
) -> Answer:
    """A greedy chat completion through the openai client, streaming or not; a request with
    a seed takes mlx_lm.server's single-request path (it is not batched)."""
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": 12,
        "logprobs": True,
    }
    if seed is not None:
        request["seed"] = seed
    client = server.client()
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        assert reply.usage is not None
        return Answer(
            choice.message.content or "",
            [_token_id(t) for t in choice.logprobs.content or []] if choice.logprobs else [],
            reply.usage.prompt_tokens,
            _cached(reply.usage),
        )
    text, usage = [], None
    for chunk in client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        text += [choice.delta.content or "" for choice in chunk.choices]
    assert usage is not None, "the stream carried no usage block"
    return Answer("".join(text), None, usage.prompt_tokens, _cached(usage))


def _token_id(logprob: Any) -> int:
    return int(logprob.model_extra["id"])  # mlx_lm.server adds the id to OpenAI's fields


def _cached(usage: Any) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def turn(seed: int, length: int) -> Messages:
    """A conversation's first user turn of length words."""
    return [{"role": "user", "content": words(length, seed)}]


def wait_for_entry(socket_path: str, tokens: int) -> None:
    """Until the kvd at socket_path holds an entry of at least tokens tokens (a server stores
    in the background)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    with Client.connect(socket_path, require=True) as client:
        while time.monotonic() < deadline:
            if any(e.tokens >= tokens for e in client.list_entries()):
                return
            time.sleep(0.05)
    raise AssertionError(f"kvd never held an entry of {tokens} tokens")
