"""Who is at the other end of a connected Unix socket: pid, uid and gid, from the kernel.

Linux answers SO_PEERCRED with `struct ucred` (pid, uid, gid). macOS has no SO_PEERCRED: it
answers LOCAL_PEERCRED with `struct xucred` (uid and groups, the first being the effective
gid) and LOCAL_PEERPID with the pid; Python does not name these, so the values come from xnu's
`sys/un.h`. The credentials are those of the peer when it connected (or called socketpair).
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # Linux struct ucred: pid_t pid; uid_t uid; gid_t gid

# xnu bsd/sys/un.h and bsd/sys/ucred.h
_SOL_LOCAL = 0
_LOCAL_PEERCRED = 1
_LOCAL_PEERPID = 2
_XUCRED_VERSION = 0
# struct xucred: u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]
_XUCRED = struct.Struct("@IIh16I")
_PID = struct.Struct("i")


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def unpack_xucred(raw: bytes) -> tuple[int, int]:
    """(uid, effective gid) from the bytes of a macOS `struct xucred`."""
    version, uid, ngroups, *groups = _XUCRED.unpack(raw)
    if version != _XUCRED_VERSION or ngroups < 1:
        raise OSError(errno.EPROTO, f"unexpected xucred (version {version}, {ngroups} groups)")
    return uid, groups[0]


def _darwin(sock: socket.socket) -> PeerCredentials:
    uid, gid = unpack_xucred(sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, _XUCRED.size))
    (pid,) = _PID.unpack(sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, _PID.size))
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The peer's credentials; OSError(ENOTSUP) on a platform other than Linux or macOS."""
    if sock.family != socket.AF_UNIX:
        raise ValueError(f"peer credentials need a Unix socket, not {sock.family!r}")
    # Written as sys.platform tests so that the type checker, on each platform, checks the
    # branch that uses that platform's constants.
    if sys.platform == "linux":
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, gid = _UCRED.unpack(raw)
        return PeerCredentials(pid=pid, uid=uid, gid=gid)
    if sys.platform == "darwin":
        return _darwin(sock)
    raise OSError(errno.ENOTSUP, f"peer credentials are not implemented on {sys.platform}")
