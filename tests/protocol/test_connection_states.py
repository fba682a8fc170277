"""The table of transitions: every step it holds is taken, every step it lacks is refused by
the rule (LocalProtocolError for this side's machine, RemoteProtocolError for the peer's, a
BadRequest for a request the server refuses), through real Connections wherever a
Connection can be brought to that state and made to take that step."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import msgpack
import pytest
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed
from kvd_protocol.connection_states import (
    INITIAL,
    TRANSITIONS,
    Role,
    State,
    Step,
    refusal,
)
from kvd_protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from kvd_protocol.framing import LENGTH
from kvd_protocol.messages import ErrorReply, Lookup, LookupReply, Ping
from wire_samples import HELLO, IDENTITY, TOKENS, connected_pair

CLIENT, SERVER = Role.CLIENT, Role.SERVER
ALL = list(itertools.product(Role, State, Step))


def _frame(body: object) -> bytes:
    packed: bytes = msgpack.packb(body)
    return LENGTH.pack(len(packed)) + packed


def _next(connection: Connection) -> object:
    """The next event, None for NEED_DATA (drain() would take ConnectionClosed forever)."""
    event = connection.next_event()
    return None if event is NEED_DATA else event


def _closed(connection: Connection) -> Connection:
    connection.receive_data(b"")
    assert _next(connection) == ConnectionClosed()
    return connection


def _failed(connection: Connection) -> Connection:
    connection.receive_data(LENGTH.pack(0))
    with pytest.raises(RemoteProtocolError):
        connection.next_event()
    return connection


def _client_open() -> Connection:
    client, _ = connected_pair()
    client.send(Lookup(id=2, identity=IDENTITY, tokens=TOKENS))  # its reply may hold one fd
    return client


def _server_open() -> Connection:
    return connected_pair()[1]


def _server_final() -> Connection:
    server = Connection(Role.SERVER)
    server.send_final_error(ErrorCode.SHUTTING_DOWN, "bye")
    return server


# (the role of the Connection, the machine, its state) -> a Connection with it in that state.
REACHED: dict[tuple[Role, Role, State], Callable[[], Connection]] = {
    (CLIENT, CLIENT, State.HELLO_FIRST): lambda: Connection(Role.CLIENT),
    (CLIENT, CLIENT, State.OPEN): _client_open,
    (CLIENT, CLIENT, State.FAILED): lambda: _failed(_client_open()),
    (CLIENT, SERVER, State.OPEN): _client_open,
    (CLIENT, SERVER, State.CLOSED): lambda: _closed(_client_open()),
    (CLIENT, SERVER, State.FAILED): lambda: _failed(_client_open()),
    (SERVER, SERVER, State.OPEN): lambda: Connection(Role.SERVER),
    (SERVER, SERVER, State.FINAL): _server_final,
    (SERVER, SERVER, State.FAILED): lambda: _failed(Connection(Role.SERVER)),
    (SERVER, CLIENT, State.HELLO_FIRST): lambda: Connection(Role.SERVER),
    (SERVER, CLIENT, State.OPEN): _server_open,
    (SERVER, CLIENT, State.CLOSED): lambda: _closed(_server_open()),
    (SERVER, CLIENT, State.FAILED): lambda: _failed(_server_open()),
}


def _send(message: object) -> Callable[[Connection], object]:
    return lambda connection: connection.send(message)  # type: ignore[arg-type]


def _receive(data: bytes, fds: tuple[int, ...] = ()) -> Callable[[Connection], object]:
    def take(connection: Connection) -> object:
        connection.receive_data(data, fds)
        return _next(connection)

    return take


# (this side's machine or the peer's, the step) -> what makes a Connection take that step;
# absent: no call of a Connection makes that side take it (a client's own descriptors).
ACTIONS: dict[tuple[bool, Step], Callable[[Connection], object]] = {
    (True, Step.HELLO): _send(HELLO),
    (True, Step.REQUEST): _send(Ping(id=7)),
    (True, Step.REPLY): _send(ErrorReply(id=0, code=ErrorCode.SHUTTING_DOWN, message="notice")),
    (True, Step.FINAL_ERROR): lambda connection: connection.send_final_error(
        ErrorCode.INTERNAL, "last"
    ),
    (False, Step.HELLO): _receive(_frame(HELLO.to_wire())),
    (False, Step.REQUEST): _receive(_frame(Ping(id=7).to_wire())),
    (False, Step.DESCRIPTORS): _receive(b"\x00", (5,)),
    (False, Step.END): _receive(b""),
}
# A client reads every frame as a reply: its peer's replies, not its requests.
CLIENT_RECEIVES: dict[Step, Callable[[Connection], object]] = {
    Step.REPLY: _receive(_frame(LookupReply(id=2, matched=0, entry=None, lease=None).to_wire())),
}


def _action(side: Role, machine: Role, step: Step) -> Callable[[Connection], object] | None:
    mine = side is machine
    if side is CLIENT and not mine and step is not Step.DESCRIPTORS and step is not Step.END:
        return CLIENT_RECEIVES.get(step)
    if side is SERVER and not mine and step in (Step.REPLY, Step.FINAL_ERROR):
        return None  # a server reads every frame as a request
    return ACTIONS.get((mine, step))


CASES = [
    (side, machine, state, step)
    for side, (machine, state, step) in itertools.product(Role, ALL)
    if (side, machine, state) in REACHED and _action(side, machine, step) is not None
]


def _case_id(case: tuple[Role, Role, State, Step]) -> str:
    side, machine, state, step = case
    return f"{side.value}:{machine.value}-{state.value}-{step.value}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(case) for case in CASES])
def test_a_step_is_taken_as_the_table_says_or_refused_by_the_rule(
    case: tuple[Role, Role, State, Step],
) -> None:
    side, machine, state, step = case
    connection = REACHED[side, machine, state]()
    assert connection.states[machine] is state
    act = _action(side, machine, step)
    assert act is not None
    after = TRANSITIONS.get((machine, state, step))
    if after is not None:
        event = act(connection)
        assert not isinstance(event, BadRequest)
        assert connection.states[machine] is after
        return
    kind = LocalProtocolError if side is machine else RemoteProtocolError
    if state is State.FAILED:
        with pytest.raises(kind, match=r": connection unusable after: "):
            act(connection)
        return
    code, message = refusal(machine, state, step)
    received = side is SERVER and machine is CLIENT and state is not State.CLOSED
    if received and step in (Step.HELLO, Step.REQUEST):  # a request refused: answered
        event = act(connection)
        assert isinstance(event, BadRequest)
        assert (event.code, event.message) == (code, message)
        assert connection.states[machine] is state
        assert not connection.failed
        return
    failed_before = connection.failed
    with pytest.raises(kind) as raised:
        act(connection)
    assert (raised.value.code, raised.value.message) == (code, message)
    if kind is LocalProtocolError:  # a refused send changes nothing
        assert connection.states[machine] is state
        assert connection.failed is failed_before
    else:
        assert connection.failed
        assert set(connection.states.values()) == {State.FAILED}


def test_every_step_the_table_lacks_has_a_refusal() -> None:
    for role, state, step in ALL:
        if (role, state, step) in TRANSITIONS or state is State.FAILED:
            continue
        code, message = refusal(role, state, step)
        assert isinstance(code, ErrorCode)
        assert message


def test_the_table_moves_only_between_states_reachable_from_the_first() -> None:
    for role in Role:
        reached, frontier = {INITIAL[role]}, [INITIAL[role]]
        while frontier:
            state = frontier.pop()
            for (machine, before, _), after in TRANSITIONS.items():
                if machine is role and before is state and after not in reached:
                    reached.add(after)
                    frontier.append(after)
        sources = {before for machine, before, _ in TRANSITIONS if machine is role}
        assert sources <= reached | {State.FAILED}


def test_a_failed_server_says_its_final_error_once() -> None:
    server = _failed(_server_open())
    assert not server.can_send
    server.send_final_error(ErrorCode.BAD_FRAME, "bad length")
    assert server.states[SERVER] is State.FINAL
    assert server.failed
    with pytest.raises(LocalProtocolError, match=r"^bad_message: the final error was sent"):
        server.send_final_error(ErrorCode.BAD_FRAME, "twice")
    with pytest.raises(RemoteProtocolError, match=r": connection unusable after: "):
        server.next_event()


def test_what_is_not_a_message_is_refused_on_both_sides_and_changes_nothing() -> None:
    for connection in (_client_open(), _server_open()):
        states, in_flight = connection.states, connection.in_flight
        with pytest.raises(LocalProtocolError, match=r"^bad_message: not a message: object"):
            connection.send(object())  # type: ignore[arg-type]
        assert (connection.states, connection.in_flight) == (states, in_flight)
