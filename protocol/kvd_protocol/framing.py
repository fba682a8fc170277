"""Frames on a stream socket: a 4-byte big-endian length N, then N bytes of one msgpack map.

A bad length is fatal (the stream cannot be resynchronised); a bad body is not (the frame's
bytes were consumed, so the next frame starts where it should).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

LENGTH = struct.Struct(">I")
LENGTH_BYTES = LENGTH.size


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack ext type {code} is not allowed")


class FrameWriter:
    """Encodes bodies into frames with a msgpack Packer made once (msgpack.packb makes one per
    call). One per connection: a Packer holds a buffer, so it is not shared between threads."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._packer = msgpack.Packer(use_bin_type=True, datetime=False)

    def frame(self, body: Mapping[str, Any]) -> bytes:
        """One frame holding body; ProtocolError(BAD_MESSAGE) if body cannot be packed,
        ProtocolError(TOO_LARGE) if it packs to more than max_frame_bytes."""
        try:
            packed: bytes = self._packer.pack(body)
        except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError: ValueError
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"cannot encode message: {exc}") from None
        if len(packed) > self.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"frame of {len(packed)} bytes, over the limit of {self.max_frame_bytes}",
            )
        return LENGTH.pack(len(packed)) + packed


def decode_body(body: bytes | memoryview) -> object:
    """Exactly one msgpack object: UTF-8 strings, string or bytes map keys, no ext types.

    Raises ProtocolError(BAD_MESSAGE). The timestamp ext (-1) bypasses ext_hook and decodes to
    msgpack.Timestamp, which no message field accepts."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except (ValueError, TypeError) as exc:  # every msgpack.exceptions class is a ValueError
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"undecodable frame body: {exc}") from None


class FrameReader:
    """Splits a byte stream into frame bodies, holding at most one partial frame's bytes.

    The length is checked as soon as its 4 bytes are here, before any body byte is waited for.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._data: bytes | bytearray = b""
        self._pos = 0  # start of the first unconsumed byte in _data
        self.ended = False  # set by the caller at the end of the stream: no byte follows

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as part of a frame."""
        return len(self._data) - self._pos

    @property
    def partial_frame_bytes(self) -> int:
        """What the partial frame buffered will hold once whole (its length and body, once
        its length is in; else the bytes buffered): valid once next_frame() returned None."""
        buffered = len(self._data) - self._pos
        if buffered < LENGTH_BYTES:
            return buffered
        size: int = LENGTH.unpack_from(self._data, self._pos)[0]
        return LENGTH_BYTES + size

    def feed(self, data: bytes) -> None:
        if self._pos == len(self._data):  # nothing buffered (not self.buffered: a call fewer)
            # Common case: keep the caller's bytes without copying (a bytearray could change).
            self._data, self._pos = (data if isinstance(data, bytes) else bytes(data)), 0
            return
        if isinstance(self._data, bytes) or self._pos:
            self._data = bytearray(memoryview(self._data)[self._pos :])
            self._pos = 0
        self._data += data

    def next_frame(self) -> memoryview | None:
        """The next complete body, or None until more bytes arrive.

        The view is valid until the next call to feed() and must be released before it (use it
        in a `with` block). Raises ProtocolError(BAD_FRAME) on a length of 0 or over the limit.
        """
        if len(self._data) - self._pos < LENGTH_BYTES:  # not self.buffered: a call fewer
            return None
        (size,) = LENGTH.unpack_from(self._data, self._pos)
        if size == 0 or size > self.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"frame length {size} outside 1..{self.max_frame_bytes}",
            )
        start = self._pos + LENGTH_BYTES
        end = start + size
        if end > len(self._data):
            return None
        self._pos = end
        return memoryview(self._data)[start:end]
