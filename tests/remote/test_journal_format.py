"""The upload journal's format: a replay finds the uploads pending in the order they joined,
keeps what comes before damage and says where it is, and the file stays bounded by the
uploads pending when compacted as worth_compacting says."""

from __future__ import annotations

import random
import zlib

import pytest

from kvd.remote import journal_format as fmt


def entry(n: int) -> str:
    return f"{n:032x}"


def journal(*records: bytes) -> bytes:
    return fmt.MAGIC + b"".join(records)


def test_a_replay_finds_the_uploads_added_and_not_left_in_the_order_they_joined() -> None:
    data = journal(
        fmt.record(fmt.ADDED, entry(3), 300),
        fmt.record(fmt.ADDED, entry(1), 100),
        fmt.record(fmt.ADDED, entry(2), 200),
        fmt.record(fmt.LEFT, entry(1)),
        fmt.record(fmt.LEFT, entry(9)),  # never added: nothing to forget
    )
    found = fmt.replay(data)
    assert list(found.pending.items()) == [(entry(3), 300), (entry(2), 200)]
    assert (found.records, found.damage) == (5, None)


def test_an_empty_file_is_an_empty_journal() -> None:
    assert fmt.replay(b"") == fmt.Replay()
    assert fmt.replay(fmt.MAGIC) == fmt.Replay()


def test_a_file_that_is_not_a_journal_says_so_and_holds_nothing() -> None:
    found = fmt.replay(b"\x00" * 4096)
    assert found.pending == {}
    assert found.damage is not None
    assert "not an upload journal" in found.damage


def test_a_damaged_record_ends_the_reading_and_what_came_before_is_kept() -> None:
    good = fmt.record(fmt.ADDED, entry(1), 100)
    bad = bytearray(fmt.record(fmt.ADDED, entry(2), 200))
    bad[5] ^= 0x40  # a flipped bit in the entry id
    found = fmt.replay(journal(good, bytes(bad), fmt.record(fmt.ADDED, entry(3), 300)))
    assert found.pending == {entry(1): 100}
    assert found.damage == f"record 2 (byte {len(fmt.MAGIC) + fmt.RECORD.size}) is damaged"


def test_a_record_of_an_unknown_kind_is_damage_even_with_its_check_right() -> None:
    head = b"?" + bytes(16) + bytes(8)
    forged = head + zlib.crc32(head).to_bytes(4, "big")
    found = fmt.replay(journal(forged))
    assert found.damage == f"record 1 (byte {len(fmt.MAGIC)}) is damaged"
    assert found.pending == {}


def test_a_record_cut_short_is_damage_and_the_whole_ones_count() -> None:
    whole = fmt.record(fmt.ADDED, entry(1), 100)
    found = fmt.replay(journal(whole, fmt.record(fmt.ADDED, entry(2), 200)[:7]))
    assert found.pending == {entry(1): 100}
    assert found.damage == "its last record is cut short (7 bytes)"


def test_an_entry_id_that_is_not_32_hex_digits_is_refused() -> None:
    with pytest.raises(ValueError, match="32 hex digits"):
        fmt.record(fmt.ADDED, "abc")
    with pytest.raises(ValueError, match="32 hex digits"):
        fmt.record(fmt.ADDED, "zz" * 16)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(7)
    for size in range(0, 400, 3):
        data = fmt.MAGIC + rng.randbytes(size) if size % 2 else rng.randbytes(size)
        fmt.replay(data)  # what it finds is anything; that it answers is the point


def test_compacted_holds_exactly_the_pending_uploads() -> None:
    pending = [(entry(5), 50), (entry(4), 40)]
    found = fmt.replay(fmt.compacted(pending))
    assert list(found.pending.items()) == pending
    assert (found.records, found.damage) == (2, None)


def test_the_journal_stays_bounded_by_the_uploads_pending_over_a_long_run() -> None:
    """Uploads join and leave at random, at most `held` pending at once; the file compacted
    as worth_compacting says never grows past about twice the records of held (plus the
    smallest journal worth compacting), and replays to the uploads pending."""
    rng = random.Random(11)
    held, data, pending = 40, bytearray(fmt.MAGIC), dict[str, int]()
    records, largest = 0, 0
    for n in range(20_000):
        if len(pending) < held and (not pending or rng.random() < 0.5):
            pending[entry(n)] = n
            data += fmt.record(fmt.ADDED, entry(n), n)
        else:
            gone = rng.choice(list(pending))
            del pending[gone]
            data += fmt.record(fmt.LEFT, gone)
        records += 1
        if fmt.worth_compacting(records, len(pending)):
            data, records = bytearray(fmt.compacted(pending.items())), len(pending)
        largest = max(largest, len(data))
    bound = len(fmt.MAGIC) + fmt.RECORD.size * max(fmt.COMPACT_MIN, 2 * held + 1)
    assert largest <= bound
    assert fmt.replay(bytes(data)).pending == pending
