"""kvd_protocol: kvd's wire protocol and entry-file format, pure and sans-I/O.

PROTOCOL.md and FORMAT.md beside this package are the specifications this code implements.
"""

from kvd_protocol.connection import (
    NEED_DATA,
    BadRequest,
    Connection,
    ConnectionClosed,
    Event,
    Role,
)
from kvd_protocol.connection_states import State
from kvd_protocol.entry import (
    ALIGNMENT,
    PREFIX_BYTES,
    BlockHeader,
    Checkpoint,
    EntryHeader,
    EntryPlan,
    Layer,
    LayerSpec,
    ManifestPlan,
    Slot,
    TensorSpec,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.entry_reader import (
    check_block,
    parse_block_head,
    parse_block_header,
    parse_head,
    parse_header,
    parse_prefix,
    verify_slot,
)
from kvd_protocol.errors import (
    EntryFormatError,
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Rule,
)
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import PROTOCOL_VERSION, EntrySummary, ErrorReply, Reply, Request
from kvd_protocol.ops import OPS
from kvd_protocol.tokens import pack_tokens, unpack_tokens

__all__ = [
    "ALIGNMENT",
    "DEFAULT_LIMITS",
    "NEED_DATA",
    "OPS",
    "PREFIX_BYTES",
    "PROTOCOL_VERSION",
    "BadRequest",
    "BlockHeader",
    "Checkpoint",
    "Connection",
    "ConnectionClosed",
    "EntryFormatError",
    "EntryHeader",
    "EntryPlan",
    "EntrySummary",
    "ErrorCode",
    "ErrorReply",
    "Event",
    "Identity",
    "Layer",
    "LayerSpec",
    "Limits",
    "LocalProtocolError",
    "ManifestPlan",
    "ProtocolError",
    "RemoteProtocolError",
    "Reply",
    "Request",
    "Role",
    "Rule",
    "Slot",
    "State",
    "TensorSpec",
    "check_block",
    "pack_tokens",
    "parse_block_head",
    "parse_block_header",
    "parse_head",
    "parse_header",
    "parse_prefix",
    "plan_entry",
    "plan_manifest",
    "unpack_tokens",
    "verify_slot",
]
