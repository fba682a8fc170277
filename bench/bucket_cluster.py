"""What an S3 cluster changes, as far as one machine shows it: SeaweedFS as `weed mini` (one
process) against a cluster of a master, 1 or 3 volume servers and a filer with its S3
gateway (a process each), all on loopback, through kvd's own S3 client (kvd/remote/bucket.py).

Per store, --repeat runs of:
- PUT and GET of --objects objects of --object-mib MiB, --parallel requests at once (a
  thread each, as the remote tier's fetcher and uploader run them; GET streams into
  /dev/null, PUT signs the body's sha256 over http as the uploader does);
- HEAD: --heads HEADs at --parallel at once, half of keys present, half absent (a probe's
  binary search asks both);
- small PUTs: --keys one-byte objects at --parallel at once (a request rate: the cost of a
  PUT with no bytes to move), then one LIST of all of them (a janitor's walk), 1,000 keys a
  page;
- once: a lifecycle rule (expire under `lc/` at a date already past) put, read back, and
  whether an object under it is gone after --lifecycle-wait seconds.

Every process shares the same 2 cores here, so a cluster shows its overheads (more hops,
more processes) and not its gains (more disks and NICs): read the ratios as that.

    .venv/bin/python bench/bucket_cluster.py [--objects 32] [--object-mib 8] [--parallel 8]
        [--heads 2000] [--keys 10000] [--repeat 3] [--lifecycle-wait 30]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from _seaweed import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    free_ports,
    running_seaweed,
    weed_binary,
)

from kvd.remote.bucket import Bucket, BucketError
from kvd.remote.credentials import Credentials
from kvd.remote.sigv4 import Signer, canonical_query

START_TIMEOUT = 60.0
LIFECYCLE_PREFIX = "lc/"
LIFECYCLE_RULE = (
    "<LifecycleConfiguration><Rule><ID>age</ID>"
    f"<Filter><Prefix>{LIFECYCLE_PREFIX}</Prefix></Filter><Status>Enabled</Status>"
    "<Expiration><Date>2020-01-01T00:00:00Z</Date></Expiration></Rule></LifecycleConfiguration>"
).encode()


CREDENTIALS = Credentials(ACCESS_KEY, SECRET_KEY, source="bench")
NO_CATALOGS = ("-port.iceberg=0", "-port.lance=0")  # S3's table catalogs: unused, fixed ports


def _weed(kind: str, port: int, grpc: int, *flags: str) -> list[str]:
    """The command of one `weed` server process on loopback."""
    return [
        str(weed_binary()),
        kind,
        "-ip=127.0.0.1",
        f"-port={port}",
        f"-port.grpc={grpc}",
        *flags,
    ]


class Cluster:
    """A master, `volumes` volume servers and a filer serving S3, each a `weed` process of its
    own on loopback, in `folder`."""

    def __init__(self, folder: Path, volumes: int) -> None:
        self.folder = folder
        self.log = folder / "weed.log"
        ports = iter(free_ports(6 + 2 * volumes))
        self.master, self.master_grpc = next(ports), next(ports)
        self.volume_ports = [(next(ports), next(ports)) for _ in range(volumes)]
        self.filer, self.filer_grpc, self.s3, self.s3_grpc = (next(ports) for _ in range(4))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def bucket(self, timeout: float = 30.0) -> Bucket:
        return Bucket(self.endpoint, BUCKET, CREDENTIALS, timeout=timeout)

    def commands(self) -> list[list[str]]:
        master = f"-master=127.0.0.1:{self.master}.{self.master_grpc}"  # HTTP.gRPC ports
        filer = f"-filer=127.0.0.1:{self.filer}.{self.filer_grpc}"
        commands = [
            _weed("master", self.master, self.master_grpc, f"-mdir={self._folder('master')}"),
            _weed(
                "filer",
                self.filer,
                self.filer_grpc,
                master,
                f"-defaultStoreDir={self._folder('filer')}",
            ),
            _weed("s3", self.s3, self.s3_grpc, filer, "-autoCreateBucket=true", *NO_CATALOGS),
        ]
        for n, (port, grpc) in enumerate(self.volume_ports):
            commands.append(
                _weed("volume", port, grpc, master, f"-dir={self._folder(f'volume{n}')}")
            )
        return commands

    def _folder(self, name: str) -> Path:
        path = self.folder / name
        path.mkdir(exist_ok=True)
        return path

    def start(self) -> None:
        """Starts every process, then waits until a PUT into the bucket (which creates it)
        succeeds."""
        environ = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        with self.log.open("ab") as log:
            for command in self.commands():
                process = subprocess.Popen(
                    command,
                    cwd=self.folder,
                    env=environ,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                self.processes.append(process)
        probe = self.bucket(timeout=2.0)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                try:
                    probe.put_if_absent("ready", b"")
                    return
                except BucketError as error:
                    exited = any(p.poll() is not None for p in self.processes)
                    if exited or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"no S3 from the cluster ({error}); see {self.log}"
                        ) from None
                    time.sleep(0.2)
        finally:
            probe.close()

    def stop(self) -> None:
        """Kills every process: its data goes with the folder (a volume server's graceful
        stop takes 10 s)."""
        for process in self.processes:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.processes.clear()


@contextmanager
def running_cluster(folder: Path, volumes: int) -> Iterator[Cluster]:
    cluster = Cluster(folder, volumes)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def parallel(
    client: Bucket, keys: Sequence[str], call: Callable[[str], object], width: int
) -> float:
    """Seconds to run call on every key, width at once (a thread and connection each)."""
    with ThreadPoolExecutor(width) as pool:
        start = time.perf_counter()
        list(pool.map(call, keys))
        elapsed = time.perf_counter() - start
    client.close()
    return elapsed


@dataclass(frozen=True)
class Run:
    """One run's figures: GB/s of PUT and GET, HEADs a second, LIST seconds."""

    put: float
    get: float
    heads: float
    listing: float


def put_objects(client: Bucket, keys: Sequence[str], size: int, width: int) -> float:
    body = os.urandom(size)
    return parallel(client, keys, lambda key: client.put_if_absent(key, body), width)


def small_objects(client: Bucket, keys: int, width: int) -> float:
    """One-byte objects under small/, made once: PUTs a second (a request's own cost)."""
    names = [f"small/{n:06d}" for n in range(keys)]
    return keys / parallel(client, names, lambda key: client.put_if_absent(key, b"x"), width)


def run_once(client: Bucket, rep: str, args: argparse.Namespace) -> Run:
    size, width = args.object_mib << 20, args.parallel
    big = [f"{rep}/big/{n:04d}" for n in range(args.objects)]
    put = put_objects(client, big, size, width)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        get = parallel(client, big, lambda key: client.get_to_file(key, sink, size), width)
    finally:
        os.close(sink)
    probes = [big[n % len(big)] if n % 2 else f"{rep}/absent/{n}" for n in range(args.heads)]
    heads = parallel(client, probes, client.head, width)
    start = time.perf_counter()
    listed = client.list("small/", args.keys + 1)
    listing = time.perf_counter() - start
    if len(listed) != args.keys:
        raise RuntimeError(f"LIST found {len(listed)} of {args.keys} keys")
    total = size * args.objects
    return Run(total / put / 1e9, total / get / 1e9, args.heads / heads, listing)


def bucket_request(
    endpoint: str, method: str, query: dict[str, str], body: bytes = b""
) -> tuple[int, bytes]:
    """A signed request on the bucket itself (Bucket has none: kvd never configures a bucket)."""
    parts = urlsplit(endpoint)
    headers = {"content-md5": base64.b64encode(hashlib.md5(body).digest()).decode()} if body else {}
    signed = Signer(CREDENTIALS, "us-east-1").headers(
        method,
        parts.netloc,
        f"/{BUCKET}",
        query=query,
        headers=headers,
        payload_hash=hashlib.sha256(body).hexdigest(),
    )
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=30)
    try:
        connection.request(method, f"/{BUCKET}?{canonical_query(query)}", body=body, headers=signed)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def lifecycle(endpoint: str, client: Bucket, wait: float) -> str:
    """Whether the bucket accepts a lifecycle rule, keeps it, and enforces it within wait s."""
    client.put_if_absent(LIFECYCLE_PREFIX + "expired", b"x")
    status, _ = bucket_request(endpoint, "PUT", {"lifecycle": ""}, LIFECYCLE_RULE)
    if status != 200:
        return f"refused ({status})"
    status, kept = bucket_request(endpoint, "GET", {"lifecycle": ""})
    read_back = (
        "read back"
        if status == 200 and b"<Date>2020-01-01" in kept
        else f"not read back ({status})"
    )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if client.head(LIFECYCLE_PREFIX + "expired") is None:
            return f"accepted, {read_back}, enforced within {wait:g} s"
        time.sleep(1.0)
    return (
        f"accepted, {read_back}, not enforced: an object past its date still there after {wait:g} s"
    )


@contextmanager
def started(kind: str, folder: Path) -> Iterator[tuple[str, Bucket]]:
    """The bucket named kind ("mini", "1 volume", "3 volumes") and a client of it."""
    if kind == "mini":
        with running_seaweed(folder) as mini:
            client = mini.bucket(timeout=30.0)
            yield mini.endpoint, client
    else:
        with running_cluster(folder, int(kind.split(maxsplit=1)[0])) as cluster:
            client = cluster.bucket()
            yield cluster.endpoint, client
    client.close()


KINDS = ("mini", "1 volume", "3 volumes")
NAMES = {
    "mini": "`weed mini` (one process)",
    "1 volume": "master + 1 volume server + filer/S3",
    "3 volumes": "master + 3 volume servers + filer/S3",
}


def spread(values: Sequence[float], digits: int) -> str:
    median = statistics.median(values)
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--object-mib", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--heads", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lifecycle-wait", type=float, default=30.0)
    args = parser.parse_args()
    runs: dict[str, list[Run]] = {}
    rules: dict[str, str] = {}
    small_puts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-cluster-") as temp:
        for kind in KINDS:
            folder = Path(temp) / kind.replace(" ", "-")
            folder.mkdir()
            with started(kind, folder) as (endpoint, client):
                put_objects(client, [f"warm/{n}" for n in range(args.objects)], 1 << 20, 8)
                small_puts[kind] = small_objects(client, args.keys, args.parallel)
                runs[kind] = [run_once(client, f"r{rep}", args) for rep in range(args.repeat)]
                rules[kind] = lifecycle(endpoint, client, args.lifecycle_wait)
    print(
        f"{args.objects} objects of {args.object_mib} MiB, {args.parallel} requests at once; "
        f"{args.heads} HEADs; LIST of {args.keys:,} keys made by one-byte PUTs; "
        f"median (min-max) of {args.repeat} runs after a warm-up (small PUTs: once); "
        "x: against `weed mini`"
    )
    print(
        f"| store | PUT GB/s | GET GB/s | HEAD /s | LIST {args.keys:,} keys s | "
        "one-byte PUT /s | GET x mini |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    anchor = statistics.median(run.get for run in runs["mini"])
    for kind in KINDS:
        taken = runs[kind]
        gets = [run.get for run in taken]
        print(
            f"| {NAMES[kind]} | {spread([r.put for r in taken], 2)} | {spread(gets, 2)} | "
            f"{spread([r.heads for r in taken], 0)} | {spread([r.listing for r in taken], 2)} | "
            f"{small_puts[kind]:.0f} | {statistics.median(gets) / anchor:.2f} |"
        )
    for kind in KINDS:
        print(f"lifecycle rule, {NAMES[kind]}: {rules[kind]}")


if __name__ == "__main__":
    main()
