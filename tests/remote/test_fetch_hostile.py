"""The read path against a bucket that misbehaves on purpose (the fake bucket on loopback,
scripted per test), with a real daemon: the bucket is trusted with bytes, never with time,
memory or the event loop.

A body trickled a byte at a time ends its fetch at remote_fetch_timeout (put aborted, staging
files gone, the miss counted "timeout"), and sixteen such prompts do not stop a later honest
fetch; a bucket failing while a probe's HEADs are under way is one "store_error", without a
traceback; a layout that is not one is read once, not every second, and refused in bounded
work; thousands of identities keep the memos at their caps; a long fetch holds a bounded
number of descriptors; a damaged block is downloaded once across lookups; a storm of damaged
answers makes a bounded number of log lines.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blocks_e2e import BLOCK_TOKENS, kv_tensors, look_up, manifest_plan, write_block
from daemon_e2e import IDENTITY, RawPeer, staging_files, wait_until
from daemon_process import Daemon, running_daemon
from fake_bucket import Answer, FakeBucket, Request, body, running_bucket, status, trickle
from kvd_protocol import messages as m
from kvd_protocol.entry_reader import parse_block_head
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens
from remote_e2e import remote_flags, remote_status

from kvd.remote import keys
from kvd.remote.context import DAMAGED_BLOCKS, REFUSED_LAYOUTS
from kvd.remote.layout import encode_layout, layout_of
from kvd.remote.probe import ABSENT_IDENTITIES

PREFIX = "team"
MIN_TOKENS = 2 * BLOCK_TOKENS
FETCH_TIMEOUT = 2.0
ENDED_WITHIN = 10.0  # seconds past a fetch's deadline its end may take, on a loaded machine
DIGEST = IDENTITY.digest()


def prompt(n: int, blocks: int) -> list[int]:
    """A prompt of its own (no block shared with another n): whole blocks and a tail of 3."""
    return [n * 10_000 + i for i in range(blocks * BLOCK_TOKENS + 3)]


def seed(bucket: FakeBucket, tokens: list[int], identity: Identity = IDENTITY) -> list[str]:
    """The identity's layout and the prompt's whole blocks in the bucket, as a daemon's
    uploads would put them; the blocks' keys in order."""
    whole = tokens[: len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS]
    plan = manifest_plan(identity, whole)
    _, tensors = kv_tensors(whole)
    digest = identity.digest()
    found = []
    for index, block_hash in enumerate(plan.hashes):
        key = keys.block_key(PREFIX, digest, block_hash)
        with tempfile.TemporaryFile() as file:
            os.ftruncate(file.fileno(), plan.block_size)
            write_block(file.fileno(), plan, tensors, index)
            bucket.objects[key] = os.pread(file.fileno(), plan.block_size, 0)
        found.append(key)
    bucket.objects[keys.layout_key(PREFIX, digest)] = encode_layout(layout_of(plan.entry.header))
    return found


@contextmanager
def daemon_on(bucket: FakeBucket, folder: Path, **settings: Any) -> Iterator[Daemon]:
    settings = {"min_tokens": MIN_TOKENS, "fetch_timeout": FETCH_TIMEOUT, **settings}
    flags = remote_flags(bucket, folder / "config", PREFIX, **settings)
    with running_daemon(folder / "tier", flags) as daemon:
        # Its first probe (a listing) reached the bucket: its fetches run.
        wait_until(lambda: bucket.asked("GET"), "the daemon's first probe")
        yield daemon


def ask(peer: RawPeer, tokens: list[int], identity: Identity = IDENTITY) -> None:
    """A lookup as a client that predates fetches: answered at once, its fetch goes on."""
    reply = peer.call(m.Lookup(id=peer.next_id(), identity=identity, tokens=pack_tokens(tokens)))
    assert isinstance(reply, m.LookupReply), reply
    if reply.lease is not None:
        assert reply.fd is not None
        os.close(reply.fd)
        assert isinstance(
            peer.call(m.Release(id=peer.next_id(), lease=reply.lease)), m.ReleaseReply
        )


def ended(peer: RawPeer) -> int:
    """Fetches ended so far: committed or missed."""
    now = remote_status(peer)
    return int(now["hits"] + now["misses"])


def wait_ended(peer: RawPeer, count: int, seconds: float = 30.0) -> dict[str, Any]:
    wait_until(lambda: ended(peer) >= count, f"{count} fetches ended", seconds)
    return remote_status(peer)


def fetched_exactly(peer: RawPeer, tokens: list[int]) -> None:
    """The prompt's whole blocks are local now, and read back as they were seeded."""
    found = look_up(peer, IDENTITY, [*tokens, 7])
    assert found is not None
    assert found.problem is None
    whole = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
    assert found.header.tokens == pack_tokens(tokens[:whole])
    _, tensors = kv_tensors(tokens[:whole])
    assert found.tensors is not None
    assert all(np.array_equal(a, b) for a, b in zip(found.tensors, tensors, strict=True))


def gets(keys_: set[str]) -> Callable[[Request], bool]:
    return lambda request: request.method == "GET" and request.key in keys_


def events(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def test_a_trickled_block_ends_its_fetch_at_the_deadline_and_gives_everything_back(
    tmp_path: Path,
) -> None:
    """A block's body a byte every 0.2 s (each read well within remote_request_timeout):
    within a generous bound after the fetch's 2 s, its put is aborted, its staging files
    gone and the miss counted "timeout"; then an honest fetch works."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        slow, honest = prompt(1, 6), prompt(2, 6)
        slow_keys = seed(bucket, slow)
        seed(bucket, honest)
        bucket.on(gets(set(slow_keys)), trickle(bucket, every=0.2))
        with RawPeer(daemon.socket_path) as peer:
            began = time.monotonic()
            ask(peer, [*slow, 7])
            wait_until(lambda: staging_files(daemon), "the fetch's staging files")
            now = wait_ended(peer, 1, FETCH_TIMEOUT + ENDED_WITHIN)
            assert time.monotonic() - began < 2 * FETCH_TIMEOUT + ENDED_WITHIN
            assert now["misses_by_reason"] == {"timeout": 1}
            assert now["state"] == "ok"  # the fetch's deadline cut it, not the request's
            wait_until(lambda: staging_files(daemon) == [], "the staging files gone")
            ask(peer, [*honest, 7])
            assert wait_ended(peer, 2)["hits"] == 1
            fetched_exactly(peer, honest)


def test_sixteen_trickled_prompts_do_not_stop_a_later_honest_fetch(tmp_path: Path) -> None:
    """As many trickled prompts as fetches may run at once (and twice the request tokens):
    once their deadline passes, the slots and tokens are free and an honest prompt is
    fetched."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        slow = [prompt(100 + n, 3) for n in range(16)]
        slow_keys = {key for tokens in slow for key in seed(bucket, tokens)}
        honest = prompt(1, 3)
        seed(bucket, honest)
        bucket.on(gets(slow_keys), trickle(bucket, every=0.2))
        with RawPeer(daemon.socket_path) as peer:
            for tokens in slow:
                ask(peer, [*tokens, 7])
            now = wait_ended(peer, 16, FETCH_TIMEOUT + ENDED_WITHIN)
            assert now["misses_by_reason"] == {"timeout": 16}
            ask(peer, [*honest, 7])
            assert wait_ended(peer, 17)["hits"] == 1
            fetched_exactly(peer, honest)
            wait_until(lambda: staging_files(daemon) == [], "the staging files gone")


def test_a_download_in_vain_is_cut_off_at_once_and_counted_abandoned(tmp_path: Path) -> None:
    """Block 0's body hangs (trickled) while block 1 is missing: the fetch is a miss at once
    ("missing": the block before the hole is not worth a fetch), block 0's request is not
    waited for, its connection shut down and its thread counted abandoned."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path, fetch_timeout=60) as daemon:
        tokens = prompt(1, 6)
        block_keys = seed(bucket, tokens)
        bucket.on(gets({block_keys[0]}), trickle(bucket, every=0.2))
        del bucket.objects[block_keys[1]]
        bucket.on(lambda request: request.method == "HEAD", status(200))  # the probe: all there
        with RawPeer(daemon.socket_path) as peer:
            began = time.monotonic()
            ask(peer, [*tokens, 7])
            now = wait_ended(peer, 1)
            assert time.monotonic() - began < ENDED_WITHIN  # far from the fetch's 60 s
            assert now["misses_by_reason"] == {"missing": 1}
            assert now["abandoned_requests"] >= 1  # block 0 (others may have been under way)
            wait_until(lambda: staging_files(daemon) == [], "the staging files gone")


def failing_after(seconds: float) -> Answer:
    """A 500 once seconds have passed: the requests sent meanwhile are all under way."""

    def answer(connection: socket.socket, request: Request) -> None:
        time.sleep(seconds)
        status(500, "InternalError")(connection, request)

    return answer


def test_a_bucket_failing_while_a_lookup_probes_is_one_bucket_error_without_a_traceback(
    tmp_path: Path,
) -> None:
    """The bucket fails every HEAD (500) while a probe's round of four is under way: the fetch is
    a miss counted "store_error", logged without a traceback, and the daemon goes on."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path, requests=4) as daemon:
        tokens = prompt(1, 6)
        seed(bucket, tokens)
        bucket.on(lambda request: request.method == "HEAD", failing_after(0.5))
        with RawPeer(daemon.socket_path) as peer:
            ask(peer, [*tokens, 7])
            assert wait_ended(peer, 1)["misses_by_reason"] == {"store_error": 1}
            assert isinstance(peer.call(m.Ping(id=peer.next_id())), m.PingReply)
        assert bucket.asked("HEAD") >= 2  # a round of HEADs at once was under way
    assert "Traceback" not in daemon.logs()
    assert "ExceptionGroup" not in daemon.logs()


def test_a_layout_that_is_not_one_is_read_once_and_refused_in_bounded_work(
    tmp_path: Path,
) -> None:
    """A layout of a million empty maps (1 MiB, within the size a layout may have): refused
    once decoded past what a layout holds, said once, and not read again by the lookups of
    the next seconds (an absent layout is asked again after a second)."""
    bomb = b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x80" * ((1 << 20) - 5)
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        bucket.objects[keys.layout_key(PREFIX, DIGEST)] = bomb
        with RawPeer(daemon.socket_path) as peer:
            for n in range(8):
                ask(peer, [*prompt(n, 3), 7])
                wait_ended(peer, n + 1)
                time.sleep(0.4)
            now = remote_status(peer)
        assert now["misses_by_reason"] == {"no_layout": 8}
        assert bucket.asked("GET", "layout") == 1
        assert now["memos"]["refused_layouts"] == {"size": 1, "capacity": REFUSED_LAYOUTS}
        (refused,) = events(daemon, "remote_layout_refused")
        assert "maps and lists" in refused["error"]


def test_a_client_naming_thousands_of_identities_keeps_the_memos_at_their_caps(
    tmp_path: Path,
) -> None:
    """Each lookup names an identity of its own, none with a layout in the bucket: the
    negative answers stay at their cap, as status says."""
    names = ABSENT_IDENTITIES + 500
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            for n in range(names):
                identity = Identity(f"model-{n}", "cfg", "tok", "codecs/1", "mlx/cpu")
                ask(peer, [*prompt(1, 3), 7], identity)
                if n % 8 == 7:  # 16 fetches may run at once: those of the batch before end
                    wait_until(partial(layouts_asked, bucket, n + 1), "the batch's probes")
            wait_until(lambda: ended(peer) == names, "every fetch ended")
            memos = remote_status(peer)["memos"]
        assert bucket.asked("GET", "layout") > ABSENT_IDENTITIES
        assert memos["absent_layouts"] == {"size": ABSENT_IDENTITIES, "capacity": ABSENT_IDENTITIES}
        assert memos["layouts"]["size"] == 0
        assert memos["damaged_blocks"] == {"size": 0, "capacity": DAMAGED_BLOCKS}


def layouts_asked(bucket: FakeBucket, count: int) -> bool:
    return bucket.asked("GET", "layout") >= count


def open_descriptors(daemon: Daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.pid}/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/PID/fd")
def test_a_long_fetch_holds_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    """A prompt of 200 blocks whose first block's body hangs (trickled): the other blocks
    download meanwhile, a window at a time, and the daemon never holds more than a few
    dozen descriptors more than before (one staging file per block opened at once would be
    200)."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path, requests=4) as daemon:
        tokens = prompt(1, 200)
        first, *_ = seed(bucket, tokens)
        bucket.on(gets({first}), trickle(bucket, every=0.2))
        with RawPeer(daemon.socket_path) as peer:
            before = open_descriptors(daemon)
            ask(peer, [*tokens, 7])
            most, until = before, time.monotonic() + FETCH_TIMEOUT + ENDED_WITHIN
            while not ended(peer) and time.monotonic() < until:
                most = max(most, open_descriptors(daemon))
                time.sleep(0.01)
            now = remote_status(peer)
        assert now["misses_by_reason"] == {"timeout": 1}
        assert now["downloaded_blocks"] > 8  # many windows went by while block 0 hung
        assert most - before < 40, (before, most)


@pytest.mark.parametrize("damage", ["size", "checksum"])
def test_a_damaged_block_is_downloaded_once_across_lookups(tmp_path: Path, damage: str) -> None:
    """Block 3 of 8 damaged in the bucket (cut short, or one byte changed: only the commit's
    checksums tell): a lookup of 6 blocks finds it, and neither the lookups of the 8 blocks
    that follow nor those of the 6 again download it, or anything past it."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        tokens = prompt(1, 8)
        block_keys = seed(bucket, tokens)
        data = bytearray(bucket.objects[block_keys[3]])
        if damage == "size":
            del data[len(data) // 2 :]
        else:  # a bit of a tensor's bytes, which its checksum covers
            name = block_keys[3].rpartition("/")[2]
            data[parse_block_head(name, bytes(data), len(data)).slots[0].start + 3] ^= 1
        bucket.objects[block_keys[3]] = bytes(data)
        with RawPeer(daemon.socket_path) as peer:
            ask(peer, [*tokens[: 6 * BLOCK_TOKENS], 7])
            wait_ended(peer, 1)
            for count, asked in enumerate([tokens, tokens, tokens[: 6 * BLOCK_TOKENS + 1]], 2):
                ask(peer, [*asked, 7])
                wait_ended(peer, count)
            now = remote_status(peer)
            wait_until(lambda: staging_files(daemon) == [], "the staging files gone")
        assert bucket.asked("GET", block_keys[3]) == 1
        assert all(bucket.asked("GET", key) <= 1 for key in block_keys[4:])
        assert (now["hits"], now["misses_by_reason"]) == (1, {"damaged": 3})
        assert now["memos"]["damaged_blocks"]["size"] == 1


def test_a_storm_of_damaged_answers_makes_a_bounded_number_of_log_lines(tmp_path: Path) -> None:
    """Every block answered with ten bytes, for thirty prompts in a row: thirty misses
    counted "damaged", a line or two said (the next one counts those left out)."""
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        prompts = [prompt(n, 3) for n in range(30)]
        every_block = {key for tokens in prompts for key in seed(bucket, tokens)}
        bucket.on(gets(every_block), body(b"x" * 10))
        with RawPeer(daemon.socket_path) as peer:
            for count, tokens in enumerate(prompts, 1):
                ask(peer, [*tokens, 7])
                wait_ended(peer, count)
            now = remote_status(peer)
        assert now["misses_by_reason"] == {"damaged": 30}
        assert len(events(daemon, "remote_miss")) <= 2
        assert len(events(daemon, "remote_fetch_cut")) <= 2
