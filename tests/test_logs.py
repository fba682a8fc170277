"""Logging: the format per destination, the journal's priority prefix, levels, tracebacks
without locals, and other libraries' records in the same format."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest
import structlog

from kvd.logs import RateLimited, configure_logging, get_logger, writes_to_journal


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def journal_environ(stream: TextIO) -> dict[str, str]:
    info = os.fstat(stream.fileno())
    return {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"}


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_events_carry_level_logger_and_time() -> None:
    out = io.StringIO()
    configure_logging("json", stream=out, environ={})
    get_logger("kvd.store.tier").info("stored", entry="abc", path=Path("/t/abc.kve"))
    (event,) = json_lines(out.getvalue())
    assert event["event"] == "stored"
    assert event["level"] == "info"
    assert event["logger"] == "kvd.store.tier"
    assert event["entry"] == "abc"
    assert event["path"] == "/t/abc.kve"  # paths as plain strings
    assert event["timestamp"].endswith("Z")


def test_a_rate_limited_warning_goes_out_once_a_period_and_counts_the_rest() -> None:
    out = io.StringIO()
    configure_logging("json", stream=out, environ={})
    now = [0.0]
    limited = RateLimited(get_logger("kvd.store.puts"), every=10.0, clock=lambda: now[0])
    for second in (0.0, 1.0, 9.9, 10.0, 12.0, 25.0):
        now[0] = second
        limited.warning("put_refused", reason=f"at {second}")
    limited.warning("another_event")  # each event has its own period
    events = json_lines(out.getvalue())
    assert [(e["event"], e["reason"], e.get("suppressed")) for e in events[:3]] == [
        ("put_refused", "at 0.0", None),
        ("put_refused", "at 10.0", 2),
        ("put_refused", "at 25.0", 1),
    ]
    assert [(e["event"], e["level"]) for e in events[3:]] == [("another_event", "warning")]


def test_a_rate_limited_info_line_shares_the_rule_at_its_own_level() -> None:
    out = io.StringIO()
    configure_logging("json", stream=out, environ={})
    now = [0.0]
    limited = RateLimited(get_logger("kvd.remote.uploader"), every=10.0, clock=lambda: now[0])
    for second in (0.0, 3.0, 11.0):
        now[0] = second
        limited.info("remote_upload_dropped", why="cap")
    events = json_lines(out.getvalue())
    assert [(e["level"], e.get("suppressed")) for e in events] == [("info", None), ("info", 1)]


def test_auto_is_json_off_a_terminal() -> None:
    out = io.StringIO()
    configure_logging("auto", stream=out, environ={})
    get_logger("kvd").info("hello")
    assert json_lines(out.getvalue())[0]["event"] == "hello"


def test_auto_is_console_on_a_terminal() -> None:
    primary, secondary = os.openpty()
    with os.fdopen(secondary, "w") as terminal:
        configure_logging("auto", stream=terminal, environ={})
        get_logger("kvd").info("hello", n=1)
        terminal.flush()
        text = os.read(primary, 4096).decode()
    os.close(primary)
    assert "hello" in text
    assert "\x1b[" in text  # coloured, for a terminal
    assert not text.lstrip().startswith("{")


def test_logger_made_before_configuration_follows_it() -> None:
    logger = get_logger("kvd.early")  # as a module-level logger is
    out = io.StringIO()
    configure_logging("json", stream=out, environ={})
    logger.warning("late")
    assert json_lines(out.getvalue())[0]["logger"] == "kvd.early"


def test_events_below_the_level_are_dropped() -> None:
    out = io.StringIO()
    configure_logging("json", "warning", stream=out, environ={})
    logger = get_logger("kvd")
    logger.info("quiet")
    logger.warning("loud")
    assert [event["event"] for event in json_lines(out.getvalue())] == ["loud"]


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("json", "verbose", stream=io.StringIO(), environ={})


def test_journal_lines_start_with_the_syslog_priority(tmp_path: Path) -> None:
    with (tmp_path / "journal").open("w+") as stream:
        configure_logging("json", "debug", stream=stream, environ=journal_environ(stream))
        logger = get_logger("kvd")
        logger.debug("d")
        logger.info("i")
        logger.warning("w")
        logger.error("e")
        logger.critical("c")
        stream.seek(0)
        lines = stream.read().splitlines()
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<2>"]
    assert [json.loads(line[3:])["event"] for line in lines] == ["d", "i", "w", "e", "c"]


def test_no_prefix_when_the_journal_stream_is_another_file(tmp_path: Path) -> None:
    with (tmp_path / "other").open("w") as other, (tmp_path / "log").open("w+") as stream:
        assert not writes_to_journal(stream, journal_environ(other))
        configure_logging("json", stream=stream, environ=journal_environ(other))
        get_logger("kvd").info("plain")
        stream.seek(0)
        assert stream.read().startswith("{")


@pytest.mark.parametrize("value", ["", "12", "a:b", "1:2:3"])
def test_malformed_journal_stream_means_no_journal(tmp_path: Path, value: str) -> None:
    with (tmp_path / "log").open("w") as stream:
        assert not writes_to_journal(stream, {"JOURNAL_STREAM": value})


def _fail(secret: str) -> None:
    raise RuntimeError("no space")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_leave_out_local_variables(fmt: str) -> None:
    out = io.StringIO()
    configure_logging(fmt, stream=out, environ={})
    try:
        _fail("-".join(["prompt", "token", "secret"]))  # the joined value is not in the source
    except RuntimeError:
        get_logger("kvd").exception("write failed")
    text = out.getvalue()
    assert "write failed" in text
    assert "no space" in text
    assert "_fail" in text  # the frames are there
    assert "prompt-token-secret" not in text  # their locals are not


def test_json_traceback_is_structured() -> None:
    out = io.StringIO()
    configure_logging("json", stream=out, environ={})
    try:
        _fail("x")
    except RuntimeError:
        get_logger("kvd").exception("write failed")
    (event,) = json_lines(out.getvalue())
    (exception,) = event["exception"]
    assert exception["exc_type"] == "RuntimeError"
    assert all("locals" not in frame for frame in exception["frames"])


# What a daemon process does: kvd.logs imported first, then an exception logged both ways.
FRESH_PROCESS = """
import io, json, sys
from kvd.logs import configure_logging, get_logger
def fail(secret):
    raise RuntimeError("no space")
for fmt in ("json", "console"):
    out = io.StringIO()
    configure_logging(fmt, stream=out, environ={})
    try:
        fail("-".join(["prompt", "token", "secret"]))
    except RuntimeError:
        get_logger("kvd").exception("write failed")
    print(json.dumps(out.getvalue()))
print("rich" in sys.modules)
import rich
"""


def test_structlog_is_imported_without_rich_and_tracebacks_stay_plain() -> None:
    """rich (installed with mlx-lm) is left out of structlog's import, a large part of the
    daemon's start; tracebacks still render without locals, and rich stays importable."""
    pytest.importorskip("rich")
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, check=True
    )
    *renders, rich_imported = done.stdout.splitlines()
    assert rich_imported == "False"
    for text in map(json.loads, renders):
        assert "no space" in text
        assert "fail" in text
        assert "prompt-token-secret" not in text


def test_other_libraries_warnings_share_the_format(tmp_path: Path) -> None:
    with (tmp_path / "journal").open("w+") as stream:
        configure_logging("json", stream=stream, environ=journal_environ(stream))
        library = logging.getLogger("watchfiles.main")
        library.info("3 changes detected")  # below warning: libraries are quieter
        library.warning("rescan needed in %s", "/tier")
        stream.seek(0)
        (line,) = stream.read().splitlines()
    assert line.startswith("<4>")
    event = json.loads(line[3:])
    assert (event["event"], event["logger"], event["level"]) == (
        "rescan needed in /tier",
        "watchfiles.main",
        "warning",
    )


def test_other_libraries_debug_passes_at_debug_level() -> None:
    out = io.StringIO()
    configure_logging("json", "debug", stream=out, environ={})
    logging.getLogger("anyio").debug("detail")
    assert json_lines(out.getvalue())[0]["event"] == "detail"
