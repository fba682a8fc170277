"""A remote tier on one machine: SeaweedFS (`weed mini`, installed by the dev extras) on
loopback with a bucket and credentials, and two kvd daemons sharing it, each with a tier
folder and a socket of its own; Ctrl-C (or SIGTERM) stops all three.

    make remote-demo                                    # the same as:
    .venv/bin/python scripts/remote_demo.py [--folder DIR]

It runs the remote tests' harness (tests/remote/seaweed.py: free loopback ports, the bucket
`kvd`, its access key and secret; tests/daemon_process.py: a daemon started, waited for and
stopped cleanly), so the demo is what those tests exercise. It prints what to run next.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))

from daemon_process import Daemon, DaemonProcessError
from remote_e2e import remote_flags
from seaweed import ACCESS_KEY, BUCKET, Seaweed, running_seaweed

PREFIX = "demo"
DAEMONS = ("a", "b")


def start_daemon(folder: Path, store: Seaweed) -> Daemon:
    """A daemon on the store, its tier, socket and log in folder (the socket's own 0700)."""
    sockets = folder / "run"
    sockets.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = remote_flags(store, folder, PREFIX)
    daemon = Daemon(folder / "tier", str(sockets / "kvd.sock"), folder / "log", flags)
    daemon.start()
    return daemon


def what_next(store: Seaweed, daemons: dict[str, Daemon], folder: Path, kept: bool) -> str:
    bin_dir = Path(sys.executable).parent
    kvctl = bin_dir / "kvctl"
    a, b = (daemons[name].socket_path for name in DAEMONS)
    lines = [
        f"SeaweedFS (weed mini) at {store.endpoint}, bucket {BUCKET!r}, access key "
        f"{ACCESS_KEY!r}; its data and log in {store.folder}",
        *(
            f"daemon {name}: socket {d.socket_path}, tier {d.tier}, log {d.log}"
            for name, d in daemons.items()
        ),
        f"both share s3://{BUCKET}/{PREFIX}, with the credentials in "
        f"{folder / DAEMONS[0] / 'credentials'} (a copy for each daemon)",
        "",
        "Next, in another terminal:",
        f"  {kvctl} --socket {a} status    # the remote row: ok, and the store",
        f"  {kvctl} --socket {b} status",
        f"  KVD_SOCKET={a} {bin_dir / 'kvd-mlx-lm-server'} --model MODEL --port 8080",
        f"  KVD_SOCKET={b} {bin_dir / 'kvd-mlx-lm-server'} --model MODEL --port 8081",
        "    # a prompt sent to a's server, then to b's: b restores it from the store",
        f"  {kvctl} --socket {a} flush --remote --wait 60    # a's uploads are in the store",
        "",
        "Ctrl-C here stops both daemons and the store"
        + ("." if kept else f", and removes {folder}."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="SeaweedFS on loopback and two kvd daemons sharing it, until Ctrl-C."
    )
    parser.add_argument(
        "--folder",
        type=Path,
        help="where the store, the tiers, the sockets and the logs go, kept at the end "
        "(default: a new folder in /tmp, removed at the end)",
    )
    args = parser.parse_args(argv)
    stop = threading.Event()

    def stop_on(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_on)
    with ExitStack() as stack:
        if args.folder is None:
            made = tempfile.TemporaryDirectory(prefix="kvd-remote-demo-", dir="/tmp")
            folder = Path(stack.enter_context(made))
        else:
            folder = args.folder.resolve()
        store = stack.enter_context(running_seaweed(folder / "store"))
        daemons: dict[str, Daemon] = {}
        for name in DAEMONS:
            try:
                daemon = start_daemon(folder / name, store)
            except DaemonProcessError as error:
                print(f"remote demo: daemon {name} did not start: {error}", file=sys.stderr)
                return 1
            stack.callback(daemon.stop)
            daemons[name] = daemon
        print(what_next(store, daemons, folder, kept=args.folder is not None), flush=True)
        stop.wait()
        print("remote demo: stopping the daemons and the store", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
