"""Frame encode/decode throughput of kvd_protocol.Connection against plain msgpack.

encode = Connection.send (checks, wire map, msgpack, length prefix);
decode = Connection.receive_data + next_event (framing, msgpack, strict field checks).
The anchor is msgpack.packb / msgpack.unpackb of the same body, measured in the same run.
Each rate is the best of REPEATS runs, the four measured in turn so that a busy moment of a
shared machine hits them alike, and timed by this process's CPU time, which other processes
on the machine do not inflate.

    .venv/bin/python bench/frames.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgpack
from kvd_protocol.connection import Connection, Role
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits
from kvd_protocol.messages import PROTOCOL_VERSION, Hello, Lookup, Ping, Request
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity("mlx-community/Qwen3-8B-4bit", "cfg", "tok", "codecs/1", "mlx/cpu")
HELLO = Hello(id=1, protocol=PROTOCOL_VERSION, client="bench", pid=1)
REPEATS = 9


def _best_rates(count: int, runs: Sequence[Callable[[], None]]) -> list[float]:
    """Operations per second of each run's fastest of REPEATS, the runs taken in turn."""
    best = [float("inf")] * len(runs)
    for _ in range(REPEATS):
        for i, run in enumerate(runs):
            start = time.process_time()
            run()
            best[i] = min(best[i], time.process_time() - start)
    return [count / seconds for seconds in best]


def _connections(count: int) -> tuple[Connection, Connection]:
    """A client and a server past hello that accept count more requests in flight."""
    limits = Limits(max_in_flight=count + 1)
    client, server = Connection(Role.CLIENT, limits), Connection(Role.SERVER, limits)
    server.receive_data(client.send(HELLO))
    server.next_event()
    return client, server


def measure(request: Request, count: int) -> tuple[float, float, float, float]:
    """(send, msgpack.packb, receive, msgpack.unpackb) rates for count copies of request."""
    requests = [replace(request, id=2 + i) for i in range(count)]
    bodies = [r.to_wire() for r in requests]
    frames = _connections(count)[0]
    frame_bytes = [frames.send(r) for r in requests]
    packed = [msgpack.packb(body) for body in bodies]

    def encode() -> None:
        client, _ = _connections(count)
        for r in requests:
            client.send(r)

    def pack() -> None:
        for body in bodies:
            msgpack.packb(body)

    def decode() -> None:
        _, server = _connections(count)
        for frame in frame_bytes:
            server.receive_data(frame)
            server.next_event()

    def unpack() -> None:
        for data in packed:
            msgpack.unpackb(data)

    send, pack_rate, receive, unpack_rate = _best_rates(count, (encode, pack, decode, unpack))
    return send, pack_rate, receive, unpack_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply operation counts")
    args = parser.parse_args()
    cases = [
        ("ping", Ping(id=1), 20_000),
        (
            "lookup, 64 tokens",
            Lookup(id=1, identity=IDENTITY, tokens=pack_tokens(range(64))),
            20_000,
        ),
        (
            "lookup, 128k tokens",
            Lookup(id=1, identity=IDENTITY, tokens=pack_tokens(range(128 * 1024))),
            100,
        ),
    ]
    print(
        "| message | frame bytes | send ops/s | packb ops/s | send/packb "
        "| receive ops/s | unpackb ops/s | receive/unpackb |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, request, count in cases:
        n = max(1, int(count * args.scale))
        size = len(_connections(1)[0].send(replace(request, id=2)))
        send, pack, receive, unpack = measure(request, n)
        print(
            f"| {name} | {size:,} | {send:,.0f} | {pack:,.0f} | {send / pack:.2f} "
            f"| {receive:,.0f} | {unpack:,.0f} | {receive / unpack:.2f} |"
        )


if __name__ == "__main__":
    main()
