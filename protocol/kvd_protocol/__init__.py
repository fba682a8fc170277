"""kvd_protocol: kvd's wire protocol and entry-file format, pure and sans-I/O."""

from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.tokens import pack_tokens, unpack_tokens

__all__ = [
    "DEFAULT_LIMITS",
    "EntryFormatError",
    "ErrorCode",
    "Identity",
    "Limits",
    "ProtocolError",
    "Rule",
    "pack_tokens",
    "unpack_tokens",
]
