"""The states of a kvd connection, and the one table of their transitions.

A Connection follows two machines, one for what each side sends: the client's (its hello, its
requests, the end of its stream; never a descriptor) and the server's (its replies, their
descriptors, its final error, the end of its stream). Each machine is in one State; a Step
is one thing its side did; TRANSITIONS holds, for (the side, its state, the step), the state
after. A step the table does not hold is refused: REFUSALS says with which code and why.
What a refusal raises follows errors.py's rule (the kind names whose machine refused).

What the table does not say is per request, not per connection: the ids in flight, the
descriptors their replies may carry, and the bad requests owed an answer (connection.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Final

from .errors import ErrorCode


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"

    # Identity, as equality is: Enum's own hashes the name in Python, and the table and the
    # machines are looked up by these on every message.
    __hash__ = object.__hash__


class State(Enum):
    HELLO_FIRST = "hello_first"  # the client's, at first: nothing but hello may come
    OPEN = "open"  # requests (the client's) or replies (the server's) come and go
    CLOSED = "closed"  # its stream ended at a frame boundary: nothing more comes
    FINAL = "final"  # the server's, once its final error went out: nothing more goes
    FAILED = "failed"  # both, after a fatal ProtocolError: nothing more either way

    __hash__ = object.__hash__  # as Role's


class Step(Enum):
    HELLO = "hello"  # the hello request
    REQUEST = "request"  # any other request
    REPLY = "reply"  # a reply to a request, or an error reply
    DESCRIPTORS = "descriptors"  # descriptors beside the stream's bytes
    FINAL_ERROR = "final_error"  # the server's last word: an error reply with id 0
    END = "end"  # the end of the stream, once every frame before it is taken

    __hash__ = object.__hash__  # as Role's


CLIENT, SERVER = Role.CLIENT, Role.SERVER
HELLO_FIRST, OPEN, CLOSED, FINAL, FAILED = State
HELLO, REQUEST, REPLY, DESCRIPTORS, FINAL_ERROR, END = Step

TRANSITIONS: Final[Mapping[tuple[Role, State, Step], State]] = MappingProxyType(
    {
        # The client: hello, then any requests, pipelined; never a descriptor.
        (CLIENT, HELLO_FIRST, HELLO): OPEN,
        (CLIENT, HELLO_FIRST, END): CLOSED,
        (CLIENT, OPEN, REQUEST): OPEN,
        (CLIENT, OPEN, END): CLOSED,
        (CLIENT, CLOSED, END): CLOSED,
        # The server: replies at once (a bad request is answered before hello), with the
        # descriptors they declare, until its final error, said once, even after a failure.
        (SERVER, OPEN, REPLY): OPEN,
        (SERVER, OPEN, DESCRIPTORS): OPEN,
        (SERVER, OPEN, FINAL_ERROR): FINAL,
        (SERVER, OPEN, END): CLOSED,
        (SERVER, CLOSED, END): CLOSED,
        (SERVER, FAILED, FINAL_ERROR): FINAL,
    }
)

INITIAL: Final[Mapping[Role, State]] = MappingProxyType({CLIENT: HELLO_FIRST, SERVER: OPEN})


# Why a step the table does not hold is refused: the first row whose role, state and step
# match (None: any) says so. A FAILED machine's refusal is the fatal error's, the Connection's.
REFUSALS: Final[tuple[tuple[Role | None, State | None, Step | None, ErrorCode, str], ...]] = (
    (CLIENT, None, DESCRIPTORS, ErrorCode.BAD_DESCRIPTORS, "clients never send descriptors"),
    (None, CLOSED, None, ErrorCode.BAD_FRAME, "data after the end of the stream"),
    (None, FINAL, None, ErrorCode.BAD_MESSAGE, "the final error was sent already"),
    (None, None, FINAL_ERROR, ErrorCode.BAD_MESSAGE, "only a server sends a final error"),
    (SERVER, None, None, ErrorCode.BAD_MESSAGE, "a server sends replies only"),
    (CLIENT, None, REPLY, ErrorCode.BAD_MESSAGE, "a client sends requests only"),
    (CLIENT, HELLO_FIRST, None, ErrorCode.HANDSHAKE_REQUIRED, "hello must come first"),
    (CLIENT, OPEN, HELLO, ErrorCode.BAD_MESSAGE, "hello was already sent"),
)


def refusal(role: Role, state: State, step: Step) -> tuple[ErrorCode, str]:
    """The code and text of role's machine refusing step in state."""
    for row_role, row_state, row_step, code, why in REFUSALS:
        if row_role in (None, role) and row_state in (None, state) and row_step in (None, step):
            return code, why
    raise ValueError(f"no refusal for {step.value} in {role.value}'s {state.value}")
