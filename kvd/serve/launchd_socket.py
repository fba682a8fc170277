"""launchd socket activation: the listening sockets a LaunchAgent's `Sockets` key created.

launch_activate_socket(3) (macOS 10.10+) returns an errno value rather than setting errno:
ESRCH when the process was not started by launchd, ENOENT when the job has no `Sockets` entry
of that name (the shipped plist has none: the daemon binds its own socket). Both mean "bind
the socket yourself", so both give []. launchd may hand back several descriptors for one
name; the caller owns them, and must free() the array.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys

LIBSYSTEM = "/usr/lib/libSystem.B.dylib"


def launchd_sockets(name: str = "Listener") -> list[socket.socket]:
    """The sockets launchd holds for `name` in this job's plist; [] when there are none."""
    if sys.platform != "darwin":
        return []
    libc = ctypes.CDLL(LIBSYSTEM, use_errno=True)
    activate = libc.launch_activate_socket
    activate.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    activate.restype = ctypes.c_int
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None

    fds = ctypes.POINTER(ctypes.c_int)()
    count = ctypes.c_size_t(0)
    error = activate(name.encode(), ctypes.byref(fds), ctypes.byref(count))
    if error in (errno.ESRCH, errno.ENOENT):
        return []
    if error:
        raise OSError(error, f"launch_activate_socket({name!r}): {os.strerror(error)}")
    try:
        sockets = [socket.socket(fileno=fds[i]) for i in range(count.value)]
    finally:
        libc.free(fds)
    for sock in sockets:
        sock.set_inheritable(False)
    return sockets
