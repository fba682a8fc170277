"""The benchmarks run SeaweedFS with the remote tests' harness, tests/remote/seaweed.py: on
loopback, or on the far end of an emulated link (bench/_netem.py)."""

import os
import sys
from pathlib import Path

from _netem import Link

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))

from seaweed import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    Seaweed,
    free_ports,
    running_seaweed,
    weed_binary,
)

__all__ = [
    "ACCESS_KEY",
    "BUCKET",
    "SECRET_KEY",
    "LinkedSeaweed",
    "Seaweed",
    "credentials_file",
    "free_ports",
    "running_seaweed",
    "weed_binary",
]

LOOPBACK = "127.0.0.1"


class LinkedSeaweed(Seaweed):
    """`weed mini` run on the far end of `link`, listening on its address there."""

    def __init__(self, folder: Path, link: Link) -> None:
        super().__init__(folder)
        self.link = link

    @property
    def endpoint(self) -> str:
        return super().endpoint.replace(LOOPBACK, self.link.peer_address)

    def command(self) -> list[str]:
        address = self.link.peer_address
        return self.link.command([part.replace(LOOPBACK, address) for part in super().command()])


def credentials_file(folder: Path) -> Path:
    """The bucket's credentials as a daemon reads them (`remote_credentials_file`, 0600)."""
    path = folder / "credentials"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        )
    return path
