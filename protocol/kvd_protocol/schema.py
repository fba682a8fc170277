"""Strict checks of decoded msgpack values, shared by the wire decoder and the entry reader.

Each check raises SchemaError naming the field; the wire maps it to ProtocolError and the
entry reader to EntryFormatError, so callers only ever see their documented error type.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any


class SchemaError(ValueError):
    """A decoded value is not of the documented shape."""


def fields(
    obj: object,
    what: str,
    required: Set[str],
    optional: Set[str] = frozenset(),
) -> dict[str, Any]:
    """A map with string keys: every required key present, no key outside required|optional."""
    if type(obj) is dict:  # the decoder's maps: one C-level set comparison when they conform
        present = obj.keys()
        if present == required or (present >= required and present - required <= optional):
            return dict(obj)
    if not isinstance(obj, Mapping):
        raise SchemaError(f"{what}: expected a map, got {type(obj).__name__}")
    keys = set(obj)
    if not all(isinstance(k, str) for k in keys):
        raise SchemaError(f"{what}: map keys must be strings")
    missing = required - keys
    if missing:
        raise SchemaError(f"{what}: missing field(s) {sorted(missing)}")
    extra = keys - required - optional
    if extra:
        raise SchemaError(f"{what}: unknown field(s) {sorted(extra)}")
    return dict(obj)


def integer(value: object, what: str, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if type(value) is int and lo <= value <= hi:  # the usual case, in one test
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise SchemaError(f"{what}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise SchemaError(f"{what}: {value} outside {lo}..{hi}")
    return value


def number(value: object, what: str, lo: float = 0.0, hi: float = float("inf")) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise SchemaError(f"{what}: expected a number, got {type(value).__name__}")
    if not lo <= value <= hi:  # also rejects NaN
        raise SchemaError(f"{what}: {value} outside {lo}..{hi}")
    return float(value)


def boolean(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise SchemaError(f"{what}: expected a boolean, got {type(value).__name__}")
    return value


def text(value: object, what: str, max_bytes: int) -> str:
    if type(value) is str and len(value) <= max_bytes >> 2:  # UTF-8: at most 4 bytes a character
        return value
    if not isinstance(value, str):
        raise SchemaError(f"{what}: expected a string, got {type(value).__name__}")
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise SchemaError(f"{what}: longer than {max_bytes} bytes")
    return value


def binary(value: object, what: str, max_bytes: int, multiple_of: int = 1) -> bytes:
    if type(value) is bytes and len(value) <= max_bytes and not len(value) % multiple_of:
        return value
    if not isinstance(value, bytes):
        raise SchemaError(f"{what}: expected bytes, got {type(value).__name__}")
    if len(value) > max_bytes:
        raise SchemaError(f"{what}: {len(value)} bytes, over the limit of {max_bytes}")
    if len(value) % multiple_of:
        raise SchemaError(f"{what}: {len(value)} bytes is not a multiple of {multiple_of}")
    return value


def sequence(value: object, what: str, max_items: int) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise SchemaError(f"{what}: expected a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise SchemaError(f"{what}: {len(value)} items, over the limit of {max_items}")
    return list(value)


def optional(value: object, check: Any, *args: Any, **kwargs: Any) -> Any:
    """None stays None; anything else must pass check."""
    return None if value is None else check(value, *args, **kwargs)
