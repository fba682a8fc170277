"""`kvctl`: the daemon's command line. `kvctl status` first of all.

It speaks the same protocol as the engines (kvd_protocol's Connection over the socket) and
finds the socket the way the daemon does: --socket, KVD_SOCKET, the config file, the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kvd_protocol import messages as m
from kvd_protocol.connection import NEED_DATA, Connection, Role
from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.limits import DEFAULT_LIMITS

from kvd.config import ConfigError, load_config
from kvd.identity_names import IdentityNameError, resolve
from kvd.ops.doctor import add_doctor_parser, run_doctor
from kvd.ops.kvctl_tables import (
    SORTS,
    format_entry,
    format_list,
    format_status,
    model_name,
    rates,
    size,
)
from kvd.ops.service import add_service_parser, run_service
from kvd.progress import Progress
from kvd.serve.metrics import exposition
from kvd.store.entry_files import read_header

RECEIVE_BYTES = 1 << 16
IDENTITY_FORMS = "its name, its digest, or the digest's first digits"


class DaemonUnavailableError(Exception):
    """The daemon does not answer on the socket."""


class Control:
    """One blocking connection to the daemon, one request at a time."""

    def __init__(self, path: str, timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailableError(
                f"no kvd answers on {path}: {exc.strerror or exc}"
            ) from None
        self._conn = Connection(Role.CLIENT)
        self._ids = itertools.count(1)
        self._timeout = timeout
        hello = self.call(m.Hello, protocol=m.PROTOCOL_VERSION, client="kvctl", pid=os.getpid())
        assert isinstance(hello, m.HelloReply)
        self.features = frozenset(hello.features)

    def wait_longer(self, seconds: float | None) -> None:
        """The next answers may take seconds (None: as long as it takes) on top of the usual
        timeout: a request that waits on purpose."""
        self._sock.settimeout(None if seconds is None else self._timeout + seconds)

    def call(self, request: type[m.Request], **fields: Any) -> m.Reply:
        self._sock.sendall(self._conn.send(request(id=next(self._ids), **fields)))
        while True:
            event = self._conn.next_event()
            if event is not NEED_DATA:
                break
            try:
                data = self._sock.recv(RECEIVE_BYTES)
            except TimeoutError:
                raise DaemonUnavailableError("the daemon did not answer in time") from None
            self._conn.receive_data(data)
        if isinstance(event, m.ErrorReply):
            raise ProtocolError(event.code, event.message)
        assert isinstance(event, m.Reply)
        return event

    def close(self) -> None:
        self._sock.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description="Inspect and manage a kvd daemon.")
    parser.add_argument("--socket", help="the daemon's socket (default: as kvd finds it)")
    parser.add_argument("--config", metavar="FILE", help="kvd's TOML configuration file")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for answers")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="the tier, the queue, each model, the clients")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument(
        "--watch", action="store_true", help="refresh in place, with rates per second"
    )
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.add_argument("--count", type=int, default=0, help="stop after this many (0: never)")
    commands.add_parser("ping", help="check that the daemon answers")
    flush = commands.add_parser("flush", help="wait until every accepted put is durable")
    flush.add_argument("--wait", type=float, default=None, help="give up after this many seconds")
    flush.add_argument(
        "--remote",
        action="store_true",
        dest="uploads",  # not `remote`: that names the setting kvctl's config reads
        help="and until the uploads to the remote store are sent",
    )
    listing = commands.add_parser("list", help="list entries")
    listing.add_argument("--identity", help=f"only this identity ({IDENTITY_FORMS})")
    listing.add_argument(
        "--sort", choices=sorted(SORTS), default="used", help="order (default used)"
    )
    listing.add_argument("--json", action="store_true")
    show = commands.add_parser("show", help="one entry: identity, tokens, layers, checksums")
    show.add_argument("entry", help="the entry id")
    show.add_argument("--json", action="store_true")
    evict = commands.add_parser("evict", help="delete entries now")
    target = evict.add_mutually_exclusive_group(required=True)
    target.add_argument("--entry", help="one entry id")
    target.add_argument("--identity", help=f"every entry of one identity ({IDENTITY_FORMS})")
    target.add_argument("--all", action="store_true", help="every entry")
    verify = commands.add_parser(
        "verify", help="check every entry's file whole; exit 1 naming each damaged one"
    )
    verify.add_argument("--identity", help=f"only this identity ({IDENTITY_FORMS})")
    verify.add_argument("--repair", action="store_true", help="quarantine the damaged ones")
    commands.add_parser("metrics", help="the status in Prometheus text format")
    add_service_parser(commands)
    add_doctor_parser(commands)
    return parser


def _identity(control: Control, given: str | None) -> str | None:
    """The digest of the identity an --identity argument names (identity_names.resolve);
    None for none given. Raises IdentityNameError."""
    if given is None:
        return None
    status = _status(control)
    return resolve(status["identities"], given, status.get("identities_left_out", 0))


def _status(control: Control) -> dict[str, Any]:
    reply = control.call(m.Status)
    assert isinstance(reply, m.StatusReply)
    return dict(reply.status)


def _watch(control: Control, interval: float, count: int) -> int:
    """The status table again every interval seconds, with rates per second, until Ctrl-C
    (or count tables); redrawn in place on a terminal, one after another off one."""
    terminal = sys.stdout.isatty()
    before, at = _status(control), time.monotonic()
    moved: dict[str, float] | None = None  # rates, from the second table on
    shown = 0
    try:
        while True:
            if terminal:
                sys.stdout.write("\033[H\033[J")  # home, clear: redraw in place
            print(format_status(before, moved), flush=True)
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(interval)
            after, now = _status(control), time.monotonic()
            moved = rates(before, after, now - at)
            before, at = after, now
    except KeyboardInterrupt:
        return 0


def _show(control: Control, entry: str, as_json: bool) -> int:
    """One entry's summary from the daemon and its header from its file (in the daemon's
    tier, which status names)."""
    found = [e for e in _entries(control, None) if e.id == entry]
    if not found:
        print(f"kvctl: no entry {entry}", file=sys.stderr)
        return 1
    (summary,) = found
    status = _status(control)
    path = Path(status["daemon"]["dir"]) / "entries" / summary.identity / f"{summary.id}.kve"
    header = read_header(path, DEFAULT_LIMITS)
    if as_json:
        shown = {**summary.to_map(), "path": str(path), "header": _header_map(header)}
        print(json.dumps(shown, indent=2))
        return 0
    names = {i["identity"]: model_name(i) for i in status["identities"]}
    print(format_entry(summary, header, names.get(summary.identity, summary.identity), str(path)))
    return 0


def _header_map(header: EntryHeader) -> dict[str, Any]:
    return {
        "identity": header.identity.to_wire(),
        "tokens": header.token_count,
        "min_reuse": header.min_reuse,
        "created": header.created,
        "file_size": header.file_size,
        "layers": [
            {
                "kind": layer.kind,
                "trimmable": layer.trimmable,
                "slots": [
                    {
                        "dtype": s.dtype,
                        "shape": list(s.shape),
                        "bytes": s.nbytes,
                        "xxh3_64": s.checksum.hex(),
                    }
                    for s in layer.slots
                ],
            }
            for layer in header.layers
        ],
        "checkpoint": header.checkpoint.key if header.checkpoint else None,
    }


def _entries(control: Control, identity: str | None) -> list[m.EntrySummary]:
    """Every entry (of one identity), page by page."""
    entries: list[m.EntrySummary] = []
    after = None
    while True:
        page = control.call(m.ListEntries, identity=identity, limit=1000, after=after)
        assert isinstance(page, m.ListEntriesReply)
        entries += page.entries
        if not page.more or not page.entries:
            return entries
        after = page.entries[-1].id


def _verify(control: Control, identity: str | None, repair: bool) -> int:
    """Check the durable entries one by one (the writer checks pending ones itself)."""
    entries = [e for e in _entries(control, identity) if e.durable]
    progress = Progress("verifying", len(entries))
    damaged = gone = 0
    try:
        for entry in entries:
            try:
                reply = control.call(m.Verify, entry=entry.id, repair=repair)
            except ProtocolError as exc:
                if exc.code is not ErrorCode.NOT_FOUND:
                    raise
                gone += 1  # evicted or superseded since the list: nothing to check
            else:
                assert isinstance(reply, m.VerifyReply)
                if reply.problem is not None:
                    damaged += 1
                    done = " (quarantined)" if reply.quarantined else ""
                    print(f"damaged {entry.id} ({entry.identity}): {reply.problem}{done}")
            progress.step()
    finally:
        progress.close()
    checked = len(entries) - gone
    print(f"{checked} entries verified, {damaged} damaged" + (f", {gone} gone" if gone else ""))
    return 1 if damaged else 0


def _flush(control: Control, wait: float | None, remote: bool) -> int:
    """Wait until the accepted puts are durable (and, remote, uploaded); 1 when not done."""
    if remote and m.REMOTE_FLUSH_FEATURE not in control.features:
        print("kvctl: this kvd predates flush --remote", file=sys.stderr)
        return 2
    control.wait_longer(wait)
    reply = control.call(m.Flush, timeout=wait, **({"remote": True} if remote else {}))
    assert isinstance(reply, m.FlushReply)
    if not remote:
        print("durable" if reply.durable else f"not durable: {reply.pending} still pending")
    elif reply.durable:
        print("durable and uploaded")
    else:
        print(
            f"not done: {reply.pending} puts not durable, {reply.remote_pending} uploads "
            f"({size(reply.remote_pending_bytes or 0)}) still pending, "
            f"{reply.remote_dropped} dropped since the last flush --remote"
        )
    return 0 if reply.durable else 1


def _run(args: argparse.Namespace, control: Control) -> int:
    if args.command == "status":
        if args.watch:
            return _watch(control, args.interval, args.count)
        status = _status(control)
        print(json.dumps(status, indent=2) if args.json else format_status(status))
    elif args.command == "ping":
        control.call(m.Ping)
        print("kvd is up")
    elif args.command == "flush":
        return _flush(control, args.wait, args.uploads)
    elif args.command == "list":
        entries = _entries(control, _identity(control, args.identity))
        if args.json:
            print(json.dumps([e.to_map() for e in entries], indent=2))
        else:
            names = {i["identity"]: model_name(i) for i in _status(control)["identities"]}
            print(format_list(entries, names, args.sort, time.time()))
    elif args.command == "show":
        return _show(control, args.entry, args.json)
    elif args.command == "evict":
        identity = _identity(control, args.identity)
        reply = control.call(m.Evict, entry=args.entry, identity=identity, all=args.all)
        assert isinstance(reply, m.EvictReply)
        print(f"evicted {reply.evicted} entries, {size(reply.bytes)}")
    elif args.command == "verify":
        return _verify(control, _identity(control, args.identity), args.repair)
    elif args.command == "metrics":
        status = _status(control)
        sys.stdout.write(exposition(lambda: status).decode())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "service":  # needs no daemon
        return run_service(args)
    if args.command == "doctor":  # needs no daemon
        return run_doctor(args)
    try:
        socket_path = str(load_config(args, os.environ).socket)
    except ConfigError as exc:
        print(f"kvctl: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        control = Control(socket_path, args.timeout)
    except DaemonUnavailableError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 3
    try:
        return _run(args, control)
    except ProtocolError as exc:
        print(f"kvctl: the daemon refused: {exc}", file=sys.stderr)
        return 1
    except IdentityNameError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 2
    except DaemonUnavailableError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 3
    finally:
        control.close()


if __name__ == "__main__":
    sys.exit(main())
