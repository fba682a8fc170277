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
        return {
            "model_id": self.model_id,
            "config_fingerprint": self.config_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "codec_id": self.codec_id,
            "runtime": self.runtime,
            "namespace": self.namespace,
        }

    @classmethod
    def from_wire(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Identity:
        """Strictly decode; raises schema.SchemaError."""
        found = cls.known(obj, limits)
        if found is not None:
            return found
        raw = schema.fields(obj, "identity", _REQUIRED, _OPTIONAL)
        values: dict[str, Any] = {
            k: schema.text(v, f"identity.{k}", limits.max_name_bytes) for k, v in raw.items()
        }
        identity = cls(**values)
        if type(obj) is dict and len(_known) < _KNOWN_KEPT:
            longest = max(len(v.encode("utf-8", "surrogatepass")) for v in values.values())
            _known[tuple(obj.items())] = identity, longest
        return identity

    @classmethod
    def known(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Identity | None:
        """What from_wire makes of obj when an equal map was decoded before (the usual), in
        one dict look-up; None otherwise. A map equal to a decoded one holds the same keys and
        the same strings (no other decoded value equals a string), so it passes the same
        checks; only the length limit may differ."""
        if type(obj) is not dict:
            return None
        try:
            found = _known.get(tuple(obj.items()))
        except TypeError:  # an unhashable value (a list, a map): not an identity's
            return None
        if found is None or found[1] > limits.max_name_bytes:
            return None
        return found[0]

    def digest(self) -> str:
        """A stable 32-hex-digit name for this identity: its directory in the tier."""
        # Kept in the instance once computed (a decoded identity that is known is the same
        # instance every time). Not a field, so equality, hashing and the wire ignore it.
        found: str | None = self.__dict__.get("_digest")
        if found is None:
            canonical = msgpack.packb(sorted(self.to_wire().items()), use_bin_type=True)
            found = self.__dict__["_digest"] = hashlib.blake2b(
                canonical, digest_size=16
            ).hexdigest()
        return found


_NAMES = tuple(f.name for f in fields(Identity))
_OPTIONAL = frozenset({"namespace"})
_REQUIRED = frozenset(_NAMES) - _OPTIONAL


# Engines ask under a handful of identities, each sent anew with every request: the maps
# decoded are remembered, by their items, with their longest string in bytes. Past this many
# (a peer inventing identities), they are decoded every time.
_KNOWN_KEPT = 256
_known: dict[tuple[tuple[object, object], ...], tuple[Identity, int]] = {}
