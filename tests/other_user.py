"""A peer of another user, for the tests of tenants: work run in a forked child as nobody, in
the group a daemon started with `--socket-group users` lets in."""

from __future__ import annotations

import grp
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest

NOBODY = 65534
GROUP = "users"


def as_nobody(work: Callable[[], object]) -> Any:
    """What work() returns (through JSON), run in a forked child as nobody in GROUP: a peer
    the daemon lets in (the socket is the group's) with a uid of its own."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a peer under another uid")
    gid = grp.getgrnam(GROUP).gr_gid
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        out, code = "", 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(NOBODY)
            out, code = json.dumps(work()), 0
        except BaseException:
            out = traceback.format_exc()
        finally:
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(out.encode())
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return json.loads(out)
