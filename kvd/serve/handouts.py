"""The descriptors one connection has handed out that its engine has not read yet, and their
bound: a client that asks and never reads is told over_limit instead of making the daemon
open more (in flight, they count against its open files)."""

from __future__ import annotations

import socket

from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode

from kvd.logs import RateLimited
from kvd.serve import socket_io

# Descriptors a connection may have in replies its engine has not read (opened for a reply
# not out yet, or out and still in the socket): an engine reads each reply before the next
# request, so four batches are plenty.
MAX_UNREAD_DESCRIPTORS = 4 * m.MAX_BLOCK_BATCH


class Handouts:
    """One connection's descriptors for replies not out yet (unsent), and out but maybe unread
    (sent), kept within MAX_UNREAD_DESCRIPTORS."""

    def __init__(self, sock: socket.socket, session: int, broken_rules: RateLimited) -> None:
        self.sock = sock
        self.session = session
        self.broken_rules = broken_rules
        self.unsent = 0
        self.sent = 0

    def may_hand_out(self, asked: int) -> bool:
        """Whether asked more descriptors keep the connection within MAX_UNREAD_DESCRIPTORS;
        if so they count from now (as unsent) until their reply is out (handed_out). Those
        sent count until the socket shows the engine has read everything sent to it."""
        if self.unsent + self.sent + asked > MAX_UNREAD_DESCRIPTORS:
            if self.sent and not socket_io.unread_bytes(self.sock):
                self.sent = 0
            if self.unsent + self.sent + asked > MAX_UNREAD_DESCRIPTORS:
                return False
        self.unsent += asked
        return True

    def handed_out(self, asked: int, reply: m.Reply) -> None:
        self.unsent -= asked
        self.sent += len(reply.fds)

    def too_many(self, request: m.Request) -> m.ErrorReply:
        unread = self.unsent + self.sent
        self.broken_rules.warning("descriptors_unread", session=self.session, descriptors=unread)
        return m.ErrorReply(
            id=request.id,
            code=ErrorCode.OVER_LIMIT,
            message=f"{unread} descriptors handed to this connection are not read yet (at most "
            f"{MAX_UNREAD_DESCRIPTORS}): read the replies before asking for more",
        )
