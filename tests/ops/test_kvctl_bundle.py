"""kvctl export, import and match against real daemons: a bundle that is damaged, truncated or
not what it says is refused with a clear error and stores nothing, whoever made it, and the
daemon serves on; presence (kvctl match, Client.presence) says what a lookup then restores and
counts nothing."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, kv_tensors
from daemon_e2e import (
    IDENTITY,
    OTHER_IDENTITY,
    SETTLE_SECONDS,
    files_on_disk,
    put_stored,
    staging_files,
    wait_until,
)
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client import AsyncClient, Client, TicketState
from kvd_client.results import Presence
from kvd_protocol import bundle
from kvd_protocol.identity import Identity

TOKENS = list(range(1000, 1000 + 5 * BLOCK_TOKENS + 7))  # five whole blocks and a tail
# Same model, another config: what a presence of its prompt names as the difference.
SAME_MODEL = replace(IDENTITY, config_fingerprint="cfg-2")
OTHER = OTHER_IDENTITY


def _patient(daemon: Daemon) -> Client:
    """A client whose lookups may wait as long as its puts: a loaded machine's slow lookup is
    no miss in these tests."""
    return Client.connect(
        daemon.socket_path,
        require=True,
        block_tokens=BLOCK_TOKENS,
        lookup_timeout=SETTLE_SECONDS,
    )


def _put(client: Client, identity: Identity, tokens: Sequence[int]) -> str:
    """Put tokens' blocked KV under identity, stored; the entry's id."""
    layers, tensors = kv_tensors(tokens)
    ticket = client.put_entry(identity, list(tokens), layers, tensors)
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
    (entry,) = [e for e in client.list_entries(identity) if e.tokens == len(tokens)]
    return entry.id


def _export(daemon: Daemon, identity: Identity, entry: str, to: Path) -> bytes:
    done = kvctl(
        daemon, "export", "--identity", identity.digest(), "--entry", entry, "--output", str(to)
    )
    assert done.returncode == 0, done.stderr
    return to.read_bytes()


def _pieces(data: bytes) -> tuple[bundle.BundleHead, bytes, list[bytes]]:
    """A bundle's head, manifest and blocks."""
    prefix = bundle.parse_prefix(data)
    head = bundle.parse_header(prefix, data[bundle.PREFIX_BYTES :], len(data))
    manifest = data[head.manifest_offset : head.manifest_offset + head.manifest_size]
    blocks = [
        data[head.block_offset(i) : head.block_offset(i) + head.block_size]
        for i in range(len(head.block_checksums))
    ]
    return head, manifest, blocks


def _rebuilt(identity: Identity, manifest: bytes, blocks: Sequence[bytes]) -> bytes:
    """A bundle of these pieces with checksums that match them: what a liar would write."""
    from kvd_protocol.checksum import checksum  # noqa: PLC0415 - the liar's tool alone

    head = bundle.encode_head(
        identity,
        "forged",
        manifest_size=len(manifest),
        manifest_checksum=checksum(manifest),
        block_size=len(blocks[0]) if blocks else 0,
        block_checksums=tuple(checksum(b) for b in blocks),
    )
    return head + manifest + b"".join(blocks)


def _flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def _holds_nothing(daemon: Daemon) -> None:
    """No entry, no block, no staging file left, and the daemon answers."""
    with Client.connect(daemon.socket_path, require=True) as client:
        status = client.status()
        assert (status["entries"], status["bytes"]) == (0, 0)
    assert files_on_disk(daemon) == (0, 0)
    assert staging_files(daemon) == []


def test_a_damaged_truncated_or_lying_bundle_is_refused_and_stores_nothing(
    daemon: Daemon, tmp_path: Path
) -> None:
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
        mine = _put(client, IDENTITY, TOKENS)
        theirs = _put(client, OTHER, TOKENS)  # the same tokens: blocks of the same hashes
    good = _export(daemon, IDENTITY, mine, tmp_path / "good.kvdb")
    other = _export(daemon, OTHER, theirs, tmp_path / "other.kvdb")
    head, manifest, blocks = _pieces(good)
    _, other_manifest, other_blocks = _pieces(other)
    padded = [b + bytes(16384) for b in blocks]
    cases = {
        # damaged: a byte of block 2's data, of the manifest's tail, of the header
        "block 2 is damaged": _flipped(good, head.block_offset(2) + head.block_size - 1),
        "the manifest is damaged": _flipped(good, head.block_offset(0) - 1),
        "do not match their checksum": _flipped(good, bundle.PREFIX_BYTES + 3),
        # truncated, or longer than it says
        "truncated": good[:-1],
        "truncated: 1 of": good[: bundle.PREFIX_BYTES + 1],
        "shorter than the 48-byte prefix": good[:20],
        "bytes after its end": good + b"\0",
        "not a kvd bundle": manifest,
        # lying, with checksums that match what it holds
        "its manifest is of identity": _rebuilt(OTHER, manifest, blocks),
        "lists 5 blocks, the bundle holds 4": _rebuilt(IDENTITY, manifest, blocks[:4]),
        # wrong sizes: each block padded, declared so; another identity's blocks
        "file_size": _rebuilt(IDENTITY, manifest, padded),
        "block_mismatch": _rebuilt(IDENTITY, manifest, other_blocks),
        # its own blocks, out of order or cut short
        "block_hash: its parent and tokens": _rebuilt(IDENTITY, manifest, blocks[::-1]),
        "truncated: 16384 bytes": _rebuilt(IDENTITY, manifest, [b[:16384] for b in blocks]),
    }
    assert len(blocks[0]) > 16384
    assert other_manifest != manifest
    with running_daemon(tmp_path / "elsewhere") as target:
        for said, data in cases.items():
            path = tmp_path / "hostile.kvdb"
            path.write_bytes(data)
            done = kvctl(target, "import", str(path))
            assert done.returncode == 1, (said, done.stdout, done.stderr)
            assert said in done.stderr, (said, done.stderr)
            assert "Traceback" not in done.stderr
            _holds_nothing(target)
        fifo = tmp_path / "fifo.kvdb"
        os.mkfifo(fifo)
        not_a_file = kvctl(target, "import", str(fifo))
        assert (not_a_file.returncode, not_a_file.stderr) == (
            1,
            f"kvctl: import: {fifo} is not a file\n",
        )
        imported = kvctl(target, "import", str(tmp_path / "good.kvdb"))
        assert imported.returncode == 0, imported.stderr
        with Client.connect(target.socket_path, require=True) as client:
            (entry,) = client.list_entries()
            assert entry.id == imported.stdout.strip()


def test_export_names_what_it_cannot_find(daemon: Daemon, tmp_path: Path) -> None:
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
        mine = _put(client, IDENTITY, TOKENS)
    output = tmp_path / "none.kvdb"
    wrong_identity = kvctl(
        daemon, "export", "--identity", OTHER.digest(), "--entry", mine, "--output", str(output)
    )
    assert wrong_identity.returncode == 1
    assert "names no entry of identity" in wrong_identity.stderr
    assert not output.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def _presence_then_lookup(
    client: Client, identity: Identity, prompt: Sequence[int]
) -> tuple[int, str | None, int]:
    """The presence answer for prompt (matched, miss), then what a lookup restores."""
    before = client.status()
    answer = client.presence(identity, prompt)
    after = client.status()
    for counter in ("hits", "misses", "engine_held", "misses_by_reason", "leased_entries"):
        assert after[counter] == before[counter], counter
    assert answer.remote is None  # no remote tier
    result = client.lookup(identity, list(prompt))
    restored = 0
    if result is not None:
        with result:
            restored = result.matched
            assert result.summary.id == answer.entry
    return answer.matched, answer.miss, restored


def test_presence_agrees_with_what_a_lookup_restores_and_counts_nothing(
    daemon: Daemon, tmp_path: Path
) -> None:
    with _patient(daemon) as client:
        _put(client, IDENTITY, TOKENS)
        _put(client, SAME_MODEL, TOKENS[:40])
        whole = [*TOKENS, 5]
        diverging = TOKENS[:40] + [7] * 30
        unrelated = [3] * 50
        assert _presence_then_lookup(client, IDENTITY, whole) == (len(TOKENS), None, len(TOKENS))
        assert _presence_then_lookup(client, IDENTITY, diverging) == (40, "no entry", 40)
        assert _presence_then_lookup(client, IDENTITY, unrelated) == (0, "no entry", 0)
        # The model's other identity holds more of it: the difference is named.
        assert _presence_then_lookup(client, OTHER, TOKENS) == (0, "no entry", 0)
        answer = client.presence(SAME_MODEL, whole)
        assert (answer.matched, answer.miss) == (40, "config differs")
        told = client.presence(IDENTITY, diverging)
        status = client.status()

    async def asked_async() -> Presence:
        async with await AsyncClient.connect(daemon.socket_path, require=True) as client:
            return await client.presence(IDENTITY, diverging)

    assert asyncio.run(asked_async()) == told  # the async client asks alike
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps(diverging))
    asked = kvctl(
        daemon, "match", "--identity", IDENTITY.digest(), "--tokens", str(tokens_file), "--json"
    )
    assert asked.returncode == 0, asked.stderr
    shown = json.loads(asked.stdout)
    assert (shown["prompt"], shown["matched"], shown["miss"]) == (70, 40, "no entry")
    assert shown["remote"] is None
    text = kvctl(daemon, "match", "--identity", IDENTITY.digest(), "--tokens", str(tokens_file))
    assert text.returncode == 0, text.stderr
    assert "local     40 tokens from entry" in text.stdout
    assert "holds no entry usable for more than 40 tokens of this 70-token prompt" in text.stdout
    with Client.connect(daemon.socket_path, require=True) as client:
        after = client.status()
        assert (after["hits"], after["misses"]) == (status["hits"], status["misses"])
    tokens_file.write_text('{"not": "a list"}')
    refused = kvctl(daemon, "match", "--identity", IDENTITY.digest(), "--tokens", str(tokens_file))
    assert refused.returncode == 2
    assert "holds no JSON list of token ids" in refused.stderr
    os.remove(tokens_file)


def _busy(daemon: Daemon, seed: int, stop: threading.Event, done: list[int]) -> None:
    """An engine putting and looking up prompts of its own until stop; done: its puts."""
    with _patient(daemon) as client:
        while not stop.is_set():
            first = (seed + 1) * 1_000_000 + len(done) * 100  # apart from every other prompt
            tokens = list(range(first, first + 3 * BLOCK_TOKENS))
            layers, tensors = kv_tensors(tokens)
            ticket = client.put_entry(IDENTITY, tokens, layers, tensors)
            assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            result = client.lookup(IDENTITY, [*tokens, 1])
            assert result is not None
            result.release()
            done.append(len(tokens))


def test_export_and_import_run_while_engines_put_and_look_up(
    daemon: Daemon, tmp_path: Path
) -> None:
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
        mine = _put(client, IDENTITY, TOKENS)
    with running_daemon(tmp_path / "elsewhere") as target:
        stop = threading.Event()
        puts: list[list[int]] = [[], []]
        with ThreadPoolExecutor(2) as engines:
            running = [
                engines.submit(_busy, where, seed, stop, done)
                for seed, (where, done) in enumerate(zip((daemon, target), puts, strict=True))
            ]
            try:
                wait_until(lambda: all(puts), "both engines put")
                data = _export(daemon, IDENTITY, mine, tmp_path / "busy.kvdb")
                imported = kvctl(target, "import", str(tmp_path / "busy.kvdb"))
                wait_until(lambda: all(len(done) > 2 for done in puts), "more puts meanwhile")
            finally:
                stop.set()
            for engine in running:
                engine.result()  # an engine's failure fails the test
        assert imported.returncode == 0, imported.stderr
        _, manifest, blocks = _pieces(data)
        entry = imported.stdout.strip()
        path = target.tier / "entries" / IDENTITY.digest() / f"{entry}.kve"
        assert path.read_bytes() == manifest
        held = {p.read_bytes() for p in (path.parent / "blocks").glob("*.kvb")}
        assert all(block in held for block in blocks)


def test_a_whole_entry_without_blocks_is_carried_byte_for_byte(
    daemon: Daemon, tmp_path: Path
) -> None:
    with Client.connect(daemon.socket_path, require=True, block_tokens=0) as client:
        put_stored(client, IDENTITY, TOKENS, seed=4)  # a version 1 entry: no block
        (entry,) = client.list_entries()
    data = _export(daemon, IDENTITY, entry.id, tmp_path / "whole.kvdb")
    head, manifest, blocks = _pieces(data)
    assert (blocks, head.block_size) == ([], 0)
    with running_daemon(tmp_path / "elsewhere") as target:
        imported = kvctl(target, "import", str(tmp_path / "whole.kvdb"))
        assert imported.returncode == 0, imported.stderr
        path = target.tier / "entries" / IDENTITY.digest() / f"{imported.stdout.strip()}.kve"
        assert path.read_bytes() == manifest
        with _patient(target) as client:
            result = client.lookup(IDENTITY, [*TOKENS, 1])
            assert result is not None
            with result:
                assert result.matched == len(TOKENS)
