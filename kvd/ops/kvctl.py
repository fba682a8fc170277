"""`kvctl`: the daemon's command line. `kvctl status` first of all.

It speaks the same protocol as the engines (kvd_protocol's Connection over the socket) and
finds the socket the way the daemon does: --socket, KVD_SOCKET, the config file, the default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import string
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvd_protocol import messages as m
from kvd_protocol.bundle import BundleError
from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import (
    DaemonUnavailableError,
    EntryFormatError,
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
)
from kvd_protocol.limits import DEFAULT_LIMITS

from kvd.config import ConfigError, env_var, load_config
from kvd.config_values import count
from kvd.identity_names import CANDIDATES_SHOWN, IdentityNameError, resolve
from kvd.ops import kvctl_bundle
from kvd.ops.control import (
    HOW_TO_START,
    Control,
    socket_source,
)
from kvd.ops.doctor import add_doctor_parser, run_doctor
from kvd.ops.kvctl_tables import (
    SORTS,
    ago,
    format_entry,
    format_list,
    format_status,
    model_name,
    rates,
    size,
)
from kvd.ops.service import add_service_parser, run_service
from kvd.ops.terminal import printable, printable_strings
from kvd.progress import Progress
from kvd.serve.metrics import exposition
from kvd.store.entry_files import read_header

ENTRY_ID_HEX = 32
HEX_DIGITS = frozenset(string.hexdigits.lower())
IDENTITY_FORMS = "its name, its digest, or the digest's first digits"
MAX_SECONDS = 7 * 86400.0  # a bound on --timeout and --interval: a week

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
PIPE_CLOSED = 141  # 128 + SIGPIPE: the reader of the output went away (`kvctl list | head`)
NO_DAEMON = 3
EXIT_CODES = {
    "status": "the daemon refused",
    "ping": "the daemon refused",
    "flush": "not done: puts not durable when --wait ran out; with --remote also uploads "
    "pending or dropped, or the remote bucket down (each said)",
    "list": "the daemon refused",
    "show": "no entry has that id, or its file cannot be read here",
    "evict": "the daemon refused (evict needs the daemon's own user or root)",
    "verify": "an entry is damaged (each named)",
    "metrics": "the daemon refused",
    **kvctl_bundle.EXIT_CODES,
}


def _exit_codes(command: str) -> str:
    """The exit statuses of a command, for its --help."""
    meanings = {
        0: "done",
        1: EXIT_CODES[command],
        2: "a bad argument or setting, or an identity or entry id that names none or several",
        NO_DAEMON: "no daemon answers on the socket",
        INTERRUPTED: "interrupted (Ctrl-C)",
        PIPE_CLOSED: "the output was closed before all of it was read (`| head`)",
    }
    return "exit status:\n" + "\n".join(f"  {code:<4} {text}" for code, text in meanings.items())


def _seconds(most: float, *, zero: bool = False) -> Callable[[str], float]:
    """The parser of a duration flag: seconds, above zero (or zero), at most most."""
    least = "0 or more" if zero else "above 0"

    def parse(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not 0 <= seconds <= most or (seconds == 0 and not zero):  # NaN fails both
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a number of seconds {least}, at most {most:.0f}"
            )
        return seconds

    return parse


def _count(value: str) -> int:
    try:
        return count(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvctl",
        description="Inspect and manage a kvd daemon.",
        epilog=f"Without a daemon answering, exit status {NO_DAEMON}: {HOW_TO_START}.",
    )
    parser.add_argument(
        "--socket",
        help=f"the daemon's socket (default: {env_var('socket')}, the configuration file, "
        "then the platform's default, as kvd finds it)",
    )
    parser.add_argument("--config", metavar="FILE", help="kvd's TOML configuration file")
    parser.add_argument(
        "--timeout",
        type=_seconds(MAX_SECONDS),
        default=10.0,
        metavar="S",
        help="seconds to wait for each answer (default: %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=text,
            description=text,
            epilog=_exit_codes(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    status = command("status", "the tier, the queue, each model, the clients")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument(
        "--watch", action="store_true", help="refresh until Ctrl-C, with rates per second"
    )
    status.add_argument(
        "--interval",
        type=_seconds(MAX_SECONDS),
        default=2.0,
        metavar="S",
        help="seconds between refreshes (default: %(default)s)",
    )
    status.add_argument(
        "--count",
        type=_count,
        default=0,
        metavar="N",
        help="stop after N tables (default: %(default)s, never)",
    )
    command("ping", "check that the daemon answers")
    flush = command("flush", "wait until every accepted put is durable")
    flush.add_argument(
        "--wait",
        type=_seconds(m.MAX_WAIT_SECONDS, zero=True),
        default=None,
        metavar="S",
        help="give up after S seconds, at most a day (default: wait as long as it takes)",
    )
    flush.add_argument(
        "--remote",
        action="store_true",
        dest="uploads",  # not `remote`: that names the setting kvctl's config reads
        help="and until the uploads to the remote bucket are sent",
    )
    listing = command("list", "list entries")
    listing.add_argument("--identity", help=f"only this identity ({IDENTITY_FORMS})")
    listing.add_argument(
        "--sort", choices=sorted(SORTS), default="used", help="order (default: %(default)s)"
    )
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    show = command("show", "one entry: identity, tokens, layers, checksums")
    show.add_argument("entry", help="the entry id, or as many of its first digits as only it has")
    show.add_argument("--json", action="store_true", help="print the entry as JSON")
    evict = command("evict", "delete entries now")
    target = evict.add_mutually_exclusive_group(required=True)
    target.add_argument("--entry", help="one entry id (all its digits)")
    target.add_argument("--identity", help=f"every entry of one identity ({IDENTITY_FORMS})")
    target.add_argument("--all", action="store_true", help="every entry")
    verify = command("verify", "check every entry's file whole; exit 1 naming each damaged one")
    verify.add_argument("--identity", help=f"only this identity ({IDENTITY_FORMS})")
    verify.add_argument("--repair", action="store_true", help="quarantine the damaged ones")
    command("metrics", "the status in Prometheus text format")
    kvctl_bundle.add_commands(command, IDENTITY_FORMS)
    add_service_parser(commands)
    add_doctor_parser(commands)
    return parser


def _digest(control: Control, given: str | None) -> str | None:
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


class EntryIdError(LookupError):
    """An entry id that is no prefix of one, or the prefix of several entries' ids: its
    lines, the first saying which, each other a candidate."""


def _entry(control: Control, given: str) -> m.EntrySummary | None:
    """The entry whose id given is, or is the unique prefix of (in any case); None for no
    such entry. Raises EntryIdError."""
    wanted = given.lower()
    if not wanted or len(wanted) > ENTRY_ID_HEX or not set(wanted) <= HEX_DIGITS:
        raise EntryIdError(
            f"{given!r} is not an entry id: an id is {ENTRY_ID_HEX} hex digits (`kvctl list` "
            "shows them), and `show` takes as many of its first ones as only it has"
        )
    found = [e for e in _entries(control, None) if e.id.startswith(wanted)]
    if len(found) > 1:
        rows = [f"  {e.id}  {e.identity}" for e in found[:CANDIDATES_SHOWN]]
        more = len(found) - CANDIDATES_SHOWN
        rows += [f"  and {more} more"] if more > 0 else []
        raise EntryIdError(f"{given!r} begins {len(found)} entries' ids (entry, identity):", *rows)
    return found[0] if found else None


def _show(control: Control, given: str, as_json: bool) -> int:
    """One entry's summary from the daemon and its header from its file (in the daemon's
    tier, which status names); the summary alone when the file cannot be read here."""
    summary = _entry(control, given)
    if summary is None:
        _say(f"no entry's id is or begins {given}: `kvctl list` shows them")
        return 1
    status = _status(control)
    path = Path(status["daemon"]["dir"]) / "entries" / summary.identity / f"{summary.id}.kve"
    try:
        header = read_header(path, DEFAULT_LIMITS)
    except (OSError, EntryFormatError) as exc:
        _say(f"entry {summary.id}'s file cannot be read here: {exc}")
        return 1
    names = {i["identity"]: model_name(i) for i in status["identities"]}
    name = names.get(summary.identity, summary.identity)
    if as_json:
        shown = {**summary.to_map(), "name": name, "path": str(path), "header": _header_map(header)}
        print(json.dumps(shown, indent=2))
        return 0
    print(format_entry(summary, header, name, str(path)))
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


def _entries(control: Control, digest: str | None) -> list[m.EntrySummary]:
    """Every entry this user may list (of one identity), page by page. A tenant lists its
    identities one at a time (the daemon lists every identity's to their owner only): those
    its status shows, which are its own."""
    if digest is None and control.tenant:
        digests = [str(i["identity"]) for i in _status(control)["identities"]]
        return [e for d in digests for e in _entries(control, d)]
    entries: list[m.EntrySummary] = []
    after = None
    while True:
        page = control.call(m.ListEntries, identity=digest, limit=1000, after=after)
        assert isinstance(page, m.ListEntriesReply)
        entries += page.entries
        if not page.more or not page.entries:
            return entries
        after = page.entries[-1].id


def _verify(control: Control, digest: str | None, repair: bool) -> int:
    """Check the durable entries one by one (the writer checks pending ones itself)."""
    entries = [e for e in _entries(control, digest) if e.durable]
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
                    problem = printable(reply.problem)
                    print(f"damaged {entry.id} ({entry.identity}): {problem}{done}")
            progress.step()
    finally:
        progress.close()
    checked = len(entries) - gone
    print(f"{checked} entries verified, {damaged} damaged" + (f", {gone} gone" if gone else ""))
    return 1 if damaged else 0


def _flush(control: Control, wait: float | None, remote: bool) -> int:
    """Wait until the accepted puts are durable (and, remote, uploaded); 1 when not done,
    saying what was not: puts, uploads pending or dropped, the bucket down."""
    if remote and m.REMOTE_FLUSH_FEATURE not in control.features:
        _say("this kvd predates flush --remote")
        return 2
    control.wait_longer(wait)
    reply = control.call(m.Flush, timeout=wait, **({"remote": True} if remote else {}))
    assert isinstance(reply, m.FlushReply)
    if not remote:
        print("durable" if reply.durable else f"not durable: {reply.pending} still pending")
    elif reply.durable:
        print("durable and uploaded")
    else:
        now = time.time()
        since = ago(now - (reply.remote_dropped_for or 0.0), now)
        print(
            f"not done: {reply.pending} puts not durable, {reply.remote_pending} uploads "
            f"({size(reply.remote_pending_bytes or 0)}) still pending, "
            f"{reply.remote_dropped} dropped since the last flush --remote or the start "
            f"({since} ago)"
        )
        if reply.remote_down is not None:
            print(f"the remote bucket is down: {printable(reply.remote_down)}")
    return 0 if reply.durable else 1


def _bundle_command(args: argparse.Namespace, control: Control) -> int:
    """export, import, match (kvctl_bundle): 1, saying why, for a bundle refused; 2 for a
    --tokens file that holds no prompt."""
    try:
        if args.command == "export":
            digest = _digest(control, args.identity)
            assert digest is not None
            head = kvctl_bundle.export(
                control, partial(_entries, control), digest, args.entry, Path(args.output)
            )
            print(f"exported entry {head.entry} to {args.output} ({size(head.file_size)})")
        elif args.command == "import":
            print(
                kvctl_bundle.import_bundle(control, partial(_entries, control), Path(args.bundle))
            )
        else:
            digest = _digest(control, args.identity)
            assert digest is not None
            try:
                tokens = kvctl_bundle.read_tokens(Path(args.tokens), control.limits)
            except (OSError, ValueError) as exc:  # an argument: no prompt to ask about
                _say(f"match: {exc}")
                return 2
            answer = kvctl_bundle.match(control, digest, tokens)
            print(json.dumps(answer, indent=2) if args.json else kvctl_bundle.format_match(answer))
    except DaemonUnavailableError:
        raise
    except (BundleError, OSError, ValueError) as exc:  # the file's, or the prompt's
        _say(f"{args.command}: {exc}")
        return 1
    return 0


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
        entries = _entries(control, _digest(control, args.identity))
        names = {i["identity"]: model_name(i) for i in _status(control)["identities"]}
        if args.json:
            named = [{**e.to_map(), "name": names.get(e.identity, e.identity)} for e in entries]
            print(json.dumps(named, indent=2))
        else:
            print(format_list(entries, names, args.sort, time.time()))
    elif args.command == "show":
        return _show(control, args.entry, args.json)
    elif args.command == "evict":
        digest = _digest(control, args.identity)
        reply = control.call(m.Evict, entry=args.entry, identity=digest, all=args.all)
        assert isinstance(reply, m.EvictReply)
        print(f"evicted {reply.evicted} entries, {size(reply.bytes)}")
    elif args.command == "verify":
        return _verify(control, _digest(control, args.identity), args.repair)
    elif args.command in ("export", "import", "match"):
        return _bundle_command(args, control)
    elif args.command == "metrics":
        status = printable_strings(_status(control))  # label values too reach a terminal
        sys.stdout.write(exposition(lambda: status).decode())
    return 0


def _say(message: str, *more: str) -> None:
    """An error for the operator, on stderr, a line each: printable, whatever the daemon,
    its clients or the arguments put in them."""
    lines = [f"kvctl: {message}", *more]
    print("\n".join(map(printable, lines)), file=sys.stderr)


def _command(args: argparse.Namespace) -> int:
    if args.command == "service":  # needs no daemon
        return run_service(args)
    if args.command == "doctor":  # asks the daemon when one answers, needs none
        return run_doctor(args)
    try:
        config = load_config(args, os.environ)
    except ConfigError as exc:
        _say(f"configuration error: {exc}")
        return 2
    try:
        source = socket_source(args, os.environ, config)
        control = Control(str(config.socket), args.timeout, source)
    except DaemonUnavailableError as exc:
        _say(str(exc))
        return NO_DAEMON
    try:
        return _run(args, control)
    except LocalProtocolError as exc:  # an argument the protocol cannot carry
        _say(f"cannot ask the daemon that: {exc}")
        return 2
    except ProtocolError as exc:
        _say(f"the daemon refused: {exc}")
        return 1
    except (IdentityNameError, EntryIdError) as exc:
        _say(*exc.args)
        return 2
    except DaemonUnavailableError as exc:
        _say(str(exc))
        return NO_DAEMON
    finally:
        control.close()


def main(argv: list[str] | None = None) -> int:
    """kvctl's exit status (see _exit_codes); a Ctrl-C or a closed output ends it quietly."""
    try:
        args = build_parser().parse_args(argv)
        code = _command(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        # Nobody reads what is left: point stdout at nothing, so that the flush at exit
        # finds no pipe to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_CLOSED
    return code


if __name__ == "__main__":
    sys.exit(main())
