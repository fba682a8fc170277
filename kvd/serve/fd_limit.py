"""Open-file limits: the soft limit raised to what the process may have, and how many
connections that leaves room for.

launchd starts an agent with a soft limit of 256 descriptors, systemd with 1024; the hard
limit is far higher (or unlimited on macOS, where the kernel's kern.maxfilesperproc still
caps it: setrlimit refuses more than OPEN_MAX there, so that is tried when the hard limit is
infinite).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Final

# macOS <sys/syslimits.h>: what setrlimit accepts as a soft limit when the hard one is infinite.
_DARWIN_OPEN_MAX: Final = 10240
# Descriptors kept for the daemon's own files: the lock, the snapshot, the watcher, the log,
# worker threads' files, the listening socket.
RESERVED_FDS: Final = 64
# A connection's socket, a staging file or entry descriptor on its way out, and room for more.
FDS_PER_CONNECTION: Final = 4


def raise_open_file_limit() -> int:
    """Raise the soft limit of open files to the hard one (as far as the kernel allows); the
    soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard
    if hard == resource.RLIM_INFINITY:
        wanted = _DARWIN_OPEN_MAX if sys.platform == "darwin" else soft
    if wanted > soft:
        # Refused: keep what we have; the connection cap follows whatever is in force.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connections_for(open_files: int) -> int:
    """The default connection cap for a soft limit of open_files descriptors."""
    return max(1, (open_files - RESERVED_FDS) // FDS_PER_CONNECTION)


def descriptors_for(connections: int) -> int:
    """The open files kvd needs to serve this many connections at once."""
    return RESERVED_FDS + FDS_PER_CONNECTION * connections
