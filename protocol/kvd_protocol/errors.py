"""The error types of kvd_protocol: one for the wire (with its two kinds), one for entry files,
and one for a daemon that cannot be reached, which kvctl and the engine library both raise."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Error codes carried by error replies and by ProtocolError (see PROTOCOL.md)."""

    BAD_FRAME = "bad_frame"  # framing broken: the connection cannot continue
    BAD_MESSAGE = "bad_message"  # a frame whose body is not a valid message
    UNKNOWN_OP = "unknown_op"
    BAD_DESCRIPTORS = "bad_descriptors"  # descriptors missing, extra, or where none belong
    HANDSHAKE_REQUIRED = "handshake_required"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"  # a limit from the handshake was exceeded
    TOO_MANY_IN_FLIGHT = "too_many_in_flight"
    DUPLICATE_ID = "duplicate_id"
    UNEXPECTED_REPLY = "unexpected_reply"
    NOT_FOUND = "not_found"  # unknown put, ticket, lease or entry
    OVER_LIMIT = "over_limit"  # a per-connection bound: puts begun, leases held
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the daemon serves its cap already
    REFUSED = "refused"  # the write-behind queue is full under the refuse policy
    TIMEOUT = "timeout"
    PERMISSION_DENIED = "permission_denied"
    NO_SPACE = "no_space"
    INVALID_ENTRY = "invalid_entry"  # a committed staging file failed validation
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request that cannot be served, or a wire rule broken: the code says which.

    The Connection raises one of its two kinds (as h11 does), by one rule. The kind says whose
    fault it is: LocalProtocolError when this side asked for what the protocol does not allow
    now (a bug of the caller, never to be passed off as the peer's), RemoteProtocolError when
    the peer sent it. Raised by send() or send_final_error(), it changes nothing: the message
    was not sent. Raised by any other call, it is fatal: every later call raises (but a
    server's one send_final_error(), its last word before closing). A request the server
    refuses is no error: next_event() returns it as a BadRequest, to be answered.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class DaemonUnavailableError(ConnectionError):
    """The daemon cannot be reached: not running, not answering in time, or the connection to
    it broke. kvctl's requests raise it, and the engine library's operator calls (ping, status,
    flush...); the engine's puts and lookups never do."""


class LocalProtocolError(ProtocolError):
    """This side's fault (a reply nobody awaits, a frame over the limit, a send after the final
    error, a server's bad requests left unanswered): see ProtocolError for the rule."""


class RemoteProtocolError(ProtocolError):
    """The peer's fault: see ProtocolError for the rule."""


class Rule(StrEnum):
    """The validation rules of an entry file (see FORMAT.md); each failure names one."""

    TRUNCATED = "truncated"  # the file is shorter than its prefix, header or declared size
    MAGIC = "magic"
    VERSION = "version"
    HEADER_SIZE = "header_size"  # header length over the limit, or data start inconsistent
    HEADER_CHECKSUM = "header_checksum"
    SCHEMA = "schema"  # the header is not the documented msgpack shape
    TOKEN_COUNT = "token_count"
    DTYPE = "dtype"
    SLOT_NBYTES = "slot_nbytes"  # nbytes != prod(shape) * itemsize
    SLOT_ALIGNMENT = "slot_alignment"
    SLOT_BOUNDS = "slot_bounds"  # a slot reaches past the end of the file
    SLOT_OVERLAP = "slot_overlap"
    FILE_SIZE = "file_size"  # the file's size differs from the size its prefix declares
    DATA_CHECKSUM = "data_checksum"  # a tensor's bytes do not match its slot checksum
    BLOCK_HASH = "block_hash"  # a block file's parent and tokens do not hash to its name
    BLOCK_MISMATCH = "block_mismatch"  # a block that is not the one its manifest lists there
    BLOCK_MISSING = "block_missing"  # a block a manifest lists cannot be had (gone, unreadable)


class EntryFormatError(Exception):
    """The only exception the entry-file reader raises: names the file and the rule broken."""

    def __init__(self, name: str, rule: Rule, detail: str) -> None:
        super().__init__(f"{name}: {rule.value}: {detail}")
        self.name = name
        self.rule = rule
        self.detail = detail
