"""The identity of a cache: which engine may use an entry, and the directory it lives in."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from . import schema
from .limits import DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class Identity:
    """Entries match only within one identity (docs/design.md, "Identity").

    codec_id names the engine library's codec set and version; runtime names the mlx
    version and device kind, since different runtimes compute different KV.
    """

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str
    codec_id: str
    runtime: str
    namespace: str = ""

    def to_wire(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Identity:
        """Strictly decode; raises schema.SchemaError."""
        names = {f.name for f in fields(cls)}
        raw = schema.fields(obj, "identity", names - {"namespace"}, {"namespace"})
        values: dict[str, Any] = {
            k: schema.text(v, f"identity.{k}", limits.max_name_bytes) for k, v in raw.items()
        }
        return cls(**values)

    def digest(self) -> str:
        """A stable 32-hex-digit name for this identity: its directory in the tier."""
        canonical = msgpack.packb(sorted(self.to_wire().items()), use_bin_type=True)
        return hashlib.blake2b(canonical, digest_size=16).hexdigest()
