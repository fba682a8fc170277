"""`kvctl doctor`: every assumption kvd makes about the platform, tried for real here.

Each check is one function in CHECKS, with what it assumes and how it finds out; it answers
holds, does not hold, or not applicable here, with what it found. The checks take the
settings of the daemon answering on the socket (doctor_daemon), else read them as kvd does
(kvd/config.py): they need no daemon. They never change the tier: what
they try, they try on files of their own in a temporary folder made inside the tier's
folder (before the tier exists, inside the nearest folder that does, on the same file
system as it will be), removed at the end. The platform modules do the work; this module
only asks them. docs/platform.md lists the checks, a run on Linux and what a Mac shows.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import os
import resource
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from kvd import __version__
from kvd.config import Config, ConfigError, load_config
from kvd.ops.doctor_daemon import running_daemons_config
from kvd.ops.doctor_remote import add_remote_flag, check_remote
from kvd.ops.kvctl_tables import size
from kvd.serve.fd_limit import connections_for, descriptors_for, raise_open_file_limit
from kvd.serve.launchd_socket import launchd_sockets
from kvd.serve.listener import socket_folder_mode, socket_folder_refusal
from kvd.serve.peercred import PeerCredentials, peer_credentials
from kvd.serve.sd_notify import listen_fds
from kvd.serve.socket_io import unread_bytes
from kvd.store.durability import disk_free, full_fsync, preallocate, replace_durably
from kvd.store.file_system import file_system_of
from kvd.store.sealing import clone_file, no_writer_left, reflink
from kvd.store.tier_dir import TierDir

PROBE_BYTES: Final = 1 << 20  # the size of the files the checks try things on
SENT_BYTES: Final = 4096  # sent on a socket pair and left unread


class Verdict(StrEnum):
    HOLDS = "holds"
    FAILS = "does not hold"
    NOT_HERE = "not applicable"


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    detail: str


@dataclass(frozen=True)
class Scratch:
    """What a check is given: the settings, and a temporary folder on the tier's file system
    (None, with the reason, when none could be made)."""

    config: Config
    folder: Path | None
    why_no_folder: str

    @property
    def tier_or_nearest(self) -> Path:
        """The tier's folder, or the nearest folder above it that exists."""
        return _nearest_existing(self.config.dir)

    def probe(self, name: str) -> Path:
        """A new file of PROBE_BYTES in the temporary folder."""
        if self.folder is None:
            raise OSError(self.why_no_folder)
        path = self.folder / name
        path.write_bytes(b"\x5a" * PROBE_BYTES)
        return path


@dataclass(frozen=True)
class Check:
    name: str
    assumes: str
    how: str
    run: Callable[[Scratch], Finding]


@dataclass(frozen=True)
class Result:
    check: Check
    finding: Finding

    def to_map(self) -> dict[str, Any]:
        verdict = self.finding.verdict
        return {
            "check": self.check.name,
            "holds": None if verdict is Verdict.NOT_HERE else verdict is Verdict.HOLDS,
            "result": str(verdict),
            "detail": self.finding.detail,
            "assumes": self.check.assumes,
            "how": self.check.how,
        }


def _holds(detail: str) -> Finding:
    return Finding(Verdict.HOLDS, detail)


def _fails(detail: str) -> Finding:
    return Finding(Verdict.FAILS, detail)


def _not_here(detail: str) -> Finding:
    return Finding(Verdict.NOT_HERE, detail)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def _opened(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


# ---- the tier's folder and file system -------------------------------------------------------


def tier_folder(scratch: Scratch) -> Finding:
    root = scratch.config.dir
    refusal = TierDir(root).refusal()
    if refusal is not None:
        return _fails(f"kvd refuses it: {refusal}")
    if not root.exists():
        if scratch.folder is None:
            return _fails(f"{root} is not made yet, and cannot be: {scratch.why_no_folder}")
        return _holds(f"{root} is not made yet: kvd makes it (mode 700) in {scratch.folder.parent}")
    info = root.stat()
    if not stat.S_ISDIR(info.st_mode):
        return _fails(f"{root} is not a folder")
    if info.st_uid != os.getuid():
        return _fails(f"{root} belongs to uid {info.st_uid}; kvd runs as uid {os.getuid()}")
    mode = stat.S_IMODE(info.st_mode)
    made = "" if mode == 0o700 else ": kvd makes it 700 at start"
    return _holds(f"{root}, yours, mode {mode:o}{made}")


def file_system(scratch: Scratch) -> Finding:
    where = scratch.tier_or_nearest
    found = file_system_of(where)
    detail = f"{found.type} at {found.mount_point} (holding {where})"
    if found.remote:
        return _fails(f"{detail}: a remote file system")
    return _holds(detail)


def free_space(scratch: Scratch) -> Finding:
    config = scratch.config
    free = disk_free(scratch.tier_or_nearest)
    floor = f"floor min_free {size(config.min_free)}"
    if free <= config.min_free:
        return _fails(f"{size(free)} free, under the {floor}: every put is refused (no_space)")
    room = free - config.min_free
    cap = f"cap max_bytes {size(config.max_bytes)}"
    bound = (
        f"the floor bounds the tier before its {cap}"
        if room < config.max_bytes
        else f"the {cap} bounds the tier"
    )
    return _holds(f"{size(free)} free, {floor}: room for {size(room)} more; {bound}")


# ---- writing files durably ---------------------------------------------------------------------


def durable_rename(scratch: Scratch) -> Finding:
    probe = scratch.probe("rename.tmp")
    replace_durably(probe, probe.with_name("renamed"))
    return _holds("a file synced, renamed over another, its folder synced")


def drive_flush(scratch: Scratch) -> Finding:
    if sys.platform != "darwin":
        return _not_here("macOS only: Linux's fsync flushes the drive's cache itself")
    probe = scratch.probe("flush")
    with _opened(probe, os.O_RDONLY) as file_fd, _opened(probe.parent, os.O_RDONLY) as dir_fd:
        refused = [
            name for name, fd in (("file", file_fd), ("folder", dir_fd)) if not full_fsync(fd)
        ]
    if refused:
        what = " and ".join(refused)
        return _fails(f"refused on a {what}: kvd falls back to fsync, which the drive may cache")
    return _holds("accepted on a file and on its folder")


def reserve_space(scratch: Scratch) -> Finding:
    probe = scratch.probe("reserve")
    wanted = 4 * PROBE_BYTES
    with _opened(probe, os.O_RDWR) as fd:
        reserved = preallocate(fd, wanted)
        allocated = os.fstat(fd).st_blocks * 512
    call = "F_PREALLOCATE" if sys.platform == "darwin" else "posix_fallocate"
    if not reserved:
        return _fails(f"{call} refused: a disk that fills fails an engine's write, not put_begin")
    return _holds(f"{call} reserved {size(wanted)} ({size(allocated)} allocated)")


def seal_without_copy(scratch: Scratch) -> Finding:
    probe = scratch.probe("staging")
    target = probe.with_name("clone")
    if sys.platform == "darwin":
        if clone_file(probe, target):
            return _holds("clonefile cloned a file: a commit copies no byte")
        return _fails("clonefile refused: every commit copies its file")
    if sys.platform != "linux":
        return _not_here(f"no sealing without a copy on {sys.platform}")
    with (
        _opened(probe, os.O_RDONLY) as source,
        _opened(target, os.O_RDWR | os.O_CREAT | os.O_EXCL) as clone,
    ):
        lease = no_writer_left(source)
        cloned = reflink(source, clone)
    ficlone = (
        "FICLONE clones" if cloned else "FICLONE refused: a file a client still holds is copied"
    )
    if lease:
        return _holds(f"read lease granted: a file its client let go is sealed as it is; {ficlone}")
    if cloned:
        return _holds("no read lease (leases off?); FICLONE clones: every commit clones its file")
    return _fails("no read lease (leases off?) and FICLONE refused: every commit copies its file")


def read_ahead(scratch: Scratch) -> Finding:
    try:
        from kvd_client.read_ahead import ask  # noqa: PLC0415 - the engine library is optional here
    except ModuleNotFoundError:
        return _not_here("kvd_client, the engine library, is not installed in this environment")
    if sys.platform == "darwin":
        call = "F_RDADVISE"
    elif hasattr(os, "posix_fadvise"):
        call = "posix_fadvise(WILLNEED)"
    else:
        return _not_here(f"no read-ahead hint on {sys.platform}")
    with _opened(scratch.probe("entry"), os.O_RDONLY) as fd:
        try:
            ask(fd)
        except OSError as error:
            return _fails(f"{call} refused ({error.strerror}): a cold restore reads as it goes")
    return _holds(f"{call} accepted on a {size(PROBE_BYTES)} file")


def restore_room(_: Scratch) -> Finding:
    try:
        from kvd_client.platform_memory import probe  # noqa: PLC0415 - the engine library is optional
    except ModuleNotFoundError:
        return _not_here("kvd_client, the engine library, is not installed in this environment")
    try:
        return _holds(probe())
    except ValueError as error:
        return _fails(f"{error}: a restore's room for growth is not zeroed as assumed")


# ---- the socket --------------------------------------------------------------------------------


def peer_identity(_: Scratch) -> Finding:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        seen = peer_credentials(left)
    own = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    if seen != own:
        return _fails(f"a socket pair's peer reads as {seen}, not this process's {own}")
    return _holds(
        f"a socket pair's peer is this process: pid {own.pid}, uid {own.uid}, gid {own.gid}"
    )


def unread(_: Scratch) -> Finding:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        left.sendall(b"\x5a" * SENT_BYTES)
        pending = unread_bytes(left)
        received = 0
        while received < SENT_BYTES:
            received += len(right.recv(SENT_BYTES))
        after = unread_bytes(left)
    call = "SO_NWRITE" if sys.platform == "darwin" else "TIOCOUTQ"
    detail = f"{call}: {pending} with {SENT_BYTES} bytes unread, {after} once read"
    if pending > 0 and after == 0:
        return _holds(detail)
    return _fails(f"{detail}: unread descriptors are bounded by the socket buffer alone")


def open_files(scratch: Scratch) -> Finding:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = raise_open_file_limit()  # this process's own limit, as kvd raises its own
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    detail = f"soft {soft}, hard {hard_text}: raised to {raised}"
    wanted = scratch.config.max_connections
    needed = descriptors_for(max(wanted, 1))
    if raised < needed:
        connections = f"max_connections {wanted}" if wanted else "one connection"
        return _fails(f"{detail}; {connections} needs {needed}")
    if wanted:
        return _holds(f"{detail}; max_connections {wanted} needs {needed}")
    return _holds(f"{detail}: room for {connections_for(raised)} connections")


def socket_folder(scratch: Scratch) -> Finding:
    config = scratch.config
    folder = config.socket.parent
    group = grp.getgrnam(config.socket_group).gr_gid if config.socket_group else None
    wanted = socket_folder_mode(group)
    try:
        info = folder.lstat()
    except FileNotFoundError:
        above = _nearest_existing(folder)
        if not os.access(above, os.W_OK | os.X_OK):
            return _fails(f"{folder} is not made yet, and uid {os.getuid()} cannot make it")
        return _holds(f"{folder} is not made yet: kvd makes it (mode {wanted:o}) in {above}")
    refusal = socket_folder_refusal(folder, info)
    if refusal is not None:
        return _fails(f"kvd refuses it: {refusal}")
    mode = stat.S_IMODE(info.st_mode)
    made = "" if mode == wanted else f": kvd makes it {wanted:o} at start"
    return _holds(f"{folder}, yours, mode {mode:o}{made}")


def socket_activation(scratch: Scratch) -> Finding:
    bound = f"kvd binds {scratch.config.socket} itself"
    if sys.platform == "darwin":
        sockets = launchd_sockets("Listener")
        for sock in sockets:
            sock.close()
        if sockets:
            return _holds(f"launchd passed {len(sockets)} listening sockets")
        return _holds(f"launch_activate_socket answers: no sockets from launchd, so {bound}")
    passed = listen_fds(dict(os.environ))  # a copy: the variables stay as they are
    if not passed:
        return _not_here(f"no sockets from systemd (LISTEN_FDS): {bound}")
    for each in passed:
        with socket.socket(fileno=os.dup(each.fd)) as sock:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            if sock.family != socket.AF_UNIX or not listening:
                return _fails(f"descriptor {each.fd} ({each.name}) is not a listening Unix socket")
    return _holds(f"systemd passed {len(passed)} listening Unix sockets")


CHECKS: Final = (
    Check(
        "tier_folder",
        "the tier's folder is this user's and not shared; kvd makes it private (700)",
        "the folder's owner and mode, as kvd's start-up reads them (TierDir.refusal)",
        tier_folder,
    ),
    Check(
        "file_system",
        "the tier is on a local file system (APFS on a Mac): atomic renames, flock, and change "
        "events (inotify, FSEvents) that see every change",
        "the mount holding the tier: /proc/self/mountinfo (Linux), statfs f_fstypename (macOS)",
        file_system,
    ),
    Check(
        "free_space",
        "the disk has more free than min_free, the floor the tier never eats into",
        "statvfs f_bavail * f_frsize against min_free and max_bytes",
        free_space,
    ),
    Check(
        "durable_rename",
        "a file synced, renamed and its folder synced survives a crash as old or new",
        "replace_durably on a file of its own",
        durable_rename,
    ),
    Check(
        "full_fsync",
        "macOS: fcntl(F_FULLFSYNC) flushes the drive's cache, for files and folders",
        "F_FULLFSYNC on a file and on its folder",
        drive_flush,
    ),
    Check(
        "preallocate",
        "a staging file's space is reserved at put_begin (F_PREALLOCATE, posix_fallocate)",
        "preallocate 4 MiB on a file, then its allocated blocks",
        reserve_space,
    ),
    Check(
        "seal_without_copy",
        "a commit seals a staging file without copying it: Linux a read lease (else FICLONE), "
        "macOS clonefile",
        "a read lease and FICLONE (Linux), clonefile (macOS) on a file of its own",
        seal_without_copy,
    ),
    Check(
        "read_ahead",
        "the engine asks the kernel to read an entry file ahead: F_RDADVISE (macOS), "
        "posix_fadvise WILLNEED (Linux)",
        "read_ahead.ask on a file, its refusal not dropped",
        read_ahead,
    ),
    Check(
        "restore_room",
        "the engine zeroes a restored cache's room for growth without touching fresh pages: "
        "mincore and MADV_DONTNEED (Linux); elsewhere it writes the room",
        "platform_memory.probe: a room over old bytes and fresh pages in a mapping of its own",
        restore_room,
    ),
    Check(
        "peer_credentials",
        "the kernel tells kvd who connected: SO_PEERCRED (Linux), LOCAL_PEERCRED and "
        "LOCAL_PEERPID (macOS)",
        "peer_credentials on a socket pair, against this process's pid, uid and gid",
        peer_identity,
    ),
    Check(
        "unread_bytes",
        "a socket says how much its peer has not read (TIOCOUTQ, SO_NWRITE), so descriptors "
        "sent are forgotten once read",
        "unread_bytes on a socket pair with bytes unread, then read",
        unread,
    ),
    Check(
        "open_files",
        "the open-file limit, raised to the hard one at start, leaves room for max_connections "
        "(0: at least one)",
        "getrlimit, then raise_open_file_limit in this process, as kvd does in its own",
        open_files,
    ),
    Check(
        "socket_folder",
        "the socket's folder is this user's and not shared; kvd makes it 700 (750 with "
        "socket_group)",
        "the folder's owner and mode, as kvd's start-up reads them (socket_folder_refusal)",
        socket_folder,
    ),
    Check(
        "socket_activation",
        "a socket passed by systemd (LISTEN_FDS) or launchd (launch_activate_socket) is a "
        "listening Unix socket; without one kvd binds its own",
        "listen_fds (a copy of the environment), launchd_sockets",
        socket_activation,
    ),
)


def _run(check: Check, scratch: Scratch) -> Finding:
    try:
        return check.run(scratch)
    except (OSError, ValueError) as error:
        return _fails(f"{type(error).__name__}: {error}")


@contextlib.contextmanager
def _scratch(config: Config) -> Iterator[Scratch]:
    """A temporary folder inside the tier's folder (or the nearest above it), removed after."""
    where = _nearest_existing(config.dir)
    try:
        folder = Path(tempfile.mkdtemp(prefix=".kvd-doctor-", dir=where))
    except OSError as error:
        yield Scratch(config, None, f"no temporary folder can be made in {where}: {error}")
        return
    try:
        yield Scratch(config, folder, "")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_checks(config: Config) -> list[Result]:
    with _scratch(config) as scratch:
        return [Result(check, _run(check, scratch)) for check in CHECKS]


MARKS: Final = {Verdict.HOLDS: "yes", Verdict.FAILS: "NO", Verdict.NOT_HERE: "n/a"}


def format_results(results: list[Result], whose: str) -> str:
    """The table of results; whose: the line that says whose settings they checked."""
    machine = os.uname()
    width = max(len(r.check.name) for r in results)
    lines = [
        f"kvd {__version__} on {sys.platform} ({machine.sysname} {machine.release}, "
        f"{machine.machine}), Python {sys.version.split()[0]}",
        whose,
        "",
        f"{'check':<{width}}  holds?  detail",
        *(
            f"{r.check.name:<{width}}  {MARKS[r.finding.verdict]:<6}  {r.finding.detail}"
            for r in results
        ),
    ]
    counts = {verdict: sum(r.finding.verdict is verdict for r in results) for verdict in Verdict}
    lines += [
        "",
        f"{counts[Verdict.HOLDS]} hold, {counts[Verdict.FAILS]} do not, "
        f"{counts[Verdict.NOT_HERE]} not applicable here",
    ]
    return "\n".join(lines)


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = "check what kvd assumes of this machine, with the running daemon's settings"
    doctor = commands.add_parser(
        "doctor",
        help=text,
        description=f"{text} (without one, as kvd would read them here)",
        epilog="exit status:\n  0    every check that applies holds\n  1    one does not\n"
        "  2    a configuration error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "--dir",
        metavar="DIR",
        help="the tier directory (default: the running daemon's, else as kvd finds it)",
    )
    doctor.add_argument("--json", action="store_true", help="a list of objects, one per check")
    add_remote_flag(doctor)


def run_doctor(args: argparse.Namespace) -> int:
    """0 when every check that applies holds, 1 otherwise, 2 for a configuration error."""
    try:
        config = load_config(args, os.environ)
        given = ["dir"] if args.dir is not None else []
        config, whose = running_daemons_config(config, args.timeout, given)
    except ConfigError as exc:
        print(f"kvctl: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.try_remote:
        return check_remote(config, whose, args.json)
    results = run_checks(config)
    if args.json:
        print(json.dumps([r.to_map() for r in results], indent=2))
    else:
        print(format_results(results, whose))
    return 1 if any(r.finding.verdict is Verdict.FAILS for r in results) else 0
