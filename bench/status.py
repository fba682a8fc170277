"""Status and a list page against the number of entries in the tier.

The daemon's own Tier, its entries indexed as at start-up (records only, no entry files), its
identities known as the engines name them (four of each model, told apart by their KV cache):
the status report (what `kvctl status` asks for), the identities' names as a status computes
them after any of them changed (a status reuses them until then), and one page of `list` (100
entries after a random id), each timed as the daemon computes its reply. Anchor, in the same
run: a ping round trip through the sans-I/O protocol (client send, server receive, reply,
client receive), the cheapest request there is. For scale, one walk over every record: what
each status cost (twice) before the tier kept its counts up as entries come and go.

    .venv/bin/python bench/status.py [--sizes 1000,100000] [--identities 4] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvd_protocol.connection import Connection, Role
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.messages import PROTOCOL_VERSION, Hello, HelloReply, Ping, PingReply
from kvd_protocol.tokens import pack_tokens

from kvd.config import Config
from kvd.identity_names import names
from kvd.serve.status import status_report
from kvd.store.records import EntryRecord
from kvd.store.tier import Tier

PAGE = 100
KV_TRAITS = ("none", "8bit-g64", "4bit-g64", "8bit-g32")


def median_us(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def ping_round_trip() -> Callable[[], None]:
    """One ping through a client and a server Connection past the handshake."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    server.receive_data(client.send(Hello(id=1, protocol=PROTOCOL_VERSION, client="b", pid=1)))
    server.next_event()
    client.receive_data(
        server.send(
            HelloReply(
                id=1, protocol=PROTOCOL_VERSION, server="b", limits=DEFAULT_LIMITS, features=()
            )
        )
    )
    client.next_event()

    def run() -> None:
        server.receive_data(client.send(Ping(id=2)))
        server.next_event()
        client.receive_data(server.send(PingReply(id=2)))
        client.next_event()

    return run


def variants(count: int) -> list[Identity]:
    """count identities, four of each model (its KV cache plain or quantised three ways), with
    the traits an engine says: what the status names them by."""
    return [
        Identity(
            model_id=f"model-{i // len(KV_TRAITS)}",
            config_fingerprint=f"cfg-{i}",
            tokenizer_hash="tok",
            codec_id="codecs/1",
            runtime="mlx/cpu",
            traits=f"kv={KV_TRAITS[i % len(KV_TRAITS)]},template=1a2b3c4d,adapter=none",
        )
        for i in range(count)
    ]


def filled_tier(folder: Path, entries: int, identities: int, rng: random.Random) -> Tier:
    tier = Tier(Config(dir=folder, socket=folder / "kvd.sock"), DEFAULT_LIMITS)
    named = variants(identities)
    for identity in named:
        tier.telemetry.seen(identity)
    digests = [identity.digest() for identity in named]
    for n in range(entries):
        tier.catalog.add(
            EntryRecord(
                id=rng.randbytes(16).hex(),
                digest=digests[n % identities],
                tokens=pack_tokens([n, 1, 2, 3]),
                nbytes=1 << 20,
                trimmable=True,
                durable=True,
                last_used=tier.catalog.tick(),
            )
        )
    return tier


def page(tier: Tier, ids: list[str], rng: random.Random) -> None:
    tier.admin.list_entries(None, PAGE, rng.choice(ids))


def walk(tier: Tier) -> None:
    per_identity: dict[str, int] = {}
    for record in tier.catalog.records.values():
        per_identity[record.digest] = per_identity.get(record.digest, 0) + record.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--identities", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(7)
    anchor = median_us(ping_round_trip(), args.repeat * 10)
    rows = [f"| ping round trip, sans-I/O (anchor) | – | {anchor:.1f} | 1.0 |"]
    with tempfile.TemporaryDirectory() as work:
        for size in (int(s) for s in args.sizes.split(",")):
            tier = filled_tier(Path(work), size, args.identities, rng)
            ids = list(tier.catalog.records)

            known = tier.view.known_identities()
            timed = [
                ("status", median_us(partial(status_report, tier, []), args.repeat)),
                ("identity names, made anew", median_us(partial(names, known), args.repeat)),
                (f"list page of {PAGE}", median_us(partial(page, tier, ids, rng), args.repeat)),
                ("one walk over every record (scale)", median_us(partial(walk, tier), 5)),
            ]
            for name, us in timed:
                rows.append(f"| {name} | {size:,} | {us:,.1f} | {us / anchor:,.1f} |")
    print(f"{args.identities} identities; medians of {args.repeat} calls\n")
    print("| request | entries | median µs | × ping round trip |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
