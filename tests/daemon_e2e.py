"""What the daemon's end-to-end tests share: identities, entries, a raw protocol peer, polls."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
from daemon_process import Daemon
from kvd_client.client import Client, LookupResult
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m
from kvd_protocol.connection import Connection, Role
from kvd_protocol.entry import EntryPlan, LayerSpec, TensorSpec, plan_entry
from kvd_protocol.errors import DaemonUnavailableError
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

SETTLE_SECONDS = 30.0  # bound on any wait for the daemon to reach a state
ENTRY_BYTES = 5 * 16384  # head + 4 aligned slots: the size of every entry(n <= 512) file

IDENTITY = Identity(
    model_id="e2e/model-a",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
OTHER_IDENTITY = Identity(
    model_id="e2e/model-b",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)

T = TypeVar("T")


def entry(
    tokens: int, seed: int, *, trimmable: bool = True, width: int = 8
) -> tuple[list[LayerSpec], list[np.ndarray]]:
    """Two layers of keys and values; width scales the bytes per token."""
    rng = np.random.default_rng(seed)
    shape = (1, 2, tokens, width)
    tensors = [rng.standard_normal(shape).astype(np.float16) for _ in range(4)]
    spec = TensorSpec("float16", shape)
    kind = "kv" if trimmable else "ssm"
    return [LayerSpec(kind, (spec, spec), trimmable=trimmable)] * 2, tensors


def put_stored(
    client: Client,
    identity: Identity,
    tokens: Sequence[int],
    seed: int,
    *,
    trimmable: bool = True,
) -> list[np.ndarray]:
    """Put an entry and wait until it is stored; its tensors."""
    layers, tensors = entry(len(tokens), seed, trimmable=trimmable)
    ticket = client.put_entry(identity, list(tokens), layers, tensors)
    state = ticket.wait(SETTLE_SECONDS)
    assert state.state == "stored", state
    return tensors


def looked_up_tokens(client: Client, identity: Identity, prompt: Sequence[int]) -> int | None:
    """The token count of the entry a lookup of prompt gets (None on a miss), verified."""
    result = client.lookup(identity, list(prompt))
    if result is None:
        return None
    with result:
        result.verify()
        return result.header.token_count


def wait_until(condition: Callable[[], T], what: str, seconds: float = SETTLE_SECONDS) -> T:
    """Poll condition until it returns something true; fail naming what did not happen."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"within {seconds} s: {what}")
        time.sleep(0.02)


def report(client: Client) -> dict[str, Any]:
    """The daemon's status report (free-form: typed Any for the tests' arithmetic)."""
    return dict(client.status())


def deleter_idle(daemon: Daemon) -> None:
    """Wait until the files a running daemon let go of have left (its deleter moves them out
    of their place on a thread of its own; a stopped daemon moved them before it ended)."""
    try:
        client = Client.connect(daemon.socket_path, require=True)
    except DaemonUnavailableError:
        return
    with client:
        wait_until(lambda: report(client)["deleting_files"] == 0, "the deleter is idle")


def files_on_disk(daemon: Daemon) -> tuple[int, int]:
    """(count, bytes) of the entry files under the daemon's tier/entries, once its deleter
    is idle."""
    deleter_idle(daemon)
    sizes = [p.stat().st_size for p in (daemon.tier / "entries").rglob("*") if p.is_file()]
    return len(sizes), sum(sizes)


def staging_files(daemon: Daemon) -> list[str]:
    """The names in the daemon's staging folder, once its deleter is idle."""
    deleter_idle(daemon)
    return sorted(os.listdir(daemon.tier / "staging"))


class RawPeer:
    """A client speaking the protocol by hand, for what the Client never does: pipelining,
    holding a put open, and bytes that are not the protocol at all."""

    def __init__(self, socket_path: str, *, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(SETTLE_SECONDS)
        self.sock.connect(socket_path)
        self.conn = Connection(Role.CLIENT)
        self._ids = iter(range(1, 1 << 31))
        if hello:
            reply = self.call(m.Hello(id=self.next_id(), protocol=1, client="e2e", pid=os.getpid()))
            assert isinstance(reply, m.HelloReply), reply

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, *requests: m.Request) -> None:
        """Send requests in one write: the daemon reads them together."""
        self.sock.sendall(b"".join(self.conn.send(request) for request in requests))

    def receive(self) -> m.Reply:
        while True:
            event = self.conn.next_event()
            if isinstance(event, m.Reply):
                return event
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, m.MAX_BLOCK_BATCH)
            self.conn.receive_data(data, fds)

    def call(self, request: m.Request) -> m.Reply:
        self.send(request)
        return self.receive()

    def begin(
        self,
        identity: Identity,
        tokens: Sequence[int],
        seed: int,
        *,
        trimmable: bool = True,
        width: int = 8,
    ) -> int:
        """put_begin, then write the entry into the staging file; the put's id."""
        began = self.try_begin(identity, tokens, seed, trimmable=trimmable, width=width)
        assert not isinstance(began, m.ErrorReply), began
        return began

    def try_begin(
        self,
        identity: Identity,
        tokens: Sequence[int],
        seed: int,
        *,
        trimmable: bool = True,
        width: int = 8,
    ) -> int | m.ErrorReply:
        """As begin, or the daemon's error reply to the put_begin (nothing written then)."""
        return self.begin_together(identity, [tokens], [seed], trimmable=trimmable, width=width)[0]

    def begin_together(
        self,
        identity: Identity,
        token_lists: Sequence[Sequence[int]],
        seeds: Sequence[int],
        *,
        trimmable: bool = True,
        width: int = 8,
    ) -> list[int | m.ErrorReply]:
        """put_begins sent in one write (the daemon may hold them all waiting at once), then
        each entry written into its staging file: per put, its id or the error reply."""
        planned = []
        for tokens, seed in zip(token_lists, seeds, strict=True):
            layers, tensors = entry(len(tokens), seed, trimmable=trimmable, width=width)
            planned.append((plan_for(identity, tokens, layers), tensors))
        requests = [
            m.PutBegin(
                id=self.next_id(),
                identity=identity,
                tokens=plan.header.tokens,
                size=plan.file_size,
            )
            for plan, _ in planned
        ]
        self.send(*requests)
        replies = {reply.id: reply for reply in (self.receive() for _ in requests)}
        began: list[int | m.ErrorReply] = []
        for request, (plan, tensors) in zip(requests, planned, strict=True):
            reply = replies[request.id]
            if isinstance(reply, m.ErrorReply):
                began.append(reply)
                continue
            assert isinstance(reply, m.PutBeginReply), reply
            assert reply.fd is not None
            try:
                write_entry(reply.fd, plan, tensor_views(plan, tensors))
            finally:
                os.close(reply.fd)
            began.append(reply.put)
        return began


def plan_for(identity: Identity, tokens: Sequence[int], layers: Sequence[LayerSpec]) -> EntryPlan:
    return plan_entry(identity, pack_tokens(tokens), layers, created=time.time(), min_reuse=0)


def raw_frame(body: object) -> bytes:
    """A frame around any msgpack value, valid or not as a message."""
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return len(packed).to_bytes(4, "big") + packed


def read_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame's body from a raw socket; None if the daemon closed the connection."""
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    body = _read_exactly(sock, int.from_bytes(head, "big"))
    assert body is not None, "the daemon closed the connection inside a frame"
    decoded: dict[str, Any] = msgpack.unpackb(body, raw=False)
    return decoded


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:  # closed with bytes of ours unread: still a close
            chunk = b""
        if not chunk:
            return None
        data += chunk
    return data


_HERE = str(Path(__file__).parent)


@contextmanager
def python_child(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child running script; it prints "ready" once it holds what it holds."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), _HERE, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait()


def read_back(hit: LookupResult) -> list[bytes]:
    """Every tensor's bytes, read by pread and checked against its checksum as a restore reads
    them; EntryFormatError for a damage."""
    data = []
    for slot, fill in zip(hit.header.slots, hit.fills(), strict=True):
        buffer = bytearray(slot.nbytes)
        fill([memoryview(buffer)])
        data.append(bytes(buffer))
    return data
