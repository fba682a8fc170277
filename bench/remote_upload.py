"""Uploads to the remote tier: how fast a daemon's uploader sends stored entries' blocks to
the bucket, against the S3 client sending the same block files itself (the anchor: what the
store and the client allow on this machine), and what a second daemon pays for blocks the
store holds already (a HEAD each, no body).

A SeaweedFS `weed mini` on loopback (tests/remote/seaweed.py) and a `kvd serve` with
`--remote-upload second-hit --remote-upload-rate 0`: --entries entries of --blocks blocks
(16 tokens each, two KV layers of --width values per head and token: about 2 MiB a block at
the default) are put and made durable, then one lookup each queues its upload, and the
time runs from the first lookup to a remote flush's answer. The anchor PUTs the same block
files from the tier with put_file_if_absent on remote_requests / 2 threads (the uploader's
share of requests), under another prefix. A second daemon on a tier of its own puts the
same entries and uploads them the same way: every block is found there.

    .venv/bin/python bench/remote_upload.py [--entries 4] [--blocks 8] [--width 8192]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _daemon import running_daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))

from blocks_e2e import BLOCK_TOKENS, put_v2, status
from daemon_e2e import IDENTITY, RawPeer
from kvd_protocol import messages as m
from kvd_protocol.tokens import pack_tokens
from remote_e2e import remote_flags
from seaweed import Seaweed, running_seaweed

from kvd.config import DEFAULT_REMOTE_REQUESTS
from kvd.store.tier_dir import TierDir

MiB = 1 << 20
DIGEST = IDENTITY.digest()


def prompt(n: int, blocks: int) -> list[int]:
    return [n * 100_000 + i for i in range(blocks * BLOCK_TOKENS + 3)]


def upload_through(peer: RawPeer, entries: int, blocks: int) -> float:
    """Seconds from the lookups that queue the entries' uploads to the remote flush's end."""
    began = time.perf_counter()
    for n in range(entries):
        reply = peer.call(
            m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(prompt(n, blocks)))
        )
        assert isinstance(reply, m.LookupReply), reply
        assert reply.lease is not None, reply
        assert reply.fd is not None
        peer.call(m.Release(id=peer.next_id(), lease=reply.lease))
        os.close(reply.fd)
    flushed = peer.call(m.Flush(id=peer.next_id(), timeout=None, remote=True))
    assert isinstance(flushed, m.FlushReply), flushed
    assert flushed.durable, flushed
    return time.perf_counter() - began


def one_daemon(
    seaweed: Seaweed, folder: Path, prefix: str, *, entries: int, blocks: int, width: int
) -> tuple[float, dict[str, Any], Path]:
    """Put the entries on a fresh daemon, upload them: (seconds, its remote status, a folder
    with copies of its block files)."""
    flags = [
        *remote_flags(seaweed, folder, prefix, upload="second-hit", upload_rate=0),
        "--max-bytes",
        "64G",
    ]
    with running_daemon(folder, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        for n in range(entries):
            put_v2(peer, IDENTITY, prompt(n, blocks), width)
        seconds = upload_through(peer, entries, blocks)
        remote = status(peer)["remote"]
        tier = TierDir(daemon.tier).blocks_folder(DIGEST)
        files = {p.name: p.read_bytes() for p in tier.glob("*.kvb")}
    kept = folder / "blocks"
    kept.mkdir(exist_ok=True)
    for name, data in files.items():  # the anchor sends these after the daemon is gone
        (kept / name).write_bytes(data)
    return seconds, remote, kept


def anchor(seaweed: Seaweed, files: list[Path], prefix: str, threads: int) -> float:
    """Seconds for the S3 client to PUT the files itself, threads at once."""
    bucket = seaweed.bucket(timeout=60.0)

    def send(path: Path) -> None:
        with path.open("rb") as file:
            key = f"{prefix}/{path.name}"
            assert bucket.put_file_if_absent(key, file.fileno(), path.stat().st_size)

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, files))
    seconds = time.perf_counter() - began
    bucket.close()
    return seconds


def spread(values: list[float], digits: int = 1) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    threads = max(1, DEFAULT_REMOTE_REQUESTS // 2)
    shape = {"entries": args.entries, "blocks": args.blocks, "width": args.width}
    uploads, anchors, ratios, heads = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as scratch:
        root = Path(scratch)
        with running_seaweed(root / "seaweed") as seaweed:
            for run in range(args.repeat):
                prefix = f"bench/run{run}"
                seconds, remote, kept = one_daemon(seaweed, root / f"a{run}", prefix, **shape)
                total = remote["uploaded_bytes"]
                assert remote["uploaded_blocks"] == args.entries * args.blocks, remote
                raw = anchor(seaweed, sorted(kept.glob("*.kvb")), f"anchor/run{run}", threads)
                again, second, _ = one_daemon(seaweed, root / f"b{run}", prefix, **shape)
                assert second["uploaded_blocks"] == 0, second
                assert second["already_there_blocks"] == args.entries * args.blocks, second
                uploads.append(total / seconds / MiB)
                anchors.append(total / raw / MiB)
                ratios.append(raw / seconds)
                heads.append(second["already_there_blocks"] / again)
    block = total / (args.entries * args.blocks) / MiB
    print(
        f"{args.entries} entries x {args.blocks} blocks of {block:.2f} MiB, "
        f"{args.repeat} runs, {threads} requests at once: median (min-max)"
    )
    print("| | MiB/s | x client |")
    print("|---|---:|---:|")
    print(f"| S3 client PUTs the block files (anchor) | {spread(anchors)} | 1.00 |")
    print(f"| uploader: lookup to remote flush | {spread(uploads)} | {spread(ratios, 2)} |")
    print(f"second daemon, every block there already: {spread(heads)} blocks/s (a HEAD each)")


if __name__ == "__main__":
    main()
