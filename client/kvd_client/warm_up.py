"""Warm-up: `kvd-mlx-lm-server --kvd-warm-prompts FILE` prefills known prompts into kvd at start.

FILE holds JSON lines, each the body of a chat completion request: messages, and tools where
the chat template takes them; a line may carry the hints of request_hints.py (a retention,
say). It is read and checked when the flags are (a bad line is a usage error naming it).

Once the server answers, a thread of its own goes through the prompts in order, while the
server serves requests: each prompt is tokenized as the server tokenizes a request, and kvd
asked whether it holds it (one presence request, which restores and counts nothing). One it
holds costs nothing more; another is sent to the server itself as a request for one token
(header WARM_UP_HEADER), so that its prefill is the server's own and stored as any request's
caches are, but not kept in the server's memory: the first real request then restores it from
kvd, as every other server of the model does. It is done once kvd holds it. So the same file
given to a second server of the same model warms nothing twice. Progress is logged per prompt,
and a summary at the end; a prompt that fails is logged and passed over.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvd_protocol.errors import DaemonUnavailableError

from .client import Client
from .identity import EngineIdentity
from .link import DaemonError
from .request_hints import read_hints

log = logging.getLogger("kvd_client")

WARM_UP_HEADER: Final = "X-Kvd-Warm-Up"  # a request of the warm-up: its caches skip memory
READY_SECONDS: Final = 600.0  # for the server to answer at start (a model may download)
STORED_SECONDS: Final = 60.0  # for kvd to hold a prompt once the server prefilled it
POLL_SECONDS: Final = 0.05
REQUEST_SECONDS: Final = 3600.0  # a long prompt's prefill on a slow machine


def read_prompts(text: str) -> list[dict[str, Any]]:
    """The request bodies of the file named text (see the module); ValueError naming the file
    and the line for one that is not a chat request body or whose hints are malformed."""
    path = Path(text)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read: {exc}") from None
    bodies = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("not a chat request body (an object with messages)")
            read_hints(body)
        except ValueError as exc:  # json's errors are ValueErrors
            raise ValueError(f"{path}, line {number}: {exc}") from None
        bodies.append(body)
    return bodies


def server_url(rest: Sequence[str]) -> str:
    """The URL of the server whose flags (mlx_lm.server's) are rest, as seen from its host."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args, _ = parser.parse_known_args(rest)
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{args.port}"


@dataclass
class Warmed:
    """What a warm-up did: prompts held already, prefilled and stored, failed."""

    held: int = 0
    stored: int = 0
    failed: int = 0


@dataclass(frozen=True)
class Served:
    """What the warm-up needs of the server: the model's identity once the tier serves one
    (None before), and a request's prompt as the server tokenizes it."""

    identity: Callable[[], EngineIdentity | None]
    prompt: Callable[[dict[str, Any]], list[int]]


class WarmUp:
    """The warm-up of one server (see the module), run by start() on a thread of its own."""

    def __init__(self, prompts: list[dict[str, Any]], url: str, socket: str | None) -> None:
        self.prompts = prompts
        self.url = url
        self.socket = socket
        self.warmed = Warmed()

    def start(self, served: Served) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(served,), name="kvd-warm-up", daemon=True)
        thread.start()
        return thread

    def _run(self, served: Served) -> None:
        try:
            identity = self._ready(served)
            with Client.connect(self.socket, name="kvd-mlx-lm-server warm-up") as client:
                for number, body in enumerate(self.prompts, 1):
                    self._warm(client, served, identity, number, body)
        except (DaemonUnavailableError, DaemonError, OSError, TimeoutError) as exc:
            log.warning("kvd: warm-up stopped: %s", exc)
        warmed = self.warmed
        log.info(
            "kvd: warm-up done: %d prompts, %d held already, %d prefilled and stored, %d failed",
            len(self.prompts),
            warmed.held,
            warmed.stored,
            warmed.failed,
        )

    def _ready(self, served: Served) -> EngineIdentity:
        """Once the server answers and the tier serves its model: the model's identity."""
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            identity = served.identity()
            if identity is not None and self._answers():
                return identity
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"the server did not answer within {READY_SECONDS:g} s")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return bool(json.loads(answer.read()).get("status") == "ok")
        except (OSError, ValueError):
            return False

    def _warm(
        self,
        client: Client,
        served: Served,
        identity: EngineIdentity,
        number: int,
        body: dict[str, Any],
    ) -> None:
        of = f"{number}/{len(self.prompts)}"
        try:
            tokens = served.prompt(body)
        except Exception as exc:  # the template's own errors: any type
            self.warmed.failed += 1
            log.warning("kvd: warm-up %s: the prompt cannot be made: %s", of, exc)
            return
        if _held(client, identity, tokens):
            self.warmed.held += 1
            log.info("kvd: warm-up %s: %d tokens held already", of, len(tokens))
            return
        started = time.perf_counter()
        problem = self._prefill(body)
        deadline = time.monotonic() + STORED_SECONDS
        while problem is None and not _held(client, identity, tokens):
            if time.monotonic() > deadline:
                problem = f"kvd does not hold it {STORED_SECONDS:g} s after its prefill"
            time.sleep(POLL_SECONDS)
        if problem is not None:
            self.warmed.failed += 1
            log.warning("kvd: warm-up %s: %d tokens not stored: %s", of, len(tokens), problem)
            return
        self.warmed.stored += 1
        took = time.perf_counter() - started
        log.info("kvd: warm-up %s: %d tokens prefilled and stored in %.1f s", of, len(tokens), took)

    def _prefill(self, body: dict[str, Any]) -> str | None:
        """The prompt's request sent to the server for one token; what went wrong, if anything."""
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            data=json.dumps(
                {**body, "max_tokens": 1, "temperature": 0.0, "stream": False}
            ).encode(),
            headers={"Content-Type": "application/json", WARM_UP_HEADER: "1"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as answer:
                answer.read()
        except urllib.error.HTTPError as refused:
            return f"the server answered {refused.code}: {refused.read()[:200]!r}"
        except OSError as exc:
            return f"the server did not answer: {exc}"
        return None


def _held(client: Client, identity: EngineIdentity, tokens: list[int]) -> bool:
    """Whether kvd would restore all of the prompt but its last token (one presence request)."""
    return client.presence(identity, tokens).matched >= len(tokens) - 1
