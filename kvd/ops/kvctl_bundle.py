"""kvctl export, import and match: an entry carried to another daemon in one file (a bundle,
kvd_protocol.bundle), and how much of a prompt a daemon would restore (presence).

Export reads as an engine's restore does: the entry leased by id (open_entry, durable entries
only, so never a file being written), its blocks opened under the lease, each file copied
into the bundle whole while its checksum is taken; the bundle is written under a temporary
name and renamed into place once whole, so no reader ever sees half of one. Import is an
engine's put: put_begin with what the bundle's manifest declares, the blocks the daemon does
not hold and the manifest copied into their staging files (each checked against the bundle's
checksum on the way: a damaged one aborts the put), then the commit, which checks the put as
any put's (identity, tokens, chain hashes, each block's place, every tensor's checksum).
Whatever fails leaves nothing stored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from kvd_protocol import bundle
from kvd_protocol import messages as m
from kvd_protocol.bundle import BundleError, BundleHead
from kvd_protocol.checksum import CHECKSUM_BYTES, new_checksum
from kvd_protocol.entry import PREFIX_BYTES, EntryHeader
from kvd_protocol.entry_reader import parse_header, parse_prefix
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.limits import Limits
from kvd_protocol.tokens import TOKEN_BYTES, pack_tokens

from kvd.ops.control import Control
from kvd.ops.terminal import printable

CHUNK: Final = 8 << 20  # bytes copied at a time
TICKET_WAIT: Final = 600.0  # seconds an import waits for its entry to be stored
MAX_TOKEN_FILE: Final = 64 << 20  # bytes of a --tokens file: max_tokens ids with room to spare
ListEntries = Callable[[str | None], list[m.EntrySummary]]  # kvctl's pager of `list`

EXIT_CODES: Final = {
    "export": "no entry has that id in that identity, or it could not be read or written",
    "import": "the bundle was refused (damaged, truncated, or not what it says), or the "
    "daemon refused its put: nothing was stored",
    "match": "the daemon refused (2: FILE holds no JSON list of token ids)",
}


def add_commands(command: Callable[[str, str], argparse.ArgumentParser], forms: str) -> None:
    """The export, import and match subcommands (command: kvctl's maker of one)."""
    export = command("export", "write one entry and its blocks to a bundle file")
    export.add_argument("--identity", required=True, help=f"the entry's identity ({forms})")
    export.add_argument(
        "--entry", required=True, help="the entry id, or as many of its first digits as only it has"
    )
    export.add_argument("--output", required=True, metavar="FILE", help="the bundle to write")
    imported = command("import", "store a bundle's entry on this daemon; print its id")
    imported.add_argument("bundle", metavar="FILE", help="a bundle `kvctl export` wrote")
    match = command("match", "how much of a prompt this daemon (and its bucket) would restore")
    match.add_argument("--identity", required=True, help=f"the prompt's identity ({forms})")
    match.add_argument(
        "--tokens", required=True, metavar="FILE", help="a JSON list of the prompt's token ids"
    )
    match.add_argument("--json", action="store_true", help="print the answer as JSON")


# --- export ---------------------------------------------------------------------------------


def export(
    control: Control, entries: ListEntries, digest: str, given: str, output: Path
) -> BundleHead:
    """Write the entry of identity digest whose id is (or begins) given to output; its head."""
    if m.OPEN_ENTRY_FEATURE not in control.features:
        raise BundleError("this kvd predates export (no open_entry)")
    wanted = given.lower()
    found = [e for e in entries(digest) if e.id.startswith(wanted)] if wanted else []
    if len(found) != 1:
        many = f"begins {len(found)} entries' ids" if found else "names no entry"
        raise BundleError(f"{given!r} {many} of identity {digest}: `kvctl list` shows them")
    reply = control.call(m.OpenEntry, entry=found[0].id)
    assert isinstance(reply, m.OpenEntryReply)
    assert reply.fd is not None
    with contextlib.ExitStack() as closing:
        closing.callback(control.call, m.Release, lease=reply.lease)
        closing.callback(os.close, reply.fd)
        manifest = _manifest_head(reply.fd, 0, os.fstat(reply.fd).st_size, control.limits)
        if manifest.identity.digest() != digest:
            raise BundleError(f"entry {reply.entry.id} is not of identity {digest}")
        return _write_bundle(control, reply, manifest, closing, output)


def _write_bundle(
    control: Control,
    reply: m.OpenEntryReply,
    manifest: EntryHeader,
    closing: contextlib.ExitStack,
    output: Path,
) -> BundleHead:
    """The bundle of the leased entry (reply) written to output, under a temporary name until
    it is whole; closing closes what it opens."""
    assert reply.fd is not None
    count = len(manifest.block_hashes)
    block_fds = list(_opened_blocks(control, reply.lease, count, closing))
    sizes = {os.fstat(fd).st_size for fd in block_fds}
    if len(sizes) > 1:
        raise BundleError(f"entry {reply.entry.id}'s blocks differ in size: {sorted(sizes)}")
    block_size = sizes.pop() if sizes else 0
    draft = BundleHead(
        identity=manifest.identity,
        entry=reply.entry.id,
        manifest_size=manifest.file_size,
        manifest_checksum=bytes(CHECKSUM_BYTES),
        block_size=block_size,
        block_checksums=(bytes(CHECKSUM_BYTES),) * count,
        header_length=0,
    )
    draft = _head(draft, len(_encoded(draft)) - bundle.PREFIX_BYTES)
    part = output.with_name(f".{output.name}.{os.getpid()}.part")
    out = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a prompt's KV: private
    try:
        try:
            os.ftruncate(out, draft.file_size)
            manifest_sum = _copy(reply.fd, 0, out, draft.manifest_offset, draft.manifest_size)
            sums = tuple(
                _copy(fd, 0, out, draft.block_offset(i), block_size)
                for i, fd in enumerate(block_fds)
            )
            done = BundleHead(
                identity=draft.identity,
                entry=draft.entry,
                manifest_size=draft.manifest_size,
                manifest_checksum=manifest_sum,
                block_size=block_size,
                block_checksums=sums,
                header_length=draft.header_length,
            )
            _write_all(out, _encoded(done), 0)
            os.fsync(out)
        finally:
            os.close(out)
        part.replace(output)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return done


def _head(head: BundleHead, header_length: int) -> BundleHead:
    return BundleHead(
        identity=head.identity,
        entry=head.entry,
        manifest_size=head.manifest_size,
        manifest_checksum=head.manifest_checksum,
        block_size=head.block_size,
        block_checksums=head.block_checksums,
        header_length=header_length,
    )


def _encoded(head: BundleHead) -> bytes:
    return bundle.encode_head(
        head.identity,
        head.entry,
        manifest_size=head.manifest_size,
        manifest_checksum=head.manifest_checksum,
        block_size=head.block_size,
        block_checksums=head.block_checksums,
    )


def _opened_blocks(
    control: Control, lease: int, count: int, closing: contextlib.ExitStack
) -> Iterator[int]:
    """The leased entry's block files, opened by the daemon a batch at a time (closing closes
    them)."""
    for first in range(0, count, m.MAX_BLOCK_BATCH):
        batch = min(m.MAX_BLOCK_BATCH, count - first)
        reply = control.call(m.OpenBlocks, lease=lease, first=first, count=batch)
        assert isinstance(reply, m.OpenBlocksReply)
        for fd in reply.fds:
            closing.callback(os.close, fd)
        if len(reply.fds) != batch:
            raise BundleError(f"the daemon gave {len(reply.fds)} files for {batch} blocks")
        yield from reply.fds


# --- import -----------------------------------------------------------------------------------


def read_bundle(fd: int, limits: Limits) -> tuple[BundleHead, EntryHeader]:
    """The bundle's head and its manifest's header, checked against each other: BundleError
    for a file that is not a whole bundle of one entry."""
    size = os.fstat(fd).st_size
    prefix = bundle.parse_prefix(os.pread(fd, bundle.PREFIX_BYTES, 0), limits)
    head = bundle.parse_header(
        prefix, os.pread(fd, prefix.header_length, bundle.PREFIX_BYTES), size, limits
    )
    manifest = _manifest_head(fd, head.manifest_offset, head.manifest_size, limits)
    if manifest.identity.digest() != head.identity.digest():
        raise BundleError(
            f"its manifest is of identity {manifest.identity.digest()}, "
            f"the bundle says {head.identity.digest()}"
        )
    if len(manifest.block_hashes) != len(head.block_checksums):
        raise BundleError(
            f"its manifest lists {len(manifest.block_hashes)} blocks, the bundle holds "
            f"{len(head.block_checksums)}"
        )
    return head, manifest


def import_bundle(control: Control, entries: ListEntries, path: Path) -> str:
    """Put the bundle's entry to the daemon; what it stored: the entry's id, or what the
    daemon said instead (it holds the entry already)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block an open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"{path} is not a file")
        head, manifest = read_bundle(fd, control.limits)
        begin = control.call(
            m.PutBegin,
            identity=head.identity,
            tokens=manifest.tokens,
            size=head.manifest_size,
            blocks=b"".join(manifest.block_hashes),
            block_tokens=manifest.block_tokens if manifest.block_hashes else 0,
            block_size=head.block_size,
        )
        assert isinstance(begin, m.PutBeginReply)
        ticket = None if begin.skip is not None else _send(control, fd, head, begin)
    finally:
        os.close(fd)
    digest = head.identity.digest()
    if ticket is None:
        found = _entry_of(entries(digest), manifest)
        return f"held already ({begin.skip})" + (f": {found}" if found else "")
    return _stored(control, entries, ticket, digest, manifest)


def _send(control: Control, fd: int, head: BundleHead, begin: m.PutBeginReply) -> int:
    """The put begun: the blocks the daemon does not hold, the manifest, the commit; its
    ticket. Aborted on any failure (the daemon then deletes what it was sent)."""
    assert begin.fd is not None
    staging = begin.fd
    count = len(head.block_checksums)
    try:
        try:
            for first in range(begin.held, count, m.MAX_BLOCK_BATCH):
                batch = min(m.MAX_BLOCK_BATCH, count - first)
                reply = control.call(m.PutBlocks, put=begin.put, first=first, count=batch)
                with contextlib.ExitStack() as closing:
                    for block_fd in reply.fds:
                        closing.callback(os.close, block_fd)
                    if len(reply.fds) != batch:
                        raise BundleError(f"the daemon gave {len(reply.fds)} files for {batch}")
                    for index, block_fd in enumerate(reply.fds, first):
                        where = head.block_offset(index)
                        got = _copy(fd, where, block_fd, 0, head.block_size)
                        _check(got, head.block_checksums[index], f"block {index}")
            got = _copy(fd, head.manifest_offset, staging, 0, head.manifest_size)
            _check(got, head.manifest_checksum, "the manifest")
        finally:
            os.close(staging)
        commit = control.call(m.PutCommit, put=begin.put)
    except BaseException:
        with contextlib.suppress(Exception):  # a refused commit has removed the put already
            control.call(m.PutAbort, put=begin.put)
        raise
    assert isinstance(commit, m.PutCommitReply)
    return commit.ticket


def _stored(
    control: Control, entries: ListEntries, ticket: int, digest: str, manifest: EntryHeader
) -> str:
    """The committed put's entry id, once its ticket says stored."""
    control.wait_longer(TICKET_WAIT)
    reply = control.call(m.WaitTicket, ticket=ticket, timeout=TICKET_WAIT)
    assert isinstance(reply, m.TicketReply)
    if reply.state != "stored":
        raise BundleError(f"the daemon took the put, then {reply.state} it: {reply.reason}")
    found = _entry_of(entries(digest), manifest)
    if reply.reason == "duplicate":  # the daemon kept the entry it held
        return "held already (duplicate)" + (f": {found}" if found else "")
    if found is None:  # superseded or evicted the moment it was stored
        raise BundleError("the daemon stored the entry, and holds it no more (see its log)")
    return found


def _entry_of(listed: Sequence[m.EntrySummary], manifest: EntryHeader) -> str | None:
    """The id of the listed entry the manifest describes: its token count and its creation
    time (the manifest's, carried byte for byte), the only one that has both."""
    count = manifest.token_count
    found = [e.id for e in listed if e.tokens == count and e.created == manifest.created]
    return found[0] if len(found) == 1 else None


def _check(got: bytes, want: bytes, what: str) -> None:
    if got != want:
        raise BundleError(f"{what} is damaged: its checksum differs from the bundle's")


# --- match ------------------------------------------------------------------------------------


def read_tokens(path: Path, limits: Limits) -> bytes:
    """The token ids of the JSON list in path, packed; ValueError for anything else."""
    if path.stat().st_size > MAX_TOKEN_FILE:
        raise ValueError(f"{path} is over {MAX_TOKEN_FILE} bytes: not a prompt's token ids")
    tokens = json.loads(path.read_text())
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise ValueError(f"{path} holds no JSON list of token ids (integers 0..2^32-1)")
    if not 0 < len(tokens) <= limits.max_tokens:
        raise ValueError(f"{path} holds {len(tokens)} token ids, not 1..{limits.max_tokens}")
    return pack_tokens(tokens)


def match(control: Control, digest: str, tokens: bytes) -> dict[str, Any]:
    """The daemon's presence answer for the prompt under the identity of digest."""
    if m.PRESENCE_FEATURE not in control.features:
        raise BundleError("this kvd predates match (no presence)")
    reply = control.call(m.Presence, identity=None, digest=digest, tokens=tokens)
    assert isinstance(reply, m.PresenceReply)
    answer = {k: v for k, v in reply.to_map().items() if k != "id"}
    return {"prompt": len(tokens) // TOKEN_BYTES, **answer}


def format_match(answer: dict[str, Any]) -> str:
    """match's answer in lines for the operator."""
    prompt, local = answer["prompt"], answer["matched"]
    lines = [f"prompt    {prompt} tokens (a lookup restores at most {max(prompt - 1, 0)})"]
    entry = f" from entry {answer['entry']}" if answer["entry"] else ""
    lines.append(f"local     {local} tokens{entry}")
    if answer["miss"]:
        lines.append(f"  stops   {answer['miss']}: {answer['detail']}")
    if answer["remote"] is None:
        lines.append("remote    no remote tier")
    else:
        lines.append(f"remote    {answer['remote']} more tokens in the bucket")
        if answer["remote_miss"]:
            lines.append(f"  stops   {answer['remote_miss']}: {answer['remote_detail']}")
    return "\n".join(map(printable, lines))


# --- copying ----------------------------------------------------------------------------------


def _manifest_head(fd: int, at: int, size: int, limits: Limits) -> EntryHeader:
    """The header of the entry file of size bytes at offset at of fd, checked as a reader
    checks one (entry_reader): BundleError naming the rule it breaks."""
    name = "the manifest"
    try:
        prefix = parse_prefix(name, os.pread(fd, PREFIX_BYTES, at), limits)
        header = os.pread(fd, prefix.header_length, at + PREFIX_BYTES)
        return parse_header(name, prefix, header, size, limits)
    except EntryFormatError as exc:
        raise BundleError(str(exc)) from None


def _copy(source: int, source_at: int, target: int, target_at: int, size: int) -> bytes:
    """size bytes from source at source_at to target at target_at; their checksum. A source
    shorter than that is a BundleError."""
    digest = new_checksum()
    done = 0
    while done < size:
        data = os.pread(source, min(CHUNK, size - done), source_at + done)
        if not data:
            raise BundleError(f"truncated: {done} of {size} bytes could be read")
        digest.update(data)
        _write_all(target, data, target_at + done)
        done += len(data)
    return digest.digest()


def _write_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
