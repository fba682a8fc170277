"""The bucket's health: ok, degraded after a failure, down after failures in a row or at once
when the credentials are refused; back to ok at the first answer; the probe's pace; the
warning said once per outage."""

from __future__ import annotations

import time

import anyio
import structlog

from kvd.remote.health import (
    AUTH_RETRY_S,
    BACKOFF_MAX_S,
    BUSY_FIRST_S,
    BUSY_MAX_S,
    FAILURES_TO_DOWN,
    RECENT_S,
    Health,
    State,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def state(health: Health) -> State:
    """The state now (a call: each look is a new one)."""
    return health.state


def test_a_failure_degrades_and_failures_in_a_row_take_it_down() -> None:
    clock = Clock()
    health = Health(clock)
    assert state(health) is State.OK
    health.failed("PUT k: no answer within 2 s")
    assert state(health) is State.DEGRADED
    assert health.up
    health.succeeded()
    assert state(health) is State.DEGRADED, "the last ones were not all failures: degraded"
    clock.now += RECENT_S + 1
    assert state(health) is State.OK
    for _ in range(FAILURES_TO_DOWN):
        health.failed("PUT k: Connection refused")
    assert state(health) is State.DOWN
    assert not health.up
    assert health.last_error == "PUT k: Connection refused"


def test_refused_credentials_take_it_down_at_once_and_an_answer_brings_it_back() -> None:
    health = Health(Clock())
    health.failed("LIST p: HTTP 403 SignatureDoesNotMatch", refused=True)
    assert state(health) is State.DOWN
    assert health.retry_in(0) == AUTH_RETRY_S
    health.failed("LIST p: Connection refused")  # another kind: still down, faster probes
    assert state(health) is State.DOWN
    assert health.retry_in(0) < AUTH_RETRY_S
    health.succeeded()
    assert state(health) is State.OK, "the outage is over: ok at once, not degraded by it"
    assert health.last_error == "LIST p: Connection refused"  # kept for people


def test_the_probe_backs_off_doubling_to_a_minute() -> None:
    health = Health(Clock())
    delays = [health.retry_in(attempt) for attempt in range(10)]
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == BACKOFF_MAX_S
    assert delays == sorted(delays)


def test_going_down_is_warned_once_per_outage_and_kind() -> None:
    health = Health(Clock())
    with structlog.testing.capture_logs() as logs:
        for i in range(FAILURES_TO_DOWN + 5):
            health.failed(f"PUT k{i}: Connection refused")
        health.failed("LIST p: HTTP 403 InvalidAccessKeyId", refused=True)
        health.failed("LIST p: HTTP 403 InvalidAccessKeyId", refused=True)
        health.succeeded()
        health.failed("x", refused=True)
    downs = [e for e in logs if e["event"] == "remote_down"]
    assert [e["log_level"] for e in downs] == ["warning"] * 3
    assert [e["error"] for e in downs] == [
        f"PUT k{FAILURES_TO_DOWN - 1}: Connection refused",
        "LIST p: HTTP 403 InvalidAccessKeyId",
        "x",
    ]
    assert [e["event"] for e in logs].count("remote_up") == 1


def test_a_bucket_that_asks_to_slow_down_is_degraded_never_down() -> None:
    clock = Clock()
    health = Health(clock)
    for _ in range(FAILURES_TO_DOWN * 3):
        pause = health.busy("PUT k: HTTP 503 SlowDown", None)
        clock.now += pause
    assert state(health) is State.DEGRADED
    assert health.failures == 0
    health.failed("PUT k: Connection refused")
    assert health.failures == 1, "asks to slow down are no failures in a row"


def test_slow_down_backs_off_doubling_with_jitter_and_honours_retry_after() -> None:
    clock = Clock()
    health = Health(clock)
    pauses = []
    for _ in range(10):
        pauses.append(health.busy("503 SlowDown", None))
        clock.now += pauses[-1]
    for ask, pause in enumerate(pauses):
        backoff = min(BUSY_MAX_S, BUSY_FIRST_S * 2**ask)
        assert backoff / 2 <= pause <= backoff
    assert health.busy("429", 7.0) == 7.0
    clock.now += 7.0
    assert health.busy("429", 0.0) == BUSY_FIRST_S, "a Retry-After of 0 still slows down"


def test_asks_answered_during_a_pause_do_not_lengthen_it() -> None:
    """Requests sent together are refused together: one ask, one pause."""
    clock = Clock()
    health = Health(clock)
    first = health.busy("503 SlowDown", 4.0)
    clock.now += 1.0
    assert health.busy("503 SlowDown", 4.0) == first - 1.0
    assert health.busy_asks == 1


def test_paced_waits_out_the_pause_unless_it_ends_past_the_deadline() -> None:
    async def scenario() -> None:
        health = Health()
        assert await health.paced(time.monotonic())
        health.busy("503 SlowDown", 0.6)
        began = time.monotonic()
        assert not await health.paced(began + 0.3), "ends after the deadline: no wait"
        assert time.monotonic() - began < 0.3
        assert await health.paced(began + 5.0)
        assert time.monotonic() - began >= 0.5

    anyio.run(scenario)


def test_failures_while_up_are_said_at_a_bounded_rate() -> None:
    """A bucket that fails every other request provokes a line per LOG_EVERY_S, not per
    failure."""
    clock = Clock()
    health = Health(clock)
    with structlog.testing.capture_logs() as logs:
        for _ in range(100):
            health.failed("GET k: HTTP 500 InternalError")
            health.succeeded()
            clock.now += 0.25
    said = [e for e in logs if e["event"] == "remote_request_failed"]
    assert [e.get("suppressed") for e in said] == [None, 39, 39]  # at 0, 10 and 20 s


def test_refused_credentials_are_probed_again_once_a_file_changed() -> None:
    """Not a minute later: within a look or two of the change (one a second)."""
    changed = False
    probes: list[float] = []

    async def scenario() -> None:
        health = Health(credentials_changed=lambda: changed)

        async def probe() -> None:
            probes.append(time.monotonic())
            health.succeeded()

        health.failed("LIST p: HTTP 403 InvalidAccessKeyId", refused=True)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(health.recover, probe)
            await anyio.sleep(2.5)
            assert probes == [], "nothing changed: the next probe is AUTH_RETRY_S away"
            nonlocal changed
            changed = True
            began = time.monotonic()
            with anyio.fail_after(AUTH_RETRY_S / 4):
                while not probes:
                    await anyio.sleep(0.05)
            assert probes[0] - began < 5
            tasks.cancel_scope.cancel()

    anyio.run(scenario)
