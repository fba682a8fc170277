"""Block hashes, names and sizes: the chain, its edge cases, and what each function refuses."""

from __future__ import annotations

import pytest
import xxhash
from kvd_protocol.blocks import (
    BLOCK_TOKENS,
    HASH_BYTES,
    ZERO_HASH,
    block_hash,
    block_hashes,
    block_name,
    check_block_tokens,
    parse_block_name,
    split_hashes,
)
from kvd_protocol.tokens import pack_tokens


def test_hashes_chain_each_block_to_its_parent() -> None:
    tokens = pack_tokens(range(50))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3  # 50 // 16: the 2-token tail is no block
    parent = bytes(16)
    for i, found in enumerate(hashes):
        parent = xxhash.xxh3_128_digest(parent + tokens[64 * i : 64 * (i + 1)])
        assert found == parent
    assert all(len(h) == HASH_BYTES for h in hashes)
    assert bytes(HASH_BYTES) == ZERO_HASH
    assert block_hash(ZERO_HASH, tokens[:64]) == hashes[0]


def test_a_shared_prefix_shares_its_blocks_and_history_matters() -> None:
    prompt = list(range(1000, 1000 + 3 * BLOCK_TOKENS))
    first = block_hashes(pack_tokens(prompt + [1] * 300), BLOCK_TOKENS)
    second = block_hashes(pack_tokens(prompt + [2] * 300), BLOCK_TOKENS)
    assert first[:3] == second[:3]
    assert first[3] != second[3]
    # The same tokens after another block are another block.
    swapped = prompt[BLOCK_TOKENS : 2 * BLOCK_TOKENS] + prompt[:BLOCK_TOKENS]
    moved = block_hashes(pack_tokens(swapped), BLOCK_TOKENS)
    assert moved[1] != first[0]
    assert block_hash(ZERO_HASH, pack_tokens(prompt[:BLOCK_TOKENS])) == first[0]


def test_fewer_tokens_than_a_block_make_no_blocks() -> None:
    assert block_hashes(b"", 16) == ()
    assert block_hashes(pack_tokens(range(15)), 16) == ()
    assert len(block_hashes(pack_tokens(range(16)), 16)) == 1


def test_block_hashes_refuses_ragged_tokens_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="whole u32"):
        block_hashes(b"\x00" * 65, 16)
    with pytest.raises(ValueError, match="power of two"):
        block_hashes(pack_tokens(range(64)), 0)


@pytest.mark.parametrize("size", [16, 32, 256, 1024, 65536])
def test_valid_block_sizes(size: int) -> None:
    assert check_block_tokens(size) == size


@pytest.mark.parametrize("size", [0, 1, 8, 15, 17, 24, 100, 1 << 17, -16, True, 256.0, "256"])
def test_invalid_block_sizes(size: object) -> None:
    with pytest.raises(ValueError, match=r"power of two in 16\.\.65536"):
        check_block_tokens(size)


def test_a_block_is_named_by_its_hash() -> None:
    digest = bytes(range(16))
    name = block_name(digest)
    assert name == "000102030405060708090a0b0c0d0e0f.kvb"
    assert parse_block_name(name) == digest
    with pytest.raises(ValueError, match="16 bytes"):
        block_name(digest[:15])


@pytest.mark.parametrize(
    "name",
    [
        "000102030405060708090A0B0C0D0E0F.kvb",  # upper case: not the name the daemon writes
        "000102030405060708090a0b0c0d0e.kvb",
        "000102030405060708090a0b0c0d0e0f00.kvb",
        "000102030405060708090a0b0c0d0e0f.kvd",
        "000102030405060708090a0b0c0d0e0f.kvb.tmp",
        "000102030405060708090a0b0c0d0e0g.kvb",
        ".kvb",
        "",
    ],
)
def test_other_names_are_no_block(name: str) -> None:
    assert parse_block_name(name) is None


def test_split_hashes() -> None:
    hashes = block_hashes(pack_tokens(range(64)), 16)
    assert split_hashes(b"".join(hashes)) == hashes
    assert split_hashes(b"") == ()
    with pytest.raises(ValueError, match="whole 16-byte"):
        split_hashes(bytes(17))
