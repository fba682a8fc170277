"""GET /metrics on 127.0.0.1 for a Prometheus scraper (setting metrics_port).

Served from the daemon's event loop, like everything that reads the tier: an anyio TCP
listener and just enough HTTP/1.1 for a scrape (one GET, then the connection closes).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import anyio
from anyio.abc import Listener, SocketAttribute, SocketStream

from kvd.logs import get_logger

if TYPE_CHECKING:
    from kvd.serve.metrics import Status

log = get_logger("kvd.serve.metrics")

LOOPBACK = "127.0.0.1"
REQUEST_MAX_BYTES = 8192  # a scrape's request line and headers are a few hundred bytes
REQUEST_SECONDS = 10.0
PATH = "/metrics"
TEXT = "text/plain; charset=utf-8"


class MetricsPortInUseError(RuntimeError):
    """The metrics port cannot be bound."""


async def metrics_listener(port: int) -> Listener[SocketStream]:
    """Bound before the daemon says it serves, so a taken port is an error at start."""
    try:
        return await anyio.create_tcp_listener(local_host=LOOPBACK, local_port=port)
    except OSError as exc:
        raise MetricsPortInUseError(
            f"cannot listen on {LOOPBACK}:{port} for metrics: {exc.strerror or exc}"
        ) from None


def bound_port(listener: Listener[SocketStream]) -> int:
    return int(listener.extra(SocketAttribute.local_port))


async def serve_metrics(listener: Listener[SocketStream], status: Callable[[], Status]) -> None:
    log.info("metrics_serving", address=f"http://{LOOPBACK}:{bound_port(listener)}{PATH}")
    await listener.serve(partial(_answer, status))


async def _read_head(stream: SocketStream) -> bytes | None:
    """The request line and headers; None when they run past REQUEST_MAX_BYTES."""
    head = b""
    while b"\r\n\r\n" not in head:
        if len(head) > REQUEST_MAX_BYTES:
            return None
        head += await stream.receive()
    return head


def _response(code: int, reason: str, body: bytes, content_type: str, head_only: bool) -> bytes:
    header = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return header + (b"" if head_only else body)


def answer(status: Callable[[], Status], head: bytes) -> bytes:
    """The response to one request head."""
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    method, target, *_ = [*request_line.split(" "), "", ""]
    if method not in ("GET", "HEAD"):
        return _response(405, "Method Not Allowed", b"GET only\n", TEXT, False)
    if target.split("?", 1)[0] != PATH:
        return _response(404, "Not Found", f"metrics are at {PATH}\n".encode(), TEXT, False)
    # Imported by the first scrape, not at start-up: prometheus_client's import is ~40 ms.
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4  # noqa: PLC0415

    from kvd.serve.metrics import exposition  # noqa: PLC0415

    return _response(200, "OK", exposition(status), CONTENT_TYPE_PLAIN_0_0_4, method == "HEAD")


async def _answer(status: Callable[[], Status], stream: SocketStream) -> None:
    """One connection; nothing it does may take the daemon down."""
    async with stream:
        try:
            with anyio.fail_after(REQUEST_SECONDS):
                head = await _read_head(stream)
            if head is None:
                await stream.send(
                    _response(431, "Request Header Fields Too Large", b"", TEXT, False)
                )
            else:
                await stream.send(answer(status, head))
        except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return  # a scraper that stalled or went away: nothing to answer
        except Exception:
            log.exception("metrics_request_failed")
