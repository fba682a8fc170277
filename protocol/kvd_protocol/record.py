"""The wire record: a frozen dataclass that is a msgpack map of exactly its wire() fields.

Record decodes a map strictly (each field by its checker, fields.py) and encodes itself back;
every message (messages.py) is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self

from . import schema
from .fields import Check
from .identity import Identity
from .limits import Limits

_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _encode(value: object) -> object:
    if isinstance(value, Record):
        return value.to_map()
    if isinstance(value, Identity | Limits):
        return value.to_wire()
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


@dataclass(frozen=True)
class _WireFields:
    """A record class's wire fields, gathered once from its declarations."""

    checked: tuple[tuple[str, Check], ...]  # (name, checker), in declaration order
    required: frozenset[str]  # every key its map must hold, the envelope's included
    # The keys it may leave out, with their defaults: fields added within a protocol version
    # (a peer that predates one neither sends nor expects it).
    optional: Mapping[str, object]
    consistency: bool  # the class has rules across fields (overrides check_consistency)
    # Every field's default, wire or not (a reply's descriptors), that a decoded record holds
    # until its map's values are set; None when the constructor must run (a default factory,
    # __post_init__, a field the map does not give and has no default).
    defaults: Mapping[str, object] | None


_wire_fields_cache: dict[type[Record], _WireFields] = {}


def _wire_fields(cls: type[Record]) -> _WireFields:
    """cls's wire fields, gathered on first use (callers look in the cache first: a call
    fewer per message)."""
    every = dataclasses.fields(cls)
    wired = [f for f in every if "check" in f.metadata]
    optional = {f.name: f.default for f in wired if f.default is not dataclasses.MISSING}
    defaults = {f.name: f.default for f in every if f.default is not dataclasses.MISSING}
    built = not hasattr(cls, "__post_init__") and all(
        f.name in defaults or "check" in f.metadata for f in every
    )
    found = _wire_fields_cache[cls] = _WireFields(
        checked=tuple((f.name, f.metadata["check"]) for f in wired),
        required=frozenset(f.name for f in wired if f.name not in optional) | cls.envelope,
        optional=optional,
        consistency=cls.check_consistency is not Record.check_consistency,
        defaults=defaults if built else None,
    )
    return found


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Record:
    """A msgpack map with exactly the fields declared with wire().

    Every record class is declared with eq=False and repr=False and shares the three methods
    below: dataclass compiles each generated method for each class, and those of the message
    classes were half of messages.py's import, paid by every start of the daemon.
    """

    envelope: ClassVar[frozenset[str]] = frozenset()  # keys checked by a subclass, not here

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.__dict__ == other.__dict__  # every field, as a dataclass's __eq__ has it

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def __repr__(self) -> str:
        values = (f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__qualname__}({', '.join(values)})"

    @classmethod
    def from_map(cls, obj: object, what: str, limits: Limits) -> Self:
        """Strictly decode; raises schema.SchemaError or ProtocolError."""
        spec = _wire_fields_cache.get(cls) or _wire_fields(cls)
        # A map holding exactly the required keys (the usual) needs one set comparison.
        if type(obj) is dict and obj.keys() == spec.required:
            raw = obj
        else:
            raw = schema.fields(obj, what, spec.required, spec.optional.keys())
        values = {}
        for name, check in spec.checked:  # a loop, not a comprehension: one call fewer
            if name in raw:
                values[name] = check(raw[name], name, limits)
        if spec.defaults is None:
            record = cls(**values)
        else:  # what the constructor does, without its call per field of a frozen dataclass
            record = object.__new__(cls)
            record.__dict__.update(spec.defaults)
            record.__dict__.update(values)
        if spec.consistency:
            record.check_consistency()
        return record

    def to_map(self) -> dict[str, object]:
        spec = _wire_fields_cache.get(type(self)) or _wire_fields(type(self))
        optional, values = spec.optional, self.__dict__
        wire_map = {}
        for name, _ in spec.checked:
            value = values[name]
            if name in optional and value == optional[name]:
                continue
            wire_map[name] = value if type(value) in _SCALARS else _encode(value)
        return wire_map

    def check_consistency(self) -> None:
        """Rules across fields; raises schema.SchemaError."""
