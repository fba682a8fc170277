"""Structured logs: JSON lines for a service manager, readable lines on a terminal.

Under systemd, when stderr is the journal's stream, each JSON line starts with a `<N>` syslog
priority that journald turns into the entry's PRIORITY. Tracebacks never include frame locals
(they may hold prompt tokens, and they make huge lines). Records of the standard library's
`logging` (from anyio, watchfiles, asyncio) go through the same renderer, so the stream stays
one format.

Call configure_logging once at start, before the first log call: loggers cache their
configuration on first use.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger


class LogFormat(StrEnum):
    """The log_format setting's values (kvd.config)."""

    JSON = "json"
    CONSOLE = "console"
    AUTO = "auto"  # console on a terminal, JSON otherwise


@contextmanager
def _not_importable(name: str) -> Iterator[None]:
    """Within, `import name` fails as if it were not installed (None in sys.modules is the
    import system's own "not there"), unless it is imported already; put back on the way out."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules[name]


# structlog's package imports structlog.dev and structlog.tracebacks, which import rich when
# it is installed (mlx-lm's dependencies bring it along): a fifth of the daemon's imports,
# paid before its first ping, and structlog has no setting to skip it. kvd uses none of it
# (plain tracebacks, never their locals: see _renderer), so rich stays out of that import.
with _not_importable("rich"):
    import structlog

# structlog level -> syslog priority (journald's PRIORITY=)
SYSLOG_PRIORITIES = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}  # fmt: skip


class NamedWriteLogger(structlog.WriteLogger):
    """A line writer with a name, which add_logger_name puts in each event as `logger`."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class JournalPriorityPrefix:
    """Wraps a renderer: prefixes its line with `<N>`, the syslog priority of the event's level."""

    def __init__(self, renderer: Processor) -> None:
        self.renderer = renderer

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
        priority = SYSLOG_PRIORITIES.get(event_dict.get("level", ""), 6)
        line = self.renderer(logger, name, event_dict)
        assert isinstance(line, str)
        return f"<{priority}>{line}"


def writes_to_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether `stream` is the journal stream systemd connected (JOURNAL_STREAM="<dev>:<ino>").

    Comparing device and inode, as systemd.exec(5) recommends, rather than only testing that
    the variable is set, keeps the prefix out of a file or pipe the unit redirected to.
    """
    value = environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in value.split(":"))
        info = os.fstat(stream.fileno())
    except (ValueError, OSError):
        return False
    return (info.st_dev, info.st_ino) == (device, inode)


def _renderer(fmt: LogFormat, stream: TextIO, environ: Mapping[str, str]) -> list[Processor]:
    if fmt is LogFormat.CONSOLE:
        return [
            structlog.dev.ConsoleRenderer(
                colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
            )
        ]
    json_renderer: Processor = structlog.processors.JSONRenderer(default=str)
    if writes_to_journal(stream, environ):
        json_renderer = JournalPriorityPrefix(json_renderer)
    return [
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        ),
        json_renderer,
    ]


def configure_logging(
    fmt: LogFormat | str = LogFormat.AUTO,
    level: str = "info",
    *,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Send kvd's events, and other libraries' warnings, to `stream` (default stderr).

    `fmt` "auto" means console when the stream is a terminal, JSON otherwise.
    """
    out = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    chosen = LogFormat(fmt)
    if chosen is LogFormat.AUTO:
        chosen = LogFormat.CONSOLE if out.isatty() else LogFormat.JSON
    try:
        threshold = LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; one of: {', '.join(LEVELS)}") from None

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    tail = _renderer(chosen, out, env)
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=lambda name="kvd", *_: NamedWriteLogger(out, name),
        cache_logger_on_first_use=True,
    )

    # Other libraries log through `logging`; they are noisy at info (watchfiles reports every
    # batch), so they pass at warning unless kvd itself logs at debug.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
        )
    )
    foreign = threshold if threshold == logging.DEBUG else max(threshold, logging.WARNING)
    logging.basicConfig(handlers=[handler], level=foreign, force=True)


def get_logger(name: str) -> FilteringBoundLogger:
    """A logger whose events carry `logger=name`. Safe to call at import time: the logger
    takes its configuration on first use."""
    logger: FilteringBoundLogger = structlog.get_logger(name)
    return logger


class RateLimited:
    """Lines a client or the remote bucket can provoke at will, at most one line per event
    every `every` seconds: the next line says how many were left out meanwhile (`suppressed`)."""

    def __init__(
        self,
        logger: FilteringBoundLogger,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every = every
        self._clock = clock
        self._last: dict[str, float] = {}  # event -> when its last line went out
        self._left_out: dict[str, int] = {}

    def warning(self, event: str, **fields: object) -> None:
        self._say(self._logger.warning, event, fields)

    def info(self, event: str, **fields: object) -> None:
        self._say(self._logger.info, event, fields)

    def _say(self, say: Callable[..., object], event: str, fields: dict[str, object]) -> None:
        now = self._clock()
        last = self._last.get(event)
        if last is not None and now - last < self._every:
            self._left_out[event] = self._left_out.get(event, 0) + 1
            return
        self._last[event] = now
        left_out = self._left_out.pop(event, 0)
        if left_out:
            fields["suppressed"] = left_out
        say(event, **fields)
