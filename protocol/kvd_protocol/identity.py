"""The identity of a cache: which engine may use an entry, and the directory it lives in."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
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
        # By hand: dataclasses.asdict deep-copies, and this is on every lookup's path.
        return {name: getattr(self, name) for name in _NAMES}

    @classmethod
    def from_wire(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Identity:
        """Strictly decode; raises schema.SchemaError."""
        raw = schema.fields(obj, "identity", _REQUIRED, _OPTIONAL)
        values: dict[str, Any] = {
            k: schema.text(v, f"identity.{k}", limits.max_name_bytes) for k, v in raw.items()
        }
        return cls(**values)

    def digest(self) -> str:
        """A stable 32-hex-digit name for this identity: its directory in the tier."""
        return _digest(self)


_NAMES = tuple(f.name for f in fields(Identity))
_OPTIONAL = frozenset({"namespace"})
_REQUIRED = frozenset(_NAMES) - _OPTIONAL


# Engines ask under a handful of identities, each decoded anew per request: remember them.
# Past this many (a peer inventing identities), digests are computed and not kept.
_DIGESTS_KEPT = 256
_digests: dict[Identity, str] = {}


def _digest(identity: Identity) -> str:
    found = _digests.get(identity)
    if found is None:
        canonical = msgpack.packb(sorted(identity.to_wire().items()), use_bin_type=True)
        found = hashlib.blake2b(canonical, digest_size=16).hexdigest()
        if len(_digests) < _DIGESTS_KEPT:
            _digests[identity] = found
    return found
