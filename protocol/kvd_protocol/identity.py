"""The identity of a cache: which engine may use an entry, and the directory it lives in."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import Any, Final

import msgpack

from . import schema
from .limits import DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class Identity:
    """Entries match only within one identity (docs/design.md, "Identity").

    codec_id names the engine library's codec set and version; runtime names the mlx
    version and device kind, since different runtimes compute different KV.

    traits: what the engine says, for people, of what its fingerprints hash ("kv=8bit-g64,
    template=1a2b3c4d": see check_traits). Not part of the identity: its digest, equality and
    an entry's header identity leave it out (a header keeps it in its meta, TRAITS_META), so
    that engines which say nothing, or say it otherwise, share entries all the same.
    """

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str
    codec_id: str
    runtime: str
    namespace: str = ""
    traits: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.traits:
            check_traits(self.traits)

    def to_wire(self) -> dict[str, str]:
        """The identity's fields and, when it has any, its traits."""
        found = self.digest_fields()
        if self.traits:
            found["traits"] = self.traits
        return found

    def digest_fields(self) -> dict[str, str]:
        """The fields that make the identity: what its digest hashes and an entry's header
        holds."""
        # By hand: dataclasses.asdict deep-copies, and this is on every lookup's path.
        return {
            "model_id": self.model_id,
            "config_fingerprint": self.config_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "codec_id": self.codec_id,
            "runtime": self.runtime,
            "namespace": self.namespace,
        }

    def trait_map(self) -> dict[str, str]:
        """The traits as a map, in their order."""
        return parse_traits(self.traits)

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
        try:
            identity = cls(**values)
        except ValueError as exc:  # its traits
            raise schema.SchemaError(f"identity.traits: {exc}") from None
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
            canonical = msgpack.packb(sorted(self.digest_fields().items()), use_bin_type=True)
            found = self.__dict__["_digest"] = hashlib.blake2b(
                canonical, digest_size=16
            ).hexdigest()
        return found


_NAMES = tuple(f.name for f in fields(Identity))
_OPTIONAL = frozenset({"namespace", "traits"})
_REQUIRED = frozenset(_NAMES) - _OPTIONAL

# Traits: "key=value" pairs joined by ",", each key once. Keys are lower-case words; values
# keep to characters that need no quoting in a shell, a Prometheus label or a table.
MAX_TRAITS_BYTES: Final = 160
MAX_TRAITS: Final = 8
MAX_TRAIT_VALUE: Final = 48
_TRAIT: Final = re.compile(r"([a-z][a-z0-9_]{0,15})=([A-Za-z0-9._:+@/_-]{1,48})")
_NEWER: Final = re.compile(r"=[^,]*[/_]")  # a value a daemon before IDENTITY_SOURCE_FEATURE refuses
# Where the engine loaded the model from (a repository id such as "mlx-community/Llama-3.2-3B",
# else the model folder's name): what the daemon names the identity by. A value may hold "/"
# or "_" only for a daemon that offers IDENTITY_SOURCE_FEATURE (one that predates it refuses
# them: older_traits).
SOURCE_TRAIT: Final = "source"
# The entry meta key a header keeps its identity's traits under.
TRAITS_META: Final = "identity_traits"


def check_traits(traits: str) -> None:
    """Raises ValueError unless traits is "key=value,...": at most MAX_TRAITS pairs in
    MAX_TRAITS_BYTES, keys unique."""
    parse_traits(traits)


def parse_traits(traits: str) -> dict[str, str]:
    """traits as a map; raises ValueError if they are not well formed (see check_traits)."""
    if not traits:
        return {}
    if len(traits) > MAX_TRAITS_BYTES or not traits.isascii():
        raise ValueError(f"longer than {MAX_TRAITS_BYTES} bytes, or not ASCII")
    pairs = traits.split(",")
    if len(pairs) > MAX_TRAITS:
        raise ValueError(f"{len(pairs)} traits, over the limit of {MAX_TRAITS}")
    found: dict[str, str] = {}
    for pair in pairs:
        matched = _TRAIT.fullmatch(pair)
        if matched is None:
            raise ValueError(
                f"{pair[:64]!r} is not key=value (a-z key, value of A-Za-z0-9._:+@/_-)"
            )
        key, value = matched.groups()
        if key in found:
            raise ValueError(f"trait {key!r} given twice")
        found[key] = value
    return found


def older_traits(traits: str) -> str:
    """traits as a daemon that predates IDENTITY_SOURCE_FEATURE takes them: without the pairs
    whose value holds a "/" or "_"."""
    if _NEWER.search(traits) is None:
        return traits
    return ",".join(pair for pair in traits.split(",") if _NEWER.search(pair) is None)


def join_traits(traits: dict[str, str]) -> str:
    """A map of traits as the text an identity carries; raises ValueError as check_traits."""
    joined = ",".join(f"{key}={value}" for key, value in traits.items())
    check_traits(joined)
    return joined


# Engines ask under a handful of identities, each sent anew with every request: the maps
# decoded are remembered, by their items, with their longest string in bytes. Past this many
# (a peer inventing identities), they are decoded every time.
_KNOWN_KEPT = 256
_known: dict[tuple[tuple[object, object], ...], tuple[Identity, int]] = {}
