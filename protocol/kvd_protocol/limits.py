"""Size limits shared by both sides of the socket and by the entry-file reader."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Limits:
    """Bounds that keep every parser's memory and work proportional to a known maximum.

    The server announces its limits in the hello reply; both sides enforce them.
    """

    max_frame_bytes: int = 8 << 20  # a 1M-token lookup (4 MiB of token ids) fits
    max_tokens: int = 1 << 20
    max_header_bytes: int = 16 << 20  # entry-file msgpack header
    max_in_flight: int = 64  # requests awaiting a reply on one connection
    max_layers: int = 4096
    max_slots: int = 65536  # tensor slots in one entry
    max_name_bytes: int = 1024  # identity fields, client names, checkpoint keys

    def to_wire(self) -> dict[str, int]:
        return asdict(self)


DEFAULT_LIMITS = Limits()
