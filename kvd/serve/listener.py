"""The daemon's listening socket: inherited from launchd or systemd, or bound by kvd itself.

Binding never steals a live daemon's socket: an existing path is probed first, and only a
stale one (connection refused) is replaced. The socket's folder is private to the owner (or
to the owner and the socket group), which is the access control that holds on every platform;
peer credentials are checked on top.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from kvd.serve.launchd_socket import launchd_sockets
from kvd.serve.sd_notify import listen_fds


class SocketInUseError(RuntimeError):
    """Another process answers on the socket path."""


def inherited_socket() -> socket.socket | None:
    """The listening socket a service manager passed in, if any."""
    fds = listen_fds()
    if fds:
        return socket.socket(fileno=fds[0].fd)
    sockets = launchd_sockets("Listener")
    return sockets[0] if sockets else None


def prepare_socket_folder(folder: Path, group: int | None = None) -> None:
    """Create the socket's folder, or check that an existing one is ours; then make it 0700,
    or 0750 owned by group so that the group's members can reach the socket."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    refusal = socket_folder_refusal(folder, info)
    if refusal is not None:
        raise PermissionError(refusal)
    mode = socket_folder_mode(group)
    if group is not None and info.st_gid != group:
        os.chown(folder, -1, group)
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(folder, mode)


def socket_folder_refusal(folder: Path, info: os.stat_result) -> str | None:
    """Why kvd refuses folder (as lstat gave it) for its socket; None when it takes it."""
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return f"{folder} is not a folder owned by uid {os.getuid()}"
    if info.st_mode & (stat.S_ISVTX | stat.S_IWOTH):
        # A shared folder such as /tmp: tightening it would lock everyone else out of it.
        return (
            f"{folder} is shared with other users (mode {stat.S_IMODE(info.st_mode):o}); "
            f"put the socket in a folder of its own, such as {folder / f'kvd-{os.getuid()}'}"
        )
    return None


def socket_folder_mode(group: int | None) -> int:
    """The mode kvd gives its socket's folder: the owner's, or the owner's and the group's."""
    return 0o700 if group is None else 0o750


def bind_socket(path: Path, group: int | None = None) -> socket.socket:
    """Bind and listen at path, replacing a stale socket file but never a live one.

    The socket is for the owner only, or for the owner and group (peer credentials are checked
    on top, by the server).
    """
    prepare_socket_folder(path.parent, group)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # a socket file left by a daemon that died
        except FileNotFoundError:
            pass
        else:
            raise SocketInUseError(f"another kvd is already serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # srw------- from the start: no window before a chmod
    try:
        sock.bind(str(path))
        if group is not None:
            os.chown(path, -1, group)
            os.chmod(path, 0o660)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    sock.listen(128)
    return sock
