"""The platform layer against the real kernel: peer credentials, durable files, systemd's
notify and activation protocols, and launchd activation off macOS."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.serve.launchd_socket import launchd_sockets
from kvd.serve.peercred import PeerCredentials, peer_credentials, unpack_xucred
from kvd.serve.sd_notify import ListenFd, Notifier, listen_fds, watchdog_interval
from kvd.store.durability import disk_free, preallocate, replace_durably, sync_directory, sync_file

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux behaviour")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: socket paths must stay under 103 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


# ---- peer credentials ----------------------------------------------------------------------


def test_socketpair_peer_is_this_process() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        own = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        assert peer_credentials(left) == own
        assert peer_credentials(right) == own


def test_connected_peer_is_the_other_process(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        listener.settimeout(30)
        script = f"""
            import socket, sys
            from kvd.serve.peercred import peer_credentials
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect({str(path)!r})
            print(peer_credentials(sock).pid, flush=True)
            sys.stdin.read()
            """
        client = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        conn, _ = listener.accept()
        with conn:
            seen_by_server = peer_credentials(conn)
            out, _ = client.communicate("", timeout=30)
    assert seen_by_server == PeerCredentials(pid=client.pid, uid=os.getuid(), gid=os.getgid())
    assert int(out) == os.getpid()  # and the client sees the server


def test_peer_credentials_need_a_unix_socket() -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
        pytest.raises(ValueError, match="Unix socket"),
    ):
        peer_credentials(sock)


def test_xucred_gives_uid_and_effective_gid() -> None:
    groups = [20, 12, 61, 79, *[0] * 12]
    raw = struct.pack("@IIh16I", 0, 501, 4, *groups)
    assert len(raw) == 76  # sizeof(struct xucred) on macOS
    assert unpack_xucred(raw) == (501, 20)


@pytest.mark.parametrize(("version", "ngroups"), [(1, 1), (0, 0)])
def test_unexpected_xucred_is_refused(version: int, ngroups: int) -> None:
    raw = struct.pack("@IIh16I", version, 501, ngroups, *[20] * 16)
    with pytest.raises(OSError, match="xucred"):
        unpack_xucred(raw)


# ---- durability ----------------------------------------------------------------------------


def test_replace_durably_puts_the_new_file_in_place(tmp_path: Path) -> None:
    src, dst = tmp_path / "entry.tmp", tmp_path / "entry"
    dst.write_bytes(b"old")
    src.write_bytes(b"new")
    replace_durably(src, dst)
    assert dst.read_bytes() == b"new"
    assert not src.exists()


def test_replace_durably_across_directories(tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    (tmp_path / "entries").mkdir()
    src, dst = tmp_path / "staging/a.tmp", tmp_path / "entries/a"
    src.write_bytes(b"x" * 4096)
    replace_durably(src, dst)
    assert dst.read_bytes() == b"x" * 4096
    assert list((tmp_path / "staging").iterdir()) == []


def test_replace_durably_reports_a_missing_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        replace_durably(tmp_path / "absent", tmp_path / "dst")


def test_sync_file_reports_errors_rather_than_hiding_them() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.close(write_end)
    with pytest.raises(OSError, match="Bad file descriptor") as raised:
        sync_file(write_end)
    assert raised.value.errno == errno.EBADF


def test_sync_directory_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        sync_directory(path)


def test_sync_directory_syncs_and_closes(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    sync_directory(tmp_path)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


def _fallocate_supported(directory: Path) -> bool:
    if sys.platform != "linux":
        return False
    probe = directory / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
    return True


@linux_only
def test_preallocate_reserves_blocks(tmp_path: Path) -> None:
    if not _fallocate_supported(tmp_path):
        pytest.skip("this file system cannot reserve space")
    size = 3 << 20
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        preallocate(fd, size)
        info = os.fstat(fd)
    finally:
        os.close(fd)
    assert info.st_size == size
    assert info.st_blocks * 512 >= size  # reserved, not a sparse file


def test_preallocate_never_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"y" * 100)
    fd = os.open(path, os.O_RDWR)
    try:
        preallocate(fd, 10)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"y" * 100


def test_preallocate_grows_a_file_keeping_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"head")
    fd = os.open(path, os.O_RDWR)
    try:
        preallocate(fd, 16384)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == 16384
    assert data[:4] == b"head"
    assert data[4:] == bytes(16380)


def test_disk_free_is_what_an_unprivileged_writer_has(tmp_path: Path) -> None:
    # shutil counts the blocks available to unprivileged users too (not the root reserve).
    # Other processes may write meanwhile; 64 MiB of slack covers that.
    assert abs(disk_free(tmp_path) - shutil.disk_usage(tmp_path).free) < 64 << 20


# ---- systemd notify ------------------------------------------------------------------------


@pytest.fixture
def manager_socket(short_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing where systemd's notify socket would be."""
    path = str(short_dir / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(10)
        yield sock, path


def test_notifications_reach_the_manager(manager_socket: tuple[socket.socket, str]) -> None:
    sock, path = manager_socket
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": path})
    try:
        assert notifier.enabled
        assert notifier.ready("serving")
        assert notifier.watchdog()
        assert notifier.status("flushing 3 entries")
        assert notifier.stopping()
        received = [sock.recv(4096) for _ in range(4)]
    finally:
        notifier.close()
    assert received == [
        b"READY=1\nSTATUS=serving",
        b"WATCHDOG=1",
        b"STATUS=flushing 3 entries",
        b"STOPPING=1",
    ]


@linux_only
def test_abstract_notify_socket() -> None:
    name = f"kvd-test-{os.getpid()}-{os.urandom(4).hex()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        try:
            assert notifier.notify("READY=1", "MAINPID=1")
        finally:
            notifier.close()
        assert sock.recv(4096) == b"READY=1\nMAINPID=1"


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}])
def test_without_a_manager_nothing_is_sent(environ: dict[str, str]) -> None:
    notifier = Notifier.from_environ(environ)
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False


@pytest.mark.parametrize("line", ["READY", "STATUS=a\nREADY=1"])
def test_malformed_assignments_are_refused(line: str) -> None:
    with pytest.raises(ValueError, match="VAR=value"):
        Notifier(None).notify(line)


def test_unsupported_notify_address() -> None:
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        Notifier("vsock:2:1234")


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({}, None),
        ({"WATCHDOG_PID": str(os.getpid())}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], interval: float | None) -> None:
    assert watchdog_interval(environ) == interval


@pytest.mark.parametrize(
    "environ",
    [
        {"WATCHDOG_USEC": "soon"},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "1", "WATCHDOG_PID": "x"},
    ],
)
def test_malformed_watchdog_variables(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="WATCHDOG"):
        watchdog_interval(environ)


# ---- systemd socket activation -------------------------------------------------------------


def test_listen_fds_for_another_process_are_ignored_and_cleared() -> None:
    environ = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "kvd"}
    assert listen_fds(environ) == []
    assert environ == {}


def test_no_listen_fds() -> None:
    environ = {"PATH": "/bin"}
    assert listen_fds(environ) == []
    assert environ == {"PATH": "/bin"}


def test_malformed_listen_fds_is_refused_and_cleared() -> None:
    environ = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "many"}
    with pytest.raises(ValueError, match="LISTEN_FDS"):
        listen_fds(environ)
    assert environ == {}


ACTIVATED_CHILD = """
    import fcntl, json, os, socket
    from kvd.serve.sd_notify import listen_fds
    fds = listen_fds()
    cloexec = [bool(fcntl.fcntl(f.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for f in fds]
    listener = socket.socket(fileno=fds[0].fd)
    conn, _ = listener.accept()
    conn.sendall(b"accepted")
    conn.close()
    left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
    print(json.dumps({"fds": [[f.fd, f.name] for f in fds], "cloexec": cloexec, "left": left}))
"""


# What systemd does between fork and exec: the socket to descriptor 3, LISTEN_PID set to the
# process's own pid (exec keeps it).
LAUNCHER = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""


def test_listen_fds_receives_an_inherited_listening_socket(short_dir: Path) -> None:
    path = str(short_dir / "kvd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        fd = listener.fileno()
        child = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(fd), textwrap.dedent(ACTIVATED_CHILD)],
            pass_fds=(fd,),
            env={**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "kvd"},
            stdout=subprocess.PIPE,
            text=True,
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            client.connect(path)
            assert client.recv(64) == b"accepted"
        out, _ = child.communicate(timeout=30)
    assert child.returncode == 0
    report = json.loads(out)
    assert [ListenFd(fd, name) for fd, name in report["fds"]] == [ListenFd(3, "kvd")]
    assert report["cloexec"] == [True]
    assert report["left"] == []


# ---- launchd -------------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_launchd_sockets_are_none_off_macos() -> None:
    assert launchd_sockets("Listener") == []
