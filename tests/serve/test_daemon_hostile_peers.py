"""Bad input on one connection, while a well-behaved client on another keeps working."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_e2e import (
    IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    entry,
    looked_up_tokens,
    raw_frame,
    read_frame,
    report,
    wait_until,
)
from daemon_process import Daemon, running_daemon
from kvd_client.client import Client
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

PROMPT = list(range(500, 564))
MAX_FRAME = DEFAULT_LIMITS.max_frame_bytes


@pytest.fixture
def witness(daemon: Daemon) -> Iterator[Client]:
    """A client that stored an entry before the trouble and checks it after each case."""
    with Client.connect(daemon.socket_path, require=True) as client:
        layers, tensors = entry(len(PROMPT), seed=1)
        assert client.put_entry(IDENTITY, PROMPT, layers, tensors).wait(SETTLE_SECONDS)
        yield client
        # Through everything, the witness's connection went on working.
        assert looked_up_tokens(client, IDENTITY, [*PROMPT, 1]) == len(PROMPT)
        layers, tensors = entry(16, seed=2)
        ticket = client.put_entry(IDENTITY, [9, *range(15)], layers, tensors)
        assert ticket.wait(SETTLE_SECONDS).state == "stored"
        assert client.stats.reconnects == 0


def _raw(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(SETTLE_SECONDS)
    sock.connect(socket_path)
    return sock


HELLO = {"op": "hello", "id": 1, "protocol": 1, "client": "hostile", "pid": 1}


def _after_hello(socket_path: str) -> socket.socket:
    sock = _raw(socket_path)
    sock.sendall(raw_frame(HELLO))
    reply = read_frame(sock)
    assert reply is not None
    assert reply["op"] == "hello"
    return sock


def _error(reply: dict[str, Any] | None) -> tuple[int, str]:
    assert reply is not None, "the daemon closed without an error frame"
    assert reply["op"] == "error", reply
    return reply["id"], reply["code"]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        pytest.param(b"\x00\x00\x00\x00", "bad_frame", id="zero-length"),
        pytest.param((MAX_FRAME + 1).to_bytes(4, "big"), "bad_frame", id="oversized-length"),
        pytest.param(b"\xff\xff\xff\xff garbage", "bad_frame", id="garbage"),
    ],
)
def test_framing_errors_get_an_error_frame_then_close(
    daemon: Daemon, witness: Client, data: bytes, code: str
) -> None:
    with _after_hello(daemon.socket_path) as sock:
        sock.sendall(data)
        assert _error(read_frame(sock)) == (0, code)
        assert read_frame(sock) is None  # closed
    witness.ping()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(b"\x00\x00\x00\x03abc", (0, "bad_message"), id="not-msgpack-map"),
        pytest.param({"op": "frobnicate", "id": 5}, (5, "unknown_op"), id="unknown-op"),
        pytest.param({"op": "ping", "id": "x"}, (0, "bad_message"), id="bad-id"),
        pytest.param({"op": "ping", "id": 6, "extra": 1}, (6, "bad_message"), id="extra-field"),
        pytest.param(
            {"op": "lookup", "id": 7, "identity": "model", "tokens": b""},
            (7, "bad_message"),
            id="wrong-type",
        ),
        pytest.param({"op": "release", "id": 8}, (8, "bad_message"), id="missing-field"),
        pytest.param(
            {
                "op": "lookup",
                "id": 9,
                "identity": IDENTITY.to_wire(),
                "tokens": pack_tokens([1] * (DEFAULT_LIMITS.max_tokens + 1)),
            },
            (9, "too_large"),
            id="too-many-tokens",
        ),
        pytest.param({"op": "hello", **{**HELLO, "id": 10}}, (10, "bad_message"), id="hello-2"),
        pytest.param({"op": "release", "id": 11, "lease": 77}, (11, "not_found"), id="no-lease"),
        pytest.param({"op": "put_commit", "id": 12, "put": 3}, (12, "not_found"), id="no-put"),
        pytest.param(
            {"op": "evict", "id": 13, "entry": None, "identity": None, "all": False},
            (13, "bad_message"),
            id="evict-no-selector",
        ),
        pytest.param(
            {"op": "evict", "id": 14, "entry": "f" * 32, "identity": None, "all": False},
            (14, "not_found"),
            id="evict-no-entry",
        ),
    ],
)
def test_bad_requests_are_answered_and_the_connection_goes_on(
    daemon: Daemon, witness: Client, body: object, expected: tuple[int, str]
) -> None:
    with _after_hello(daemon.socket_path) as sock:
        sock.sendall(body if isinstance(body, bytes) else raw_frame(body))
        assert _error(read_frame(sock)) == expected
        sock.sendall(raw_frame({"op": "ping", "id": 99}))
        assert read_frame(sock) == {"op": "ping", "id": 99}
    witness.ping()


def test_a_request_before_hello_is_refused_and_hello_still_works(
    daemon: Daemon, witness: Client
) -> None:
    with _raw(daemon.socket_path) as sock:
        sock.sendall(raw_frame({"op": "ping", "id": 3}))
        assert _error(read_frame(sock)) == (3, "handshake_required")
        sock.sendall(raw_frame(HELLO))
        assert read_frame(sock)["op"] == "hello"  # type: ignore[index]
    witness.ping()


def test_an_unsupported_version_is_refused(daemon: Daemon, witness: Client) -> None:
    with _raw(daemon.socket_path) as sock:
        sock.sendall(raw_frame({**HELLO, "protocol": 99}))
        assert _error(read_frame(sock)) == (1, "unsupported_version")
    witness.ping()


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("count", [1, 10])
def test_descriptors_sent_to_the_daemon_are_fatal_and_closed(
    daemon: Daemon, witness: Client, count: int
) -> None:
    if not os.path.isdir(f"/proc/{daemon.pid}/fd"):
        pytest.skip("counting a process's descriptors needs /proc")
    before = _open_descriptors(daemon.pid)
    with _after_hello(daemon.socket_path) as sock, open(os.devnull, "rb") as stray:
        socket.send_fds(sock, [raw_frame({"op": "ping", "id": 2})], [stray.fileno()] * count)
        assert _error(read_frame(sock)) == (0, "bad_descriptors")
        assert read_frame(sock) is None
    wait_until(
        lambda: _open_descriptors(daemon.pid) <= before, "the daemon closes what it was sent"
    )
    witness.ping()


def test_a_client_that_hangs_up_mid_frame_or_mid_put(daemon: Daemon, witness: Client) -> None:
    with _after_hello(daemon.socket_path) as sock:
        sock.sendall((100).to_bytes(4, "big") + b"\x85" + b"x" * 10)
    with RawPeer(daemon.socket_path) as peer:
        peer.begin(IDENTITY, [3, *range(40)], seed=3)  # written, never committed
    # The hang-up and the witness's requests come on different connections: either may be
    # read first.
    wait_until(lambda: report(witness)["abandoned_puts"] == 1, "the put abandoned")
    assert report(witness)["abandoned_puts"] == 1
    assert not list((daemon.tier / "staging").iterdir())


def test_the_daemon_survives_many_bad_connections_at_once(daemon: Daemon, witness: Client) -> None:
    sockets = [_after_hello(daemon.socket_path) for _ in range(20)]
    for i, sock in enumerate(sockets):
        sock.sendall(raw_frame({"op": "frobnicate", "id": i + 2}) + b"\x00\x00\x00\x00")
    for sock in sockets:
        assert _error(read_frame(sock))[1] == "unknown_op"
        assert _error(read_frame(sock)) == (0, "bad_frame")
        sock.close()
    witness.ping()


# --- peers of other users ---------------------------------------------------------------------

NOBODY = 65534


def _connect_and_try(socket_path: str) -> list[str]:
    """Say hello, then try an evict; what came back, as words."""
    with _raw(socket_path) as sock:
        with contextlib.suppress(BrokenPipeError):  # a refused peer may find it closed already
            sock.sendall(raw_frame(HELLO))
        first = read_frame(sock)
        assert first is not None
        if first["op"] == "error":  # refused: the daemon must have closed the connection
            return [first["op"], first["code"], str(read_frame(sock))]
        sock.sendall(
            raw_frame({"op": "evict", "id": 2, "entry": None, "identity": None, "all": True})
        )
        second = read_frame(sock)
        assert second is not None
        return [first["op"], second["op"], second["code"]]


def _as_other_user(daemon: Daemon, group: int) -> list[str]:
    """_connect_and_try in a forked child running as nobody in group."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a peer under another uid")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(group)
            os.setuid(NOBODY)
            os.write(write_end, " ".join(_connect_and_try(daemon.socket_path)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        seen = pipe.read().decode().split()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    return seen


def test_a_peer_of_another_uid_is_refused(daemon: Daemon, witness: Client) -> None:
    # The daemon keeps its socket folder private; open it (and the socket) to the child so
    # that the kernel lets it connect and the daemon's own check is what is tested.
    os.chmod(Path(daemon.socket_path).parent, 0o711)
    os.chmod(daemon.socket_path, 0o666)
    assert _as_other_user(daemon, NOBODY) == ["error", "permission_denied", "None"]
    witness.ping()


def test_evict_needs_the_daemons_uid_or_root(tmp_path: Path) -> None:
    with running_daemon(tmp_path, ["--socket-group", "users"]) as daemon:
        # The daemon opened its socket to the group itself: no chmod here.
        seen = _as_other_user(daemon, grp.getgrnam("users").gr_gid)
        assert seen == ["hello", "error", "permission_denied"]
