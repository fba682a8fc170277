"""Default paths: shared with the engine library, so they live in kvd_protocol.paths."""

from kvd_protocol.paths import (
    SOCKET_PATH_MAX_BYTES,
    DefaultPaths,
    default_paths,
    socket_path_fits,
)

__all__ = ["SOCKET_PATH_MAX_BYTES", "DefaultPaths", "default_paths", "socket_path_fits"]
