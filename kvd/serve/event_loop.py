"""The daemon's event loop: uvloop's (libuv) where it can be imported, asyncio's own otherwise.

Every request the daemon answers costs a turn of the loop: a poll, the reader callback, a
send. uvloop runs that turn in C (docs/benchmarks.md, "Round trip": the daemon's CPU a ping
falls by about a fifth), so it is one of the daemon's dependencies on Linux and macOS, where
it ships as wheels. A daemon that cannot import it (another platform, a build without it)
runs on asyncio's loop, which serves the same requests the same way: the daemon uses only
what both loops offer (add_reader, call_later, the anyio API on top).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's new_event_loop, or None (asyncio's default loop) where uvloop is missing."""
    try:
        import uvloop  # noqa: PLC0415 - optional at run time: imported where it is used
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def backend_options() -> dict[str, Any]:
    """anyio.run's backend_options for the daemon's loop."""
    factory = loop_factory()
    return {} if factory is None else {"loop_factory": factory}


def loop_name() -> str:
    """The running loop's package: "uvloop" or "asyncio" (for the log and the status)."""
    module = type(asyncio.get_running_loop()).__module__
    return module.split(".", 1)[0]
