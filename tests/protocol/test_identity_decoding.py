"""Identity.from_wire remembers the maps it decoded: a map equal to one of them is known at
once, but only within the length limit it passed."""

from __future__ import annotations

import pytest
from kvd_protocol import identity as identity_module
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits

LIMITS = Limits(max_frame_bytes=4096, max_tokens=64, max_name_bytes=32)


def test_an_identity_decoded_before_is_known_only_within_the_limit_it_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(identity_module, "_known", {})  # room for this one, whatever ran before
    wire = Identity("m" * 20, "c", "t", "k", "r").to_wire()
    decoded = Identity.from_wire(dict(wire), LIMITS)
    assert Identity.known(dict(wire), LIMITS) is decoded
    assert Identity.known(dict(wire), Limits(max_name_bytes=19)) is None
    assert Identity.known({**wire, "namespace": ["x"]}, LIMITS) is None  # unhashable: no
    assert Identity.known({**wire, "runtime": b"r"}, LIMITS) is None
