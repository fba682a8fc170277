"""What the remote tier's end-to-end tests share: a daemon's flags for the test bucket, two
daemons sharing it, its `remote` status, a put of any planned v2 entry, the bucket's objects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

from blocks_e2e import commit, status, wait
from daemon_e2e import RawPeer, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from kvd_protocol import messages as m
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import ManifestPlan, Slot
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, Seaweed

from kvd.remote.bucket import Bucket, BucketError

WRITABLE_S = 60.0
WARM_BYTES = 64 << 10


class BucketServer(Protocol):
    """A test bucket a daemon can be pointed at: SeaweedFS (seaweed.py), the fake bucket
    (fake_bucket.py)."""

    @property
    def endpoint(self) -> str: ...


def remote_flags(
    bucket: BucketServer, folder: Path, prefix: str, *, secret: str = SECRET_KEY, **settings: object
) -> list[str]:
    """A daemon's flags for the test bucket under prefix (its bucket `kvd`): its credentials
    in a 0600 file (secret: the one written there), settings as `remote_*` flags
    (upload_rate=... gives --remote-upload-rate)."""
    folder.mkdir(parents=True, exist_ok=True)
    credentials = folder / "credentials"
    credentials.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret}\n"
    )
    credentials.chmod(0o600)
    flags = [
        "--remote",
        f"s3://{BUCKET}/{prefix}",
        "--remote-endpoint",
        bucket.endpoint,
        "--remote-credentials-file",
        str(credentials),
    ]
    for name, value in settings.items():
        flags += [f"--remote-{name.replace('_', '-')}", str(value)]
    return flags


@contextmanager
def two_macs(
    bucket: BucketServer, folder: Path, prefix: str, **settings: Any
) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons A and B on tiers of their own in folder, sharing the bucket under prefix with
    these remote settings (remote_flags)."""
    flags = remote_flags(bucket, folder, prefix, **settings)
    with ExitStack() as stack:
        a = stack.enter_context(running_daemon(folder / "a", flags))
        b = stack.enter_context(running_daemon(folder / "b", flags))
        yield a, b


def restart(seaweed: Seaweed) -> None:
    """Start the killed bucket again, and wait until it takes a write: after a kill, weed
    mini's first writes can wait seconds for a volume (seen up to 15 s), longer than a test
    should take to learn that uploads resume."""
    seaweed.start()
    client = seaweed.bucket(timeout=5.0)
    deadline = time.monotonic() + WRITABLE_S
    try:
        while True:
            try:
                # Bytes enough to need a volume (a tiny object lives in the filer's metadata).
                client.put_if_absent(f"warm/{time.monotonic_ns()}", bytes(WARM_BYTES))
                return
            except BucketError as error:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no write within {WRITABLE_S:g} s: {error}") from None
    finally:
        client.close()


def logged(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    """The daemon's log events of this name, in order."""
    lines = daemon.logs().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in events if e.get("event") == event]


def remote_status(peer: RawPeer) -> dict[str, Any]:
    found: dict[str, Any] = status(peer)["remote"]
    return found


def wait_remote(
    peer: RawPeer, condition: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """The `remote` status once condition holds of it."""

    def met() -> dict[str, Any] | None:
        now = remote_status(peer)
        return now if condition(now) else None

    found = wait_until(met, what)
    assert found is not None
    return found


def flush_remote(daemon: Daemon, wait_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return kvctl(daemon, "flush", "--remote", "--wait", str(wait_s))


AGO = re.compile(r" \(\d+[smhd] ago\)$")


def flush_said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What `flush --remote` printed, line by line; a first line that counts drops ends with
    how long ago that count began ("(42s ago)"), checked here and left out."""
    lines = done.stdout.splitlines()
    if lines and lines[0].startswith("not done:"):
        assert AGO.search(lines[0]), done.stdout
        lines[0] = AGO.sub("", lines[0])
    return lines


def dropped_since(count: int) -> str:
    """The end of `flush --remote`'s first line when it is not done (flush_said's)."""
    return f"{count} dropped since the last flush --remote or the start"


def stored(bucket: Bucket, prefix: str) -> dict[str, int]:
    """Every object under the prefix: key (after the prefix) -> size."""
    return {key.removeprefix(prefix + "/"): size for key, size in bucket.list(prefix + "/", 10_000)}


def _fill(fd: int, slots: tuple[Slot, ...], seed: int) -> list[bytes]:
    """Each slot's bytes (a pattern of seed) written at its place; their checksums."""
    sums = []
    for k, slot in enumerate(slots):
        data = bytes((seed * 31 + k * 7 + j) % 251 for j in range(slot.nbytes))
        os.pwrite(fd, data, slot.start)
        sums.append(checksum(data))
    return sums


def put_plan(peer: RawPeer, plan: ManifestPlan, seed: int = 1) -> None:
    """A put of the planned entry, its tensors a pattern of seed, waited for until stored:
    any kind of entry (a hybrid's whole layers, a checkpoint's header) as an engine puts it."""
    header = plan.entry.header
    reply = peer.call(
        m.PutBegin(
            id=peer.next_id(),
            identity=header.identity,
            tokens=header.tokens,
            size=plan.entry.file_size,
            blocks=b"".join(plan.hashes),
            block_tokens=plan.block_tokens,
            block_size=plan.block_size,
        )
    )
    assert isinstance(reply, m.PutBeginReply), reply
    assert reply.fd is not None
    try:
        os.pwrite(reply.fd, plan.entry.head(_fill(reply.fd, plan.entry.slots, seed)), 0)
    finally:
        os.close(reply.fd)
    missing = len(plan.hashes) - reply.held
    if missing:
        blocks = peer.call(
            m.PutBlocks(id=peer.next_id(), put=reply.put, first=reply.held, count=missing)
        )
        assert isinstance(blocks, m.PutBlocksReply), blocks
        for index, fd in enumerate(blocks.fds, start=reply.held):
            try:
                os.pwrite(fd, plan.block_head(index, _fill(fd, plan.block_slots, index)), 0)
            finally:
                os.close(fd)
    ticket = commit(peer, reply.put)
    assert isinstance(ticket, int), ticket
    assert wait(peer, ticket).state == "stored"
